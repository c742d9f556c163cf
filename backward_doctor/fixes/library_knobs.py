"""Fixes where the training loop is a library's: its own knobs, not a rewritten step.

A cell that runs ``trainer.train()`` (transformers), ``trainer.fit(...)`` (Lightning) or a loop over
``accelerator.accumulate(model)`` (Accelerate) has no ``backward()`` of its own to rewrite: the library
runs it. The fix is the library's own setting, written where the cell builds its arguments:

============  ===================================================  ===================================
fix           transformers (``TrainingArguments``)                 Lightning (``Trainer``, ``DataLoader``)
============  ===================================================  ===================================
accumulate:k  ``gradient_accumulation_steps`` x k,                 ``accumulate_grad_batches`` x k,
              ``per_device_train_batch_size`` / k                  the ``DataLoader``'s ``batch_size`` / k
amp           ``bf16=True`` (``fp16=True`` on CUDA)                ``precision="bf16-mixed"``
checkpoint    ``activation_checkpointing=True`` (a model that has   the modules the trace chose, inside
              it), else as Lightning                              ``with checkpointing(...)`` around ``fit``
============  ===================================================  ===================================

Accelerate: ``Accelerator(gradient_accumulation_steps=...)`` and the ``DataLoader``'s ``batch_size``
(its mixed precision is fixed once per process, so ``amp`` is not offered there). The same examples make
each optimizer step; only their split changes. Where the cell does not build those arguments (they were
built in another cell), they are set on the live objects for the run and put back after it: a ``Trainer``'s
``TrainingArguments`` (``live_knobs.py``), Lightning's ``Trainer`` and ``DataLoader`` (``live_lightning.py``),
Accelerate's ``Accelerator`` and prepared ``DataLoader`` (``live_accelerate.py``).

>>> import ast
>>> set_keyword(Cell("args = make(a=1, b=2)\\n"), ast.parse("make(a=1, b=2)").body[0].value, "b", "4")[2]
'4'
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from ..util.cell import Cell, NotApplicable, check_compiles, resolve
from . import checkpoint, live_accelerate, live_knobs, live_lightning
from .accumulate import Rewrite, _default_k, split_batch
from .live_knobs import _keyword, set_keyword
from .spec import FixSpec

#: library -> (its name in words, the call that runs its loop)
WORDS = {"transformers": ("transformers", "`Trainer.train()`"), "lightning": ("Lightning", "`Trainer.fit()`"),
         "accelerate": ("Accelerate", "a loop over `accelerator.accumulate(...)`")}
#: library -> (the arguments' class, its accumulation keyword, its batch keyword or None: the DataLoader's)
KNOBS = {"transformers": ("TrainingArguments", "gradient_accumulation_steps", "per_device_train_batch_size"),
         "lightning": ("Trainer", "accumulate_grad_batches", None),
         "accelerate": ("Accelerator", "gradient_accumulation_steps", None)}
_PACKAGES = {"transformers": ("transformers",), "lightning": ("pytorch_lightning", "lightning"),
             "accelerate": ("accelerate",)}


def _is(obj: Any, library: str, name: str) -> bool:
    """``obj`` (a class or an instance) is ``name`` of ``library`` or a subclass, read from its MRO (the
    library is never imported here)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return any(c.__name__ == name and c.__module__.split(".")[0] in _PACKAGES[library]
               for c in getattr(cls, "__mro__", ()))


def _is_loader_class(obj: Any) -> bool:
    return isinstance(obj, type) and any(c.__name__ == "DataLoader" and c.__module__.startswith("torch.utils.data")
                                         for c in obj.__mro__)


@dataclass
class LibraryLoop:
    """A library's training loop in a cell: which library, the top-level statement that runs it and the call
    (``trainer.fit(model, loader)``), the calls in the cell that build its arguments and its DataLoader (None:
    built elsewhere), the object that runs it."""

    library: str
    index: int
    call: ast.Call
    knobs: ast.Call | None
    loader: ast.Call | None
    runner: Any


def find_library_loop(cell: Cell, namespace: dict[str, Any]) -> LibraryLoop | None:
    """The library loop the cell runs, if any (the namespace is read after the cell has run once)."""
    found: tuple[str, int, ast.Call, Any] | None = None
    for i, stmt in enumerate(cell.stmts):
        for node in ast.walk(stmt):
            if found is None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                obj, attr = resolve(node.func.value, namespace), node.func.attr
                if attr == "train" and _is(obj, "transformers", "Trainer"):
                    found = ("transformers", i, node, obj)
                elif attr == "fit" and _is(obj, "lightning", "Trainer"):
                    found = ("lightning", i, node, obj)
                elif attr == "accumulate" and _is(obj, "accelerate", "Accelerator"):
                    found = ("accelerate", i, node, obj)
    if found is None:
        return None
    library, index, call, runner = found
    knobs = loader = None
    for node in ast.walk(cell.tree):
        if isinstance(node, ast.Call):
            cls = resolve(node.func, namespace)
            if isinstance(cls, type) and _is(cls, library, KNOBS[library][0]) and knobs is None:
                knobs = node
            elif _is_loader_class(cls) and loader is None:
                loader = node
    return LibraryLoop(library, index, call, knobs, loader, runner)


