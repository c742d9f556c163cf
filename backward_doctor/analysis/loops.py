"""Which iteration of the cell's loop a finding's root cause happened in (a pure pass after the rules).

An iteration ends when the outermost ``optimizer.step()`` returns (``trace.iterations``). A finding gets
``iteration`` when its root-cause line lies inside a ``for``/``while`` loop of the cell and the op it
points at (``evidence["op_index"]``, or the op that raised for the cell's exception) is known; the loop
is the outermost one holding that line.

>>> loop_at("x = 1\\nfor i in range(3):\\n    y = i\\n", 3)
(2, ['i'])
>>> loop_at("x = 1\\n", 1) is None
True
"""
from __future__ import annotations

import ast
import functools

from ..trace.records import Trace
from .findings import Finding


@functools.lru_cache(maxsize=64)
def _loops(source: str) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """(first line, last line, target names) of each top-level loop of the cell (outermost only)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            names = tuple(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)) \
                if not isinstance(node, ast.While) else ()
            out.append((node.lineno, node.end_lineno or node.lineno, names))
    # Outermost: a loop inside another is dropped.
    return tuple(lp for lp in out if not any(o[0] < lp[0] and lp[1] <= o[1] for o in out if o != lp))


def loop_at(source: str, line: int) -> tuple[int, list[str]] | None:
    """(line of the outermost loop holding ``line``, its target names), or None."""
    for first, last, names in _loops(source):
        if first <= line <= last:
            return first, list(names)
    return None


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
        index = f.evidence.get("op_index")
        if index is None and (trace.exception is not None or trace.timed_out) and f is findings[0]:
            # The cell's exception (its finding comes first): the op that raised, else the iteration
            # that was running when it came.
            index = trace.failed_op.index if trace.failed_op is not None else None
            if index is None:
                f.iteration = its.steps
        if index is not None:
            f.iteration = its.iteration_of(index)
        if f.iteration is not None:
            f.evidence["loop_line"] = loop[0]
    return findings
