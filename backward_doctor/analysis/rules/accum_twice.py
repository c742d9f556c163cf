"""``grad_accumulation``, a loss divided twice: the user divides each micro-batch's loss by the accumulation
steps, and the library that calls ``backward()`` for them divides it again (Accelerate's
``accelerator.backward(loss)`` by the Accelerator's ``gradient_accumulation_steps``; the ``Trainer``'s
``training_step`` by ``gradient_accumulation_steps`` whenever it takes the loss for a per-batch mean; Lightning's
automatic optimization by ``accumulate_grad_batches``). The step's gradient is 1/k of one full batch's: in effect
a learning rate k times smaller, and nothing fails.

Read from each ``backward()`` call of an accumulating window (``trace.accumulation``): ``divisor``, everything
the loss was divided by at its root, and ``library_divisor``, the part the library's own frames did (read by the
capture from their state, ``capture/accum_libraries.library_division``). Placed at the user's division: the
forward op that made it (the ops of a recorded iteration, followed back from ``backward()``'s first node through
the library's own scalings), else the statement of the cell that divided what ``backward()`` was given; the fix
is that line without the division. Silent on one division (by hand or by the library), on a division by
something else than the accumulation steps (a token count, a temperature), and without accumulation.

>>> from backward_doctor.trace import Trace
>>> divided_twice(Trace(), [])
[]
>>> undivided("loss = loss / accum_steps"), undivided("return loss / self.args.gradient_accumulation_steps")
('', 'return loss')
>>> undivided("accelerator.backward(loss / 4)"), undivided("loss.backward()")
('accelerator.backward(loss)', None)
"""
from __future__ import annotations

import ast
import linecache

from ..findings import Finding, at, code_at, looped, placed
from ...trace.accumulation import StepWindow
from ...trace.records import Trace, Where

_TITLE = "Gradient accumulation written wrong"
_SCALING = ("aten::div", "aten::mul", "aten::div_", "aten::mul_", "aten::_to_copy", "aten::clone", "aten::alias")
_DIVIDING = ("aten::div", "aten::div_", "aten::mul", "aten::mul_")

#: what each library divides by, as its users set it ({n}: by how much); its fix when the user's division is not shown
_LIBRARIES = {
    "accelerate": ("`accelerator.backward()` divides it again, by the Accelerator's `gradient_accumulation_steps` "
                   "({n})", "accelerator.backward(loss)  # divides by gradient_accumulation_steps itself"),
    "transformers": ("the Trainer's `training_step` divides it again, by `gradient_accumulation_steps` ({n}), as it "
                     "does for a loss it takes for a per-micro-batch mean (a model whose `forward` takes no "
                     "`**kwargs`, or `loss_is_scaled_for_ga = False`)", "return loss  # the Trainer divides it"),
    "lightning": ("Lightning divides the loss `training_step` returns again, by `accumulate_grad_batches` ({n}), "
                  "under automatic optimization", "return loss  # Lightning divides it by accumulate_grad_batches"),
}


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-3 * max(abs(a), abs(b))


