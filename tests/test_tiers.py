"""Two tiers: the cheap first capture, and the detailed replay from the rolled-back state."""
from __future__ import annotations

import contextlib
import io

import torch

import backward_doctor as bd

CELL = """
print("step")
h = model(x)
loss = torch.log(h - h.detach() + (h > 1e9).float()).mean()   # log(0) = -inf
loss.backward()
opt.step()
"""


def _ns():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return {"torch": torch, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "x": torch.randn(8, 4)}


def test_nan_triggers_a_silent_detailed_replay_from_the_saved_state():
    ns = _ns()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = bd.diagnose(CELL, ns)
    assert out.getvalue() == "step\n"                      # the replay's print is swallowed
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("nonfinite", 4, "aten::log")
    assert any("replayed" in n for n in report.trace.notes)
    plain = _ns()
    with contextlib.redirect_stdout(io.StringIO()):
        exec(CELL, plain)
    for p, q in zip(plain["model"].parameters(), ns["model"].parameters()):  # as a plain run leaves them
        assert torch.equal(p.isnan(), q.isnan()) and torch.equal(p.nan_to_num(), q.nan_to_num())


def test_without_rollback_the_first_tier_still_says_nan_happened():
    with contextlib.redirect_stdout(io.StringIO()):
        report = bd.diagnose(CELL, _ns(), rollback=False)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.evidence["located"] is False and f.line == 4
    assert "rollback" in f.message
    assert not any("replayed" in n for n in report.trace.notes)


def test_a_clean_step_is_not_replayed():
    with contextlib.redirect_stdout(io.StringIO()):
        report = bd.diagnose(CELL.replace("torch.log(", "torch.exp("), _ns())
    assert report.ok and not any("replayed" in n for n in report.trace.notes)
    assert report.trace.needs_detail is None
