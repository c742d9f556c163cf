"""A loss that spikes and stays finite (issue 48, "loss spikes without NaN"): the iteration, the batch, the layer whose
activations jumped and the line, each bug beside its correct twin, silent (a healthy noisy loop, a warm-up, a
decreasing loss with noise, a loss high throughout). The spike is decided after the run from the loop watch's loss
series (no cost in any iteration) and its batch probed from the end state (``run/spike_replay.py``); the probe
leaves the user's results as the plain run left them (rule 1).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd
from backward_doctor.trace.spikes import spike_points
from report_check import describe, fits_the_schema, only, silent

CELL = ("losses = []\n"                                  # 1
        "for i, (xb, yb) in enumerate(batches):\n"      # 2
        "    opt.zero_grad()\n"                          # 3
        "    out = model(xb)\n"                          # 4  <-- the layer that jumps is called here
        "    loss = F.cross_entropy(out, yb)\n"          # 5
        "    loss.backward()\n"                          # 6
        "    opt.step()\n"                               # 7
        "    losses.append(loss.item())\n")              # 8
LOOP_LINE, MODEL_LINE = 2, 4
BAD = 25


def _batches(n: int = 40, bad: int | None = BAD, scale: float = 1000.0, flip: float = 0.0, classes: int = 3,
             batch: int = 16, random_labels: bool = False) -> list:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, classes, generator=g)
    out = []
    for i in range(n):
        x = torch.randn(batch, 8, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g) if random_labels else (x @ w).argmax(1)
        if flip:
            noisy = torch.rand(batch, generator=g) < flip
            y = torch.where(noisy, torch.randint(0, classes, (batch,), generator=g), y)
        if i == bad:
            x = x * scale  # <-- one batch whose values are 1000x the others'
        out.append((x, y))
    return out


def _ns(batches: list, lr: float = 1e-2, classes: int = 3, optimizer: str = "adam") -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, classes))
    opt = torch.optim.Adam(model.parameters(), lr=lr) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), lr=lr)
    return {"batches": batches, "model": model, "opt": opt, "F": F, "torch": torch}


def _same_results(plain: dict, doctored: dict) -> None:
    """Rule 1: the doctored run (and its probe) leaves what the plain run leaves: weights, optimizer state, the
    names the cell bound and the lists it appended to."""
    for p, q in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    for (p, s), (_, t) in zip(plain["opt"].state.items(), doctored["opt"].state.items()):
        assert all(torch.equal(s[k], t[k]) for k in s)
    assert plain["losses"] == doctored["losses"] and plain["i"] == doctored["i"]
    assert torch.equal(plain["xb"], doctored["xb"]) and torch.equal(plain["loss"], doctored["loss"])


def _diagnose(cell: str, make, engine: str):
    plain, doctored = make(), make()
    exec(cell, plain)
    rng_plain = torch.get_rng_state()
    make()  # (the same seeds again: the doctored run starts where the plain one did)
    report = fits_the_schema(bd.diagnose(cell, doctored, engine=engine))
    assert torch.equal(torch.get_rng_state(), rng_plain)  # the probe's draws are put back
    return plain, doctored, report


def test_a_poisoned_batch_names_the_batch_the_layer_and_the_line(engine: str) -> None:
    plain, doctored, report = _diagnose(CELL, lambda: _ns(_batches()), engine)
    _same_results(plain, doctored)
    f = only(report, "loss_spike")
    assert f.severity == "warning" and f.iteration == BAD and f.line == MODEL_LINE and f.file is None, describe(report)
    assert f.module == "model.0" and f.module_type == "Linear", describe(report)
    s = report.trace.loss_spike
    assert (s.iteration, s.batch, s.baseline, s.loop_line, s.jumped) == (BAD, BAD, BAD - 1, LOOP_LINE, "activations")
    assert s.out_of_range == "xb" and s.ratio > 5 and s.spikes == 1 and not s.why_not
    assert f.title == f"Loss spike in iteration {BAD}: batch {BAD} is out of range"
    assert f"Batch {BAD} of `enumerate(batches)`" in f.message and "`xb` holds values up to" in f.message
    assert f"The output of `model.0` (Linear) grew" in f.message and "the first layer where the jump shows" in f.message
    assert f"look at `batches[{BAD}]`" in f.message and "clip_grad_norm_" in f.message and "as below" in f.message
    assert f.evidence["batch"] == BAD and f.evidence["layer"] == "model.0" and f.evidence["batch_is_odd"] is True
    code = f.evidence["fix_code"]
    assert "loss.item() > 5 * statistics.median(recent)" in code and f"look at `batches[{BAD}]`" in code
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)" in code and code.endswith("opt.step()\n")
    # the renderers show it: the text report and the HTML panel's view
    assert "Loss spike in iteration 25" in str(report) and "Loss spike" in report.to_html()
    assert any("the loop's body was run twice more, on batch 25 and batch 24" in n for n in report.trace.notes)
    # the record goes through the JSON report and back
    again = type(report).from_dict(report.to_dict())
    assert again.trace.loss_spike == s and again.findings[0].evidence["batch"] == BAD


def test_wrong_labels_name_the_layer_whose_gradients_jumped(engine: str) -> None:
    """A batch whose labels are all wrong, on a model that has learnt the task: its values are in range, the
    activations do not jump, the loss and the last layer's gradients do."""
    batches = _batches(n=60, bad=None)
    x, y = batches[45]
    batches[45] = (x, (y + 1) % 3)  # <-- every label of one batch wrong
    plain, doctored, report = _diagnose(CELL, lambda: _ns(batches, lr=3e-2), engine)
    _same_results(plain, doctored)
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert (f.iteration, s.batch, s.jumped, s.out_of_range) == (45, 45, "gradients", ""), describe(report)
    assert s.reproduced is True and f.module == "model.2" and f.line == MODEL_LINE, describe(report)
    assert "its values are in the range of the other batches" in f.message


