"""Bugs inside real library loops (`transformers.Trainer.train()`, Lightning `Trainer.fit()`, an Accelerate loop)
and in long cell loops: the user's line (in their `Trainer` subclass, `LightningModule`, custom Function or
cell), the iteration (the optimizer step, with the library's epoch/batch), the phase from what ran, the real
cause. Each bug stands beside its correct version, which must stay silent, on both engines.

User code is defined from source in a file of its own (``library_loops.define``, as a notebook cell defines
it); the bug's line is marked ``# <-- bug`` and the correct version replaces that line.
"""
from __future__ import annotations

import contextlib
import io
import linecache
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import backward_doctor as bd
from backward_doctor.render.svg_plots import memory_timeline_svg

import library_loops as ll


os.environ.setdefault("HF_HUB_OFFLINE", "1")
BUG = "# <-- bug"


def fixed(source: str, line: str) -> str:
    """``source`` with its marked line replaced by ``line`` (same indentation): the correct version."""
    out = []
    for text in source.splitlines(keepends=True):
        if BUG in text:
            indent = text[:len(text) - len(text.lstrip())]
            text = "".join(indent + ln + "\n" for ln in textwrap.dedent(line).splitlines())
        out.append(text)
    return "".join(out)


@dataclass
class Case:
    """A bug: how to build its namespace from the user's source, the cell that runs it, what to expect."""

    build: Callable[[str], dict[str, Any]]
    source: str
    correct: str                     # the marked line's correct version
    cell: str
    kind: str
    owner: str                       # the class or function whose file holds the marked line ("<cell>": the cell)
    function: str | None = None
    iteration: int | None = None
    loop_value: str | None = None
    loop_call: str | None = None
    check: Callable[[Any, dict], None] | None = None  # more assertions on (finding, namespace)
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- transformers.Trainer
HF_INPLACE = """\
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        probs = out.logits.softmax(-1)
        if self.state.global_step == 2:
            probs += 1e-6  # <-- bug
        loss = F.nll_loss(probs.log(), inputs["labels"])
        return (loss, out) if return_outputs else loss
"""

HF_ITEM = """\
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = F.cross_entropy(out.logits, inputs["labels"])
        loss = torch.tensor(loss.item(), requires_grad=True)  # <-- bug
        return (loss, out) if return_outputs else loss
"""

PROJECT_FUNCTION = """\
class Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = grad.t() @ x  # <-- bug
        return grad @ w.t(), grad_w
"""
PROJECT_FIX = "grad_w = x.t() @ grad"

HF_FUNCTION = PROJECT_FUNCTION + """

class MyTrainer(Trainer):
    proj = torch.nn.Parameter(torch.eye(3, 4))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        logits = Project.apply(out.logits, self.proj)
        loss = F.cross_entropy(logits, inputs["labels"])
        return (loss, out) if return_outputs else loss
"""

HF_LR = "args = TrainingArguments(**base_args, learning_rate=5e5)  # <-- bug\n"

