"""Where a model's weights were made bf16/fp16: the statement of the user's sources that cast them.

A step on bf16 weights whose small updates round away (``watches/precision.py``) is caused by the line that
made the weights bf16, often in an earlier cell (``model = model.to(torch.bfloat16)`` "to save memory"), not by
``optimizer.step()``. The doctor cannot see that line run (it ran before the doctor did), so it is read from the
sources: the cells IPython has run, the user's files whose code ran, and the cell (``trainers.user_sources``).
A statement counts only when it casts to the dtype the weights have and names the model that holds them (its
variable, or the class whose ``__init__`` casts ``self``); the last such statement wins. Lightning's
``precision="bf16-true"`` counts too. Where none is found, nothing is guessed.

>>> src = ["model = Net()\\n", "model = model.to(torch.bfloat16)\\n", "other.half()\\n"]
>>> c = find_cast("bfloat16", [(None, src)], names={"model"}, classes=set())
>>> c.line, c.code, c.fix
(2, 'model = model.to(torch.bfloat16)', '')
>>> c = find_cast("bfloat16", [("/t/1.py", ["m = AutoModel.from_pretrained('x', torch_dtype=torch.bfloat16)\\n"])],
...               names={"m"}, classes=set())
>>> c.file, c.fix
('/t/1.py', "m = AutoModel.from_pretrained('x', torch_dtype=torch.float32)")
"""
from __future__ import annotations

import ast
import copy
import re
from typing import Any, Callable, Iterable

from .. import namespace as ns_mod
from ...trace.precision import WeightsCast
from ...trace.records import Trace
from ...util.stores import function_at

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}
_TRUE = {"bf16-true": "bfloat16", "16-true": "float16"}  # Lightning's precision= for weights in that dtype
_LOADERS = ("from_pretrained", "from_config", "_from_config")


