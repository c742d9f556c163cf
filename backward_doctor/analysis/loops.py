"""Which iteration of a training loop a finding's root cause happened in (a pure pass after the rules).

An iteration is an optimizer step: it ends when the outermost ``optimizer.step()`` returns
(``trace.iterations``), and before the first one returns the loop is in iteration 0. A finding gets
``iteration`` when the op it points at (``evidence["op_index"]``, or the op that raised for the cell's
exception) is known and its root-cause line lies

- inside a ``for``/``while`` loop of the cell that steps an optimizer (the outermost loop holding the line),
- or in the cell's call of a library's loop (``trainer.train()``, ``trainer.fit(...)``): then the evidence
  names that call and the library's epoch and batch (``capture/trainers.py``).

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
from ..util.loops import loop_at, steps_in
from .findings import Finding


def place_in_loops(trace: Trace, findings: list[Finding]) -> list[Finding]:
    """Set ``iteration`` (and ``evidence["loop_line"]``, ``["loop_call"]`` for a library's loop, ``["loop_value"]``)
    on findings whose root cause ran in a training loop."""
    its = trace.iterations
    if not trace.source:
        return findings
    for f in findings:
        line = f.cell_line if f.cell_line is not None else (f.line if f.file is None else None)
        if line is None and its.library and f.iteration is not None:
            line = its.library_line  # (a rule placed it in an iteration, at a line of the user's own files)
        if line is None:
            continue
        library = bool(its.library) and line == its.library_line
        loop = None if library else loop_at(trace.source, line)
        if loop is None and not library:
            continue
        if loop is not None and not its.starts and not steps_in(trace.source, loop[0]):
            continue  # a loop that steps no optimizer: its iterations are not counted
        index = f.evidence.get("op_index") if f.iteration is None else None  # (a rule may know it already)
        if f.iteration is None and index is None and (trace.exception is not None or trace.timed_out) and f is findings[0]:
            # The cell's exception (its finding comes first): the op that raised, else the iteration
            # that was running when it came.
            index = trace.failed_op.index if trace.failed_op is not None else \
                trace.exception.oom.index if trace.exception is not None and trace.exception.oom is not None else None
            if index is None:
                f.iteration = its.steps
        if index is not None:
            f.iteration = its.iteration_of(index) if its.starts else 0
            if loop is not None and f.iteration and ran_after_step(trace, index, line) is not None:
                f.iteration -= 1
        if f.iteration is not None:
            if library:
                f.evidence["loop_line"], f.evidence["loop_call"] = its.library_line, its.library_call
            else:
                f.evidence["loop_line"] = loop[0]
            value = its.values.get(str(f.iteration))
            if value:
                f.evidence["loop_value"] = value
    return findings


def ran_after_step(trace: Trace, index: int, line: int) -> int | None:
    """The cell line of the ``optimizer.step()`` that op ``index`` (at cell line ``line``) ran after in the same
    pass through the loop's body (an evaluation after the step), else None: the step is in the same loop,
    before ``line``, and every op between the step's return and this one is on a line after it.

    >>> from backward_doctor.trace import Trace
    >>> ran_after_step(Trace(), 3, 2) is None
    True
    """
    its = trace.iterations
    iteration = its.iteration_of(index) if its.starts else None
    if not iteration or its.replayed is not None or iteration not in its.recorded:
        return None
    begun = its.starts[its.recorded.index(iteration)]
    steps = [s for s in trace.optimizer_steps if s.index < begun and s.cell_line is not None]
    loop = loop_at(trace.source, line)
    if not steps or loop is None:
        return None
    step_line = steps[-1].cell_line
    if not step_line < line or loop_at(trace.source, step_line) != loop:
        return None
    ops = trace.ops
    lo = bisect.bisect_left([op.index for op in ops], begun)
    for op in ops[lo:]:
        if op.index >= index:
            break
        if op.where.cell_line is not None and op.where.cell_line < step_line:
            return None  # the loop came round again: a new iteration's body
    return step_line
