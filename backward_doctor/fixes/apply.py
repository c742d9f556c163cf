"""Run a fix: snapshot, original run, restore, rewritten run, comparison.

The rewritten cell is what runs (through the same capture as any cell), so the
code the report offers to keep is the code that was measured.
"""
from __future__ import annotations

import logging
import dataclasses
import difflib
import warnings as _warnings
from typing import Any, Callable

from ..util.process import exclusive
from ..report.report import Report
from ..trace.parts import OomInfo
from ..trace.records import Trace
from ..util.units import format_bytes, parse_size
from . import accumulate, amp, checkpoint, library_knobs, sync
from ..util.cell import Cell, NotApplicable, stored_names
from .compare import GradProbe, FixProgress, grad_max_rel_err, loss_value, run_numbers
from ..report.fix_result import FixResult
from ..run.snapshot import Snapshot, take_if_it_fits
from ..run.step import check_cell, check_timeout, remember, run_step
from .live_knobs import LiveObjects, touched
from .spec import FixSpec, parse_fix

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]


def rewrite_for(spec: FixSpec, source: str, namespace: dict[str, Any], original: Report | None,
                reuse: set[str] = frozenset()):
    """The cell rewritten for ``spec`` (``NotApplicable`` when it cannot be, with the reason)."""
    # A loop a library runs (Trainer.train(), Trainer.fit(), Accelerate) is fixed with the library's own knobs.
    cell = Cell(source)
    loop = library_knobs.find_library_loop(cell, namespace)
    if loop is not None:
        return library_knobs.rewrite(spec, cell, namespace, original, loop)
    if spec.kind == "accumulate":
        return accumulate.rewrite(source, namespace, spec.arg, original, reuse=reuse)
    if spec.kind == "amp":
        return amp.rewrite(source, namespace, spec.arg)
    if spec.kind == "checkpoint":
        return checkpoint.rewrite(source, namespace, original)
    return sync.rewrite(source, namespace, original)


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # a cell we cannot parse: no names, no loss
        log.debug("cell analysis failed", exc_info=True)
        return None


def _diff(before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        fromfile="original cell", tofile="with fix"))


def _cancelled(trace: Trace | None) -> bool:
    return trace is not None and trace.exception is not None and trace.exception.type == "FixCancelled"


