"""Questions about a trace that more than one layer asks (the capture's history, the rules).

>>> from backward_doctor.trace import Trace
>>> skipped_amp_steps(Trace())
[]
"""
from __future__ import annotations

from .records import OpRecord, Trace

#: Ops the profiler and the recorder add around the user's own (``record_function`` markers): bookkeeping,
#: not work the step asked for (the ops table and the hang report leave them out).
BOOKKEEPING_PREFIXES = ("profiler::",)


def is_bookkeeping(op_name: str) -> bool:
    """True for an op that is the recorder's or profiler's own marker (``profiler::_record_function_enter_new``).

    >>> is_bookkeeping("profiler::_record_function_enter_new"), is_bookkeeping("aten::mm")
    (True, False)
    """
    return op_name.startswith(BOOKKEEPING_PREFIXES)


def skipped_amp_steps(trace: Trace) -> list[OpRecord]:
    """GradScaler unscale ops not followed by an optimizer step before the scale update."""
    steps = [s.index for s in trace.optimizer_steps]
    skipped = []
    pending = None
    checked = None  # scaler.step reads found_inf with .item(): that op sits on the step line
    for op in trace.ops:
        if op.op == "aten::_amp_foreach_non_finite_check_and_unscale_":
            pending, checked = op, None
        elif op.op == "aten::_local_scalar_dense" and pending is not None:
            checked = op
        elif op.op == "aten::_amp_update_scale_" and pending is not None:
            if not any(pending.index < s <= op.index for s in steps):
                skipped.append(checked or pending)
            pending = checked = None
    return skipped
