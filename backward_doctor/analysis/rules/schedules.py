"""``scheduler_misuse``: a learning-rate scheduler stepped out of step with its optimizer. Nothing raises; the
model trains on a schedule other than the one written.

- **Before the optimizer** (``before_optimizer``): the scheduler's first ``step()`` ran before its optimizer's first
  ``step()`` (``scheduler.step()`` at the top of the loop or of the epoch): the schedule's first learning rate is
  never used. A GradScaler that skipped the optimizer step for inf/NaN gradients (its first iterations, as the
  scale calibrates) makes the same order without a mistake: silent.
- **Too often** (``too_often``): more than one ``scheduler.step()`` per optimizer step, most often one per
  micro-batch under gradient accumulation (or the user's and a library's both): the schedule runs that many times
  too fast (warm-up over in a fraction of its steps, the decay reached early).
- **Orphaned** (``optimizer_never_stepped``): the scheduler's optimizer never stepped while another one did: it was
  made for an optimizer since replaced, so the optimizer that trains never follows the schedule.

Read from ``trace.schedules`` (``capture/watches/schedules.py``: each ``scheduler.step()`` with the optimizer steps
before it and torch's own flag that its optimizer stepped). ``ReduceLROnPlateau`` follows a metric, not a count of
steps: it says nothing here. Neither does a schedule stepped to plot it (in a cell with no optimizer step, or on
an optimizer of its own that never steps, all its steps at one point of the run).

>>> from backward_doctor.trace import Trace
>>> scheduler_misuse(Trace())
[]
"""
from __future__ import annotations

import re
from collections import Counter

from ..findings import Finding, at, code_at, looped, placed
from ...trace.records import Trace
from ...trace.schedules import SchedulerCall, SchedulerRecord

_TITLES = {"before_optimizer": "The scheduler stepped before the optimizer",
           "too_often": "The scheduler steps more often than the optimizer",
           "optimizer_never_stepped": "The scheduler's optimizer never stepped"}
_LIBRARY = {"transformers": "the Trainer", "lightning": "Lightning", "accelerate": "Accelerate"}


def per_step(calls: list[SchedulerCall]) -> int:
    """How many ``scheduler.step()`` calls one optimizer step got: the most common count among the optimizer steps
    the calls cover whole (the first and last may be cut by the cell's start and end), else among all.

    >>> per_step([SchedulerCall(iteration=i) for i in (0, 0, 0, 1, 1, 1, 1, 2)])
    4
    >>> per_step([SchedulerCall(iteration=i) for i in (1, 2, 3)])
    1
    """
    counts = Counter(c.iteration for c in calls)
    if not counts:
        return 0
    lo, hi = min(counts), max(counts)
    whole = [n for it, n in counts.items() if lo < it < hi] or list(counts.values())
    return Counter(whole).most_common(1)[0][0]


def _name(code: str, method: str) -> str:
    """``sched`` from ``sched.step()`` (the object a call was made on), '' when the line does not say.

    >>> _name("self.sched.step()", "step"), _name("opt.step()", "step"), _name("x = 1", "step")
    ('self.sched', 'opt', '')
    """
    m = re.search(rf"([A-Za-z_][\w.]*?)\.{method}\(", code)
    return m.group(1) if m else ""


def _indent(trace: Trace, line: int | None, file: str | None) -> str:
    """The indentation of a cell line ('' for a file's line: the trace keeps those stripped)."""
    lines = trace.source.splitlines()
    if file is None and line is not None and 0 < line <= len(lines):
        text = lines[line - 1]
        return text[:len(text) - len(text.lstrip())]
    return ""


def _optimizer_line(trace: Trace) -> tuple[str, str]:
    """(the code of the cell's first optimizer step line, its indentation); ('', '') when unknown."""
    for s in trace.optimizer_steps:
        code = code_at(trace, s.line, s.file)
        if code:
            return code, _indent(trace, s.line, s.file)
    return "", ""


