"""Which iteration of the cell's loop a finding's root cause happened in (a pure pass after the rules).

An iteration ends when the outermost ``optimizer.step()`` returns (``trace.iterations``). A finding gets
``iteration`` when its root-cause line lies inside a ``for``/``while`` loop of the cell and the op it
points at (``evidence["op_index"]``, or the op that raised for the cell's exception) is known; the loop
is the outermost one holding that line.

>>> from backward_doctor.trace import Trace
>>> f = Finding("nonfinite", "", line=3, evidence={"op_index": 5})
>>> t = Trace(source="for i in range(9):\\n    x = 1\\n    y = 2\\n")
>>> t.iterations.recorded, t.iterations.starts, t.iterations.steps = [0, 1], [0, 4], 1
>>> t.iterations.values = {"1": "i = 1"}
>>> place_in_loops(t, [f])[0].location()
'cell line 3, in iteration 1 of the loop at line 1 (i = 1)'
"""
from __future__ import annotations

from ..trace.records import Trace
from ..util.loops import loop_at
from .findings import Finding


def place_in_loops(trace: Trace, findings: list[Finding]) -> list[Finding]:
    """Set ``iteration`` (and ``evidence["loop_line"]``) on findings whose root cause ran in the cell's loop."""
    its = trace.iterations
    if not its.starts or not trace.source:
        return findings
    for f in findings:
        line = f.cell_line if f.cell_line is not None else (f.line if f.file is None else None)
        loop = loop_at(trace.source, line) if line is not None else None
        if loop is None:
            continue
        index = f.evidence.get("op_index") if f.iteration is None else None  # (a rule may know it already)
        if f.iteration is None and index is None and (trace.exception is not None or trace.timed_out) and f is findings[0]:
            # The cell's exception (its finding comes first): the op that raised, else the iteration
            # that was running when it came.
            index = trace.failed_op.index if trace.failed_op is not None else None
            if index is None:
                f.iteration = its.steps
        if index is not None:
            f.iteration = its.iteration_of(index)
        if f.iteration is not None:
            f.evidence["loop_line"] = loop[0]
            value = its.values.get(str(f.iteration))
            if value:
                f.evidence["loop_value"] = value
    return findings
