"""Issue 47, item 5: gradient accumulation written wrong under a ``transformers.Trainer`` is placed at the
user's ``compute_loss`` line (as the README's rule table says: "or your `compute_loss` line"), not at
``trainer.train()``; its text report never prints a ``fix:`` label over nothing.

The bug: ``gradient_accumulation_steps=2`` and a ``compute_loss`` that returns a per-micro-batch mean of a
language model's loss while the model's ``forward`` takes ``**kwargs`` (so the Trainer leaves it undivided,
expecting it normalised by ``num_items_in_batch``): each step's gradient is twice one full batch's.
``backward()`` runs inside the Trainer, so the place is found from the loss's own op. The class is defined
where users define it: in the very cell that trains (the cell's own lines, ``file`` None; this placed the
finding at ``trainer.train()``), in a cell of its own (a file of its own, as IPython keeps a cell), and run
by the ``DoctorCallback``. A cell's own loop keeps the finding at its ``backward()`` line, where the fix goes.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import backward_doctor as bd

import library_loops as ll
from test_accumulation_libraries import MEAN_LOSS  # (compute_loss: the mean over its own micro-batch only)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the cell that defines the subclass and trains with it
TRAIN_CELL = MEAN_LOSS + """\
trainer = MyTrainer(model=model, args=args, train_dataset=train_ds)
trainer.train()
"""


def _describe(report) -> str:
    return "\n".join([f"exception={report.exception!r}"] + [
        f"  {f.kind} {f.location()} file={f.file} function={f.function}: {f.message}" for f in report.findings])


def _only_accumulation(report):
    assert [f.kind for f in report.findings] == ["grad_accumulation"], _describe(report)
    f = report.findings[0]
    assert f.evidence["problem"] == "loss_not_divided" and f.evidence["micro_batches"] == 2, _describe(report)
    assert abs(f.evidence["check"]["factor"] - 2.0) < 1e-6
    return f


def _fix_blocks_filled(text: str) -> None:
    """Every ``fix:`` label of a text report has code under it (indented deeper, not blank)."""
    lines = text.splitlines()
    labels = [i for i, ln in enumerate(lines) if ln.strip() == "fix:"]
    assert labels, text
    for i in labels:
        indent = len(lines[i]) - len(lines[i].lstrip())
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        assert nxt.strip() and len(nxt) - len(nxt.lstrip()) > indent, text


def test_compute_loss_defined_in_the_training_cell_is_the_place(engine: str) -> None:
    report = bd.diagnose(TRAIN_CELL, ll.hf_trainer(task="lm", steps=2, accum=2), engine=engine)
    f = _only_accumulation(report)
    want = next(i for i, ln in enumerate(TRAIN_CELL.splitlines(), 1) if "# <-- mean over" in ln)
    assert (f.line, f.file, f.function, f.iteration) == (want, None, "MyTrainer.compute_loss", 0), _describe(report)
    text = str(report)
    assert f"cell line {want}, in MyTrainer.compute_loss" in text, text
    assert f"> {want:4d} | loss = F.cross_entropy(" in text, text   # the source shown is that line, not the call
    _fix_blocks_filled(text)
    assert "trainer.loss_is_scaled_for_ga = False" in text


def test_compute_loss_defined_in_a_cell_of_its_own_is_the_place(engine: str) -> None:
    ns = ll.hf_trainer(MEAN_LOSS, task="lm", steps=2, accum=2)
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _only_accumulation(report)
    assert f.file == ll.defined_in(ns, "MyTrainer") and f.function == "MyTrainer.compute_loss", _describe(report)
    assert f.line == ll.marked_line(ns, "MyTrainer", "# <-- mean over") and f.iteration == 0
    text = str(report)
    assert "in MyTrainer.compute_loss" in text and "trainer.train()" in text, text
    _fix_blocks_filled(text)


def test_the_doctor_callback_places_it_at_compute_loss_too(tmp_path) -> None:
    integrations = pytest.importorskip("backward_doctor.integrations")
    cb = integrations.DoctorCallback(tmp_path, quiet=True)
    ns = ll.hf_trainer(MEAN_LOSS, task="lm", steps=2, accum=2, callbacks=[cb])
    ns["trainer"].train()
    f = _only_accumulation(cb.report)
    assert f.file == ll.defined_in(ns, "MyTrainer") and f.function == "MyTrainer.compute_loss", _describe(cb.report)
    assert f.line == ll.marked_line(ns, "MyTrainer", "# <-- mean over")
    # the namespace that called train() holds no trainer: the loop itself says the Trainer accumulated, so
    # the fix is the Trainer's knob, not a `loss.backward()` the user never wrote
    assert f.evidence["library"] == "trainer" and f.evidence["fix_code"] == "trainer.loss_is_scaled_for_ga = False"
    _fix_blocks_filled(str(cb.report))


CELL_LOOP = """\
def loss_of(x, y):
    return F.mse_loss(model(x), y)  # a helper of the cell's own
for i in range(4):
    loss = loss_of(xs[i], ys[i])
    loss.backward()  # <-- not divided
    if (i + 1) % 2 == 0:
        opt.step()
        opt.zero_grad()
"""


def test_a_cell_loop_keeps_its_backward_line() -> None:
    """backward() called by the cell itself: the fix (``(loss / 2).backward()``) goes on that line, even when
    the loss came from a function the cell defines."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ns = {"torch": torch, "F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
          "xs": torch.randn(4, 8, 4), "ys": torch.randn(4, 8, 1)}
    report = bd.diagnose(CELL_LOOP, ns)
    f = _only_accumulation(report)
    want = next(i for i, ln in enumerate(CELL_LOOP.splitlines(), 1) if "# <-- not divided" in ln)
    assert (f.line, f.file) == (want, None) and f.evidence["fix_code"] == "(loss / 2).backward()", _describe(report)
    _fix_blocks_filled(str(report))
