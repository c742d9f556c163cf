"""Custom ``torch.autograd.Function``\\ s whose ``backward`` returned a gradient autograd refused.

Autograd checks what a Function's ``backward`` returns against the inputs of its ``forward`` *after* it
returned, in the engine: the error (``Function ScaledMatmulBackward returned an invalid gradient at index
1 - got [3, 4] but expected shape compatible with [4, 3]``) is raised at ``loss.backward()``, with no op
failing and none of the Function's frames in the traceback. The root cause is in the Function's
``backward``: the rule finds it from the ops that ran there (their file), then the statement that made the
refused gradient (the assignment of the name it returns at that position, else the ``return``).

>>> from backward_doctor.trace import Trace
>>> invalid_gradient(Trace())
[]
>>> src = "class F:\\n    def backward(ctx, g):\\n        a = g * 2\\n        b = g.t()\\n        return a, b\\n"
>>> gradient_line(src, "F", 1), gradient_line(src, "F", 5)
((4, 'b'), (5, None))
"""
from __future__ import annotations

import ast
import linecache
import re

from ..findings import Finding, at, source_line
from ...trace.records import Trace, Where

_INVALID = re.compile(r"Function (\w+?)Backward\w* returned an invalid gradient at index (\d+) - (.*)")
_SHAPE = re.compile(r"got \[([\d, ]*)\] but expected shape compatible with \[([\d, ]*)\]")


def _method(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def gradient_line(source: str, cls: str, index: int) -> tuple[int, str | None] | None:
    """(line, returned name) of what ``cls.backward`` returns at position ``index``: the last assignment of
    that name before the ``return`` (the line that computed it), else the ``return`` line itself."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    fn = _method(tree, cls, "backward")
    if fn is None:
        return None
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return fn.lineno, None
    ret = returns[-1]
    elts = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
    if index >= len(elts) or not isinstance(elts[index], ast.Name):
        return ret.lineno, None
    name = elts[index].id
    stores = [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
              and n.lineno < ret.lineno and any(isinstance(t, ast.Name) and t.id == name for t in
                                                (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    return (max(stores), name) if stores else (ret.lineno, name)


def _forward_input(source: str, cls: str, index: int) -> str | None:
    """The name of ``forward``'s input at ``index`` (``ctx`` not counted)."""
    try:
        fn = _method(ast.parse(source), cls, "forward")
    except SyntaxError:
        return None
    args = [a.arg for a in fn.args.args][1:] if fn is not None else []
    return args[index] if index < len(args) else None


def invalid_gradient(trace: Trace) -> list[Finding]:
    """A custom Function's ``backward`` returned a gradient of the wrong shape (or dtype, device) for one of
    its inputs: ``shape_mismatch`` (``dtype_mismatch``, ``device_mismatch``) at the line that made it."""
    exc = trace.exception
    m = _INVALID.search(exc.message) if exc is not None else None
    if m is None:
        return []
    cls, index, detail = m.group(1), int(m.group(2)), m.group(3).splitlines()[0]
    ran = [op for op in trace.ops if (op.where.function or "").startswith(f"{cls}.")]
    inside = [op for op in ran if op.where.function == f"{cls}.backward"]
    last = (inside or ran or [None])[-1]
    file = last.where.file if last is not None else None
    source = trace.source if file is None else "".join(linecache.getlines(file))
    found = gradient_line(source, cls, index) if source and last is not None else None
    where = Where(line=found[0], file=file, cell_line=last.where.cell_line, module=last.where.module,
                  function=f"{cls}.backward") if found else exc.where
    shape = _SHAPE.search(detail)
    kind = "shape_mismatch" if shape else "device_mismatch" if "device" in detail else \
        "dtype_mismatch" if "type" in detail else "shape_mismatch"
    arg = _forward_input(source, cls, index) if source else None
    of = f"input {index} of `{cls}.forward`" + (f" (`{arg}`)" if arg else "")
    name = f"`{found[1]}`" if found and found[1] else "the gradient"
    evidence: dict = {"function": cls, "index": index, "detail": detail, "backward_line": exc.where.line}
    if last is not None:
        evidence["op_index"] = last.index
    if shape:
        got, want = ([int(s) for s in g.split(",") if s.strip()] for g in shape.groups())
        evidence.update(got=got, expected=want)
        transposed = sorted(got) == sorted(want) and got != want
        msg = (f"`{cls}.backward` returned {name} of shape {got} for {of}, which has shape {want}: a gradient "
               "must have the shape of the input it is for. Autograd checks it only after `backward` returned, so "
               f"the error surfaced at `backward()` (line {exc.where.line}). "
               + ("The shape is the transpose of the input's: transpose it back (`.t()`), or swap the "
                  "operands of the matmul that made it (for `y = x @ w`, `grad_w = x.t() @ grad`). "
                  if transposed else "Reduce the dimensions a broadcast added (`.sum(0)`) or reshape it "
                  "(`.reshape(input.shape)`). ")
               + "`torch.autograd.gradcheck(" + cls + ".apply, inputs)` on small float64 inputs checks every "
               "returned gradient.")
    else:
        msg = (f"`{cls}.backward` returned {name} for {of} that autograd refused: {detail}. A gradient must "
               "have the dtype and device of the input it is for: `.to(input)` on it before returning.")
    code = source_line(trace, where.line, where.file)
    if code:
        evidence["code"] = code
    return [at(kind, where, msg, title=f"{cls}.backward returned a wrongly shaped gradient" if shape
               else f"{cls}.backward returned an invalid gradient", evidence=evidence)]


__all__ = ["invalid_gradient", "gradient_line"]
