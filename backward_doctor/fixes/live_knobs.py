"""A library's knobs set on the live objects, for a loop whose arguments an earlier cell built.

Most notebooks build ``TrainingArguments`` and the ``Trainer`` in one cell and run ``trainer.train()`` in a
later one. The cell that runs has no arguments to edit, so the fix changes them on the object the cell uses:
the rewritten cell assigns ``trainer.args`` a ``dataclasses.replace`` of them (and re-applies what the Trainer
copies from them at construction: its batch size, and its ``Accelerator`` for mixed precision), then runs the
cell as it is. That is what runs and is measured, and it is the "insert as a new cell" code. After the run the
objects are put back as they were (:class:`LiveObjects`), so nothing changes unless the user keeps the fix.

Where the arguments live is found in IPython's input history (``In`` in the namespace): the latest cell that
calls the arguments' class gets the same keywords edited, shown as a diff and named as IPython names it.

>>> place_name(3, 5)
'Cell In[3], line 5'
>>> settings({"per_device_train_batch_size": 16, "bf16": True})
'per_device_train_batch_size=16, bf16=True'
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import sys
import textwrap
from typing import Any

from ..util.cell import Cell, NotApplicable, resolve
from .accumulate import Rewrite, split_batch
from .spec import FixSpec

#: Accelerate keeps its process-wide state in class-level dicts every instance shares (``self.__dict__ =
#: self._shared_state``): a Trainer rebuilding its Accelerator writes there, so they are put back too.
_SHARED = ("PartialState", "AcceleratorState", "GradientState")


def place_name(number: int, line: int) -> str:
    """A line of an earlier cell, named as IPython's tracebacks name it."""
    return f"Cell In[{number}], line {line}"


def settings(changes: dict[str, Any]) -> str:
    """The keywords as they are written in a call."""
    return ", ".join(f"{k}={v!r}" for k, v in changes.items())


def touched(runner: Any) -> list[Any]:
    """The objects whose attributes a live fix of ``runner`` changes: it and its model."""
    return [obj for obj in (runner, getattr(runner, "model", None)) if obj is not None]


class LiveObjects:
    """The attributes of the objects a live fix changes (``vars()``, one level: the attribute bindings, so a
    replaced ``args`` or ``Accelerator`` is the very same object again) and Accelerate's shared state, taken
    before the fixed run and put back after it.

    >>> class T: pass
    >>> t = T(); t.args = a = object()
    >>> kept = LiveObjects([t]); t.args = 1; t.extra = 2
    >>> kept.restore(); t.args is a, hasattr(t, "extra")
    (True, False)
    """

    def __init__(self, objects: list[Any], loops: list[Any] = (), dicts: list[dict] = ()) -> None:
        import copy

        self._dicts = [(d, dict(d)) for d in dicts]  # dicts changed in place (Accelerate's plugin_kwargs)
        self._attrs = [(obj, dict(vars(obj))) for obj in objects if hasattr(obj, "__dict__")]
        # A library's loop mutates its progress in place (Lightning's fit_loop): its own state_dict puts it back.
        self._loops = [(loop, copy.deepcopy(loop.state_dict())) for loop in loops]
        module = sys.modules.get("accelerate.state")  # never imported here: only a process that uses it has it
        shared = [getattr(getattr(module, name, None), "_shared_state", None) for name in _SHARED]
        self._shared = [(d, dict(d)) for d in shared if isinstance(d, dict)]

    def restore(self) -> None:
        for obj, attrs in self._attrs:
            now = vars(obj)
            now.clear()
            now.update(attrs)
        for d, items in self._shared:
            d.clear()
            d.update(items)
        for loop, state in self._loops:
            loop.load_state_dict(state)
        for d, items in self._dicts:
            d.clear()
            d.update(items)


def comment_lines(text: str, place: str | None) -> str:
    """``text`` as comment lines of at most 100 characters, ``place`` never broken across two of them."""
    keep = place or ""
    return "".join(f"# {part}\n".replace("\0", " ") for part in
                   textwrap.wrap(text.lstrip("# ").strip().replace(keep, keep.replace(" ", "\0")), 98))


def _keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def set_keyword(cell: Cell, call: ast.Call, name: str, value: str) -> tuple[int, int, str]:
    """The edit that makes ``call`` pass ``name=value``: its value replaced, or the keyword added last."""
    kw = _keyword(call, name)
    if kw is not None:
        return (*cell.span(kw.value), value)
    args = [*call.args, *call.keywords]
    if args:
        last = max(args, key=lambda n: (n.end_lineno, n.end_col_offset))
        end = cell.span(last.value if isinstance(last, ast.keyword) else last)[1]
        return (end, end, f", {name}={value}")
    end = cell.span(call)[1] - 1  # just inside the closing parenthesis
    return (end, end, f"{name}={value}")