# --------------------------------------------------------------------------- editing a call's keywords
def _int_value(call: ast.Call, name: str, position: int | None, default: int | None, what: str) -> int:
    """The whole number ``call`` passes as ``name`` (or at ``position``), the default when it passes none."""
    node = _keyword(call, name)
    node = node.value if node is not None else (call.args[position] if position is not None
                                                and len(call.args) > position else None)
    if node is None:
        if default is None:
            raise NotApplicable(f"{what} sets no `{name}`")
        return default
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    raise NotApplicable(f"`{name}` in {what} is `{ast.unparse(node)}`, not a number written in the cell, so the "
                        "doctor cannot divide it")


def _default(cls: Any, name: str, fallback: int) -> int:
    """A keyword's default: the dataclass field's (``TrainingArguments``) or the signature's."""
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name == name and isinstance(f.default, int):
                return f.default
    try:
        value = inspect.signature(cls).parameters[name].default
    except (TypeError, ValueError, KeyError):
        return fallback
    return value if isinstance(value, int) and not isinstance(value, bool) else fallback


def _code(cell: Cell, edits: list[tuple[int, int, str]], comments: dict[int, list[str]]) -> str:
    """The cell with ``edits`` applied and ``comments`` (statement index -> lines) above the edited statements;
    every other line as the user wrote it."""
    touched = sorted({cell.index_at(lo) for lo, _, _ in edits} | set(comments))
    out, start = [], 0
    for i in touched:
        out.append(cell.kept(range(start, i)))
        out.extend(f"# {part}\n" for line in comments.get(i, []) for part in textwrap.wrap(line, 98))
        out.append(cell.edited(i, edits))
        start = i + 1
    out.append(cell.kept(range(start, len(cell.stmts))))
    code = "".join(out)
    check_compiles(code)
    return code


# --------------------------------------------------------------------------- the fixes
def _not_here(loop: LibraryLoop, setting: str) -> NotApplicable:
    lib, runs = WORDS[loop.library]
    return NotApplicable(f"{lib} runs this loop ({runs}): the fix is {setting}, where those arguments are built "
                         "(not in this cell). Build them in this cell and the doctor can try it")


def _halved(loop: LibraryLoop, k: int) -> str:
    """The accumulation setting in words, with the numbers the arguments built elsewhere hold."""
    cls_name, accum_kw, batch_kw = KNOBS[loop.library]
    args = getattr(loop.runner, "args", loop.runner)
    accum = getattr(args, accum_kw, None)
    accum = accum if isinstance(accum, int) else 1
    if batch_kw is not None:
        batch = getattr(args, batch_kw, None)
        if isinstance(batch, int) and batch % k == 0:
            return f"`{batch_kw}={batch // k}, {accum_kw}={accum * k}` in `{cls_name}`"
        return f"`{accum_kw}={accum * k}` and `{batch_kw}` divided by {k} in `{cls_name}`"
    return f"`{accum_kw}={accum * k}` in `{cls_name}` with the `DataLoader`'s `batch_size` divided by {k}"