# ----------------------------------------------------------------------------- Lightning
LIT_HEAD = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
"""
LIT_OPT = """
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""
LIT_INPLACE = LIT_HEAD + """
    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.sigmoid(self.net[0](x))
        if batch_idx == 2:
            h += 1  # <-- bug
        return F.cross_entropy(self.net[2](h), y)
""" + LIT_OPT
LIT_DETACH = LIT_HEAD + """
    def training_step(self, batch, batch_idx):
        x, y = batch
        feats = self.net[0](x).detach()  # <-- bug
        return F.cross_entropy(self.net[2](torch.relu(feats)), y)
""" + LIT_OPT
LIT_DETACH_ALL = LIT_HEAD + """
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x).detach()  # <-- bug
        return F.cross_entropy(logits, y)
""" + LIT_OPT
LIT_NAN = LIT_HEAD + """
    def training_step(self, batch, batch_idx):
        x, y = batch
        probs = self.net(x).softmax(-1) * (batch_idx != 2)
        loss = -probs.gather(1, y[:, None]).log().mean()  # <-- bug
        return loss
""" + LIT_OPT
LIT_MANUAL = LIT_HEAD + """\
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        opt.step()  # <-- bug
        return loss
""" + LIT_OPT
LIT_LEAK = LIT_HEAD + """\
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss)  # <-- bug
        return loss
""" + LIT_OPT
LIT_ITEM = LIT_HEAD + """
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return torch.tensor(loss.item(), requires_grad=True)  # <-- bug
""" + LIT_OPT
LIT_FUNCTION = LIT_HEAD.replace("import torch.nn.functional as F\n", "import torch.nn.functional as F\n\n\n"
                                + PROJECT_FUNCTION).replace(
    "torch.nn.Linear(32, 5))\n", "torch.nn.Linear(32, 5))\n        self.proj = torch.nn.Parameter(torch.eye(5, 7))\n") + """
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(Project.apply(self.net(x), self.proj), y)
""" + LIT_OPT


def _lit(source: str, **kw: Any) -> dict[str, Any]:
    return ll.lit_fit(module_source=source, module_name="LitModel", **kw)


def _no_false_backward(f: Any, ns: dict) -> None:
    assert "backward of None" not in f.message and "forward pass was finite" not in f.message, f.message
    assert f.op == "aten::log", f


def _stale_names_the_step(f: Any, ns: dict) -> None:
    assert "earlier iteration" in f.message, f.message


def _shape_of_the_gradient(f: Any, ns: dict) -> None:
    assert f.evidence["got"] != f.evidence["expected"] and f.evidence["index"] == 1, f.evidence
    assert "`grad_w`" in f.message and "(`w`)" in f.message and "transpose" in f.message, f.message


def _item_rebuilt(f: Any, ns: dict) -> None:
    assert f.evidence["cut"] == "new_tensor", f.evidence


# ----------------------------------------------------------------------------- Accelerate (a cell loop)
_ACC_LOSS = "        loss = torch.nn.functional.cross_entropy(model(x), y)\n"  # (the line of ll.ACCEL_LOOP each bug edits)
# (tanh saves its output for backward as a sigmoid does; a sigmoid before cross_entropy is a bug of its own)
ACC_INPLACE = ll.ACCEL_LOOP.replace(_ACC_LOSS, """\
        h = torch.tanh(model(x))
        if step == 5:
            h += 1  # <-- bug
        loss = torch.nn.functional.cross_entropy(h, y)
""")
ACC_ITEM = ll.ACCEL_LOOP.replace(_ACC_LOSS, _ACC_LOSS + """\
        loss = torch.tensor(loss.item(), requires_grad=True)  # <-- bug
""")
ACC_FUNCTION = ll.ACCEL_LOOP.replace(_ACC_LOSS, """\
        loss = torch.nn.functional.cross_entropy(Project.apply(model(x), proj), y)
""")


def _acc_with_function(source: str) -> dict[str, Any]:
    ns = ll.accelerate_loop(accum=2)
    ll.define(source, ns, name="project_function")
    ns["proj"] = torch.nn.Parameter(torch.eye(5, 7))
    return ns


def _acc_cell(source: str, **kw: Any) -> Callable[[str], dict[str, Any]]:
    return lambda _: ll.accelerate_loop(**kw)