def building_cell(namespace: dict[str, Any], cls: type) -> tuple[int, Cell, ast.Call] | None:
    """(its ``In[N]``, the cell, the call) of the latest cell in IPython's input history that calls ``cls``
    (the class of the live arguments), or None where there is no history or no such cell."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return None
    for number in range(len(history) - 1, 0, -1):
        source = history[number]
        if not isinstance(source, str) or cls.__name__ not in source:
            continue
        try:
            cell = Cell(source)
        except NotApplicable:
            continue
        for node in ast.walk(cell.tree):
            if isinstance(node, ast.Call) and resolve(node.func, namespace) is cls:
                return number, cell, node
    return None


def elsewhere(namespace: dict[str, Any], pairs: list[tuple[type, dict[str, Any]]], live: str) -> dict[str, Any]:
    """Where the knobs live and the edit there, for each (class of a live object, its keywords to set):
    ``place`` (``Cell In[3], line 5``: the first found, None when no building cell was found), ``setting``,
    ``cell`` (its number), ``code`` (that cell edited) and ``diff`` (every cell edited); ``live``: the
    assignment on the live object, which is what to write where the cell is not found."""
    out: dict[str, Any] = {"place": None, "setting": "; ".join(settings(c) for _, c in pairs), "cell": None,
                           "code": "", "diff": "", "live": live}
    cells: dict[int, tuple[Cell, list[tuple[int, int, str]]]] = {}
    for cls, changes in pairs:
        found = building_cell(namespace, cls)
        if found is None:
            continue
        number, cell, call = found
        cell, edits = cells.setdefault(number, (cell, []))
        edits.extend(set_keyword(cell, call, k, repr(v)) for k, v in changes.items())
        if out["place"] is None:
            line = cell._raw[:min(lo for lo, _, _ in edits)].count(b"\n") + 1
            out.update(place=place_name(number, line), cell=number)
    for number, (cell, edits) in cells.items():
        raw = cell._raw
        for lo, hi, text in sorted(edits, reverse=True):
            raw = raw[:lo] + text.encode("utf-8") + raw[hi:]
        code = raw.decode("utf-8")
        out["code"] = out["code"] or code
        out["diff"] += "".join(difflib.unified_diff(cell.source.splitlines(True), code.splitlines(True),
                                                    fromfile=f"In[{number}]", tofile=f"In[{number}] with the fix"))
    return out


def _transformers(spec: FixSpec, var: str, trainer: Any, original: Any) -> tuple[dict[str, Any], str, dict]:
    """(the arguments to change, what it does in words, details) for ``spec`` on a live ``Trainer``."""
    import torch

    args = trainer.args
    if spec.kind == "accumulate":
        batch, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
        k = split_batch(spec.arg if isinstance(spec.arg, int) else None, original, batch)
        what = (f"per_device_train_batch_size {batch} -> {batch // k} and gradient_accumulation_steps {accum} -> "
                f"{accum * k}: the same {batch * accum} examples per optimizer step, in micro-batches of {batch // k}")
        flag = ("loss_is_scaled_for_ga" if hasattr(type(trainer), "loss_is_scaled_for_ga")
                else "model_accepts_loss_kwargs")
        return ({"per_device_train_batch_size": batch // k, "gradient_accumulation_steps": accum * k}, what,
                {"k": k, "batch_size": batch, "trainer_var": var, "loss_flag": flag})
    if spec.kind == "amp":
        fp16 = spec.arg == "fp16"
        if fp16 and not torch.cuda.is_available():
            raise NotApplicable("float16 mixed precision needs a CUDA device; use `amp` (bfloat16) here")
        on, off = ("fp16", "bf16") if fp16 else ("bf16", "fp16")
        changes = {on: True, **({off: False} if getattr(args, off, False) else {})}
        words = "float16" if fp16 else "bfloat16"
        return (changes, f"the forward pass in {words} autocast (activations saved in 16 bits), weights kept in "
                "float32; the loss is close to, not equal to, the float32 loss", {})
    fields = {f.name for f in dataclasses.fields(args)}
    knob = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return ({knob: True}, f"{type(trainer.model).__name__} recomputes each layer's activations in backward instead "
            "of keeping them (about one more forward pass)", {})


def rewrite(spec: FixSpec, cell: Cell, namespace: dict[str, Any], original: Any, loop: Any) -> Rewrite | None:
    """``spec`` set on the live objects of ``loop`` (a library loop whose arguments this cell does not build),
    or None where the live objects are not what decides it (the generic rewrite applies)."""
    if loop.library != "transformers" or spec.kind not in ("accumulate", "amp", "checkpoint"):
        return None
    trainer = loop.runner
    if spec.kind == "checkpoint" and not getattr(getattr(trainer, "model", None), "supports_gradient_checkpointing",
                                                 False):
        return None
    func = loop.call.func
    args = getattr(trainer, "args", None)
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)) or not dataclasses.is_dataclass(args):
        raise NotApplicable("the Trainer is not a name in this cell, so its TrainingArguments cannot be set for the "
                            "run: set them where they are built")
    var = func.value.id
    changes, what, details = _transformers(spec, var, trainer, original)
    lines = ["import dataclasses\n",
             f"{var}.args = dataclasses.replace({var}.args, {settings(changes)})\n"]
    if spec.kind == "accumulate" and hasattr(trainer, "_train_batch_size"):
        # The Trainer copies the batch size at construction; its hyperparameter search re-applies it this way.
        lines.append(f"{var}._train_batch_size = {var}.args.train_batch_size\n")
    if hasattr(trainer, "create_accelerator_and_postprocess"):
        # Its Accelerator, built at construction, holds the mixed precision, and new TrainingArguments reset
        # Accelerate's process state: rebuilt as the Trainer builds it.
        lines.append(f"{var}.create_accelerator_and_postprocess()\n")
    if spec.kind == "amp" and getattr(getattr(trainer, "model", None), "_is_accelerate_prepared", False):
        # An Accelerator prepares a model once: the first run's (no autocast) would stay in place.
        lines.append(f"{var}.model._is_accelerate_prepared = False\n")
    where = elsewhere(namespace, [(type(args), changes)], lines[1].strip())
    at = (f"the TrainingArguments built in {where['place']}" if where["place"] else
          f"`{var}.args` (the cell that built them is not in this kernel's input history)")
    head = (f"# backward_doctor fix {spec.name} - {what}. Set on the live `{var}` for this run; to keep it, set "
            f"`{settings(changes)}` in {at}, or run this cell.\n")
    comment = comment_lines(head, where["place"])
    code = comment + "".join(lines) + cell.source + ("" if cell.source.endswith("\n") else "\n")
    kind = {"accumulate": "gradient accumulation", "amp": "mixed precision"}.get(spec.kind, "activation checkpointing")
    msg = (f"transformers' own {kind}, `{settings(changes)}` "
           f"on the live `{var}.args`: {what}. Where the arguments are built: "
           + (f"{where['place']}." if where["place"] else "not found in this kernel's input history "
              f"(assign `{where['live']}` before `{var}.train()`)."))
    return Rewrite(code=code, message=msg, details={**details, "live_var": var, "elsewhere": where})


def built_at(cls: type, namespace: dict[str, Any] | None, path: str | None) -> str | None:
    """Where ``cls`` (the arguments' class) is called: a notebook cell in IPython's input history
    (``Cell In[3], line 5``), else the script's line (``train.py, line 12``), else None.

    >>> built_at(int, {"In": ["", "n = int(3)\\n"], "int": int}, None)
    'Cell In[1], line 1'
    """
    found = building_cell(namespace, cls) if namespace is not None else None
    if found is not None:
        return place_name(found[0], found[2].lineno)
    try:
        with open(path or "", encoding="utf-8") as f:  # (the script a callback runs in, as its report reads it)
            tree = ast.parse(f.read(1 << 22))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == cls.__name__:
            return f"{path.rsplit('/', 1)[-1]}, line {node.lineno}"
    return None


def advice(report: Any, trainer: Any, where: str | None) -> dict[str, str]:
    """A callback's report (``report.fix_offers``): for each fix the findings name, the ``TrainingArguments``
    to set and where they are built; a callback cannot re-run the training, so none is a button."""
    from .spec import parse_fix

    offers: dict[str, str] = {}
    for name in dict.fromkeys(n for f in report.findings for n in f.fixes):
        spec = parse_fix(name)
        if spec.kind not in ("accumulate", "amp", "checkpoint") or not dataclasses.is_dataclass(
                getattr(trainer, "args", None)):
            offers[name] = "a callback cannot re-run the training: try it on the cell with `%%backward_doctor --fix`"
            continue
        try:
            changes, _, _ = _transformers(spec, "trainer", trainer, report)
        except NotApplicable as exc:
            offers[name] = str(exc)
            continue
        at = f" ({where})" if where else ""
        offers[name] = (f"set `{settings(changes)}` in `TrainingArguments` where they are built{at}; a callback "
                        "cannot re-run the training (in a notebook, `%%backward_doctor` on the cell that trains gives "
                        "a button that measures it)")
    return offers