@exclusive
def run_fix(source: str, namespace: dict[str, Any] | None, fix: str, *, original: Report | dict | None = None,
            timeout: float | None = None, memory_limit: int | str | None = None, rollback: bool = True,
            progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
            run_original: Callable[[], Report] | None = None) -> Report:
    """Apply ``fix`` to the cell ``source`` and run it; the report of the fixed run (see ``FixResult``).

    Without ``original`` the original cell runs first (so the fix can be compared
    with it and, for ``checkpoint``, planned from its trace); with ``rollback`` the
    training state is snapshotted before and restored between the two runs, and
    after a fixed run that fails or is cancelled. ``progress(fraction, text)`` is
    called as work proceeds; ``cancel()`` returning True stops at the next model
    call or optimizer step. Bad arguments raise ``ValueError`` before anything runs.
    """
    spec = parse_fix(fix)
    check_cell(source, namespace)
    timeout = check_timeout(timeout)
    limit = parse_size(memory_limit)
    if isinstance(original, dict):
        original = Report.from_dict(original)
    ns = {} if namespace is None else namespace
    ns.setdefault("__builtins__", __builtins__)

    def say(fraction: float, text: str) -> None:
        if progress is not None:
            progress(min(1.0, max(0.0, fraction)), text)

    result = FixResult(name=spec.name)
    cell = _safe(lambda: Cell(source))
    names = set().union(*(cell.loads(i) for i in range(len(cell.stmts)))) if cell and cell.stmts else set()
    rebinds = stored_names(cell.stmts) if cell else set()
    loss_name = _safe(cell.loss_name) if cell else None
    before_loss = loss_value(ns, loss_name) if original is not None and original.exception is None else None

    # 1. Snapshot (when it fits in RAM).
    snap: Snapshot | None = None
    if rollback:
        say(0.0, "saving the training state (rollback snapshot)")
        snap, why_not = take_if_it_fits(ns, rebinds, source)
        if snap is None:
            text = f"rollback skipped: {why_not}; the fix runs on top of the original run's state"
            _warnings.warn(text, RuntimeWarning, stacklevel=2)
            result.warnings.append(text)
    else:
        result.warnings.append("rollback off: the fix runs on the state the original run left")

    # 2. The original run.
    probe_before = GradProbe(ns, enabled=original is None)
    lo = 0.05 if original is None else 0.0
    if original is None:
        if cancel is not None and cancel():
            return _stop(Report(exception="FixCancelled: cancelled by the user"), result, snap, ns,
                         "Cancelled before anything ran.")
        say(lo, "running the original cell")
        with FixProgress(ns, names, lo, 0.45, "running the original cell", progress, cancel), probe_before:
            if run_original is not None:
                original = run_original()
            else:
                original = run_step(source, ns, timeout=timeout, memory_limit=limit, engine="python",
                                    rollback=False, detail=True)
        if _cancelled(original.trace):
            original = Report(exception="FixCancelled: cancelled by the user", trace=original.trace)
            return _stop(original, result, snap, ns, "Cancelled while the original cell ran; the state was "
                         "restored." if snap else "Cancelled while the original cell ran.")
        before_loss = loss_value(ns, loss_name) if original.exception is None else None
    result.original = original.to_dict()
    result.comparison = {"before": run_numbers(original.trace, before_loss), "after": run_numbers(None, None),
                         "grad_max_rel_err": None}

    # 3. The rewrite (an honest "cannot" leaves the namespace as the original run left it).
    say(0.47, f"rewriting the cell for {spec.name}")
    try:
        rw = rewrite_for(spec, source, ns, original)
    except NotApplicable as exc:
        result.message = f"{spec.name} cannot be applied: {exc}"
        say(1.0, "done (fix not applicable)")
        return _as_last(dataclasses.replace(original, fix=spec.name, fix_result=result))  # the caller's stays as it was
    result.warnings.extend(rw.warnings)
    # Arguments an earlier cell built are set on the live objects for the run: their attributes go back after it.
    live = (LiveObjects(*rw.details["live_objects"]) if "live_objects" in rw.details else
            LiveObjects(touched(ns[rw.details["live_var"]])) if rw.details.get("live_var") in ns else None)

    # 4. Restore, then run the rewritten cell. Plain "accumulate" (no k) doubles k while the
    #    step still runs out of memory, restoring the state before each try.
    if snap is not None and probe_before.enabled:
        _restore(snap, ns, result)
        result.rolled_back = True
    # Gradients are compared only with an original step that ran to the end (and was run here).
    compare = probe_before.enabled and original.exception is None and not original.trace.timed_out
    tried: list[str] = []
    last_failure: tuple[Any, Any] = (None, None)
    while True:
        name = f"accumulate:{rw.details['k']}" if spec.kind == "accumulate" else spec.name
        result.name, result.code, result.diff = name, rw.code, _diff(source, rw.code)
        result.elsewhere = rw.details.get("elsewhere")
        result.comparison.pop("predicted_peak", None)
        predicted, lower = _predicted(original, name)
        if predicted is not None:
            result.comparison["predicted_peak"] = predicted
            result.comparison["predicted_is_lower_bound"] = lower
        if snap is not None:
            snap.add_names(ns, _safe(lambda: stored_names(Cell(rw.code).stmts)) or set())
        if cancel is not None and cancel():
            return _stop(original, result, snap, ns, "Cancelled before the fixed cell ran.", live)
        # Each retry gets half of what is left of the bar, so the fraction never goes back.
        lo, hi = 0.95 - 0.45 * 0.5 ** len(tried), 0.95 - 0.45 * 0.5 ** (len(tried) + 1)
        hi = 0.95 if spec.arg is not None or spec.kind != "accumulate" else hi
        say(lo, f"running the cell with {name}")
        probe_after = GradProbe(ns, enabled=compare)
        with FixProgress(ns, names, lo, hi, f"running the cell with {name}", progress, cancel,
                   rw.details.get("k", 1)), probe_after:
            fixed = run_step(rw.code, ns, timeout=timeout, memory_limit=limit, engine="python", rollback=False,
                             history=False, detail=True, fix=name)
            trace = fixed.trace
        if _cancelled(trace):
            return _stop(original, result, snap, ns, "Cancelled while the fixed cell ran.", live)
        told = library_knobs.undivided_loss_followup(rw, fixed) if snap is not None else None
        if told is not None:  # (at most once: the follow-up clears what asks for it)
            tried.append(f"{name} as first written left each micro-batch's loss undivided (the gradients "
                         f"{rw.details['k']}x one full batch's)")
            _restore(snap, ns, result, live)
            rw = told
            continue
        oom = trace.exception is not None and trace.exception.type == "OutOfMemoryError"
        k = rw.details.get("k")
        if not (oom and spec.kind == "accumulate" and spec.arg is None and snap is not None
                and k is not None and k < rw.details["batch_size"] and len(tried) < 5):
            break
        info = trace.exception.oom or OomInfo()
        failed = trace.op(info.index)
        if failed is not None and failed.phase == "optimizer":
            result.warnings.append(f"{name} ran out of memory in the optimizer step, which more micro-batches do "
                                   "not shrink: parameters, gradients and optimizer state alone exceed the device")
            break
        signature = (failed.op if failed else None, info.requested)
        if tried and signature == last_failure and signature[1]:
            result.warnings.append(f"smaller micro-batches do not shrink the allocation that fails "
                                   f"({format_bytes(signature[1])} in {signature[0]})")
            break
        last_failure = signature
        if live is not None:  # the next rewrite reads the live arguments as the user set them
            live.restore()
        try:  # before restoring: batch tensors the cell makes itself exist now
            made = (_safe(lambda: stored_names(Cell(rw.code).stmts)) or set()) - rebinds
            following = rewrite_for(FixSpec("accumulate", min(2 * k, rw.details["batch_size"])), source, ns,
                                    original, reuse=made)
        except NotApplicable:
            break
        tried.append(f"{name} still ran out of memory (peak {format_bytes(trace.memory.peak_bytes)})")
        _restore(snap, ns, result, live)
        say(hi, f"{name} ran out of memory; trying {following.details['k']} micro-batches")
        rw = following
    report = fixed
    after_loss = loss_value(ns, loss_name) if trace.exception is None else None
    result.comparison["after"] = run_numbers(trace, after_loss)
    if probe_after.enabled and trace.exception is None:
        result.comparison["grad_max_rel_err"] = grad_max_rel_err(probe_before.grads, probe_after.grads)
    result.applied = True
    result.fits = trace.exception is None and not trace.timed_out
    result.message = _outcome(rw.message, result, original, trace, limit)
    if tried:
        result.message += " Tried first: " + "; ".join(tried) + "."
    if not result.fits and snap is not None:
        _restore(snap, ns, result)
        result.rolled_back = True
        result.message += " The training state was rolled back to before the fix."
    if live is not None:  # nothing the live fix changed stays unless the user keeps it
        if snap is not None and result.fits:
            _restore(snap, ns, result)
            result.rolled_back = True
        live.restore()
        what = rw.details.get("live_what", "its arguments, its Accelerator")
        back = f"`{rw.details['live_var']}` was put back as it was ({what})"
        result.message += (f" Then {back}" + (" and the training state rolled back" if snap is not None else "")
                           + ": run the code to keep to train with the fix." if result.fits else f" {back}.")
    report.fix_result = result
    say(1.0, "done")
    return report


