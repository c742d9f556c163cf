"""``graph_leak`` for tensors a library's training step keeps on its own object for metrics: a
`transformers.Trainer` subclass whose ``compute_loss`` appends ``outputs.logits`` (or the loss) to an attribute
of the trainer, and a `LightningModule` whose ``training_step`` does the same, each without ``.detach()``.
Every step's graph stays alive; the finding names the user's storing line (in the class's own file, as a
notebook cell defines it) with that line rewritten as the fix. Each beside its correct twin, asserted silent:
``.detach()``, ``.item()``, the stock Trainer. Both engines; tiny random configs, nothing downloaded.
"""
from __future__ import annotations

import os

import pytest

import backward_doctor as bd

import library_loops as ll
from report_check import describe, fits_the_schema, silent

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KEEPS_LOGITS = """\
class MyTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        self.seen.append(outputs.logits)  # <-- kept for metrics
        loss = outputs.loss
        return (loss, outputs) if return_outputs else loss
"""
KEEPS_LOSS = """\
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        outputs = model(**inputs)
        loss = outputs.loss
        if not hasattr(self, "history"):
            self.history = {"loss": []}
        self.history["loss"].append(loss)  # <-- kept for metrics
        return (loss, outputs) if return_outputs else loss
"""
LIT_KEEPS = ll.LIT_MODULE.replace("        self.lr = lr\n", "        self.lr = lr\n        self.outputs = []\n") \
    .replace("        return loss\n", "        self.outputs.append(loss)  # <-- kept for metrics\n        return loss\n", 1)


def _leak_kind(report):
    fits_the_schema(report)
    assert [f.kind for f in report.findings] == ["graph_leak"], describe(report)
    return report.findings[0]


def _leak(report, ns: dict, name: str):
    f = _leak_kind(report)
    want = ll.marked_line(ns, name, "# <-- kept for metrics")
    assert (f.line, f.file) == (want, ll.defined_in(ns, name)), describe(report)
    return f


def test_trainer_compute_loss_keeping_logits(engine):
    ns = ll.hf_trainer(KEEPS_LOGITS, steps=4)
    f = _leak(bd.diagnose(ll.HF_TRAIN, ns, engine=engine), ns, "MyTrainer")
    assert f.function == "MyTrainer.compute_loss" and f.evidence["holders"][0] == "trainer.seen[0]"
    assert "`self.seen.append(outputs.logits.detach())`" in f.message, f.message
    assert f.evidence["fix_code"] == "self.seen.append(outputs.logits.detach())"
    assert f.evidence["iterations"] == [0, 2] and f.evidence["loop_call"] == "trainer.train()"

    ok = ll.hf_trainer(KEEPS_LOGITS.replace("outputs.logits)", "outputs.logits.detach())"), steps=4)
    silent(bd.diagnose(ll.HF_TRAIN, ok, engine=engine))
    assert len(ok["trainer"].seen) == 4  # (the twin does keep them: only the graphs are gone)


def test_trainer_compute_loss_keeping_the_loss_in_a_dict_of_lists(engine):
    ns = ll.hf_trainer(KEEPS_LOSS, steps=4)
    f = _leak(bd.diagnose(ll.HF_TRAIN, ns, engine=engine), ns, "MyTrainer")
    assert f.evidence["holders"][0] == "trainer.history['loss'][0]"
    assert "`self.history[\"loss\"].append(loss.item())`" in f.message, f.message

    silent(bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(KEEPS_LOSS.replace("append(loss)", "append(loss.item())"),
                                                  steps=4), engine=engine))


def test_the_stock_trainer_keeps_nothing(engine):
    silent(bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(steps=4), engine=engine))