def _accumulate(cell: Cell, namespace: dict[str, Any], loop: LibraryLoop, k: int | None, original: Any) -> Rewrite:
    cls_name, accum_kw, batch_kw = KNOBS[loop.library]
    if loop.knobs is None or (batch_kw is None and loop.loader is None):
        raise _not_here(loop, _halved(loop, k or _default_k(original, 1 << 30)[0]))
    if loop.library == "lightning":
        module = loop.call.args[0] if loop.call.args else next(
            (k.value for k in loop.call.keywords if k.arg == "model"), None)
        if module is not None and getattr(resolve(module, namespace), "automatic_optimization", True) is False:
            raise NotApplicable("the LightningModule optimizes by hand (`automatic_optimization = False`), which "
                                "Lightning's accumulate_grad_batches does not support: accumulate in its "
                                "training_step (step every k batches)")
    if loop.library == "accelerate" and not any(
            isinstance(n, ast.Attribute) and n.attr == "accumulate" for n in ast.walk(cell.stmts[loop.index])):
        raise NotApplicable("the loop does not run its steps inside `with accelerator.accumulate(model):`, so "
                            "Accelerate's gradient_accumulation_steps would change nothing")
    knob_cls = resolve(loop.knobs.func, namespace)
    accum = _int_value(loop.knobs, accum_kw, None, _default(knob_cls, accum_kw, 1), f"`{cls_name}(...)`")
    if batch_kw is not None:
        batch_call, batch_name, position = loop.knobs, batch_kw, None
        batch = _int_value(batch_call, batch_kw, None, _default(knob_cls, batch_kw, 8), f"`{cls_name}(...)`")
    else:
        batch_call, batch_name, position = loop.loader, "batch_size", 1
        batch = _int_value(batch_call, "batch_size", 1, 1, "the `DataLoader(...)`")
    k = split_batch(k, original, batch)
    edits = [set_keyword(cell, loop.knobs, accum_kw, str(accum * k))]
    if batch_call is loop.knobs or _keyword(batch_call, batch_name) is not None or not batch_call.args[position:]:
        edits.append(set_keyword(cell, batch_call, batch_name, str(batch // k)))
    else:  # DataLoader(dataset, 64): the positional batch size
        edits.append((*cell.span(batch_call.args[position]), str(batch // k)))
    what = (f"{batch_name} {batch} -> {batch // k} and {accum_kw} {accum} -> {accum * k}: the same {batch * accum} "
            f"examples per optimizer step, in micro-batches of {batch // k}")
    comments = {cell.index_of(loop.knobs): [f"backward_doctor fix accumulate:{k} - {what}."]}
    code = _code(cell, edits, comments)
    msg = f"{_owner(loop)} own gradient accumulation: {what}. Each micro-batch holds 1/{k} of the activations."
    details = {"k": k, "batch_size": batch}
    func = loop.call.func
    if loop.library == "transformers" and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        details["trainer_var"] = func.value.id  # (for the follow-up below, should the fixed run need it)
        details["loss_flag"] = ("loss_is_scaled_for_ga" if hasattr(type(loop.runner), "loss_is_scaled_for_ga")
                                else "model_accepts_loss_kwargs")
    return Rewrite(code=code, message=msg, details=details,
                   warnings=["dropout draws different random masks per micro-batch (same distribution)"]
                   if _has_dropout(namespace) else [])


def undivided_loss_followup(rw: Rewrite, fixed: Any) -> Rewrite | None:
    """The Trainer's own accumulation, measured in the fixed run, left each micro-batch's loss undivided (a model
    whose ``forward`` takes ``**kwargs``, so the Trainer trusts it to normalise by ``num_items_in_batch``, but
    whose loss is a per-batch mean): the same fix with the Trainer told so, or None when nothing is to add.

    >>> rw = Rewrite(code="trainer = Trainer(model=m, args=a)\\ntrainer.train()\\n", message="m.",
    ...              details={"k": 2, "trainer_var": "trainer", "loss_flag": "loss_is_scaled_for_ga"})
    >>> from backward_doctor.analysis.findings import Finding
    >>> from backward_doctor.report import Report
    >>> bad = Report(findings=[Finding(kind="grad_accumulation", message="x",
    ...                                evidence={"library": "trainer", "problem": "loss_not_divided"})])
    >>> print(undivided_loss_followup(rw, bad).code.splitlines()[1][:44])
    trainer.loss_is_scaled_for_ga = False  # bac
    >>> undivided_loss_followup(rw, Report()) is None
    True
    """
    var, flag = rw.details.get("trainer_var"), rw.details.get("loss_flag")
    if not var or not flag or fixed.trace.exception is not None:
        return None
    if not any(f.kind == "grad_accumulation" and f.evidence.get("library") == "trainer"
               and f.evidence.get("problem") == "loss_not_divided" for f in fixed.findings):
        return None
    lines = rw.code.splitlines(keepends=True)
    at = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(f"{var}.train(")), None)
    if at is None:
        return None
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    told = (f"{indent}{var}.{flag} = False  # backward_doctor: this model's loss is a per-batch mean, "
            "so the Trainer must divide it by gradient_accumulation_steps\n")
    msg = (rw.message + f" With `{var}.{flag} = False`: this model's `forward` takes `**kwargs`, so the Trainer "
           "expected its loss to be normalised over the whole accumulated batch, but it is a per-batch mean (measured "
           "in the first try: each micro-batch's gradient was not divided).")
    return dataclasses.replace(rw, code="".join(lines[:at] + [told] + lines[at:]), message=msg,
                               details={**rw.details, "trainer_var": None})


def _owner(loop: LibraryLoop) -> str:
    """``transformers'`` / ``Lightning's``: the library's name as an owner."""
    name = WORDS[loop.library][0]
    return name + ("'" if name.endswith("s") else "'s")


def _has_dropout(namespace: dict[str, Any]) -> bool:
    import torch

    from ..capture import namespace as ns_mod

    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
               for _, mod in ns_mod.modules(namespace) for m in mod.modules())


def _amp(cell: Cell, namespace: dict[str, Any], loop: LibraryLoop, dtype: str | None) -> Rewrite:
    import torch

    if loop.library == "accelerate":
        raise NotApplicable("Accelerate fixes mixed precision once per process (its AcceleratorState): pass "
                            "`Accelerator(mixed_precision='bf16')` where it is first built and restart the kernel")
    fp16 = dtype == "fp16"
    if fp16 and not torch.cuda.is_available():
        raise NotApplicable("float16 mixed precision needs a CUDA device; use `amp` (bfloat16) here")
    cls_name = KNOBS[loop.library][0]
    if loop.library == "transformers":
        setting = "`fp16=True`" if fp16 else "`bf16=True`"
        if loop.knobs is None:
            raise _not_here(loop, f"{setting} in `TrainingArguments`")
        edits = [set_keyword(cell, loop.knobs, "fp16" if fp16 else "bf16", "True")]
        other = _keyword(loop.knobs, "bf16" if fp16 else "fp16")
        if other is not None:
            edits.append((*cell.span(other.value), "False"))
    else:
        value = '"16-mixed"' if fp16 else '"bf16-mixed"'
        setting = f"`precision={value}`"
        if loop.knobs is None:
            raise _not_here(loop, f"{setting} in `Trainer`")
        edits = [set_keyword(cell, loop.knobs, "precision", value)]
    words = "float16" if fp16 else "bfloat16"
    comments = {cell.index_of(loop.knobs): [f"backward_doctor fix amp: {setting[1:-1]} - the forward pass in {words} "
                                            "autocast (activations saved in 16 bits), weights kept in float32."]}
    code = _code(cell, edits, comments)
    msg = (f"{_owner(loop)} own mixed precision, {setting} in `{cls_name}(...)`: activations saved for "
           f"backward in {words}, weights and optimizer state in float32; the loss is close to, not equal to, the "
           "float32 loss.")
    return Rewrite(code=code, message=msg, details={"setting": setting})


def _checkpoint(cell: Cell, namespace: dict[str, Any], loop: LibraryLoop, original: Any) -> Rewrite:
    if loop.library == "transformers":
        model = getattr(loop.runner, "model", None)
        if getattr(model, "supports_gradient_checkpointing", False):
            # transformers 5 calls it activation_checkpointing (gradient_checkpointing is its deprecated alias).
            args_cls = resolve(loop.knobs.func, namespace) if loop.knobs is not None else type(
                getattr(loop.runner, "args", None))
            fields = {f.name for f in dataclasses.fields(args_cls)} if dataclasses.is_dataclass(args_cls) else set()
            knob = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
            if loop.knobs is None:
                raise _not_here(loop, f"`{knob}=True` in `TrainingArguments`")
            edits = [set_keyword(cell, loop.knobs, knob, "True")]
            comments = {cell.index_of(loop.knobs): [f"backward_doctor fix checkpoint: {knob}=True - the model's "
                                                    "layers keep only their inputs in forward and recompute their "
                                                    "activations in backward."]}
            return Rewrite(code=_code(cell, edits, comments), details={"setting": f"{knob}=True"},
                           message=f"transformers' own activation checkpointing, `{knob}=True` in "
                                   f"`TrainingArguments(...)`: {type(model).__name__} recomputes each layer's "
                                   "activations in backward instead of keeping them (about one more forward pass).")
    chosen = checkpoint.plan(namespace, original)
    code = checkpoint.wrapped(cell, namespace, loop.index, loop.index, chosen)
    return Rewrite(code=code, message=checkpoint.plan_message(chosen) + f" The block is around {WORDS[loop.library][1]}: "
                   "the library's loop runs the modules checkpointed.",
                   details={"modules": chosen.chosen, "saved_bytes": chosen.total, "kept_bytes": chosen.kept})


def rewrite(spec: FixSpec, cell: Cell, namespace: dict[str, Any], original: Any, loop: LibraryLoop) -> Rewrite:
    """``spec`` as the library's own knob, in ``cell`` (where :func:`find_library_loop` found ``loop``);
    ``NotApplicable`` with the reason when it cannot be set here. Arguments built in an earlier cell are set on
    the live objects for the run (``live_knobs``)."""
    if loop.knobs is None:
        module = {"lightning": live_lightning, "accelerate": live_accelerate}.get(loop.library, live_knobs)
        live = module.rewrite(spec, cell, namespace, original, loop)
        if live is not None:
            return live
    if spec.kind == "accumulate":
        return _accumulate(cell, namespace, loop, spec.arg if isinstance(spec.arg, int) else None, original)
    if spec.kind == "amp":
        return _amp(cell, namespace, loop, spec.arg if isinstance(spec.arg, str) else None)
    if spec.kind == "checkpoint":
        return _checkpoint(cell, namespace, loop, original)
    raise NotApplicable(f"`{spec.name}` has no counterpart in {WORDS[loop.library][0]}'s loop")