def _as_last(report: Report) -> Report:
    """Make ``report`` what ``backward_doctor.last_report()`` returns."""
    return remember(report)


def _restore(snap: Snapshot, ns: dict[str, Any], result: FixResult, live: LiveObjects | None = None) -> None:
    if live is not None:
        live.restore()
    try:
        snap.restore(ns)
    except Exception as exc:  # say so: the state may be partly restored
        result.warnings.append(f"rollback failed part-way ({type(exc).__name__}: {exc}); check the model's state")


def _stop(report: Report, result: FixResult, snap: Snapshot | None, ns: dict[str, Any], message: str,
          live: LiveObjects | None = None) -> Report:
    if live is not None:  # a live fix cancelled: the objects it set go back too
        live.restore()
    if snap is not None:
        _restore(snap, ns, result)
        result.rolled_back = True
    result.cancelled = True
    result.applied = False
    result.message = message
    if result.original is None and report.trace.ops:
        result.original = report.to_dict()
    return _as_last(dataclasses.replace(report, fix=result.name, fix_result=result))


def _predicted(original: Report, name: str) -> tuple[int | None, bool]:
    """The OOM finding's predicted peak for this fix, and whether it is only a lower bound."""
    finding = next((f for f in original.findings if f.kind == "oom"), None)
    if finding is None:
        return None, False
    preds = finding.evidence.get("predicted_peak") or {}
    key = name if name in preds else name.split(":")[0]
    return preds.get(key), bool(finding.evidence.get("lower_bound"))


