"""``grad_accumulation``, the tail of an epoch leaking into the next: a loop steps every k micro-batches
(``if (i + 1) % k == 0:``) over an epoch whose batches are not a multiple of k, so the last r < k micro-batches
of each epoch are neither stepped nor zeroed; their gradients join the first step of the next epoch (k + r
micro-batches, each divided by k: that step's gradient is (k + r)/k of one full batch's and mixes two epochs),
and the last epoch's are never used. The fix is to step (or zero) the tail, not to divide again.

Read from the counts alone (``trace.accumulation``: ``per_step`` and ``trailing``), since a long epoch's leaking
step lies past the windows kept in detail: every step fed by k ``backward()`` calls but one per epoch boundary
fed by k + r, and r left over after the last step, consistent with epochs of B = m k + r batches (m steps each).
The iteration is the first epoch's m-th step (a window kept in detail says it too). Placed at the accumulation
guard (the ``if`` with the ``%``), with the guard that also steps at the end of the epoch as code.

Also the accumulation guard the other checks read (:func:`modulo_guard`).

>>> from backward_doctor.trace import Trace
>>> tail_leak(Trace())
[]
>>> modulo_guard("for i in range(8):\\n    if (i + 1) % k == 0:\\n        opt.step()\\n", 3)[0]
'k'
"""
from __future__ import annotations

import ast
import linecache

from ..findings import Finding, at, code_at, looped
from ...trace.accumulation import Accumulation
from ...trace.records import Trace, Where

_TITLE = "Gradient accumulation written wrong"


def _scope(tree: ast.AST, line: int | None) -> ast.AST | None:
    """The innermost loop holding ``line``, else the innermost function (a Lightning ``training_step``)."""
    if line is None:
        return None
    holders = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef))
               and n.lineno <= line <= (n.end_lineno or n.lineno)]
    loops = [n for n in holders if isinstance(n, (ast.For, ast.While))]
    return max(loops or holders, key=lambda n: n.lineno, default=None)


def modulo_guard(source: str, line: int | None) -> tuple[str | None, ast.If | None]:
    """The ``if ... % N == 0:`` near ``line`` (in its loop, else its function): the accumulation's guard,
    and ``N`` as written."""
    try:
        scope = _scope(ast.parse(source), line)
    except SyntaxError:
        return None, None
    for node in ast.walk(scope) if scope is not None else ():
        if isinstance(node, ast.If):
            mod = next((m for m in ast.walk(node.test) if isinstance(m, ast.BinOp) and isinstance(m.op, ast.Mod)), None)
            if mod is not None:
                return ast.unparse(mod.right), node
    return None, None


def _epochs(acc: Accumulation) -> tuple[int, int, int, int] | None:
    """(k, r, steps per epoch, epochs) when the counts are those of a tail leaking: steps fed by k ``backward()``
    calls and by k + r (0 < r < k, one per epoch boundary), r left after the last step, and B = m k + r
    batches in every epoch."""
    counts = {n: c for n, c in enumerate(acc.per_step) if n >= 1 and c}
    if len(counts) != 2 or len(acc.per_step) >= 33:  # (the last bucket is "32 or more": no count to reason on)
        return None
    k, big = sorted(counts)
    r = big - k
    if k < 2 or not 0 < r < k or acc.trailing != r or counts[k] <= counts[big]:
        return None
    epochs = counts[big] + 1
    steps = counts[k] + counts[big]
    if steps % epochs:
        return None
    return k, r, steps // epochs, epochs


def _tail_fix(source: str, guard: ast.If, line: int) -> str | None:
    """The guard that also steps at the end of the epoch: ``if (i + 1) % k == 0 or i + 1 == len(loader):``."""
    mod = next(m for m in ast.walk(guard.test) if isinstance(m, ast.BinOp) and isinstance(m.op, ast.Mod))
    try:
        loops = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.For)
                 and n.lineno <= line <= (n.end_lineno or n.lineno)]
    except SyntaxError:
        return None
    loop = max(loops, key=lambda n: n.lineno, default=None)
    if loop is None:
        return None
    it = loop.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
        it = it.args[0]
    count = mod.left
    counted = (isinstance(count, ast.BinOp) and isinstance(count.op, ast.Add) and isinstance(count.right, ast.Constant)
               and count.right.value == 1)
    last = f"{ast.unparse(count)}{'' if counted else ' + 1'} == len({ast.unparse(it)})"
    return f"if {ast.unparse(guard.test)} or {last}:"


def tail_leak(trace: Trace) -> list[Finding]:
    acc = trace.accumulation
    found = _epochs(acc)
    if found is None or not acc.windows:
        return []
    k, r, m, epochs = found
    if any(x.backward == k + r and any(z.after == r for z in x.zero_grads) for x in acc.windows):
        return []  # zeroed before each epoch (such a window is kept in detail): the tail dropped, not leaked
    w = next((x for x in acc.windows if x.backward == k + r), acc.windows[0])
    iteration = w.iteration if w.backward == k + r else m
    step = code_at(trace, w.line, w.file) or "optimizer.step()"
    source = trace.source if w.file is None else "".join(linecache.getlines(w.file))
    _, guard = modulo_guard(source, w.line)
    fix = _tail_fix(source, guard, w.line) if guard is not None and w.line is not None else None
    line = guard.lineno if guard is not None else w.line
    where = Where(line=line, file=w.file, cell_line=line if w.file is None else None, function=w.function)
    how = (f"`{code_at(trace, line, w.file)}` steps every {k} micro-batches" if guard is not None
           else f"`{step}` runs every {k} micro-batches")
    tail = "the last batch of each epoch is" if r == 1 else f"the last {r} batches of each epoch are"
    msg = (f"{how}, but an epoch has {m * k + r} batches ({m} x {k} + {r}): {tail} never stepped nor zeroed, so "
           f"their gradients leak into the first step of the next epoch ({k + r} micro-batches instead of {k}, two "
           f"epochs mixed: {(k + r) / k:.3g}x one full batch's gradient) - iteration {iteration}, {epochs - 1} "
           f"time{'s' if epochs > 2 else ''} in this run - and the last epoch's tail is never used. "
           f"Dividing differently does not fix it: step (or zero) the tail at the end of each epoch"
           + (f": `{fix}`" if fix else "") + ", or call `optimizer.zero_grad()` before each epoch to drop it.")
    return [at("grad_accumulation", where, msg, title=_TITLE, severity="warning", iteration=looped(trace, iteration),
               evidence={"problem": "tail_leaks_into_next_epoch", "micro_batches": k, "tail": r,
                         "batches_per_epoch": m * k + r, "epochs": epochs, "step_line": w.line,
                         "fix_code": fix or f"{step}  # also after the epoch's last batch"})]


__all__ = ["modulo_guard", "tail_leak"]