CASES: dict[str, Case] = {
    # 1. the iteration inside library loops (and 2: in-place in the user's code, placed there)
    "hf_inplace_in_compute_loss": Case(
        lambda src: ll.hf_trainer(src), HF_INPLACE, "probs = probs + 1e-6", ll.HF_TRAIN, "inplace", "MyTrainer",
        "MyTrainer.compute_loss", iteration=2, loop_value="epoch 0", loop_call="trainer.train()"),
    "lightning_inplace_in_training_step": Case(
        _lit, LIT_INPLACE, "h = h + 1", ll.LIT_FIT, "inplace", "LitModel", "LitModel.training_step", iteration=2,
        loop_value="epoch 0, batch 2", loop_call="trainer.fit(model, loader)"),
    "accelerate_inplace_in_accumulated_step": Case(
        _acc_cell("", accum=2, n=64), ACC_INPLACE, "h = h + 1", "", "inplace", "<cell>", iteration=2,
        loop_value="step = 5, x = float32[8, 16], y = int64[8]"),
    # 2. Lightning: bugs in training_step (run inside optimizer.step(closure)), manual optimization, a graph kept
    "lightning_detach_in_training_step": Case(
        _lit, LIT_DETACH, "feats = self.net[0](x)", ll.LIT_FIT, "detached", "LitModel", "LitModel.training_step",
        iteration=0, loop_call="trainer.fit(model, loader)"),
    "lightning_detach_whole_output_in_training_step": Case(
        _lit, LIT_DETACH_ALL, "logits = self.net(x)", ll.LIT_FIT, "no_grad_path", "LitModel", "LitModel.training_step",
        iteration=0, loop_value="epoch 0, batch 0"),
    "lightning_log_of_zero_in_training_step": Case(
        _lit, LIT_NAN, "loss = F.cross_entropy(self.net(x), y)", ll.LIT_FIT, "nonfinite", "LitModel",
        "LitModel.training_step", iteration=2, loop_value="epoch 0, batch 2", check=_no_false_backward),
    "lightning_manual_optimization_never_zeroes": Case(
        _lit, LIT_MANUAL, "opt.step()\nopt.zero_grad()", ll.LIT_FIT, "stale_grad", "LitModel",
        "LitModel.training_step", iteration=1, loop_value="epoch 0, batch 1", check=_stale_names_the_step),
    "lightning_module_keeps_its_losses": Case(
        lambda src: _lit(src, steps=8), LIT_LEAK, "self.losses.append(loss.detach())", ll.LIT_FIT, "graph_leak",
        "LitModel", "LitModel.training_step", iteration=0, loop_call="trainer.fit(model, loader)"),
    # 3. a loss rebuilt from .item(), scaled by the library before backward
    "hf_loss_rebuilt_from_item": Case(
        lambda src: ll.hf_trainer(src), HF_ITEM, "loss = loss", ll.HF_TRAIN, "no_grad_path", "MyTrainer",
        "MyTrainer.compute_loss", iteration=0, loop_call="trainer.train()", check=_item_rebuilt),
    "lightning_loss_rebuilt_from_item_accumulating": Case(
        lambda src: _lit(src, trainer_kwargs={"accumulate_grad_batches": 2}), LIT_ITEM, "return loss", ll.LIT_FIT,
        "no_grad_path", "LitModel", "LitModel.training_step", iteration=0, check=_item_rebuilt),
    "accelerate_loss_rebuilt_from_item": Case(
        _acc_cell("", accum=2), ACC_ITEM, "loss = loss", "", "no_grad_path", "<cell>", iteration=0,
        check=_item_rebuilt),
    # 4. a custom autograd.Function's backward returning a wrongly shaped gradient
    "hf_custom_function_gradient_shape": Case(
        lambda src: ll.hf_trainer(src), HF_FUNCTION, PROJECT_FIX, ll.HF_TRAIN, "shape_mismatch", "Project",
        "Project.backward", iteration=0, loop_call="trainer.train()", check=_shape_of_the_gradient),
    "lightning_custom_function_gradient_shape": Case(
        _lit, LIT_FUNCTION, PROJECT_FIX, ll.LIT_FIT, "shape_mismatch", "Project", "Project.backward", iteration=0,
        loop_call="trainer.fit(model, loader)", check=_shape_of_the_gradient),
    "accelerate_custom_function_gradient_shape": Case(
        _acc_with_function, PROJECT_FUNCTION, PROJECT_FIX, ACC_FUNCTION, "shape_mismatch", "Project", "Project.backward",
        iteration=0, check=_shape_of_the_gradient),
}


