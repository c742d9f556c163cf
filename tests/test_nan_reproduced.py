"""A NaN the doctor replays from its saved state is said **deterministic** (the replay from the same weights,
batch and random state made it again: this data, these weights, not chance) or **transient** (the replay stayed
finite: hardware, a nondeterministic kernel, a race, state the replay does not restore), issue 48.

A loop of 300 iterations goes NaN at iteration 250, which the native recorder sleeps through (it records 0, 1, 2
and each power of two): that iteration alone is replayed from the state kept when its loss went NaN
(``run/iteration_replay.py``). The Python tier replays only where its first run screens scalars alone (CUDA's
first tier, simulated here on the CPU as ``tests/test_always_on.py`` does): the cell is run again from the
snapshot taken before it (``run/engine.py``). Each bug beside its healthy twin, which stays silent.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd

CELL = ("for i in range(300):\n"            # 1
        "    opt.zero_grad()\n"              # 2
        "    xb = bad if i == {bad} else x\n"  # 3
        "    feats = torch.log(xb)\n"        # 4  <-- a batch with a zero: log(0) = -inf
        "    loss = F.cross_entropy(model(feats), y)\n"  # 5
        "    loss.backward()\n"              # 6
        "    opt.step()\n")                  # 7
LOG_LINE, LOSS_LINE, BACKWARD_LINE = 4, 5, 6


def fault_at(call: int | None):
    """A fault that turns a layer's input into NaN at its ``call``-th call (counted from 1), and only then: the
    count lives in a closure, which no snapshot restores (weights, optimizer state, RNG, loop variables), so a
    replay of that iteration does not see that call again, as a replay does not see a bit flip again."""
    calls = itertools.count(1)

    def fault(x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if next(calls) == call else x  # <-- transient fault

    return fault


class Net(nn.Module):
    def __init__(self, fault) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.fault(x))


class MaskedNet(Net):
    """``Net`` with a causal mask of ``-inf`` over its rows, which softmax turns into zeros: NaN/Inf made in every
    iteration on purpose, which reaches nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fault(x)
        scores = (h @ h.T).masked_fill(torch.ones(len(h), len(h)).triu(1).bool(), float("-inf"))
        return self.body(torch.softmax(scores, dim=-1) @ h)


def _ns(fault_call: int | None = None, net: type = Net) -> dict:
    torch.manual_seed(0)
    model = net(fault_at(fault_call))
    x = torch.rand(12, 8) + 0.5
    bad = x.clone()
    bad[3, 2] = 0.0
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": x, "bad": bad,
            "y": torch.randint(0, 3, (12,)), "F": F, "torch": torch}


@pytest.fixture
def replaying(engine: str, monkeypatch) -> str:
    """``engine``, run where the NaN is replayed: the native recorder samples the loop (the iteration is replayed);
    the Python tier screens every op on the CPU in its one run, so CUDA's first tier is simulated (scalars
    screened, the cell replayed from the snapshot taken before it)."""
    if engine == "python":
        from backward_doctor.run import step

        monkeypatch.setattr(step, "screens_every_op", lambda: False)
    return engine


def _same_results(plain: dict, doctored: dict) -> None:
    """Rule 1: the doctored run leaves the weights a plain run leaves (NaN where it has NaN)."""
    for p, q in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p.isnan(), q.isnan()) and torch.equal(p.nan_to_num(), q.nan_to_num())


def test_a_nan_the_replay_makes_again_is_deterministic(replaying: str) -> None:
    cell = CELL.format(bad=250)
    plain, doctored = _ns(), _ns()
    exec(cell, plain)
    report = bd.diagnose(cell, doctored, engine=replaying)
    _same_results(plain, doctored)
    assert report.trace.engine == replaying and report.trace.nonfinite_reproduced is True, report.trace.notes
    f = report.findings[0]
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::log", LOG_LINE, 250), str(report)
    assert f.evidence["reproduced"] is True and "`log` of zero" in f.message
    assert "made NaN/Inf again: it is deterministic, this data and these weights, not chance" in f.message
    assert "transient" not in f.message.lower()
    if replaying == "native":  # the iteration alone, from the state kept when its loss went NaN
        assert report.trace.iterations.replayed == 250 and 250 not in report.trace.iterations.recorded
        assert "Replayed from the same weights, optimizer state, batch and random state, iteration 250" in f.message
    else:  # the cell, from the snapshot taken before it
        assert "Run again from the state saved before the cell" in f.message
    # the field goes through the JSON report and back
    again = type(report).from_dict(report.to_dict())
    assert again.trace.nonfinite_reproduced is True and again.findings[0].evidence["reproduced"] is True