def _lr(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "?"


def _before(trace: Trace, rec: SchedulerRecord, call: SchedulerCall, code: str, said: str) -> Finding:
    its = trace.iterations
    first_lr = its.lr[0] if its.lr and its.lr[0] is not None else call.lr_after
    opt_code, indent = _optimizer_line(trace)
    opt_code = opt_code or "optimizer.step()"
    per_epoch = rec.calls < its.steps  # (fewer scheduler steps than optimizer steps: an epoch's scheduler)
    sched_code = code or "scheduler.step()"
    if per_epoch:
        fix = f"# at the end of each epoch, after its last `{opt_code}`:\n{sched_code}"
        when = "at the end of each epoch, after the epoch's optimizer steps"
    else:
        fix = f"{opt_code}\n{sched_code}  # after the optimizer step: the schedule starts at its first value"
        when = f"after `{opt_code}`"
    skipped = (f"its first learning rate, {_lr(call.lr_before)}, was skipped: the first optimizer step already ran "
               f"at {_lr(first_lr)}") if call.lr_before != call.lr_after else \
        "its first value is used one step late, and every later value one step early"
    msg = (f"{said} stepped the `{rec.type}` schedule before `{opt_code}` had ever run (iteration "
           f"{call.iteration}): {skipped}. The whole schedule runs one step ahead of the optimizer. Nothing raises "
           f"(PyTorch only warns). Call `{sched_code}` {when}.")
    return _finding(trace, "before_optimizer", rec, call, msg, fix, {"skipped_lr": call.lr_before,
                                                                    "first_step_lr": first_lr})


def _too_often(trace: Trace, rec: SchedulerRecord, calls: list[SchedulerCall], k: int, code: str,
               said: str) -> Finding:
    its = trace.iterations
    libraries = sorted({c.library for c in calls if c.library})
    both = bool(libraries) and any(not c.library for c in calls)  # (the user's code and a library's loop)
    library = _LIBRARY.get(libraries[0], libraries[0]) if libraries else ""
    gaps = [b.backwards - a.backwards for a, b in zip(calls, calls[1:])]
    counts = Counter(n for n in its.backwards if n)
    accum = counts.most_common(1)[0][0] if counts else 1  # backward() calls per optimizer step
    micro = not both and bool(gaps) and Counter(gaps).most_common(1)[0][0] == 1 and accum > 1
    why = (f"once per micro-batch (each `backward()`), while the optimizer steps once every {accum} of them "
           "(gradient accumulation)") if micro else f"{k} times for each optimizer step"
    if both:
        why += f" (by your code and by {library}, which steps it itself once per optimizer step)"
    # (Accelerate's own pattern steps the scheduler in every micro-batch: right once it prepared the scheduler)
    prepare = rec.optimizer == "AcceleratedOptimizer" and micro
    if prepare:
        why += " (`accelerator.prepare` was not given this scheduler: only the one it returns skips with the optimizer)"
    last = rec.last or calls[-1]
    sched_code = code or "scheduler.step()"
    steps = last.iteration - calls[0].iteration
    start, end = _lr(calls[0].lr_before), _lr(last.lr_after)
    # (a periodic schedule can come back to where it started: then the count says it, not "from 0.001 to 0.001")
    drop = ("" if steps <= 0 else f": the learning rate went from {start} to {end} in {steps} optimizer step{'s' if steps != 1 else ''}"
            if start != end else f": {rec.calls} scheduler steps over {steps + 1} iterations of the loop")
    msg = (f"{said} stepped the `{rec.type}` schedule {why}: {k} scheduler steps per optimizer step, so the schedule "
           f"runs {k} times too fast{drop} (a warm-up ends {k} times early, the decay is reached {k} times sooner). "
           f"Nothing raises. " + (f"Leave the stepping to {library}." if both else
                                  "Step the scheduler once per optimizer step, right after it."))
    if both:
        fix = f"# {sched_code}  # deleted: {library} steps the scheduler itself, once per optimizer step"
    elif prepare:
        name = _name(sched_code, "step") or "scheduler"
        fix = f"{name} = accelerator.prepare({name})  # it steps only when the optimizer really steps"
    else:
        opt_code, indent = _optimizer_line(trace) if not its.library else ("", "")
        fix = (f"{opt_code}\n{sched_code}  # once per optimizer step, not per micro-batch" if opt_code else
               f"{sched_code}  # only where the optimizer steps: once per optimizer step")
        if opt_code and indent:
            fix = "\n".join(indent + ln for ln in fix.splitlines())
    return _finding(trace, "too_often", rec, _placed(calls), msg, fix,
                    {"per_optimizer_step": k, "micro_batches": micro})


def _orphaned(trace: Trace, rec: SchedulerRecord, call: SchedulerCall, code: str, said: str) -> Finding:
    its = trace.iterations
    stepped = trace.optimizer_steps[0] if trace.optimizer_steps else None
    opt_code = code_at(trace, stepped.line, stepped.file) if stepped else ""
    opt_name = _name(opt_code, "step") or "optimizer"
    sched_name = _name(code, "step") or "scheduler"
    other = f"`{stepped.optimizer}`" if stepped else "another optimizer"
    msg = (f"{said} stepped a `{rec.type}` schedule whose `{rec.optimizer}` optimizer never stepped since the "
           f"scheduler was made, while {other} stepped {its.steps} time(s) in this run: the scheduler was made for "
           f"an optimizer that was replaced since (re-created after the scheduler), so the learning rate of the "
           f"optimizer that trains never follows the schedule. Nothing raises. Make the scheduler after the "
           f"optimizer it schedules, from that optimizer.")
    fix = f"{sched_name} = torch.optim.lr_scheduler.{rec.type}({opt_name}, ...)  # the optimizer that steps"
    return _finding(trace, "optimizer_never_stepped", rec, call, msg, fix, {"stepped_optimizer": other.strip("`")})


def iteration_of(trace: Trace, call: SchedulerCall) -> int:
    """The loop iteration a call ran in: a call after its iteration's optimizer step (no ``backward()`` since)
    belongs to that iteration, though the step was already counted.

    >>> from backward_doctor.trace.parts import Iterations
    >>> t = Trace(iterations=Iterations(steps=2, backwards=[1, 1]))
    >>> [iteration_of(t, SchedulerCall(iteration=1, backwards=n)) for n in (1, 2)]
    [0, 1]
    """
    its = trace.iterations
    if call.iteration >= 1 and its.stride == 1 and len(its.backwards) >= call.iteration and \
            call.backwards == sum(its.backwards[:call.iteration]):
        return call.iteration - 1
    return call.iteration


def _placed(calls: list[SchedulerCall]) -> SchedulerCall:
    """The call to name: the first the user's own code made (a library's call names only the line that ran its
    loop), else the first."""
    return next((c for c in calls if not c.library), calls[0])


def _finding(trace: Trace, problem: str, rec: SchedulerRecord, call: SchedulerCall, msg: str, fix: str,
             extra: dict) -> Finding:
    return at("scheduler_misuse", placed(call), msg, severity="warning", title=_TITLES[problem],
              iteration=looped(trace, iteration_of(trace, call)),
              evidence={"problem": problem, "scheduler": rec.type, "optimizer": rec.optimizer,
                        "library": rec.library, "calls": rec.calls, "fix_code": fix, **extra})


def scheduler_misuse(trace: Trace) -> list[Finding]:
    """Schedulers stepped before, more often than, or without their optimizer: one finding per scheduler."""
    if not trace.schedules or trace.iterations.steps < 1:
        return []  # (no optimizer stepped: a schedule stepped on its own, to plot or inspect it)
    out: list[Finding] = []
    for rec in trace.schedules:
        calls = rec.steps
        if not calls or rec.type == "ReduceLROnPlateau":
            continue
        first, last, named = calls[0], rec.last or calls[-1], _placed(calls)
        code = code_at(trace, named.line, named.file)
        place = f"line {named.line}" if named.file is None else \
            f"`{(named.file or '').rsplit('/', 1)[-1]}:{named.line}`"
        said = f"`{code}` ({place})" if code else place
        k = per_step(calls)
        # (a schedule stepped between no two optimizer steps, all at one point of the run, is plotted or inspected
        # on an optimizer of its own: said nothing)
        interleaved = len({c.iteration for c in calls}) >= 2
        if last.optimizer_stepped is False and last.scaler_skipped == 0 and interleaved:
            out.append(_orphaned(trace, rec, named, code, said))
        elif k >= 2 and interleaved:
            out.append(_too_often(trace, rec, calls, k, code, said))
        elif first.first and first.optimizer_stepped is False and first.scaler_skipped == 0 and \
                any(c.optimizer_stepped for c in calls[1:]):  # (its own optimizer stepped after it)
            out.append(_before(trace, rec, first, code, said))
    return out


__all__ = ["per_step", "scheduler_misuse"]
