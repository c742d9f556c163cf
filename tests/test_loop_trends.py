"""A training loop watched in every iteration (issue 17): loss, gradient norm, learning rate and live
memory per iteration; a divergence told from a bad batch, the learning rate raised inside the loop named
as the root cause; memory kept across iterations named at the line that keeps it, with its growth per
iteration and where it is heading; a loop with tqdm stays a loop. Runs on whichever tier is active
(``BACKWARD_DOCTOR_NATIVE=0`` runs it on the Python tier)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd


def _ns(seed: int = 0, **extra) -> dict:
    torch.manual_seed(seed)
    return {"torch": torch, "F": F, "nn": nn, **extra}


DIVERGE = """
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(3000, 8); Y = torch.randn(3000, 1)
for i in range(300):
    if i == 150:
        for g in opt.param_groups:
            g["lr"] = 1.5
    xb, yb = X[i * 10:(i + 1) * 10], Y[i * 10:(i + 1) * 10]
    loss = ((model(xb) - yb) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""

BAD_BATCH = """
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for i in range(300):
    xb, yb = X[i * 10:(i + 1) * 10], Y[i * 10:(i + 1) * 10]
    loss = ((model(xb) - yb) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""

KEEPS_OUTPUTS = """
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(64, 64); Y = torch.randint(0, 10, (64,))
outputs = []
for i in range({n}):
    loss = F.cross_entropy(model(X), Y)
    outputs.append(model(X))   # kept for a metric: each one with its graph
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_the_series_are_the_loops_own_numbers():
    """The loss the watch read is the loss the cell computed, iteration by iteration, and the gradient
    norm is the norm of the gradients each step used; a plain loop keeps steady memory and no finding."""
    cell = ("losses, norms = [], []\nfor i in range(40):\n    loss = ((model(X) - Y) ** 2).mean()\n"
            "    opt.zero_grad(); loss.backward()\n    losses.append(loss.item())\n"
            "    norms.append(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item())\n"
            "    opt.step()\n")
    ns = _ns(X=torch.randn(32, 8), Y=torch.randn(32, 1))
    ns["model"] = nn.Linear(8, 1)
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.05)
    report = bd.diagnose(cell, ns)
    its = report.trace.iterations
    assert report.ok and its.steps == 40 and its.stride == 1
    assert its.loss == pytest.approx(ns["losses"], rel=1e-6)
    assert its.grad_norm == pytest.approx(ns["norms"], rel=1e-4)
    assert its.lr == [0.05] * 40 and its.first_nonfinite is None
    assert len(its.live_bytes) == 40 and its.live_kind in ("allocator", "ledger")
    assert max(its.live_bytes[2:]) - min(its.live_bytes[2:]) < 4096  # steady: nothing kept


def test_a_bad_batch_deep_in_the_loop_is_a_jump_at_its_iteration():
    X = torch.randn(4000, 8)
    X[2003, 5] = float("nan")  # (made by an earlier cell: the data pipeline)
    report = bd.diagnose(BAD_BATCH, _ns(X=X, Y=torch.randn(4000, 1)))
    f = report.findings[0]
    assert (f.kind, f.iteration) == ("nonfinite", 200), f
    assert f.line == 6 and f.evidence["variable"] == "X"  # the data, not the model
    assert f.evidence["pattern"] == "jump" and "steady" in f.message
    hist = f.evidence["history"]
    assert hist["iterations"][-1] == 200 and len(hist["loss"]) == len(hist["iterations"]) <= 64
    assert hist["loss"][-1] is None and all(v is not None for v in hist["loss"][:-1])


def test_a_learning_rate_raised_in_the_loop_is_the_root_cause_of_the_divergence():
    report = bd.diagnose(DIVERGE, _ns())
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 8, 150), f
    assert f.evidence["pattern"] == "divergence" and f.evidence["lr_change"]["to"] == 1.5
    assert "raised from 0.01 to 1.5 in iteration 150 at line 8" in f.message
    first = report.trace.iterations.first_nonfinite
    assert first is not None and first > 160
    assert "in iteration 150 of the loop at line 5" in f.location()


def test_a_divergence_without_a_change_says_so():
    cell = DIVERGE.replace("lr=0.01", "lr=1.5").replace("    if i == 150:\n        for g in opt.param_groups:\n"
                                                       "            g[\"lr\"] = 1.5\n", "")
    f = bd.diagnose(cell, _ns()).findings[0]
    assert f.kind == "nonfinite" and f.evidence["pattern"] == "divergence", f
    assert "lr_change" not in f.evidence and "clip_grad_norm_" in f.message


