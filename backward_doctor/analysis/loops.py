"""Which iteration of a training loop a finding's root cause happened in (a pure pass after the rules).

An iteration is an optimizer step: it ends when the outermost ``optimizer.step()`` returns
(``trace.iterations``), and before the first one returns the loop is in iteration 0. A finding gets
``iteration`` when the op it points at (``evidence["op_index"]``, or the op that raised for the cell's
exception) is known and its root-cause line lies

- inside a ``for``/``while`` loop of the cell that steps an optimizer (the outermost loop holding the line),
- or in the cell's call of a library's loop (``trainer.train()``, ``trainer.fit(...)``): then the evidence
  names that call and the library's epoch and batch (``capture/loop/trainers.py``).

Code after ``optimizer.step()`` in the loop's body (an evaluation, logging) belongs to the iteration whose
step just ran, until the loop comes round again.

>>> from backward_doctor.trace import Trace
>>> f = Finding("nonfinite", "", line=3, evidence={"op_index": 5})
>>> t = Trace(source="for i in range(9):\\n    x = 1\\n    y = 2\\n    opt.step()\\n")
>>> t.iterations.recorded, t.iterations.starts, t.iterations.steps = [0, 1], [0, 4], 1
>>> t.iterations.values = {"1": "i = 1"}
>>> place_in_loops(t, [f])[0].location()
'cell line 3, in iteration 1 of the loop at line 1 (i = 1)'
"""
from __future__ import annotations

import bisect

from ..trace.records import Trace
from ..util.loops import always_steps, loop_at, steps_in
from .findings import Finding, looped


def place_in_loops(trace: Trace, findings: list[Finding]) -> list[Finding]:
    """Set ``iteration`` (and ``evidence["loop_line"]``, ``["loop_call"]`` for a library's loop, ``["loop_value"]``)
    on findings whose root cause ran in a training loop."""
    its = trace.iterations
    if not trace.source:
        if its.library:  # a library's loop seen from its callback: no cell, its iterations are the library's steps
            for f in findings:
                index = f.evidence.get("op_index")
                if f.iteration is None and isinstance(index, int):
                    f.iteration = looped(trace, its.iteration_of(index))
        return findings
    for f in findings:
        line = f.cell_line if f.cell_line is not None else (f.line if f.file is None else None)
        if line is None and its.library and (f.iteration is not None or its.replayed is not None):
            # (a rule placed it in an iteration, at a line of the user's own files; or the library's step was
            # replayed alone, from no line of the cell: its ops are that iteration's)
            line = its.library_line
        if line is None:
            continue
        library = bool(its.library) and line == its.library_line
        loop = None if library else loop_at(trace.source, line)
        if loop is None and not library:
            continue
        if loop is not None and not its.starts and not steps_in(trace.source, loop[0]):
            continue  # a loop that steps no optimizer: its iterations are not counted
        tail = False  # it ran after the step of the iteration before the one counting when it ran
        if f.iteration is None:  # (a rule may know it already)
            f.iteration, tail = _iteration(trace, f, line, loop is not None, f is findings[0])
        if f.iteration is None:
            continue
        if library:
            f.evidence["loop_line"], f.evidence["loop_call"] = its.library_line, its.library_call
        else:
            f.evidence["loop_line"] = loop[0]
        # (loop variables are noted at an iteration's step, and when the cell stopped: in a tail, after it)
        value = its.values.get(str(f.iteration)) or (its.values.get(str(f.iteration + 1)) if tail else None)
        if value:
            f.evidence["loop_value"] = value
    return findings


def _iteration(trace: Trace, f: Finding, line: int, in_cell_loop: bool, first: bool) -> tuple[int | None, bool]:
    """(iteration, whether in the tail of the body after its step) of the op ``f`` points at; for the cell's
    exception (its finding comes first) the op that raised, else the iteration running when it came."""
    its = trace.iterations
    index = f.evidence.get("op_index")
    if index is None and first and (trace.exception is not None or trace.timed_out):
        exc = trace.exception
        index = trace.failed_op.index if trace.failed_op is not None else \
            exc.oom.index if exc is not None and exc.oom is not None else None
        if index is None:  # (it raised in an iteration the recorder did not record)
            tail = in_cell_loop and _tail_of_last_step(trace, line)
            return its.steps - tail, tail
    if index is None:
        return None, False
    # (no iteration recorded: the run stopped before its first step ended, or slept until then, always on)
    iteration = its.iteration_of(index) if its.starts or its.replayed is not None else its.steps
    tail = in_cell_loop and bool(iteration) and ran_after_step(trace, index, line) is not None
    return iteration - tail, tail


def _tail_of_last_step(trace: Trace, line: int) -> bool:
    """The cell stopped at ``line``, after the optimizer step's line in the same loop, where no op was
    recorded: it is still the pass through the body whose step completed last when every pass steps (the
    step is not under an ``if`` and each iteration had one ``backward()``: no accumulation)."""
    its = trace.iterations
    steps = [s.cell_line for s in trace.optimizer_steps if s.cell_line is not None]
    if not its.steps or not steps or not steps[-1] < line or loop_at(trace.source, steps[-1]) != loop_at(trace.source, line):
        return False
    return always_steps(trace.source, steps[-1]) and bool(its.backwards) and set(its.backwards[-4:]) == {1}


def ran_after_step(trace: Trace, index: int, line: int) -> int | None:
    """The cell line of the ``optimizer.step()`` that op ``index`` (at cell line ``line``) ran after in the same
    pass through the loop's body (an evaluation after the step), else None: the last step before the op is
    in the same loop, on an earlier line, and no op between them ran on a line before the step's (the loop
    did not come round again). In a replayed iteration (``run/iteration_replay.py``) the replay's own step
    is that step: the replay ran the body from its top, the run had stopped after the step before.

    >>> from backward_doctor.trace import Trace
    >>> ran_after_step(Trace(), 3, 2) is None
    True
    """
    loop = loop_at(trace.source, line)
    steps = [s for s in trace.optimizer_steps if s.index < index and s.cell_line is not None]
    if loop is None or not steps:
        return None
    step = steps[-1]
    if not step.cell_line < line or loop_at(trace.source, step.cell_line) != loop:
        return None
    ops = trace.ops
    lo = bisect.bisect_left([op.index for op in ops], step.index)
    for op in ops[lo:]:
        if op.index >= index:
            break
        if op.where.cell_line is not None and op.where.cell_line < step.cell_line:
            return None  # the loop came round again: a new iteration's body
    return step.cell_line