def _divisions(node: ast.expr) -> list[ast.BinOp]:
    """The outermost division of ``node`` (``x / n``; into both arms of ``a if c else b``, the first item of a
    tuple, as ``compute_loss`` returns ``(loss, outputs)``, and the loss a ``backward()`` call is given)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node]
    if isinstance(node, ast.IfExp):
        return _divisions(node.body) + _divisions(node.orelse)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
            and node.func.attr in ("backward", "manual_backward")):  # ``accelerator.backward(loss / n)``
        return _divisions(node.args[0])
    if isinstance(node, ast.Tuple) and node.elts:
        return _divisions(node.elts[0])
    return []


def undivided(code: str) -> str | None:
    """The statement ``code`` (one line) as written, without its division: '' when the statement does nothing
    else (``loss /= n``, ``loss = loss / n``: delete it), None when it divides nothing."""
    code = code.strip()
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    stmt = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(stmt, ast.AugAssign):
        return "" if isinstance(stmt.op, ast.Div) else None
    if not isinstance(stmt, (ast.Assign, ast.Return, ast.Expr)) or stmt.value is None or stmt.end_lineno != 1:
        return None
    found = _divisions(stmt.value)
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
    if (len(found) == 1 and found[0] is stmt.value and isinstance(target, ast.Name)
            and isinstance(stmt.value.left, ast.Name) and stmt.value.left.id == target.id):
        return ""  # ``loss = loss / n``
    for div in sorted(found, key=lambda n: n.col_offset, reverse=True):
        left = code[div.left.col_offset:div.left.end_col_offset]
        code = code[:div.col_offset] + left + code[div.end_col_offset:]
    return code if found else None


def _division_op(trace: Trace, w: StepWindow) -> Where | None:
    """The user's division, from a recorded iteration's ops: the first Div/Mul behind ``backward()``'s first node
    made at another place than the call (the library's own divisions are placed at the user's line that called
    the library)."""
    c = w.calls[0]
    root = next((op for op in trace.ops if op.phase == "backward" and op.fwd_index is not None), None)
    fwd = trace.op(root.fwd_index) if root is not None else None
    for _ in range(12):
        if fwd is None or fwd.op not in _SCALING or not fwd.in_keys:
            return None
        where = fwd.where
        if fwd.op in _DIVIDING and where.line is not None and (where.file, where.line) != (c.file, c.line):
            return where
        key = fwd.in_keys[0]
        fwd = next((op for op in reversed(trace.ops[:fwd.index]) if op.phase == "forward" and key in op.out_keys), None)
    return None


def _division_in_source(trace: Trace, w: StepWindow) -> Where | None:
    """Without the ops: the last statement before the ``backward()`` call, in its loop (or function), that divides
    the name the call was given (``loss = loss / accum_steps`` above ``accelerator.backward(loss)``)."""
    c = w.calls[0]
    source = trace.source if c.file is None else "".join(linecache.getlines(c.file))
    try:
        tree = ast.parse(source)
        call = ast.parse(code_at(trace, c.line, c.file))
    except SyntaxError:
        return None
    names = {a.id for n in ast.walk(call) if isinstance(n, ast.Call) for a in n.args if isinstance(a, ast.Name)}
    names |= {n.value.id for n in ast.walk(call) if isinstance(n, ast.Attribute) and n.attr == "backward"
              and isinstance(n.value, ast.Name)}
    holders = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.FunctionDef))
               and c.line is not None and n.lineno <= c.line <= (n.end_lineno or n.lineno)]
    scope = max(holders, key=lambda n: n.lineno, default=tree)
    found = None
    for stmt in ast.walk(scope):
        if not isinstance(stmt, (ast.Assign, ast.AugAssign)) or c.line is None or stmt.lineno >= c.line:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        if any(isinstance(t, ast.Name) and t.id in names for t in targets) and undivided(ast.unparse(stmt)) is not None:
            if found is None or stmt.lineno > found:
                found = stmt.lineno
    return None if found is None else Where(line=found, file=c.file, cell_line=found if c.file is None else None,
                                            function=c.function)


def divided_twice(trace: Trace, windows: list[StepWindow]) -> list[Finding]:
    """``windows``: the accumulating ones (several ``backward()`` calls of one call site per step)."""
    for w in windows:
        k, c = w.backward, w.calls[0]
        if not c.library or any(x.library != c.library or x.library_divisor < 1.5 for x in w.calls):
            continue
        lib_d = min(x.library_divisor for x in w.calls)
        d = min(x.divisor for x in w.calls)
        mine = d / lib_d
        if mine < 1.5 or not (_near(mine, lib_d) or _near(mine, k)):
            continue  # divided once, or by something else too (a token count, a temperature)
        where = _division_op(trace, w) or _division_in_source(trace, w) or placed(c)
        code = code_at(trace, where.line, where.file)
        fixed = undivided(code) if code else None
        what, fallback = _LIBRARIES[c.library]
        what = what.format(n=f"{lib_d:g}")
        if fixed is None:
            where, fix = placed(c), fallback
            yours, how = f"each micro-batch's loss reached the library already divided by {mine:g}", f"`{fix}`"
        else:
            call = code_at(trace, c.line, c.file) if c.library == "accelerate" else ""
            fix = fixed or f"# delete: {code}" + (f"\n{call}" if call else "")
            yours = f"`{code}` divides each micro-batch's loss by {mine:g} for gradient accumulation"
            how = f"`{fixed}`" if fixed else f"delete `{code}`"
        lib = "Accelerate" if c.library == "accelerate" else "Lightning" if c.library == "lightning" else "the Trainer"
        msg = (f"{k} backward() calls feed each optimizer step (gradient accumulation over {k} micro-batches): "
               f"{yours}, and {what}. Each loss reaches backward() divided by {d:g}, so the step's "
               f"gradient is 1/{d / k:.3g} of one full batch's - in effect a learning rate {d / k:.3g}x smaller "
               f"(and gradient clipping and the logged loss see it too); nothing fails. Fix: divide once, and let "
               f"{lib} do it: {how}.")
        if c.library == "transformers":
            msg += " (Or keep it and tell the Trainer it is scaled already: `loss_is_scaled_for_ga = True` on your Trainer.)"
        return [at("grad_accumulation", where, msg, title=_TITLE, severity="warning",
                   iteration=looped(trace, w.iteration),
                   evidence={"problem": "loss_divided_twice", "micro_batches": k, "divisor": d,
                             "library": c.library, "library_divisor": lib_d, "user_divisor": mine,
                             "division_line": code, "fix_code": fix})]
    return []


__all__ = ["divided_twice", "undivided"]
