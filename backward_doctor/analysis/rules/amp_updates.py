"""``amp_misuse``, ``scaler.update()`` left out after a ``scaler.step(optimizer)`` that ran: a ``continue`` (or an
``if``) between the step and the update skips it on some iterations.

torch raises at the next ``scaler.step(optimizer)``, "step() has already been called since the last update()",
which names the step, not what skipped the update; a ``break`` or the loop's last iteration leaves the scaler
waiting instead, and the next cell's first ``scaler.step`` raises. What ran is read from
``trace.precision.scaler.unpaired`` (the precision watch: the step's iteration and line, from the scaler's own
stage); which line skipped the update is read from the cell's source around that step (the loop holding it: a
``continue``/``break``/``return`` between the step and the update, else the ``if`` the update sits under). The fix:
``scaler.update()`` right after every ``scaler.step(optimizer)``, once per optimizer step (accumulation included).

>>> from backward_doctor.trace import Trace
>>> skipped_update(Trace()) + update_left_out(Trace())
[]
>>> skipper("for i in range(3):\\n    scaler.step(opt)\\n    if i % 2:\\n        continue\\n    scaler.update()\\n",
...         2, "scaler")
(4, 'continue', 5)
"""
from __future__ import annotations

import ast
import functools
import re

from ..findings import Finding, at, code_at, looped, placed
from ...trace.precision import UnpairedStep
from ...trace.records import Trace, Where

#: torch's words at a second ``scaler.step``/``unscale_`` of an optimizer before ``update()`` (torch/amp/grad_scaler.py)
STEPPED_TWICE = ("step() has already been called since the last update()", "unscale_() is being called after step()")
_TITLE = "GradScaler's update() skipped"
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_EXITS = {ast.Continue: "continue", ast.Break: "break", ast.Return: "return"}