def _run(case: Case, source: str, engine: str) -> tuple[Any, dict]:
    ns = case.build(source)
    cell = case.cell or source
    return bd.diagnose(cell, ns, engine=engine), ns


@pytest.mark.parametrize("name", sorted(CASES))
def test_bug_in_a_library_loop_is_placed_and_its_fix_is_silent(name: str, engine: str) -> None:
    case = CASES[name]
    report, ns = _run(case, case.source, engine)
    assert report.findings, str(report)
    f = report.findings[0]
    assert f.kind == case.kind, str(report)
    if case.owner == "<cell>":
        line = next(i for i, t in enumerate(case.source.splitlines(), 1) if BUG in t)
        assert (f.file, f.line) == (None, line), f.location()
    else:
        assert (f.file, f.line) == (ll.defined_in(ns, case.owner), ll.marked_line(ns, case.owner, BUG)), f.location()
    if case.function:
        assert f.function == case.function, f.location()
    assert f.iteration == case.iteration, f.location()
    if case.loop_value is not None:
        assert f.evidence.get("loop_value") == case.loop_value, f.location()
    if case.loop_call is not None:
        assert f.evidence.get("loop_call") == case.loop_call and f"of `{case.loop_call}`" in f.location(), \
            f.location()
    if case.check is not None:
        case.check(f, ns)

    ok, _ = _run(case, fixed(case.source, case.correct), engine)
    assert ok.exception is None and ok.findings == [], str(ok)


# ----------------------------------------------------------------------------- phases from what runs
def test_a_correct_fit_records_training_step_as_forward_and_shows_its_activations(engine: str) -> None:
    report = bd.diagnose(ll.LIT_FIT, ll.lit_fit(), engine=engine)
    assert report.findings == [], str(report)
    steps = [op for op in report.trace.ops if op.where.function == "LitClassifier.training_step"]
    assert steps and {op.phase for op in steps} == {"forward"}
    assert {op.where.module for op in steps if op.op == "aten::addmm"} == {"model.net.0", "model.net.2"}
    assert any(op.phase == "backward" for op in report.trace.ops)
    optimizer = {op.op for op in report.trace.ops if op.phase == "optimizer"}
    assert optimizer and all(o.startswith(("aten::add", "aten::_foreach", "aten::mul", "aten::detach",
                                           "profiler::")) for o in optimizer), optimizer
    assert max(report.trace.memory.by_category["activations"]) > 0
    assert "<title>saved activations</title></polygon>" in memory_timeline_svg(report.trace)


@pytest.mark.parametrize("kw", [{"gradient_clip_val": 1.0}, {"accumulate_grad_batches": 2}], ids=["clip", "accumulate"])
def test_fit_with_clipping_or_accumulation_is_watched_like_a_cell_loop(engine: str, kw: dict) -> None:
    report = bd.diagnose(ll.LIT_FIT, ll.lit_fit(steps=4, trainer_kwargs=kw), engine=engine)
    assert report.findings == [], str(report)
    its = report.trace.iterations
    assert its.steps == 4 and its.library == "lightning" and len(its.loss) == 4 and all(its.grad_norm)
    assert its.backwards == [kw.get("accumulate_grad_batches", 1)] * 4
    if "gradient_clip_val" in kw:  # the norm is read after the closure (and Lightning's clipping) ran
        assert max(its.grad_norm) <= 1.0 + 1e-5, its.grad_norm
    assert its.values["1"] == f"epoch 0, batch {2 * kw.get('accumulate_grad_batches', 1) - 1}"


# ----------------------------------------------------------------------------- 5. a learning rate too high
def _hf_lr(lr: str) -> dict[str, Any]:
    return ll.hf_trainer(args_source=HF_LR.replace("5e5", lr), steps=6)


