"""``amp_misuse``, the optimizer stepped beside its GradScaler: ``scaler.scale(loss).backward()`` then
``optimizer.step()`` where ``scaler.step(optimizer)`` belongs.

The step applies gradients still multiplied by the scale (65,536 at first), unchecked for inf/NaN, and
the ``scaler.update()`` after it raises torch's ``AssertionError: No inf checks were recorded prior to
update.`` at a line that is not the mistake. The root cause is the ``optimizer.step()`` line: named
there, with the line rewritten. (Without the ``update()`` nothing raises and the weights take 65,536x
steps: the silent form, :func:`direct_step`, reads the direct steps the precision watch saw,
``trace.precision.scaler.unpaired``: named at the ``optimizer.step()`` line, ahead of the NaN/Inf it leads to.)

>>> from backward_doctor.trace import Trace
>>> scaled_step(Trace()) + direct_step(Trace())
[]
"""
from __future__ import annotations

import re

from ..findings import Finding, at, code_at, looped, placed
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


def direct_step(trace: Trace) -> list[Finding]:
    """``optimizer.step()`` on gradients a GradScaler scaled, in a run that never called ``scaler.step`` nor (torch
    would have raised) ``scaler.update()``: the first such step's line, every iteration it ran at, the fix as
    code. Before the NaN/Inf rule in the list: the huge steps are what makes the weights NaN."""
    s = trace.precision.scaler
    direct = [u for u in s.unpaired if u.direct]
    exc = trace.exception
    if not direct or s.calls or (exc is not None and NO_INF_CHECKS in (exc.message or "")):
        return []  # (scaler.step ran somewhere: a second model stepped plainly is no proof; the raising form is
        #          scaled_step's)
    first = direct[0]
    step_code = code_at(trace, first.line, first.file) or ""
    m = _STEP.search(step_code)
    opt = m.group(1) if m else "optimizer"
    scaler = next((n for n in re.findall(r"\b([A-Za-z_][\w.]*)\.scale\(", trace.source)), "scaler")
    fix = (rewrite(step_code, scaler) or f"{scaler}.step({opt})").strip() + f"\n{scaler}.update()"
    said = f"`{step_code}` (line {first.line})" if step_code else f"the optimizer step at line {first.line}"
    scale = f"{first.scale:g}" if first.scale is not None else "the scale (65,536 unless the scaler was built " \
                                                              "otherwise)"
    count = s.unpaired_count
    its = sorted({u.iteration for u in direct})
    shown = ", ".join(str(i) for i in its[:6]) + (", ..." if len(its) > 6 or count > len(direct) else "")
    when = f" at iteration{'s' if count > 1 else ''} {shown} ({count} step{'s' if count > 1 else ''})" \
        if looped(trace, first.iteration) is not None else ""
    msg = (f"{said} steps the {first.optimizer} optimizer directly on gradients `{scaler}.scale(loss).backward()` "
           f"multiplied by the GradScaler's loss scale ({scale}){when}: every update is {scale} times too large, "
           f"and gradients that overflowed are applied instead of skipped, so the weights jump and the loss diverges "
           f"or turns NaN later. Nothing raised: `{scaler}.update()` is never called, so torch's \"{NO_INF_CHECKS}\" "
           f"check never ran. Step through the scaler, which unscales the gradients first and skips a step whose "
           f"gradients overflowed, and update its scale after each step: `{fix.replace(chr(10), '; ')}`.")
    return [at("amp_misuse", placed(first), msg, title="Optimizer stepped beside its GradScaler",
               iteration=looped(trace, first.iteration),
               evidence={"problem": "step_without_scaler", "raised": False, "optimizer": first.optimizer,
                         "scale": first.scale, "iterations": its[:16], "steps": count, "fix_code": fix})]


__all__ = ["NO_INF_CHECKS", "direct_step", "rewrite", "scaled_step"]