def test_a_nan_the_replay_does_not_make_again_is_transient_and_names_no_line(replaying: str) -> None:
    plain, doctored = _ns(fault_call=251), _ns(fault_call=251)  # (call 251: iteration 250)
    cell = CELL.format(bad=-1)
    exec(cell, plain)
    report = bd.diagnose(cell, doctored, engine=replaying)
    _same_results(plain, doctored)
    assert report.trace.iterations.first_nonfinite == 250 and report.trace.nonfinite_reproduced is False, \
        report.trace.notes
    assert not report.ok and [g.kind for g in report.findings] == ["nonfinite"], str(report)
    f = report.findings[0]
    assert f.title == "Transient NaN/Inf (its replay did not make it again)" and f.iteration == 250
    assert f.evidence["reproduced"] is False and f.evidence["located"] is False
    # no op and no line from a replay that saw none: the line is where the run saw the NaN, in the cell (the
    # fault's line in this file is never named)
    assert f.op is None and f.file is None and f.module is None
    assert f.line == (BACKWARD_LINE if replaying == "native" else LOSS_LINE), str(report)
    assert f"line {f.line} is where the run saw it, not where it was born" in f.message
    for cause in ("the NaN/Inf is transient", "the hardware", "a nondeterministic kernel", "a race",
                  "state the replay does not restore"):
        assert cause in f.message, f.message
    assert "it is deterministic" not in f.message and "from this iteration's data or op" not in f.message
    # the HTML shows that line as where NaN/Inf was seen, not as the root cause
    html = report.to_html()
    assert "where NaN/Inf was seen (not its origin)" in html and "root cause: cell, line" not in html
    assert report.trace.iterations.replayed is None  # (the trace is the run's own: no replayed op shown)


def test_the_healthy_twin_is_silent(replaying: str) -> None:
    plain, doctored = _ns(), _ns()
    cell = CELL.format(bad=-1)
    exec(cell, plain)
    report = bd.diagnose(cell, doctored, engine=replaying)
    assert report.ok and not report.findings, str(report)
    assert report.trace.nonfinite_reproduced is None and report.trace.iterations.first_nonfinite is None
    for p, q in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p, q)


def test_a_nan_seen_op_by_op_in_the_one_run_is_not_called_either() -> None:
    """The Python tier on the CPU screens every op in its one run: the NaN is located there, with no replay,
    so the report says neither deterministic nor transient (it does not know)."""
    report = bd.diagnose(CELL.format(bad=250), _ns(), engine="python")
    f = report.findings[0]
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::log", LOG_LINE, 250), str(report)
    assert report.trace.nonfinite_reproduced is None and "reproduced" not in f.evidence
    assert "deterministic" not in f.message and "transient" not in f.message.lower()


def test_a_masks_intended_inf_in_the_replay_does_not_make_a_transient_nan_deterministic(replaying: str) -> None:
    """The replay of the transient iteration makes the mask's ``-inf`` again (every iteration does), which reaches
    neither the loss, a gradient nor a weight: that is not the NaN made again. (It counted as made again: the
    iteration's replay was merged with no origin in it, and the cell's replay, the Python tier's, made the report
    OK over a loop that went NaN.) Its healthy twin stays silent."""
    cell = CELL.format(bad=-1)
    plain, doctored = _ns(fault_call=251, net=MaskedNet), _ns(fault_call=251, net=MaskedNet)
    exec(cell, plain)
    report = bd.diagnose(cell, doctored, engine=replaying)
    _same_results(plain, doctored)
    assert report.trace.nonfinite_reproduced is False, report.trace.notes
    f = report.findings[0]
    assert f.title == "Transient NaN/Inf (its replay did not make it again)" and f.op is None, str(report)
    healthy = bd.diagnose(cell, _ns(net=MaskedNet), engine=replaying)
    assert healthy.ok and healthy.trace.nonfinite_reproduced is None, str(healthy)