def _is_update(node: ast.AST, scaler: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
        and ast.unparse(node.func.value) == scaler


def _exits(node: ast.AST, first: int, last: int, nested: bool = False) -> list[tuple[int, str]]:
    """``continue``/``break``/``return`` statements of a loop's body between lines ``first`` and ``last`` (a
    nested loop's own ``continue``/``break`` do not leave this one; a nested function's nothing)."""
    out: list[tuple[int, str]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        kind = _EXITS.get(type(child))
        if kind is not None and first < child.lineno < last and (kind == "return" or not nested):
            out.append((child.lineno, kind))
        out += _exits(child, first, last, nested or isinstance(child, _LOOPS))
    return out


@functools.lru_cache(maxsize=64)
def skipper(source: str, step_line: int, scaler: str, ended: bool = False) -> tuple[int, str, int | None] | None:
    """(the line that skips ``scaler.update()`` after the ``scaler.step`` at ``step_line``, how: ``continue``,
    ``break``, ``return``, ``if``, ``update`` (it runs unconditionally: something else skipped it), ``after_loop``
    (it runs once, after the loop), ``missing``; the update's line or None). ``ended``: the run ended waiting for
    the update (a ``break``/``return`` more likely than a ``continue``). None: the step is in no loop of the cell."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    loops = [n for n in ast.walk(tree) if isinstance(n, _LOOPS) and n.lineno <= step_line <= (n.end_lineno or 0)]
    if not loops:
        return None
    loop = max(loops, key=lambda n: n.lineno)  # the innermost
    updates = sorted(n.lineno for n in ast.walk(loop) if _is_update(n, scaler))
    after = [u for u in updates if u > step_line]
    if not after:
        later = sorted(n.lineno for n in ast.walk(tree) if _is_update(n, scaler) and n.lineno > (loop.end_lineno or 0))
        return (later[0], "after_loop", later[0]) if later else (step_line, "missing", None)
    update = after[0]
    exits = sorted(_exits(loop, step_line, update))
    order = ("break", "return", "continue") if ended else ("continue", "break", "return")
    for kind in order:
        hit = next((line for line, k in exits if k == kind), None)
        if hit is not None:
            return hit, kind, update
    guard = next((n for n in ast.walk(loop) if isinstance(n, ast.If) and n is not loop
                  and any(_is_update(c, scaler) and c.lineno == update for c in ast.walk(n))
                  and not n.lineno <= step_line <= (n.end_lineno or 0)), None)
    if guard is not None:
        return guard.lineno, "if", update
    return update, "update", update


def _names(step_code: str) -> tuple[str, str]:
    m = re.search(r"\b([A-Za-z_][\w.]*)\.step\(\s*([A-Za-z_][\w.]*(?:\[[^\]]*\])?)", step_code)
    return (m.group(1), m.group(2)) if m else ("scaler", "optimizer")


def _finding(trace: Trace, u: UnpairedStep, raised: bool) -> Finding:
    step_code = code_at(trace, u.line, u.file) or ""
    scaler, opt = _names(step_code)
    got = skipper(trace.source, u.line, scaler, not raised) if u.file is None and u.line is not None else None
    line, how, update = got if got is not None else (u.line, "missing", None)
    skip_code = code_at(trace, line, u.file) if line is not None else ""
    step = f"`{step_code}` (line {u.line})" if step_code else "the GradScaler's step"
    when = f" at iteration {u.iteration}" if u.iteration >= 0 else " in an earlier run"
    at_update = f" at line {update}" if update is not None else ""
    why = {"continue": f"`{skip_code}` at line {line} jumps to the next iteration before `{scaler}.update()`"
                       f"{at_update}",
           "break": f"`{skip_code}` at line {line} leaves the loop before `{scaler}.update()`{at_update}",
           "return": f"`{skip_code}` at line {line} returns before `{scaler}.update()`{at_update}",
           "if": f"`{scaler}.update()`{at_update} runs only when `{skip_code}` (line {line}) holds",
           "after_loop": f"`{scaler}.update()`{at_update} runs once, after the loop, not after each step",
           "update": f"`{scaler}.update()`{at_update} did not run after it",
           "missing": f"no `{scaler}.update()` follows it"}[how]
    fix = f"{scaler}.step({opt})\n{scaler}.update()"
    then = ("torch raised at the next `scaler.step`, which is not where the mistake is" if raised else
            f"the scaler is left waiting, and the next `{scaler}.step({opt})` (the next cell's) raises \"{STEPPED_TWICE[0]}\"")
    msg = (f"{step} stepped the {u.optimizer} optimizer{when}, and {why}: {then}. Without an update after each step "
           "the loss scale never adapts (after an overflow it is not lowered, and it never grows back). Call "
           f"`{scaler}.update()` once right after every `{scaler}.step({opt})`, before any `continue`: "
           f"`{fix.replace(chr(10), '; ')}`.")
    where = Where(line=line, cell_line=line) if u.file is None and line is not None else placed(u)
    return at("amp_misuse", where, msg, title=_TITLE, severity="error" if raised else "warning",
              # (a step in a loop of the cell has its iteration even when torch raised at the loop's second step)
              iteration=None if u.iteration < 0 else u.iteration if got is not None else looped(trace, u.iteration),
              evidence={"problem": "update_skipped", "how": how, "step_line": u.line, "update_line": update,
                        "iterations": sorted({x.iteration for x in trace.precision.scaler.unpaired
                                              if not x.direct and x.iteration >= 0})[:16],
                        "fix_code": fix})


def skipped_update(trace: Trace) -> list[Finding]:
    """torch's "step() has already been called since the last update()": the line that skipped the update."""
    exc = trace.exception
    if exc is None or exc.type != "RuntimeError" or not any(m in (exc.message or "") for m in STEPPED_TWICE):
        return []
    unpaired = [x for x in trace.precision.scaler.unpaired if not x.direct]
    # (the step that went without its update: found at the next scaler.step, or, where the next unscale_() raised
    # first, still waiting when the run ended)
    u = next((x for x in unpaired if not x.at_end), None) or next(iter(unpaired), None)
    return [_finding(trace, u, raised=True)] if u is not None else []


def update_left_out(trace: Trace) -> list[Finding]:
    """The run ended with a scaler waiting for its update after a step that ran: the next step raises."""
    if trace.exception is not None or trace.timed_out:
        return []
    u = next((x for x in trace.precision.scaler.unpaired if x.at_end), None)
    return [_finding(trace, u, raised=False)] if u is not None else []


__all__ = ["STEPPED_TWICE", "skipped_update", "skipper", "update_left_out"]
