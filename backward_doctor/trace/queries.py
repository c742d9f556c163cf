"""Questions about a trace that more than one layer asks (the capture's history, the rules, the renderers).

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


def recorded_nothing(trace: Trace) -> bool:
    """No op of the run is in the trace, recorded or replayed: the native recorder slept through all of it
    (always on's cost budget, ``capture/loop/choosing.py``), or no op ran at all.

    >>> recorded_nothing(Trace()), recorded_nothing(Trace(op_count=3))
    (True, False)
    """
    its = trace.iterations
    return not trace.op_count and not its.recorded and its.replayed is None


def made_nonfinite_again(replay: Trace, loose: bool = False) -> bool:
    """Whether a replay from the saved state made NaN/Inf again (``Trace.nonfinite_reproduced``): its loss or
    gradients went non-finite, or an op's NaN/Inf reached the loss, a gradient or a parameter; not a NaN/Inf that
    reached none of them (a mask's ``-inf`` that softmax turns into zeros is made in every iteration). ``loose``:
    what the run saw reached none of them either (a NaN/Inf scalar of a forward, a value the cell kept), so any
    NaN/Inf of the replay counts.

    >>> made_nonfinite_again(Trace()), made_nonfinite_again(Trace(nonfinite_reached={"loss": True}))
    (False, True)
    """
    if replay.iterations.first_nonfinite is not None or any(replay.nonfinite_reached.values()):
        return True
    return any(e.reached or loose for e in replay.nonfinite)


def sharded_by_fsdp(trace: Trace) -> bool:
    """The run's model is sharded by FSDP2 (its ``fsdp::`` ops are in the trace): its parameters are read under
    no_grad by FSDP's machinery, and its training state is split across the ranks.

    >>> sharded_by_fsdp(Trace())
    False
    """
    return any(op.op.startswith("fsdp::") for op in trace.ops)


def source_lines(trace: Trace, file: str | None) -> dict[int, str]:
    """The lines of the cell (``file`` None) or of ``file`` that the trace holds, by number: the whole cell,
    and of another file only the excerpts copied when the run was recorded (never read from disk here).

    >>> from backward_doctor.trace.parts import SourceExcerpt
    >>> t = Trace(source="a = 1\\nb = 2", excerpts=[SourceExcerpt("/m.py", 10, ["def f():", "    return 1"])])
    >>> source_lines(t, None)[2], source_lines(t, "/m.py")[11], source_lines(t, "/etc/passwd")
    ('b = 2', '    return 1', {})
    """
    if file is None:
        return dict(enumerate(trace.source.splitlines(), 1))
    out: dict[int, str] = {}
    for ex in trace.excerpts:
        if ex.file == file:
            out.update(enumerate(ex.lines, ex.first))
    return out


def line_text(trace: Trace, line: int | None, file: str | None = None) -> str:
    """The text of one line of the cell or of a file the trace holds an excerpt of, stripped; '' unknown.

    >>> line_text(Trace(source="x = 1\\n  y = 2"), 2), line_text(Trace(), 3, "/etc/passwd")
    ('y = 2', '')
    """
    if line is None:
        return ""
    return source_lines(trace, file).get(line, "").strip()


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
