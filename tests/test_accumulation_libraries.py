"""grad_accumulation and amp_misuse inside library loops: `transformers.Trainer.train()`, Lightning
`Trainer.fit()` and an Accelerate loop (the shared kit, ``tests/library_loops.py``), on both engines.

Each bug stands beside its correct version, which must stay silent. The bugs live where users write
them: in a `Trainer` subclass or a `LightningModule` defined in a file of its own (as a notebook cell
defines it), or in the cell that runs the Accelerate loop; the finding names that line. One of them is
not the user's: the Trainer leaves the loss of a BERT classifier undivided under
``gradient_accumulation_steps`` (its ``forward`` takes ``**kwargs`` but its loss drops
``num_items_in_batch``: transformers#47688), and the measured check says by how much.
"""
from __future__ import annotations

import os

import pytest
import torch

import backward_doctor as bd

import library_loops as ll

os.environ.setdefault("HF_HUB_OFFLINE", "1")




def _describe(report) -> str:
    return "\n".join([f"exception={report.exception!r}"] + [
        f"  {f.kind} {f.location()} file={f.file}: {f.message}" for f in report.findings])


def _only(report, kind: str):
    assert [f.kind for f in report.findings] == [kind], _describe(report)
    return report.findings[0]


def _at_user_line(f, ns: dict, name: str, marker: str) -> None:
    """The finding names the marked line of the user's code *name* (a class defined from source)."""
    want = ll.marked_line(ns, name, marker)
    path = getattr(ns[name], "__module__", None)
    assert f.line == want and f.file is not None and f.file.startswith(ll._DIR), (f.line, want, f.file, path)


# ----------------------------------------------------------------------------- transformers.Trainer
GA_SCALED = """\
class MyTrainer(Trainer):
    loss_is_scaled_for_ga = False  # compute_loss returns a per-batch mean: the Trainer divides it
"""
MEAN_LOSS = """\
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())  # <-- mean over this micro-batch
        return (loss, None) if return_outputs else loss
"""
SUM_LOSS = """\
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
        loss = loss / num_items_in_batch  # the tokens of all the step's micro-batches
        return (loss, None) if return_outputs else loss
"""
ZERO_EACH_BATCH = """\
class MyTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.zero_grad()  # <-- a clean start for every batch
        return super().training_step(model, inputs, num_items_in_batch)
"""


def test_trainer_leaves_a_classifier_loss_undivided_and_the_fix_makes_it_silent(engine):
    report = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(steps=2, accum=2), engine=engine)
    f = _only(report, "grad_accumulation")
    assert (f.line, f.file, f.iteration) == (1, None, 0), _describe(report)
    assert f.evidence["problem"] == "loss_not_divided" and f.evidence["library"] == "trainer"
    check = f.evidence["check"]
    assert check["micro_batches"] == 2 and abs(check["factor"] - 2.0) < 1e-6 and abs(check["rel_diff"] - 1.0) < 1e-6
    assert "trainer.loss_is_scaled_for_ga = False" in f.message and "2x" in f.message

    fixed = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(GA_SCALED, steps=2, accum=2), engine=engine)
    assert fixed.findings == [], _describe(fixed)
    check = fixed.trace.accumulation.check
    assert check is not None and abs(check.factor - 1.0) < 1e-6 and check.rel_diff < 1e-5


def test_trainer_compute_loss_that_drops_num_items_in_batch(engine):
    ns = ll.hf_trainer(MEAN_LOSS, task="lm", steps=2, accum=2)
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _only(report, "grad_accumulation")
    _at_user_line(f, ns, "MyTrainer", "# <-- mean over this micro-batch")
    assert f.function == "MyTrainer.compute_loss" and f.iteration == 0
    assert abs(f.evidence["check"]["factor"] - 2.0) < 1e-6

    ok = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(SUM_LOSS, task="lm", steps=2, accum=2), engine=engine)
    assert ok.findings == [], _describe(ok)


def test_trainer_zero_grad_in_every_training_step(engine):
    ns = ll.hf_trainer(ZERO_EACH_BATCH, task="lm", steps=2, accum=2)
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _only(report, "grad_accumulation")
    _at_user_line(f, ns, "MyTrainer", "# <-- a clean start")
    assert f.evidence["problem"] == "zero_grad_inside" and f.evidence["thrown_away"] == 1
    assert f.evidence["check"]["rel_diff"] > 0.1

    ok = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(task="lm", steps=2, accum=2), engine=engine)
    assert ok.findings == [], _describe(ok)


def test_trainer_on_bf16_weights_vs_bf16_mixed_precision(engine):
    ns = ll.hf_trainer(steps=2)
    ns["model"].to(torch.bfloat16)  # "to save memory", then the Trainer's AdamW at 5e-5
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _only(report, "amp_misuse")
    assert f.evidence["problem"] == "update_below_precision" and f.evidence["fraction"] >= 0.2
    assert any("LayerNorm" in name for name in f.evidence["frozen"]), f.evidence
    assert "bf16=True" in f.message and (f.line, f.file) == (1, None)

    ok = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(steps=2, bf16=True), engine=engine)
    assert ok.findings == [], _describe(ok)