def test_outputs_kept_across_iterations_are_the_root_cause_with_their_growth():
    report = bd.diagnose(KEEPS_OUTPUTS.format(n=120), _ns())
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("graph_leak", 8, 0), f
    assert f.title == "Graphs of earlier iterations kept alive" and f.severity == "warning"
    growth = f.evidence["growth"]
    assert 50_000 < growth["per_iteration"] < 90_000  # one output's saved activations: ~66 KiB
    assert "per iteration" in f.message and ".detach()" in f.message


def test_the_leak_comes_before_the_oom_it_causes_and_predicts_it():
    limit = 10_000_000
    first = bd.diagnose(KEEPS_OUTPUTS.format(n=60), _ns(), memory_limit=limit)
    finished = first.findings[0]
    assert finished.kind == "graph_leak" and "growth" in finished.evidence, first.trace.iterations.live_bytes
    assert finished.evidence["growth"]["full_at"] is not None
    predicted = finished.evidence["growth"]["full_at"]
    report = bd.diagnose(KEEPS_OUTPUTS.format(n=400), _ns(), memory_limit=limit)
    kinds = [f.kind for f in report.findings]
    assert kinds[:2] == ["graph_leak", "oom"], (kinds, report.trace.iterations.live_bytes)
    leak, oom = report.findings[:2]
    assert leak.line == 8 and leak.severity == "error" and "consequence" in leak.message
    assert oom.fixes == [] and oom.message.startswith("A consequence of the graphs `outputs` keeps")
    ran_out = report.trace.iterations.steps
    assert oom.iteration == ran_out and abs(predicted - ran_out) <= 0.1 * ran_out, (predicted, ran_out)


def test_accumulating_the_loss_tensor_is_named():
    cell = ("total = 0\nfor i in range(30):\n    loss = ((model(X) - Y) ** 2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n    total += loss\n")
    ns = _ns(X=torch.randn(32, 8), Y=torch.randn(32, 1))
    ns["model"] = nn.Linear(8, 1)
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.05)
    f = bd.diagnose(cell, ns).findings[0]
    assert (f.kind, f.line) == ("graph_leak", 5) and "total += loss.item()" in f.message
    clean = bd.diagnose(cell.replace("total += loss", "total += loss.item()"), dict(ns))
    assert clean.ok, clean.findings


def test_tqdm_in_the_cell_still_works():
    tqdm = pytest.importorskip("tqdm")
    cell = ("bar = tqdm.tqdm(range(25), file=sink)\nfor i in bar:\n    loss = ((model(X) - Y) ** 2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n    bar.set_postfix(loss=loss.item())\n")
    import io

    ns = _ns(X=torch.randn(32, 8), Y=torch.randn(32, 1), tqdm=tqdm, sink=io.StringIO())
    ns["model"] = nn.Linear(8, 1)
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.05)
    report = bd.diagnose(cell, ns)
    assert report.ok and report.trace.iterations.steps == 25
    assert "25/25" in ns["sink"].getvalue()


def test_the_series_survive_json_and_stay_bounded():
    from backward_doctor.trace import Trace

    report = bd.diagnose(KEEPS_OUTPUTS.format(n=30), _ns())
    import json

    its = Trace.from_dict(json.loads(json.dumps(report.trace.to_dict()))).iterations
    assert its.live_bytes == report.trace.iterations.live_bytes and its.loss == report.trace.iterations.loss
    from backward_doctor.capture.loop.series import LoopWatch
    from backward_doctor.trace.parts import Iterations

    long = Iterations()
    watch = LoopWatch(long, live=lambda: 1)
    for _ in range(10_000):
        watch.saw_backward(torch.tensor(1.0))
        watch.iteration_ended()
        long.steps += 1
    assert len(long.loss) <= 4096 and long.stride == 4 and len(long.live_bytes) == len(long.loss)
    assert not any(math.isnan(v) for v in long.loss)


def test_ctrl_c_in_a_long_loop_reports_what_was_seen_so_far():
    """An interrupt in iteration 90 (raised by the cell here, as a Ctrl-C would land): the report has the
    90 iterations done, their series, and the leak they already show; nothing stays installed."""
    cell = KEEPS_OUTPUTS.format(n=400).replace("    loss = F.cross_entropy",
                                               "    if i == 90:\n        raise KeyboardInterrupt\n"
                                               "    loss = F.cross_entropy")
    before = torch.autograd.backward
    report = bd.diagnose(cell, _ns())
    assert torch.autograd.backward is before
    assert report.exception is not None and "KeyboardInterrupt" in report.exception
    its = report.trace.iterations
    assert its.steps == 90 and len(its.live_bytes) == 90
    leak = next(f for f in report.findings if f.kind == "graph_leak")
    assert leak.line == 10 and leak.evidence["growth"]["per_iteration"] > 50_000