def _dtype(node: ast.AST) -> str | None:
    """``torch.bfloat16``, ``bfloat16``, ``"bfloat16"`` -> "bfloat16" (None: not a low-precision dtype)."""
    if isinstance(node, ast.Attribute):
        return _DTYPES.get(node.attr) if node.attr != "half" else "float16"
    if isinstance(node, ast.Name):
        return _DTYPES.get(node.id)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _DTYPES.get(node.value)
    return None


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _cast(call: ast.Call) -> tuple[str, str] | None:
    """(dtype, how) of a call that casts weights: "receiver" (``x.to(dtype)``, ``x.half()``: the model is
    its receiver), "keyword" (``from_pretrained(..., torch_dtype=...)``, ``set_default_dtype``, ``precision=``)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in ("bfloat16", "half") and isinstance(func, ast.Attribute) and not call.args and not call.keywords:
        return ("bfloat16" if name == "bfloat16" else "float16"), "receiver"
    if name in ("to", "type") and isinstance(func, ast.Attribute):
        got = [d for d in map(_dtype, list(call.args) + [k.value for k in call.keywords if k.arg == "dtype"]) if d]
        return (got[0], "receiver") if got else None
    if name in _LOADERS:
        got = [_dtype(k.value) for k in call.keywords if k.arg in ("torch_dtype", "dtype")]
        return (got[0], "keyword") if got and got[0] else None
    if name == "set_default_dtype" and call.args and _dtype(call.args[0]):
        return _dtype(call.args[0]), "default"
    for k in call.keywords:
        if k.arg == "precision" and isinstance(k.value, ast.Constant) and k.value.value in _TRUE:
            return _TRUE[k.value.value], "lightning"
    return None


class _Float32(ast.NodeTransformer):
    """The statement keeping float32 weights: the cast call replaced by its receiver, the dtype keyword by
    ``torch.float32``, ``precision="bf16-true"`` by ``"bf16-mixed"``."""

    def visit_Call(self, node: ast.Call) -> Any:
        node = self.generic_visit(node)
        got = _cast(node)
        if got is None:
            return node
        if got[1] == "receiver":
            return node.func.value  # type: ignore[attr-defined]
        for k in node.keywords:
            if k.arg in ("torch_dtype", "dtype"):
                k.value = ast.parse("torch.float32", mode="eval").body
            elif k.arg == "precision":
                k.value = ast.Constant(k.value.value.replace("-true", "-mixed"))  # type: ignore[attr-defined]
        if got[1] == "default":
            node.args = [ast.parse("torch.float32", mode="eval").body]
        return node


def _fixed(stmt: ast.stmt) -> str:
    """``stmt`` with float32 weights, '' where what is left does nothing (``model = model``, ``model``)."""
    new = _Float32().visit(copy.deepcopy(stmt))
    if isinstance(new, ast.Expr) and not isinstance(new.value, ast.Call):
        return ""
    if isinstance(new, ast.Assign) and all(ast.dump(t, False) == ast.dump(new.value, False).replace("Load", "Store")
                                           for t in new.targets):
        return ""
    return ast.unparse(new)


def _targets(stmt: ast.stmt) -> set[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] \
        if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []
    return {r for r in map(_root, targets) if r}


def _fresh_model(stmt: ast.stmt, names: set[str]) -> bool:
    """``model = Net()``: the model's variable bound to a new object built from nothing it held before (a
    ``prepare(model)`` or ``get_peft_model(model, ...)`` keeps its weights, and their dtype)."""
    value = getattr(stmt, "value", None)
    return isinstance(stmt, (ast.Assign, ast.AnnAssign)) and bool(_targets(stmt) & names) \
        and isinstance(value, ast.Call) and not any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(value))


def _casts_in(tree: ast.AST, dtype: str, names: set[str], classes: set[str], lightning: bool = False
              ) -> Iterable[tuple[ast.stmt, bool]]:
    """The statements of ``tree`` that cast the weights of the model named ``names`` (or of ``classes``), with
    True, and those that bind its variable to a model built afresh, with False: in the order they are written."""
    def visit(node: ast.AST, cls: str | None) -> Iterable[tuple[ast.stmt, bool]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            if isinstance(child, ast.stmt) and not isinstance(child, (ast.FunctionDef, ast.ClassDef, ast.For,
                                                                      ast.While, ast.If, ast.With, ast.Try)):
                for call in (n for n in ast.walk(child) if isinstance(n, ast.Call)):
                    got = _cast(call)
                    if got is None or got[0] != dtype:
                        continue
                    owner = _root(call.func.value) if got[1] == "receiver" else None  # type: ignore[attr-defined]
                    named = bool(_targets(child) & names) or owner in names or (owner == "self" and cls in classes)
                    if got[1] == "default" or (lightning if got[1] == "lightning" else named):
                        yield child, True
                        break
                else:
                    if _fresh_model(child, names):
                        yield child, False
            yield from visit(child, inner)
    yield from visit(tree, None)


def _one_line(text: str) -> str:
    """A statement on one line, comments dropped (where no string could hold a ``#``), at most 200 characters."""
    text = " ".join(" ".join(line.split("#")[0] if "#" in line and "'" not in line and '"' not in line else line
                             for line in text.splitlines()).split())
    return re.sub(r"\s+([)\]])", r"\1", re.sub(r"([(\[])\s+", r"\1", text))[:200]


def find_cast(dtype: str, sources: Iterable[tuple[str | None, list[str]]], names: set[str], classes: set[str],
              lightning: bool = False) -> WeightsCast | None:
    """The last statement of ``sources`` ((file or None for the cell, lines), oldest first) that made the model
    named ``names`` (or an instance of ``classes``) ``dtype`` (``lightning``: a Lightning loop ran, whose
    ``precision="bf16-true"`` counts); None when none did, or when the model was built afresh after it.

    >>> find_cast("float16", [(None, ["model.half()\\n", "model = Net()\\n"])], {"model"}, set()) is None
    True
    """
    found: WeightsCast | None = None
    for file, lines in sources:
        text = "".join(lines)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):  # (a cell's magic, a null byte, deep nesting)
            continue
        for stmt, cast in _casts_in(tree, dtype, names, classes, lightning):
            # (a model built afresh after the cast is not the one it cast: the line stays unknown, no guess)
            found = WeightsCast(dtype=dtype, file=file, line=stmt.lineno, fix=_fixed(stmt),
                                code=_one_line(ast.get_source_segment(text, stmt) or "")) if cast else None
    if found is not None and found.file is not None and found.line is not None:
        found.function = function_at(found.file, found.line)
    return found


def locate_cast(trace: Trace, namespace: dict[str, Any], is_user: Callable[[str], bool]) -> WeightsCast | None:
    """Where the weights of the run's first sampled low-precision step were made that dtype
    (``Precision.cast``), from the cells run so far, the user's files that ran, and the cell."""
    from ..loop.trainers import user_sources

    if not trace.precision.updates:
        return None
    dtype = trace.precision.updates[0].dtype
    names, classes = set(), set()
    for path, mod in ns_mod.modules(namespace):
        if any(_DTYPES.get(str(p.dtype).rsplit(".", 1)[-1]) == dtype for p in mod.parameters()):
            names.update({path.split(".", 1)[0], path})
            classes.add(type(mod).__name__)
    ran = {op.where.file for op in trace.ops if op.where.file}
    return find_cast(dtype, user_sources(is_user, ran, trace.source), names, classes,
                     lightning=trace.iterations.library == "lightning")


__all__ = ["find_cast", "locate_cast"]