#: An op that takes this many times as long per call in the fixed run, and that is a large part of its time
#: (``SLOW_SHARE`` of the time inside ops, at least ``SLOW_MIN_S`` more in all), makes the fix "much slower".
SLOW_RATIO, SLOW_SHARE, SLOW_MIN_S = 3.0, 0.25, 0.25


def slowdown(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, str] | None:
    """(how many times as long per call, the op) for the op the fix made much slower, when one did. Per call of
    the same op: more micro-batches or a recomputed forward add calls, which the step time shows anyway (and an
    original that failed part-way has no full step time); slower kernels (bfloat16 autocast on a CPU without
    fast ones) make each call of the ops that do the work slower.

    >>> slowdown({"op_time": {"aten::mm": [10, 5e4]}}, {"op_time": {"aten::mm": [10, 1e6], "aten::add": [5, 1e3]}})
    (20.0, 'aten::mm')
    >>> slowdown({"op_time": {"aten::mm": [10, 5e4]}}, {"op_time": {"aten::mm": [80, 4e5]}}) is None
    True
    """
    was, now = before.get("op_time") or {}, after.get("op_time") or {}
    inside = sum(us for _, us in now.values())
    found = None
    for name, (calls, us) in now.items():
        old = was.get(name)
        if not old or not calls or not old[0] or old[1] <= 0 or us < SLOW_SHARE * inside:
            continue
        per_call = old[1] / old[0]
        ratio = (us / calls) / per_call
        if ratio >= SLOW_RATIO and (us - calls * per_call) / 1e6 >= SLOW_MIN_S and (found is None or ratio > found[0]):
            found = (round(ratio, 1), name)
    return found


def _outcome(what: str, result: FixResult, original: Report, trace: Trace, limit: int | None) -> str:
    before, after = result.comparison["before"], result.comparison["after"]
    parts = [what.rstrip(". ") + "."]
    if trace.exception is None and not trace.timed_out:
        was = format_bytes(before["peak_bytes"]) if before.get("peak_bytes") else "?"
        ran_out = "" if before.get("completed") else " when it failed"
        of = f" (limit {format_bytes(limit)})" if limit else ""
        parts.append(f"The fixed step ran: peak live tensors {format_bytes(after['peak_bytes'])}{of}, "
                     f"was {was}{ran_out}.")
        slow = slowdown(before, after)
        if slow is not None:
            result.slowdown, op = slow
            why = (" bfloat16 autocast on a CPU runs without the fast kernels a GPU has (most CPUs lack them);"
                   " on a GPU AMP is usually faster, on this machine prefer accumulation."
                   if result.name.startswith("amp") and trace.device == "cpu" else "")
            until = "" if before.get("completed") else " until it failed"
            how = (f"each call of `{op}` took {result.slowdown:g}x as long as in the original run "
                   f"({after['step_s']:.2f} s for the fixed step; the original ran {before['step_s']:.2f} s{until})")
            parts.append(f"It is much slower: {how}.{why}")
        err = result.comparison.get("grad_max_rel_err")
        if err is not None:
            parts.append(f"Gradients differ from the original step's by at most {err:.2g} (relative).")
        if before.get("loss") is not None and after.get("loss") is not None:
            parts.append(f"Loss {after['loss']:.6g} (original {before['loss']:.6g}).")
    else:
        exc = trace.exception.summary().split("\n")[0][:200] if trace.exception else "timed out"
        parts.append(f"The fixed step did not complete: {exc.rstrip('.')}.")
    if result.warnings:
        parts.append("Note: " + "; ".join(result.warnings) + ".")
    return " ".join(parts)
