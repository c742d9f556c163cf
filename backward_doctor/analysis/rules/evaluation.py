"""Memory that ran out in an evaluation run with gradients on: the missing ``torch.no_grad()``.

With gradients on, every layer of a forward pass saves what its backward would need, for as long as the
output lives. An evaluation never calls backward, so it only needs each layer's output until the next
layer has read it: under ``torch.no_grad()`` (or ``torch.inference_mode()``) its peak is a layer or two,
without it, the whole forward's activations, for a batch that is often larger than the training one.
Smaller batches, accumulation or AMP would shrink what need not be kept at all: the fix is the context.

An evaluation is told from the training forward by what the doctor saw: the forward ran out with
gradients on, either after the optimizer step in the same pass through the cell's training loop (the
evaluation block of the loop's body, ``loops.ran_after_step``), or in a model in eval mode in a cell that
calls no ``backward()``.

>>> print(no_grad_code("for s in range(3):\\n    opt.step()\\n    val = model(xv)\\n    model.train()\\n", 3)[2])
    with torch.no_grad():
        val = model(xv)
"""
from __future__ import annotations

import ast
import textwrap

from ..findings import Finding, at, source_line
from ..loops import ran_after_step
from ...trace.records import Trace, Where
from ...util.units import format_bytes

_TRAINING_CALLS = {"backward", "step", "zero_grad", "train"}


def _calls(stmt: ast.stmt, names: set[str]) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names
               for n in ast.walk(stmt))


def _block_of(tree: ast.AST, line: int) -> tuple[list[ast.stmt], int] | None:
    """The innermost statement list holding a statement that spans ``line``, and that statement's index."""
    best = None
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                if isinstance(stmt, ast.stmt) and stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
                    if best is None or stmt.lineno >= best[0][best[1]].lineno and \
                            (stmt.end_lineno or 0) <= (best[0][best[1]].end_lineno or 0):
                        best = (stmts, i)
    return best


def no_grad_code(source: str, line: int) -> tuple[int, int, str] | None:
    """(first line, last line, code) of the statements from the one at ``line`` to the end of its block
    (stopping before one that trains: ``backward``, ``step``, ``zero_grad``, ``model.train()``), wrapped in
    ``with torch.no_grad():`` at their own indentation."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = _block_of(tree, line)
    if found is None:
        return None
    stmts, i = found
    if _calls(stmts[i], {"backward", "step"}):
        return None
    j = i
    while j + 1 < len(stmts) and not _calls(stmts[j + 1], _TRAINING_CALLS):
        j += 1
    first, last = stmts[i].lineno, stmts[j].end_lineno or stmts[j].lineno
    lines = source.splitlines()[first - 1:last]
    indent = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    body = "\n".join(("    " + ln) if ln.strip() else ln for ln in lines)
    return first, last, f"{indent}with torch.no_grad():\n{body}"


def eval_without_no_grad(trace: Trace) -> list[Finding]:
    """Out of memory in a forward pass that is an evaluation, with gradients on."""
    exc = trace.exception
    if exc is None or exc.oom is None or not (exc.type == "OutOfMemoryError" or "out of memory" in exc.message.lower()):
        return []
    rec = trace.op(exc.oom.index)
    if rec is None or rec.phase != "forward" or not rec.grad_enabled or rec.where.cell_line is None:
        return []
    line = rec.where.cell_line
    after = ran_after_step(trace, rec.index, line)
    calls_backward = "backward(" in trace.source
    if after is None and not (exc.oom.eval_mode and not calls_backward and not trace.optimizer_steps):
        return []
    code = no_grad_code(trace.source, line)
    if code is None:
        return []
    activations = exc.oom.by_category.get("activations", 0)
    what = f"after `optimizer.step()` (line {after}) in the loop's body" if after is not None else \
        "on a model in eval mode, in a cell that calls no `backward()`"
    text = source_line(trace, line, None)
    first, last, block = code
    fix = (f"`with torch.no_grad(): {block.splitlines()[1].strip()}`" if first == last else
           f"lines {first}-{last} inside `with torch.no_grad():`")
    msg = (f"Memory ran out in an evaluation at line {line} (`{text}`), {what}, run with gradients on: every "
           f"layer saved what a backward would need ({format_bytes(activations)} of the {format_bytes(exc.oom.live)} "
           "in use were activations), for a backward that never comes. An evaluation needs each layer's output only until the next layer has "
           f"read it. Fix: {fix} (or `torch.inference_mode()`); `model.eval()` alone does not turn gradients off. "
           "A smaller batch, gradient accumulation or AMP would only shrink what need not be kept at all.")
    evidence = {"activations": activations, "step_line": after, "eval_mode": exc.oom.eval_mode,
                "fix_code": textwrap.dedent(block), "fix_lines": [first, last], "by_category": exc.oom.by_category,
                "op_index": rec.index}
    where = Where(line=line, cell_line=line)  # (the evaluation's statement in the cell)
    return [at("oom", where, msg, op=rec.op, title="Evaluation without torch.no_grad() ran out of memory",
               evidence=evidence)]


__all__ = ["eval_without_no_grad", "no_grad_code"]