def test_lightning_training_step_keeping_its_losses(engine):
    ns = ll.lit_fit(LIT_KEEPS, steps=4)
    f = _leak(bd.diagnose(ll.LIT_FIT, ns, engine=engine), ns, "LitClassifier")
    assert f.function == "LitClassifier.training_step" and f.evidence["holders"][0] == "model.outputs[0]"
    assert "`self.outputs.append(loss.item())`" in f.message and f.evidence["fix_code"] == "self.outputs.append(loss.item())"

    ok = ll.lit_fit(LIT_KEEPS.replace("append(loss)", "append(loss.detach())"), steps=4)
    silent(bd.diagnose(ll.LIT_FIT, ok, engine=engine))


def test_a_trainer_of_an_earlier_cell_keeps_graphs_across_runs(engine):
    """The trainer built once, ``trainer.train()`` run in two cells: the second run finds the first run's graphs
    in the trainer's list (``earlier_runs``), at the same line of the subclass."""
    ns = ll.hf_trainer(KEEPS_LOGITS, steps=1)
    bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _leak(bd.diagnose(ll.HF_TRAIN, ns, engine=engine), ns, "MyTrainer")
    assert "`self.seen.append(outputs.logits.detach())`" in f.message, f.message
    assert f.evidence["graphs"] == 1 and f.evidence["fix_code"] == "self.seen.append(outputs.logits.detach())"


@pytest.mark.parametrize("code, scalar, want", [
    ("self.seen.append(outputs.logits)", False, "self.seen.append(outputs.logits.detach())"),
    ("self.outputs.append(loss)  # metrics", True, "self.outputs.append(loss.item())"),
    ("self.total += loss * 2", True, "self.total += (loss * 2).item()"),
    ("self.by_step[step] = out", False, "self.by_step[step] = out.detach()"),
    ("self.seen.extend(batch_logits)", False, None),
])
def test_the_storing_line_rewritten(code, scalar, want):
    from backward_doctor.analysis.rules.keep_fix import detached_statement

    assert detached_statement(code, scalar) == want


@pytest.mark.ipython
def test_a_trainer_subclass_of_an_earlier_cell_of_a_real_shell_is_named_by_its_cell(engine):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()

    def cell(source: str) -> int:
        return ll.numbered_cell(shell, source)

    cell("%load_ext backward_doctor")
    cell("import library_loops as ll\nfrom transformers import Trainer\n")
    defined = cell(KEEPS_LOGITS)
    cell("ns = ll.hf_trainer(steps=4)\ntrainer = MyTrainer(model=ns['model'], args=ns['args'], "
         "train_dataset=ns['train_ds'])\n")
    cell(f"%%backward_doctor --engine {engine}\ntrainer.train()\n")
    report = bd.last_report()
    f = _leak_kind(report)
    line = next(i for i, t in enumerate(KEEPS_LOGITS.splitlines(), 1) if "# <-- kept for metrics" in t)
    assert f.location().startswith(f"Cell In[{defined}], line {line}, in MyTrainer.compute_loss"), f.location()
    cell("del trainer, ns\n")


class _Slots:
    """An object of the namespace with no ``__dict__`` to read."""

    __slots__ = ("x",)


class _Runner:
    """A plain object that keeps the latest loss (this iteration's graph, replaced each step) and numbers."""

    def __init__(self) -> None:
        self.last_loss = None
        self.history: dict[str, list] = {"loss": []}


def test_objects_keeping_the_latest_loss_or_numbers_are_silent(engine):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ns = {"torch": torch, "model": model, "slots": _Slots(), "runner": _Runner(),
          "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(8, 4), "y": torch.randn(8, 2)}
    cell = ("for i in range(4):\n    loss = ((model(x) - y) ** 2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
            "    runner.last_loss = loss\n    runner.history['loss'].append(loss.item())\n")
    silent(bd.diagnose(cell, ns, engine=engine))
    assert len(ns["runner"].history["loss"]) == 4

    ns.update(runner=_Runner(), model=model)
    report = bd.diagnose(cell.replace("append(loss.item())", "append(loss)"), ns, engine=engine)
    f = _leak_kind(report)  # (the object's class never stores it: the cell's line does)
    assert (f.line, f.file) == (5, None) and f.evidence["fix_code"] == "runner.history['loss'].append(loss.item())"