def _with_another_cell(ns: dict[str, Any]) -> dict[str, Any]:
    """An earlier cell that passes the same number as ``lr=`` to something else: not where this loop's
    learning rate was set (it builds no optimizer of this loop)."""
    ll.define("class Schedule:\n    def __init__(self, lr):\n        self.lr = lr\n\n\nother = Schedule(lr=5e5)\n", {})
    return ns


LR_CASES = {  # name: (the run with the learning rate too high, the same with a sound one, cell, where it was set)
    "hf_training_arguments_typo": (lambda: _hf_lr("5e5"), lambda: _hf_lr("5e-5"), ll.HF_TRAIN,
                                   lambda ns: ("training_args_", 1)),
    "lightning_configure_optimizers": (lambda: ll.lit_fit(module_kwargs={"lr": 5e5}, steps=8),
                                       lambda: ll.lit_fit(steps=8), ll.LIT_FIT,
                                       lambda ns: (ll.defined_in(ns, "LitClassifier"),
                                                   ll.marked_line(ns, "LitClassifier", "torch.optim.SGD("))),
    "accelerate_sgd": (lambda: _with_another_cell(ll.accelerate_loop(accum=2, n=128, lr=5e5)),
                       lambda: ll.accelerate_loop(accum=2, n=128), ll.ACCEL_LOOP,
                       lambda ns: (None, 5)),  # (not in the user's sources: the cell's optimizer.step())
}


@pytest.mark.parametrize("name", sorted(LR_CASES))
def test_divergence_from_the_first_steps_is_the_learning_rate(name: str, engine: str) -> None:
    bad, good, cell, where = LR_CASES[name]
    ns = bad()
    report = bd.diagnose(cell, ns, engine=engine)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.title.startswith("The learning rate is too high"), str(report)
    file, line = where(ns)
    if file is not None and not os.path.isabs(file):  # the user's `args = ...` (a file of its own, as a cell)
        assert os.path.basename(f.file).startswith(file) and "learning_rate=5e5" in linecache.getline(f.file, 1)
    else:
        assert f.file == file, f.location()
    assert f.line == line, f.location()
    assert f.iteration == 0 and f.evidence["learning_rate"] == 5e5 and f.evidence["early"], f.evidence
    assert "5e+05" in f.message and "LayerNorm" not in f.title and "add an epsilon" not in f.message, f.message
    its = report.trace.iterations
    assert its.loss[0] is not None and its.first_nonfinite is not None and its.first_nonfinite > 1
    if name.startswith("hf"):  # the typo and its fix, in TrainingArguments' own words
        assert "`learning_rate=5e-5`" in f.message and "warmup_steps" in f.message, f.message
        assert f.evidence["lr_set"]["code"] == "args = TrainingArguments(**base_args, learning_rate=5e5)"
    ok = bd.diagnose(cell, good(), engine=engine)
    assert ok.exception is None and ok.findings == [], str(ok)


# ----------------------------------------------------------------------------- 6. evaluation without no_grad
def _mlp(width: int = 512) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 5))


def _eval_loop_ns() -> dict[str, Any]:
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    return {"torch": torch, "F": torch.nn.functional, "model": model,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
            "x": torch.randn(32, 16, generator=g), "y": torch.randint(0, 5, (32,), generator=g),
            "x_val": torch.randn(4096, 16, generator=g), "y_val": torch.randint(0, 5, (4096,), generator=g)}


def _eval_accelerate_ns() -> dict[str, Any]:
    ns = ll.accelerate_loop(accum=1, n=32, model=_mlp())
    g = torch.Generator().manual_seed(1)
    ns.update(x_val=torch.randn(4096, 16, generator=g), y_val=torch.randint(0, 5, (4096,), generator=g))
    return ns


