"""grad_accumulation made precise (issue 48): a loss divided twice, and an epoch's tail leaking into the next
epoch, on both engines, each bug beside its correct twin asserted silent.

**Divided twice.** The user divides each micro-batch's loss by the accumulation steps, and the library that calls
``backward()`` divides it again: Accelerate's ``accelerator.backward(loss)`` (by the Accelerator's
``gradient_accumulation_steps``, inside ``accumulate()`` or not), the ``Trainer``'s ``training_step`` (by
``gradient_accumulation_steps`` when it takes the loss for a per-micro-batch mean: a model whose ``forward`` takes
no ``**kwargs``), Lightning's automatic optimization (by ``accumulate_grad_batches``). The step's gradient is 1/k
of one full batch's. The finding names the user's division line, the library, the iteration and the line without
the division as the fix; the fix run without the doctor gives the weights of the correct loop bit for bit. Silent:
one division by hand in a plain loop, Accelerate's own division alone, the Trainer's alone (and a ``compute_loss``
that divides where the Trainer does not), Lightning's alone, a loss divided by a token count or a temperature, and
an accumulation of 1.

**The tail leaking.** ``if (i + 1) % k == 0: step`` over epochs whose batches are not a multiple of k: the last
r < k micro-batches of each epoch are never stepped nor zeroed and join the next epoch's first step. Before this
it was read as "the loss not divided by k + r" (a short epoch, whose leaking step is kept in detail: the wrong
fix) or not at all (a long one). Silent: the guard that also steps at the epoch's end, and ``zero_grad()`` before
each epoch.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.analysis.rules import accum_twice
from backward_doctor.analysis.rules.accumulation import grad_accumulation
from backward_doctor.trace.records import Trace

import library_loops as ll

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _describe(report) -> str:
    return "\n".join([f"exception={report.exception!r}"] + [
        f"  {f.kind} {f.location()} file={f.file} function={f.function}: {f.message}" for f in report.findings])


def _only(report, problem: str):
    assert [f.kind for f in report.findings] == ["grad_accumulation"], _describe(report)
    f = report.findings[0]
    assert f.evidence["problem"] == problem, _describe(report)
    return f


def _line(cell: str, text: str) -> int:
    return next(i for i, ln in enumerate(cell.splitlines(), 1) if text in ln)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- a plain loop
PLAIN = """\
accum_steps = 3
for i, (xb, yb) in enumerate(loader):
    loss = F.cross_entropy(model(xb), yb) / accum_steps
    loss.backward()
    if (i + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
"""


def _plain_ns(n: int = 6, batches_of: int = 5) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    data = [(torch.randn(batches_of, 6), torch.randint(0, 3, (batches_of,))) for _ in range(n)]
    return {"torch": torch, "F": F, "model": model, "loader": data,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_a_plain_loop_divided_once_by_hand_is_silent(engine):
    report = bd.diagnose(PLAIN, _plain_ns(), engine=engine)
    assert report.findings == [], _describe(report)
    calls = report.trace.accumulation.windows[0].calls
    assert [(c.divisor, c.library, c.library_divisor) for c in calls] == [(3.0, "", 1.0)] * 3


# ----------------------------------------------------------------------------- Accelerate
#: (the cell, its line that divides, the fix as code)
ACCEL_TWICE = {
    # the division on a line of its own, inside accumulate(): delete it
    "own_line": (ll.ACCEL_LOOP.replace(
        "        accelerator.backward(loss)",
        "        loss = loss / accelerator.gradient_accumulation_steps\n        accelerator.backward(loss)"),
        "loss = loss / accelerator.gradient_accumulation_steps",
        "# delete: loss = loss / accelerator.gradient_accumulation_steps\naccelerator.backward(loss)"),
    # the division inside the call
    "in_the_call": (ll.ACCEL_LOOP.replace("accelerator.backward(loss)", "accelerator.backward(loss / 2)"),
                    "accelerator.backward(loss / 2)", "accelerator.backward(loss)"),
    # no accumulate(): a guard of the user's own, with an Accelerator built with gradient_accumulation_steps
    "manual_guard": ("""\
accum_steps = 2
for step, (x, y) in enumerate(loader):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss = loss / accum_steps
    accelerator.backward(loss)
    if (step + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
""", "loss = loss / accum_steps", "# delete: loss = loss / accum_steps\naccelerator.backward(loss)"),
}


@pytest.mark.parametrize("case", sorted(ACCEL_TWICE))
def test_accelerate_divides_a_loss_the_user_divided_already(case, engine):
    cell, division, fix = ACCEL_TWICE[case]
    ns = ll.accelerate_loop(accum=2)
    report = bd.diagnose(cell, ns, engine=engine)
    f = _only(report, "loss_divided_twice")
    assert (f.line, f.file, f.iteration) == (_line(cell, division), None, 0), _describe(report)
    ev = f.evidence
    assert (ev["library"], ev["library_divisor"], ev["user_divisor"], ev["divisor"], ev["micro_batches"]) == (
        "accelerate", 2.0, 2.0, 4.0, 2)
    assert ev["fix_code"] == fix and ev["division_line"] == division
    assert "`accelerator.backward()` divides it again" in f.message and "learning rate 2x smaller" in f.message
    assert f.severity == "warning" and f"`{division}`" in f.message

    # the fix, run without the doctor, trains exactly as the correct loop does
    fixed_cell = "\n".join(ln for ln in cell.splitlines() if ln.strip() != division) + "\n" if fix.startswith(
        "# delete") else cell.replace(division, fix)
    fixed, correct = ll.accelerate_loop(accum=2), ll.accelerate_loop(accum=2)
    exec(fixed_cell, fixed)
    exec(ll.ACCEL_LOOP, correct)
    assert all(torch.equal(a, b) for a, b in zip(_weights(fixed["model"]), _weights(correct["model"])))
    # and the doctor changed nothing of the buggy run
    plain = ll.accelerate_loop(accum=2)
    exec(cell, plain)
    assert all(torch.equal(a, b) for a, b in zip(_weights(plain["model"]), _weights(ns["model"])))

    ok = bd.diagnose(ll.ACCEL_LOOP, ll.accelerate_loop(accum=2), engine=engine)
    assert ok.findings == [], _describe(ok)
    assert {(c.library, c.library_divisor, c.divisor) for c in ok.trace.accumulation.windows[0].calls} == {
        ("accelerate", 2.0, 2.0)}


ACCEL_SILENT = {
    # a sum over the batch divided by its size (8), then by Accelerate: a mean, not the accumulation count
    "token_mean": (ll.ACCEL_LOOP.replace("cross_entropy(model(x), y)",
                                         "cross_entropy(model(x), y, reduction='sum') / y.numel()"), 2),
    # a temperature at the loss, accumulation over 4
    "temperature": (ll.ACCEL_LOOP.replace("        accelerator.backward(loss)",
                                          "        accelerator.backward(loss / temperature)"), 4),
    # an accumulation of 1: the user's division by it divides by nothing
    "accumulation_of_one": (ll.ACCEL_LOOP.replace(
        "        accelerator.backward(loss)",
        "        loss = loss / accelerator.gradient_accumulation_steps\n        accelerator.backward(loss)"), 1),
}


@pytest.mark.parametrize("case", sorted(ACCEL_SILENT))
def test_accelerate_with_a_loss_divided_by_something_else_is_silent(case, engine):
    cell, accum = ACCEL_SILENT[case]
    ns = ll.accelerate_loop(accum=accum)
    ns["temperature"] = 2.0
    report = bd.diagnose(cell, ns, engine=engine)
    assert report.findings == [], _describe(report)


def test_the_division_is_found_in_the_cell_without_recorded_ops(engine):
    """An iteration slept through (always on) leaves no ops: the statement of the cell that divided what
    ``accelerator.backward`` was given is the place."""
    cell, division, fix = ACCEL_TWICE["manual_guard"]
    report = bd.diagnose(cell, ll.accelerate_loop(accum=2), engine=engine)
    trace = Trace.from_dict(report.trace.to_dict())
    window = trace.accumulation.windows[0]
    assert accum_twice._division_op(trace, window).line == _line(cell, division)  # (what the recorded ops say)
    trace.ops = []
    assert accum_twice._division_op(trace, window) is None
    (f,) = grad_accumulation(trace)
    assert (f.evidence["problem"], f.line, f.evidence["fix_code"]) == ("loss_divided_twice", _line(cell, division), fix)


# ----------------------------------------------------------------------------- transformers.Trainer
class PlainClassifier(nn.Module):
    """A model of the user's own: its ``forward`` takes no ``**kwargs``, so the Trainer takes its loss for a
    per-micro-batch mean and divides it by ``gradient_accumulation_steps``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(99, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


DIVIDING_COMPUTE_LOSS = """\
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs["loss"] / self.args.gradient_accumulation_steps  # <-- divided for accumulation
        return (loss, outputs) if return_outputs else loss
"""


#: the Trainer told the loss is a per-micro-batch mean (transformers' own advice for such a loss), on a BERT
#: classifier whose ``forward`` takes ``**kwargs``: it divides it, on top of the user's division
FLAGGED_COMPUTE_LOSS = DIVIDING_COMPUTE_LOSS.replace(
    "class MyTrainer(Trainer):\n", "class MyTrainer(Trainer):\n    loss_is_scaled_for_ga = False\n\n")


@pytest.mark.parametrize("source, model", [(DIVIDING_COMPUTE_LOSS, PlainClassifier), (FLAGGED_COMPUTE_LOSS, None)],
                         ids=["forward_without_kwargs", "loss_is_scaled_for_ga_false"])
def test_trainer_divides_a_loss_compute_loss_divided_already(source, model, engine):
    ns = ll.hf_trainer(source, model=model() if model else None, steps=2, accum=2)
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _only(report, "loss_divided_twice")
    assert f.line == ll.marked_line(ns, "MyTrainer", "# <-- divided") and f.file == ll.defined_in(ns, "MyTrainer")
    assert f.function == "MyTrainer.compute_loss" and f.iteration == 0, _describe(report)
    assert (f.evidence["library"], f.evidence["library_divisor"], f.evidence["divisor"]) == ("transformers", 2.0, 4.0)
    assert f.evidence["fix_code"] == 'loss = outputs["loss"]'
    assert "the Trainer's `training_step` divides it again" in f.message and "loss_is_scaled_for_ga = True" in f.message

    ok = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(model=PlainClassifier(), steps=2, accum=2), engine=engine)
    assert ok.findings == [], _describe(ok)
    assert {(c.library, c.library_divisor) for c in ok.trace.accumulation.windows[0].calls} == {("transformers", 2.0)}


def test_trainer_that_does_not_divide_leaves_the_users_one_division_silent(engine):
    """A BERT classifier's ``forward`` takes ``**kwargs``: the Trainer expects its loss normalised over the
    accumulated batch and divides nothing, so the same ``compute_loss``'s division is the only one."""
    report = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(DIVIDING_COMPUTE_LOSS, steps=2, accum=2), engine=engine)
    assert report.findings == [], _describe(report)
    assert {(c.library, c.library_divisor, c.divisor) for c in report.trace.accumulation.windows[0].calls} == {
        ("", 1.0, 2.0)}


# ----------------------------------------------------------------------------- Lightning
LIT_DIVIDING = ll.LIT_MODULE.replace(
    "        return loss\n", "        return loss / self.trainer.accumulate_grad_batches  # <-- divided\n")


def test_lightning_divides_a_loss_training_step_divided_already(engine):
    ns = ll.lit_fit(LIT_DIVIDING, trainer_kwargs={"accumulate_grad_batches": 2})
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    f = _only(report, "loss_divided_twice")
    assert f.line == ll.marked_line(ns, "LitClassifier", "# <-- divided") and f.function == "LitClassifier.training_step"
    assert f.iteration == 0 and (f.evidence["library"], f.evidence["library_divisor"]) == ("lightning", 2.0)
    assert f.evidence["fix_code"] == "return loss" and "accumulate_grad_batches" in f.message

    ok = bd.diagnose(ll.LIT_FIT, ll.lit_fit(trainer_kwargs={"accumulate_grad_batches": 2}), engine=engine)
    assert ok.findings == [], _describe(ok)
    # without accumulation Lightning divides by 1: the user's division by accumulate_grad_batches (1) is nothing
    one = bd.diagnose(ll.LIT_FIT, ll.lit_fit(LIT_DIVIDING), engine=engine)
    assert one.findings == [], _describe(one)


# ----------------------------------------------------------------------------- the tail of an epoch
TAIL = """\
accum_steps = 2
for epoch in range(3):
    for i, (xb, yb) in enumerate(loader):
        loss = F.cross_entropy(model(xb), yb) / accum_steps
        loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""
TAIL_FIX = "if (i + 1) % accum_steps == 0 or i + 1 == len(loader):"


@pytest.mark.parametrize("batches, iteration", [(5, 2), (41, 20)])
def test_an_epochs_tail_leaking_into_the_next_epoch(batches, iteration, engine):
    """5 batches: the leaking step is kept in detail (it was read as "the loss not divided by 3"); 41: it lies
    past the detailed windows (it was not seen at all)."""
    report = bd.diagnose(TAIL, _plain_ns(n=batches), engine=engine)
    f = _only(report, "tail_leaks_into_next_epoch")
    assert (f.line, f.file, f.iteration) == (_line(TAIL, "if (i + 1) % accum_steps"), None, iteration), _describe(report)
    ev = f.evidence
    assert (ev["micro_batches"], ev["tail"], ev["batches_per_epoch"], ev["epochs"]) == (2, 1, batches, 3)
    assert ev["fix_code"] == TAIL_FIX and "leak into the first step of the next epoch" in f.message
    assert "not divided" not in f.message

    fixed = bd.diagnose(TAIL.replace("if (i + 1) % accum_steps == 0:", TAIL_FIX), _plain_ns(n=batches), engine=engine)
    assert fixed.findings == [], _describe(fixed)
    dropped = TAIL.replace("for epoch in range(3):\n", "for epoch in range(3):\n    optimizer.zero_grad()\n")
    zeroed = bd.diagnose(dropped, _plain_ns(n=batches), engine=engine)
    assert zeroed.findings == [], _describe(zeroed)


def test_an_epoch_that_is_a_multiple_of_the_accumulation_leaks_nothing(engine):
    report = bd.diagnose(TAIL, _plain_ns(n=6), engine=engine)
    assert report.findings == [] and report.trace.accumulation.trailing == 0, _describe(report)
