"""The cell runs once, every op screened (CPU); the detailed replay only where a per-op screen cannot be
afforded (CUDA), and then the report says the cell ran twice."""
from __future__ import annotations

import contextlib
import io

import torch

import backward_doctor as bd
from backward_doctor.run import engine as tiers
from backward_doctor.run import step

CELL = """
print("step")
b = next(batches); seen.append(b)
h = model(x)
loss = torch.log(h - h.detach() + (h > 1e9).float()).mean()   # log(0) = -inf
loss.backward()
opt.step()
"""


def _ns():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return {"torch": torch, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "x": torch.randn(8, 4), "batches": iter(range(100)), "seen": []}


def test_nan_origin_found_in_the_one_run(engine):
    ns = _ns()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = bd.diagnose(CELL, ns, engine=engine)
    assert out.getvalue() == "step\n"
    assert ns["seen"] == [0] and next(ns["batches"]) == 1   # the cell's code ran exactly once
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("nonfinite", 5, "aten::log")
    assert report.trace.engine == engine and not any("replayed" in n for n in report.trace.notes)
    plain = _ns()
    with contextlib.redirect_stdout(io.StringIO()):
        exec(CELL, plain)
    for p, q in zip(plain["model"].parameters(), ns["model"].parameters()):  # as a plain run leaves them
        assert torch.equal(p.isnan(), q.isnan()) and torch.equal(p.nan_to_num(), q.nan_to_num())


def test_without_rollback_the_origin_is_still_found(engine):
    with contextlib.redirect_stdout(io.StringIO()):
        report = bd.diagnose(CELL, _ns(), rollback=False, engine=engine)
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("nonfinite", 5, "aten::log")


def test_where_every_op_cannot_be_screened_the_replay_says_the_cell_ran_twice(monkeypatch, engine):
    """On CUDA (simulated here) the first run screens scalars only and the step is replayed in detail."""
    monkeypatch.setattr(tiers, "screens_every_op", lambda: False)
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    ns = _ns()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = bd.diagnose(CELL, ns, engine=engine)
    assert out.getvalue() == "step\n"                      # the replay's print is swallowed
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("nonfinite", 5, "aten::log")
    note = next(n for n in report.trace.notes if "replayed" in n)
    assert "ran twice" in note
    assert ns["seen"] == [0, 1]                            # ... and the report said so


def test_without_rollback_where_nothing_can_be_replayed_the_first_tier_still_says_nan_happened(monkeypatch):
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    with contextlib.redirect_stdout(io.StringIO()):
        report = bd.diagnose(CELL, _ns(), rollback=False)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.evidence["located"] is False and f.line == 5
    assert "rollback" in f.message
    assert not any("replayed" in n for n in report.trace.notes)


def test_a_clean_step_is_seen_once(engine):
    ns = _ns()
    with contextlib.redirect_stdout(io.StringIO()):
        report = bd.diagnose(CELL.replace("torch.log(", "torch.exp("), ns, engine=engine)
    assert report.ok and not any("replayed" in n for n in report.trace.notes)
    assert report.trace.needs_detail is None and ns["seen"] == [0]


def test_a_replay_that_does_not_go_nan_again_keeps_the_first_runs_report(monkeypatch):
    """(Found simulating CUDA under ``%%backward_doctor`` on ``trainer.fit()``: the replay of a Lightning trainer
    that had reached its last step returned at once, and its empty trace replaced the run's report: "OK".) State
    the snapshot does not roll back, here a list the cell counts its runs in, makes the replay differ."""
    monkeypatch.setattr(tiers, "screens_every_op", lambda: False)
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    ns = _ns()
    ns["runs"] = []
    cell = ("runs.append(1)\nh = model(x)\nloss = (h * (float('nan') if len(runs) == 1 else 1.0)).mean()\n"
            "loss.backward()\nopt.step()\n")
    report = bd.diagnose(cell, ns)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.evidence["located"] is False and f.line == 3, str(report)
    assert ("The cell was run again from the state saved before it (weights, optimizer state, random state), with "
            "every op checked, and it stayed finite: the NaN/Inf is transient" in f.message), f.message
    assert report.trace.nonfinite_reproduced is False and f.evidence["reproduced"] is False
    assert "state the replay does not restore (a counter or global your code keeps" in f.message
    assert any("it did not appear again" in n and "where it was born is not known" in n for n in report.trace.notes)
    assert ns["runs"] == [1, 1]