EVAL_LOOP = """\
for step in range(4):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    model.eval()
    val_loss = F.cross_entropy(model(x_val), y_val)  # <-- bug
    model.train()
"""
EVAL_ACCELERATE = ll.ACCEL_LOOP + "    val_loss = torch.nn.functional.cross_entropy(model(x_val), y_val)  # <-- bug\n"
EVAL_CELL = """\
model.eval()
val_loss = F.cross_entropy(model(x_val), y_val)  # <-- bug
"""
EVAL_CASES = {"cell_loop": (_eval_loop_ns, EVAL_LOOP, 0), "accelerate": (_eval_accelerate_ns, EVAL_ACCELERATE, 0),
              "eval_cell": (_eval_loop_ns, EVAL_CELL, None)}


@pytest.mark.parametrize("name", sorted(EVAL_CASES))
def test_oom_in_an_evaluation_with_gradients_on_is_the_missing_no_grad(name: str, engine: str) -> None:
    build, cell, iteration = EVAL_CASES[name]
    limit = 20 * 2 ** 20  # the training step fits, an evaluation of 4,096 rows with its activations does not
    report = bd.diagnose(cell, build(), engine=engine, memory_limit=limit)
    assert report.exception is not None and "out of memory" in report.exception.lower(), str(report)
    f = report.findings[0]
    line = next(i for i, t in enumerate(cell.splitlines(), 1) if BUG in t)
    assert (f.kind, f.file, f.line, f.fixes) == ("oom", None, line, []), str(report)
    assert f.title == "Evaluation without torch.no_grad() ran out of memory" and f.iteration == iteration, f.location()
    assert "accumulation" not in f.evidence.get("fix_code", "") and "torch.no_grad()" in f.message
    code = f.evidence["fix_code"]
    assert code.startswith("with torch.no_grad():\n    val_loss = ") and "model.train()" not in code, code
    assert "with torch.no_grad():" in str(report) and "with torch.no_grad():" in report.to_html()
    compile(code, "<fix>", "exec")
    ok = bd.diagnose(fixed(cell, "with torch.no_grad():\n    " + cell.splitlines()[line - 1].strip()), build(),
                     engine=engine, memory_limit=limit)
    assert ok.exception is None and ok.findings == [], str(ok)


# ----------------------------------------------------------------------------- 1. iterations in a cell's loop
def _cell_loop_ns() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    return {"torch": torch, "F": torch.nn.functional, "model": model, "x": x, "y": y, "x_val": torch.randn(32, 16),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.01), "batches": iter([(x, y)] * 16)}


TAIL = """\
for step in range(8):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    val = model(x_val if step != K else x_val[:, :3])  # <-- bug
"""
TAIL_NEXT = TAIL.replace("    loss = F.cross_entropy(model(x), y)\n",
                         "    xb, yb = next(batches)\n    loss = F.cross_entropy(model(xb), yb)\n")