def test_a_shuffling_loader_is_named_but_not_probed(engine: str) -> None:
    """The batch of that iteration cannot be drawn again (the sampler's order is gone): the spike is said at the
    loop's line, with why no batch is named."""
    def make() -> dict:
        xs = torch.cat([b[0] for b in _batches(bad=None)])
        ys = torch.cat([b[1] for b in _batches(bad=None)])
        xs[400:416] *= 1000.0
        torch.manual_seed(3)
        ns = _ns([])
        ns["batches"] = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16,
                                                    shuffle=True, generator=torch.Generator().manual_seed(7))
        return ns
    plain, doctored, report = _diagnose(CELL, make, engine)
    _same_results(plain, doctored)
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert s.batch is None and "`batches` shuffles or loads in worker processes" in s.why_not, describe(report)
    assert f.line == LOOP_LINE and "It was not probed" in f.message and f.evidence["probed"] is False


@pytest.mark.parametrize("twin", ["noisy", "warmup", "decreasing", "high"])
def test_correct_twins_are_silent(engine: str, twin: str) -> None:
    cell = CELL
    if twin == "noisy":  # small batches, a fifth of the labels wrong: a loss that jumps about
        make = lambda: _ns(_batches(n=60, bad=None, flip=0.2, batch=4), lr=3e-2)  # noqa: E731
    elif twin == "warmup":  # the learning rate ramps from 1% to all of it over the first 20 steps
        cell = CELL.replace("    opt.step()\n", "    opt.step()\n    sched.step()\n")

        def make() -> dict:
            ns = _ns(_batches(n=60, bad=None), lr=0.5, optimizer="sgd")
            ns["sched"] = torch.optim.lr_scheduler.LinearLR(ns["opt"], start_factor=0.01, total_iters=20)
            return ns
    elif twin == "decreasing":
        make = lambda: _ns(_batches(n=60, bad=None, flip=0.05))  # noqa: E731
    else:  # random labels over 50 classes: nothing to learn, the loss stays near log(50) throughout
        make = lambda: _ns(_batches(n=60, bad=None, classes=50, random_labels=True), classes=50)  # noqa: E731
    plain, doctored, report = _diagnose(cell, make, engine)
    _same_results(plain, doctored)
    silent(report)
    assert report.trace.loss_spike is None and len(report.trace.iterations.loss) == 60


def test_the_series_test_does_not_alarm_on_noise_schedules_or_high_losses() -> None:
    """The decision alone, on series of many seeds: heavy-tailed noise around a falling trend, a warm-up's rise, a
    step schedule's drop, the first iterations' swings, a flat high loss: none; a single jump: found."""
    for seed in range(200):
        rng = random.Random(seed)
        falling = [2.0 * 0.99 ** i * rng.lognormvariate(0, 0.35) for i in range(300)]
        assert spike_points(falling) == [], (seed, falling)
        high = [40.0 + rng.gauss(0, 4) for _ in range(100)]
        assert spike_points(high) == []
        warm = [1.0 + 0.02 * min(i, 30) + rng.gauss(0, 0.05) for i in range(80)]
        assert spike_points(warm) == []
    early = [5.0, 40.0, 3.0, 2.5, 2.4, 2.2, 2.0, 2.1] + [2.0 - 0.01 * i for i in range(40)]
    assert spike_points(early) == []  # (a swing in the first iterations: no trend yet)
    steps = [1.0] * 30 + [0.1] * 30 + [0.01] * 30
    assert spike_points(steps) == []
    jump = [1.0 - 0.01 * i for i in range(40)]
    jump[30] = 12.0
    assert spike_points(jump) == [30]
    # a second model's loop later in the same run (a script training several): it starts high and comes down
    # slowly; a loss that jumps and stays up (diverged): neither is a spike
    assert spike_points(jump[:30] + [2.3 * 0.97 ** i for i in range(40)]) == []
    assert spike_points(jump[:30] + [12.0 + i for i in range(10)]) == []
    assert spike_points(jump[:30] + [12.0, 0.7]) == []  # (the last points: no trend after them to come back to)
    # several loops in one run (a script: tests/idioms_script.py), one of them at another scale for 8 iterations:
    # its second half is no jump from the point before it
    mixed = [1.6, 1.5, 1.7, 1.6] * 5 + [1e5, 1.05e5, 1.07e5, 1.1e5] * 2 + [1.6, 1.5, 1.7, 1.6] * 5
    assert spike_points(mixed) == []
    none_read = [None] * 50  # (CUDA: the loss is not read)
    assert spike_points(none_read) == []