def test_a_library_loop_screened_at_scalars_replays_the_librarys_step_not_the_cell(monkeypatch):
    """CUDA's first tier (simulated): ``trainer.train()`` in a cell is not replayed whole (the library would not
    start again from the same state), but the step that went NaN/Inf, through the trainer's own
    ``training_step`` with that step's batch; the wrapper that knew the batch is gone after the run."""
    import library_loops as ll

    monkeypatch.setattr(tiers, "screens_every_op", lambda: False)
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    ns = ll.hf_rare_token_trainer(ll.HF_NAN, poison=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        report = bd.diagnose("trainer.train()\n", ns, engine="python")
    f = report.findings[0]
    assert (f.kind, f.op, f.line) == ("nonfinite", "aten::log", ll.marked_line(ns, "MyTrainer", "# <-- here")), \
        str(report)
    assert report.trace.iterations.replayed == ll.POISONED_STEP and report.trace.iterations.steps == 10
    assert f.iteration == ll.POISONED_STEP, str(report)  # (placed in the loop, though no line of the cell ran it)
    assert "training_step" not in vars(ns["trainer"])


def test_a_lightning_fit_screened_at_scalars_replays_the_modules_step_not_the_cell(monkeypatch):
    """The same for Lightning's ``trainer.fit(model, loader)`` in a cell: the batch that went NaN/Inf (the sixth)
    is replayed through the LightningModule's own ``training_step`` and its backward, from the state kept when
    it went non-finite; the fit is not run again (a trainer at its last step would return at once: "origin not
    located"), and the wrapper that knew the batch is gone after the run."""
    import library_loops as ll

    monkeypatch.setattr(tiers, "screens_every_op", lambda: False)
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    ns = ll.lit_fit(ll.LIT_LATE_NAN, "LitLate", steps=8)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        report = bd.diagnose(ll.LIT_FIT, ns, engine="python")
    f = report.findings[0]
    assert (f.kind, f.op, f.line) == ("nonfinite", "aten::log", ll.marked_line(ns, "LitLate", "# <-- here")), \
        str(report)
    assert f.function == "LitLate.training_step" and report.trace.iterations.replayed == 5, str(report)
    assert f.iteration == 5 and f.evidence["loop_value"] == "epoch 0, batch 5", str(report)
    assert "training_step" not in vars(ns["model"])


def test_a_correct_lightning_fit_screened_at_scalars_runs_as_plain(monkeypatch):
    """The wrapper on the LightningModule's ``training_step`` changes nothing: same weights as a plain fit, the
    wrapper and the batch it knew gone after the run; a module under manual optimization is not wrapped."""
    import library_loops as ll
    from backward_doctor.capture.loop.library_step import library_step

    monkeypatch.setattr(tiers, "screens_every_op", lambda: False)
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    plain, ns = ll.lit_fit(steps=6), ll.lit_fit(steps=6)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        exec(ll.LIT_FIT, plain)
        report = bd.diagnose(ll.LIT_FIT, ns, engine="python")
    assert report.ok, str(report)
    for a, b in zip(plain["model"].parameters(), ns["model"].parameters()):
        assert torch.equal(a, b)
    assert "training_step" not in vars(ns["model"])
    manual = ll.lit_fit(ll.LIT_MANUAL, "LitManual")
    assert library_step(manual, ll.LIT_FIT) is None and "training_step" not in vars(manual["model"])