FIRST = """\
for step in range(8):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x[:, :3] if step == 0 else x), y)  # <-- bug
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize("k", [0, 2, 3, 5])
@pytest.mark.parametrize("cell", [TAIL, TAIL_NEXT], ids=["replayed", "next_batch"])
def test_code_after_the_step_belongs_to_the_iteration_whose_step_ran(cell: str, k: int, engine: str) -> None:
    """An evaluation after ``optimizer.step()`` that fails in iteration k is placed in iteration k, recorded
    or not (native: 3 and 5 run unrecorded and are replayed, or, with ``next()``, not replayable)."""
    report = bd.diagnose(cell.replace("K", str(k)), _cell_loop_ns(), engine=engine)
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("shape_mismatch", cell.count("\n") - 0, k), f.location()
    if cell is TAIL:
        assert f.evidence["loop_value"] == f"step = {k}", f.evidence


def test_before_the_first_step_returns_the_loop_is_in_iteration_0(engine: str) -> None:
    report = bd.diagnose(FIRST, _cell_loop_ns(), engine=engine)
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration, f.evidence["loop_value"]) == ("shape_mismatch", 3, 0, "step = 0"), \
        f.location()
    assert "in iteration 0 of the loop at line 1" in f.location()


def test_a_leaf_made_to_be_differentiated_is_not_a_loss_rebuilt_from_numbers(engine: str) -> None:
    """Only a tensor made from a number a ``.item()`` took out of the graph is a rebuilt loss: a leaf the user
    made with ``requires_grad=True`` (a model idle in the namespace) is differentiated on purpose."""
    ns = {"torch": torch, "model": torch.nn.Linear(4, 2)}
    for cell in ("z = torch.ones(2, requires_grad=True)\n(z * 3).sum().backward()\n",
                 "z = torch.tensor([1.0, 2.0], requires_grad=True)\n(z * model.weight.sum().item()).sum().backward()\n"):
        report = bd.diagnose(cell, ns, engine=engine)
        assert report.findings == [], str(report)


LATE = {  # (namespace, cell, class, iteration, loop value): NaN/Inf in an iteration the native recorder samples out
    "hf_trainer": (lambda: ll.hf_rare_token_trainer(ll.HF_NAN, poison=True), ll.HF_TRAIN, "MyTrainer",
                   ll.POISONED_STEP, "epoch 0"),
    # (a finite loss, NaN/Inf gradients: seen at the optimizer step, after training_step returned)
    "hf_trainer_nan_gradients": (lambda: ll.hf_rare_token_trainer(ll.HF_NAN_GRADIENTS, poison=True), ll.HF_TRAIN,
                                 "MyTrainer", ll.POISONED_STEP, "epoch 0"),
    "lightning_fit": (lambda: ll.lit_fit(ll.LIT_LATE_NAN, "LitLate", steps=8), ll.LIT_FIT, "LitLate", 5,
                      "epoch 0, batch 5"),
    # (Inf only under autocast: the replay runs the step in the trainer's precision context, as fit() did)
    "lightning_fit_bf16_mixed": (lambda: ll.lit_fit(ll.LIT_BF16_NAN, "LitBf16", steps=8,
                                                    trainer_kwargs={"precision": "bf16-mixed"}),
                                 ll.LIT_FIT, "LitBf16", 5, "epoch 0, batch 5"),
}


@pytest.mark.parametrize("loop", sorted(LATE))
def test_nan_in_an_unrecorded_iteration_of_a_library_loop_is_replayed_through_its_step(loop: str,
                                                                                        engine: str) -> None:
    """``trainer.train()`` / ``trainer.fit(model, loader)`` in a cell, NaN/Inf first in an iteration the native
    recorder slept through (it records 0, 1, 2, 4, 8): that iteration is replayed through the library's own step
    with its batch (it said "could not be replayed: the cell has no training loop of its own"), placed in the
    loop with the library's position; the wrapper that knew the batch is gone. (Python: every iteration
    recorded, found in the one run.)"""
    build, cell, cls, k, value = LATE[loop]
    ns = build()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        report = bd.diagnose(cell, ns, engine=engine)
    f = report.findings[0]
    op = "aten::sqrt" if "gradients" in loop else "aten::log"
    assert (f.kind, f.op, f.line) == ("nonfinite", op, ll.marked_line(ns, cls, "# <-- here")), str(report)
    assert (f.iteration, f.evidence.get("loop_value")) == (k, value), str(report)
    assert report.trace.iterations.replayed == (k if engine == "native" else None)
    assert "training_step" not in vars(ns["trainer"]) and "training_step" not in vars(ns["model"])
    # in bfloat16 the message says what that precision does (rules/amp.py); in float32 it says nothing of it
    assert ("It ran in bfloat16" in f.message) == ("bf16" in loop), f.message
    assert f.evidence.get("dtype") == ("bfloat16" if "bf16" in loop else None)