# ----------------------------------------------------------------------------- Lightning
MANUAL = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class ManualAccumulation(pl.LightningModule):
    def __init__(self, accum=2, lr=0.1):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        self.accum, self.lr = accum, lr

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss / self.accum)  # <-- backward
        if (batch_idx + 1) % self.accum == 0:
            opt.step()  # <-- step
            opt.zero_grad()  # <-- zero

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
"""
LIT_BUGS = {
    "loss_not_divided": (MANUAL.replace("loss / self.accum)  # <-- backward", "loss)  # <-- backward"),
                         "# <-- backward"),
    "zero_grad_inside": (MANUAL.replace("            opt.zero_grad()  # <-- zero",
                                        "        opt.zero_grad()  # <-- zero"), "# <-- zero"),
    "step_every_micro_batch": (MANUAL.replace("""        if (batch_idx + 1) % self.accum == 0:
            opt.step()  # <-- step
            opt.zero_grad()  # <-- zero""", """        if (batch_idx + 1) % self.accum == 0:
            self.log("accumulated", 1.0)
        opt.step()  # <-- step
        opt.zero_grad()  # <-- zero"""), "# <-- step"),
}


@pytest.mark.parametrize("problem", sorted(LIT_BUGS))
def test_lightning_manual_accumulation_bug_beside_the_correct_module(problem, engine):
    source, marker = LIT_BUGS[problem]
    ns = ll.lit_fit(source, "ManualAccumulation")
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    f = _only(report, "grad_accumulation")
    assert f.evidence["problem"] == problem, _describe(report)
    _at_user_line(f, ns, "ManualAccumulation", marker)
    assert f.function == "ManualAccumulation.training_step"

    ok = bd.diagnose(ll.LIT_FIT, ll.lit_fit(MANUAL, "ManualAccumulation"), engine=engine)
    assert ok.findings == [], _describe(ok)
    assert ok.trace.accumulation.check is not None and abs(ok.trace.accumulation.check.factor - 1) < 1e-6


ZERO_IN_STEP = ll.LIT_MODULE.replace("""        x, y = batch
        logits = self.net(x)""", """        x, y = batch
        self.zero_grad()  # <-- start clean
        logits = self.net(x)""")


def test_lightning_zero_grad_in_training_step_under_accumulate_grad_batches(engine):
    """Automatic optimization: the last micro-batch's training_step runs inside ``optimizer.step(closure)``;
    counted by backward() calls per step, its zero_grad still sits between the micro-batches."""
    ns = ll.lit_fit(ZERO_IN_STEP, trainer_kwargs={"accumulate_grad_batches": 2})
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    f = _only(report, "grad_accumulation")
    _at_user_line(f, ns, "LitClassifier", "# <-- start clean")
    assert f.evidence["micro_batches"] == 2 and f.evidence["thrown_away"] == 1

    ok = bd.diagnose(ll.LIT_FIT, ll.lit_fit(trainer_kwargs={"accumulate_grad_batches": 2}), engine=engine)
    assert ok.findings == [], _describe(ok)


def test_lightning_bf16_true_vs_bf16_mixed(engine):
    report = bd.diagnose(ll.LIT_FIT, ll.lit_fit(module_kwargs={"lr": 1e-4}, trainer_kwargs={"precision": "bf16-true"}),
                         engine=engine)
    f = _only(report, "amp_misuse")
    assert f.evidence["problem"] == "update_below_precision" and f.evidence["fraction"] > 0.9
    assert "bf16-mixed" in f.message

    ok = bd.diagnose(ll.LIT_FIT, ll.lit_fit(module_kwargs={"lr": 1e-4}, trainer_kwargs={"precision": "bf16-mixed"}),
                     engine=engine)
    assert ok.findings == [], _describe(ok)


CROSSING = ll.LIT_MODULE.replace("""        logits = self.net(x)""", """\
        with torch.autocast("cpu", dtype=torch.bfloat16):
            feats = self.net[:2](x)
        logits = self.net[2](feats)  # <-- head""")
CAST_BACK = CROSSING.replace("self.net[2](feats)  # <-- head", "self.net[2](feats.float())")


def test_lightning_autocast_output_used_after_the_block(engine):
    ns = ll.lit_fit(CROSSING)
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    assert report.exception is not None and "same dtype" in report.exception
    f = report.findings[0]
    assert f.kind == "amp_misuse" and f.evidence["problem"] == "autocast_output_outside", _describe(report)
    _at_user_line(f, ns, "LitClassifier", "# <-- head")
    assert f.evidence["made_line"] == f.line - 1 and f.evidence["with_line"] == f.line - 2

    ok = bd.diagnose(ll.LIT_FIT, ll.lit_fit(CAST_BACK), engine=engine)
    assert ok.exception is None and ok.findings == [], _describe(ok)


# ----------------------------------------------------------------------------- Accelerate
def _line_of(cell: str, text: str) -> int:
    return next(i for i, line in enumerate(cell.splitlines(), 1) if text in line)