def test_an_optimizer_step_that_writes_inf_is_named_with_its_iteration():
    """Finite loss and gradients in iteration 200, but its step (a learning rate of inf set at line 3)
    writes Inf into the weights: the first NaN loss is in iteration 201, and the finding names the step
    of iteration 200 and the line that set the learning rate, not the data."""
    cell = ("for i in range(300):\n    if i == 200:\n        opt.param_groups[0]['lr'] = float('inf')\n"
            "    loss = ((model(X) - Y) ** 2).mean()\n    opt.zero_grad(); loss.backward(); opt.step()\n")
    ns = _ns(X=torch.randn(12, 8), Y=torch.randn(12, 1))
    ns["model"] = nn.Linear(8, 1)
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.01)
    report = bd.diagnose(cell, ns)
    f = report.findings[0]
    assert report.trace.iterations.first_nonfinite == 201
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 3, 200), f
    assert f.title == "The optimizer step of iteration 200 made the weights NaN/Inf"


class _Cached(nn.Module):
    """A module that keeps every activation it made, for 'analysis later'."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.cache = []

    def forward(self, x):
        h = self.lin(x).relu()
        self.cache.append(h)
        return h.sum(1, keepdim=True)


def test_a_cache_on_a_module_is_the_line_in_its_class():
    cell = ("for i in range(60):\n    loss = ((model(X) - Y) ** 2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n")
    torch.manual_seed(0)
    model = _Cached()
    ns = _ns(X=torch.randn(32, 64), Y=torch.randn(32, 1), model=model,
             opt=torch.optim.SGD(model.parameters(), lr=0.01))
    f = bd.diagnose(cell, ns).findings[0]
    assert f.kind == "graph_leak" and f.file is not None and f.file.endswith("test_loop_trends.py"), f
    import inspect

    src, first = inspect.getsourcelines(_Cached.forward)
    assert f.line == first + next(i for i, s in enumerate(src) if "self.cache.append" in s)
    assert f.evidence["variable"] == "model" and f.evidence["growth"]["per_iteration"] >= 32 * 64 * 4


def test_a_cpu_loop_on_a_machine_with_an_untouched_gpu_is_a_cpu_loop(monkeypatch):
    """Seen on an H200 box: with a GPU present every CPU loop's memory series was read from the idle GPU allocator
    (all zeros), so a leak had no growth, and the doctor itself started a CUDA context for a CPU step. The GPU is
    the doctor's business only once the process uses it; here no CUDA call is made (on this CPU-only torch
    any would raise)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    from backward_doctor.run.engine import screens_every_op

    assert screens_every_op()                        # one run, every op screened, as on a CPU-only machine
    report = bd.diagnose(KEEPS_OUTPUTS.format(n=40), _ns(), engine="python")
    f = report.findings[0]
    assert (f.kind, f.line) == ("graph_leak", 8) and 50_000 < f.evidence["growth"]["per_iteration"] < 90_000, f
    assert report.trace.device == "cpu" and report.trace.memory.cuda is None
    assert report.trace.iterations.live_kind == "ledger"


# NaN/Inf gradients from a finite loss in iteration 3, then the optimizer writes them into the weights with ops that
# return nothing (in place over lists: a fused AdamW, a foreach one, `clip_grad_norm_`'s `_foreach_mul_`): the next
# iteration's forward reads NaN weights. The root cause is iteration 3's backward of sqrt at 0, not "the weights
# were already NaN" in iteration 4 (both tiers said so: what those ops wrote was not screened).
FUSED_GRAD_NAN = """
for i in range(6):
    opt.zero_grad()
    out = model(x)
    z = (out * 0).sum() + (0.0 if i == 3 else 1.0)
    loss = out.pow(2).mean() + torch.sqrt(z)   # <-- root cause
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
"""


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_nan_gradients_written_by_a_fused_or_foreach_step_keep_their_origin(optimizer: str, engine: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{optimizer: True})
    ns = _ns(model=model, opt=opt, x=torch.randn(4, 8))
    report = bd.diagnose(FUSED_GRAD_NAN, ns, engine=engine, every_iteration=True)
    f = report.findings[0]
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::sqrt", 6, 3), str(report)
    assert "already" not in f.message, f.message
