"""``amp_misuse``, the optimizer stepped beside its GradScaler: ``scaler.scale(loss).backward()`` then
``optimizer.step()`` where ``scaler.step(optimizer)`` belongs.

The step applies gradients still multiplied by the scale (65,536 at first), unchecked for inf/NaN, and
the ``scaler.update()`` after it raises torch's ``AssertionError: No inf checks were recorded prior to
update.`` at a line that is not the mistake. The root cause is the ``optimizer.step()`` line: named
there, with the line rewritten. (Without the ``update()`` nothing raises and the weights take 65,536x
steps: that silent form needs the capture to see the direct step and is not covered here.)

>>> from backward_doctor.trace import Trace
>>> scaled_step(Trace())
[]
"""
from __future__ import annotations

import re

from ..findings import Finding, at, code_at
from ...trace.records import Trace, Where
from ...util.loops import outer_loops

#: torch's words when ``update()`` finds no ``scaler.step()`` since the last ``scale()`` (torch/amp/grad_scaler.py)
NO_INF_CHECKS = "No inf checks were recorded prior to update"
_STEP = re.compile(r"\b([A-Za-z_][\w.]*(?:\[[^\]]*\])?)\.step\(\s*\)")
_UPDATE = re.compile(r"\b([A-Za-z_][\w.]*)\.update\(")


def rewrite(step_code: str, scaler: str) -> str | None:
    """The optimizer step line with its ``opt.step()`` replaced by ``scaler.step(opt)`` (None: no such call).

    >>> rewrite("    opt.step(); opt.zero_grad()", "scaler")
    '    scaler.step(opt); opt.zero_grad()'
    >>> rewrite("loss.backward()", "scaler") is None
    True
    """
    m = _STEP.search(step_code)
    if m is None:
        return None
    return step_code[:m.start()] + f"{scaler}.step({m.group(1)})" + step_code[m.end():]


def _in_loop(trace: Trace, line: int | None, file: str | None) -> bool:
    """Whether ``line`` of the cell is inside one of its loops (a library's loop counts as one)."""
    if trace.iterations.library:
        return True
    return file is None and line is not None and any(a <= line <= b for a, b, _ in outer_loops(trace.source))


def scaled_step(trace: Trace) -> list[Finding]:
    """The cell's ``scaler.update()`` raised because the optimizer was stepped directly (no ``scaler.step``
    in the run, an optimizer step recorded): the finding at that step's line, with the fix as code."""
    exc = trace.exception
    if exc is None or exc.type != "AssertionError" or NO_INF_CHECKS not in (exc.message or ""):
        return []
    if trace.precision.scaler.calls or not trace.optimizer_steps:
        return []  # (scaler.step did run: an update() out of order is torch's message to give, as it is)
    step = trace.optimizer_steps[-1]  # (the one before the update that raised)
    step_code = code_at(trace, step.line, step.file) or ""
    update_code = code_at(trace, exc.where.line, exc.where.file) or ""
    m = _UPDATE.search(update_code)
    scaler = m.group(1) if m else "scaler"
    fix = rewrite(step_code, scaler) if step_code else None
    said = f"`{step_code.strip()}` (line {step.line})" if step_code else f"the optimizer step at line {step.line}"
    where_update = f" at line {exc.where.line}" if exc.where.line else ""
    msg = (f"{said} steps the {step.optimizer} optimizer directly, beside a GradScaler: the gradients it applies "
           f"are still multiplied by the loss scale (65,536 at first) and were never checked for inf/NaN, so the "
           f"weights take steps thousands of times too large. `{scaler}.update()`{where_update} then raised "
           f"\"{NO_INF_CHECKS}\": torch's way of saying `{scaler}.step()` never ran. Step through the scaler, which "
           f"unscales the gradients and skips a step whose gradients overflowed: "
           f"`{scaler}.step({_STEP.search(step_code).group(1) if _STEP.search(step_code) else 'optimizer'})`.")
    return [at("amp_misuse", Where(line=step.line, file=step.file, cell_line=step.cell_line,
                                   function=step.function), msg,
               title="Optimizer stepped beside its GradScaler",
               # (the step that ran is the iteration's: its end already counted it when update() raised; a
               # step outside a loop of the cell has no iteration to name)
               iteration=max(0, trace.iterations.steps - 1) if _in_loop(trace, step.line, step.file) else None,
               evidence={"problem": "step_without_scaler", "optimizer": step.optimizer,
                         "update_line": exc.where.line, **({"fix_code": fix.strip()} if fix else {})})]


__all__ = ["NO_INF_CHECKS", "rewrite", "scaled_step"]