def test_an_accelerate_loop_with_a_poisoned_batch(engine: str) -> None:
    """A library's loop the cell writes (Accelerate's prepared loader): the spike and its iteration are named; the
    prepared loader keeps state of its own as it iterates, so its batch is not drawn again."""
    from library_loops import ACCEL_LOOP, accelerate_loop

    def make() -> dict:
        ns = accelerate_loop(accum=1, n=8 * 30, batch=8, lr=1e-3)
        x, _ = ns["loader"].dataset.tensors
        x[8 * 20:8 * 21] *= 1000.0  # <-- batch 20
        return ns
    ns = make()
    report = fits_the_schema(bd.diagnose(ACCEL_LOOP, ns, engine=engine))
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert f.iteration == 20 and s.iteration == 20 and s.batch is None and s.spikes == 1, describe(report)
    assert "DataLoaderShard" in s.why_not and f.line == 1, describe(report)


def test_an_epoch_loop_names_the_batch_within_its_pass(engine: str) -> None:
    """Iterations count across epochs; the batch is the one of the pass through ``batches`` (40 a pass)."""
    cell = ("losses = []\n"
            "for epoch in range(2):\n"
            + "".join("    " + line + "\n" for line in CELL.splitlines()[1:]))
    plain, doctored, report = _diagnose(cell, lambda: _ns(_batches()), engine)
    _same_results(plain, doctored)
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert (f.iteration, s.batch, s.loop_line, f.line, f.module) == (BAD, BAD, 3, MODEL_LINE + 1, "model.0"), \
        describe(report)


def test_a_body_that_logs_outside_is_not_run_again(engine: str) -> None:
    """A body that logs to a dashboard (``run.log``) would log twice more: the spike is named, unprobed."""
    class Run:
        def __init__(self) -> None:
            self.points: list = []

        def log(self, data: dict) -> None:
            self.points.append(data)

    cell = CELL + "    run.log({'loss': loss.item(), 'lr': torch.log(torch.tensor(1e-2)).item()})\n"
    runs = []

    def make() -> dict:
        ns = _ns(_batches())
        ns["run"] = Run()
        runs.append(ns["run"])
        return ns
    plain, doctored, report = _diagnose(cell, make, engine)
    _same_results(plain, doctored)
    assert len(runs[0].points) == len(runs[1].points) == 40  # (plain, doctored: no point logged by the probe)
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert s.batch is None and "calls `run.log(...)` (line 9)" in s.why_not and f.iteration == BAD, describe(report)


def test_one_sample_out_of_range_is_named_by_its_row() -> None:
    """The batch's description names the sample: one row of batch 25 scaled 1000x (one the model gets wrong: an
    outlier it classifies right adds no loss)."""
    batches = _batches(bad=None)
    x, y = batches[BAD]
    x = x.clone()
    x[3] *= 1000.0  # <-- one sample
    batches[BAD] = (x, y)
    report = fits_the_schema(bd.diagnose(CELL, _ns(batches), engine="python"))
    f = only(report, "loss_spike")
    assert f.iteration == BAD and f.module == "model.0", describe(report)
    assert "in sample 3 of its 16 (dimension 0)" in f.message, f.message


def test_no_probe_where_the_run_asks_for_no_replay(engine: str) -> None:
    """``rollback=False`` (what a distributed rank's run asks: its collectives would have no peers): the spike is
    said from the series, its batch not run again."""
    report = fits_the_schema(bd.diagnose(CELL, _ns(_batches()), engine=engine, rollback=False))
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert f.iteration == BAD and s.batch is None and s.why_not.startswith("the run asked for no replay"), \
        describe(report)
    assert not any("the loop's body was run twice more" in n for n in report.trace.notes)


def test_a_loader_in_order_gives_its_batch_again(engine: str) -> None:
    """A ``DataLoader`` that does not shuffle and has no workers gives the same batches again: the batch is named."""
    def make() -> dict:
        xs = torch.cat([b[0] for b in _batches(bad=None)])
        ys = torch.cat([b[1] for b in _batches(bad=None)])
        xs[16 * BAD:16 * (BAD + 1)] *= 1000.0
        ns = _ns([])
        ns["batches"] = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16)
        return ns
    plain, doctored, report = _diagnose(CELL, make, engine)
    _same_results(plain, doctored)
    f = only(report, "loss_spike")
    s = report.trace.loss_spike
    assert (f.iteration, s.batch, s.out_of_range, f.module, f.line) == (BAD, BAD, "xb", "model.0", MODEL_LINE), \
        describe(report)
    assert f"look at `next(itertools.islice(batches, {BAD}, None))`" in f.message  # (a DataLoader has no [k])