ACCEL_BUGS = {
    # accelerate#2341: accumulate() holds back optimizer.zero_grad(), not model.zero_grad()
    "zero_grad_inside": (ll.ACCEL_LOOP.replace("optimizer.zero_grad()", "model.zero_grad()"), {}, "model.zero_grad()"),
    # Accelerate's own docstring example calls loss.backward(): the loss is not divided
    "loss_not_divided": (ll.ACCEL_LOOP.replace("accelerator.backward(loss)", "loss.backward()"), {}, "loss.backward()"),
    # the optimizer left out of prepare(): it steps on the micro-batches accumulate() holds back
    "step_every_micro_batch": (ll.ACCEL_LOOP, {"prepare_optimizer": False}, "optimizer.step()"),
}


@pytest.mark.parametrize("problem", sorted(ACCEL_BUGS))
def test_accelerate_accumulation_bug_beside_the_correct_loop(problem, engine):
    cell, kwargs, text = ACCEL_BUGS[problem]
    report = bd.diagnose(cell, ll.accelerate_loop(accum=2, **kwargs), engine=engine)
    f = _only(report, "grad_accumulation")
    assert f.evidence["problem"] == problem and (f.line, f.file) == (_line_of(cell, text), None), _describe(report)
    assert f.iteration is not None and f.evidence.get("fix_code")
    if problem == "zero_grad_inside":
        assert "optimizer.zero_grad()" in f.message and f.evidence["check"]["rel_diff"] > 0.1
    if problem == "loss_not_divided":
        assert "accelerator.backward(loss)" in f.message and abs(f.evidence["check"]["factor"] - 2) < 1e-6

    ok = bd.diagnose(ll.ACCEL_LOOP, ll.accelerate_loop(accum=2), engine=engine)
    assert ok.findings == [], _describe(ok)


def test_accelerate_bf16_weights_small_lr_vs_float32(engine):
    cell = ll.ACCEL_LOOP.replace("cross_entropy(model(x), y)", "cross_entropy(model(x).float(), y)")
    report = bd.diagnose(cell, ll.accelerate_loop(accum=1, dtype=torch.bfloat16, lr=1e-4), engine=engine)
    f = _only(report, "amp_misuse")
    assert f.line == _line_of(cell, "optimizer.step()") and f.evidence["dtype"] == "bfloat16"

    ok = bd.diagnose(cell, ll.accelerate_loop(accum=1, lr=1e-4), engine=engine)
    assert ok.findings == [], _describe(ok)


def test_accelerate_state_left_by_an_earlier_cell_flags_nothing_later(engine):
    """Accelerate's gradient state is a process-wide singleton: a loop stopped on a micro-batch it holds
    back leaves ``sync_gradients=False`` behind. A later plain loop (no ``accumulate()``) must not be read as
    stepping off Accelerate's sync."""
    stopped = ll.ACCEL_LOOP.replace("for step, (x, y) in enumerate(loader):",
                                    "for step, (x, y) in enumerate(loader):\n    if step == 3:\n        break")
    exec(stopped, ll.accelerate_loop(accum=2))
    from accelerate.state import GradientState

    assert GradientState._shared_state.get("sync_gradients") is False  # what the next cell inherits
    ns2 = {"torch": torch, "model": torch.nn.Linear(16, 5), "loader": ll.xy_loader(n=32, batch=8)}
    ns2["optimizer"] = torch.optim.SGD(ns2["model"].parameters(), lr=0.1)
    cell = """\
for x, y in loader:
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y) / 2
    loss.backward()
    optimizer.step()
"""
    report = bd.diagnose(cell, ns2, engine=engine)
    assert report.findings == [], _describe(report)


def test_accelerate_state_left_by_an_earlier_cell_changes_no_record_of_a_long_loop(engine, monkeypatch):
    """Past its 16 detailed windows the accumulation watch keeps up to 8 more that stepped off Accelerate's
    sync: with the flag an earlier cell left behind (no ``accumulate()`` in this run), a plain loop of 40 steps
    keeps the same record as in a fresh process, not 8 windows more."""
    import dataclasses

    from accelerate.state import GradientState

    cell = """\
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
"""

    def record(state: dict) -> dict:
        monkeypatch.setattr(GradientState, "_shared_state", state)
        torch.manual_seed(0)
        ns = {"torch": torch, "model": torch.nn.Linear(16, 5), "loader": ll.xy_loader(n=320, batch=8)}
        ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
        return dataclasses.asdict(bd.diagnose(cell, ns, engine=engine).trace.accumulation)

    left = record({"sync_gradients": False, "plugin_kwargs": {"num_steps": 2}})
    fresh = record({})
    assert len(fresh["windows"]) == 16 and sum(fresh["per_step"]) == 40
    assert left == fresh
    # and on the general path (every window's end in Python, as while the accumulation check measures one)
    from backward_doctor.capture.watches import accumulation as accum_watch

    monkeypatch.setattr(accum_watch.AccumulationWatch, "_counting", property(lambda self: False, lambda self, v: None),
                        raising=False)
    assert record({"sync_gradients": False, "plugin_kwargs": {"num_steps": 2}}) == record({}) == fresh
