"""The source lines a report shows, copied while the run is recorded: a few lines around each place
outside the cell the trace names (an op's line in the user's module, a library frame, a finding's line).

A report travels (a CI artifact, a bug report, ``render`` and ``combine`` on another machine): whoever
renders it must never read files of their own machine because the report names them. So the lines are
taken here, on the machine and at the time the step ran, as text in ``Trace.excerpts``; renderers and
rules read source only from the trace (``trace.queries.source_lines``).

>>> import linecache
>>> from backward_doctor.trace import Trace
>>> linecache.cache["/virtual/m.py"] = (1, None, [f"line {i}\\n" for i in range(1, 21)], "/virtual/m.py")
>>> t = Trace()
>>> keep_excerpts(t, [("/virtual/m.py", 10), ("/virtual/m.py", 11), (None, 3)])
>>> [(e.file, e.first, len(e.lines)) for e in t.excerpts]
[('/virtual/m.py', 7, 7), ('/virtual/m.py', 14, 1)]
"""
from __future__ import annotations

import linecache
from typing import Iterable

from ...trace.parts import SourceExcerpt
from ...trace.records import Trace, Where

AROUND = 3             # lines before and after a place (what the report's source box shows)
MAX_EXCERPTS = 400     # places kept per trace: a bounded report whatever the step did
MAX_LINE = 400         # characters kept of one line


def trace_places(trace: Trace) -> list[tuple[str | None, int | None]]:
    """Every (file, line) the trace names: its ops, its exception, NaN/Inf and in-place events, optimizer
    steps, backward calls, graphs kept alive, thread stacks (the user's frames)."""
    wheres: dict[int, Where] = {}
    for group in ([op.where for op in trace.ops], [e.where for e in trace.nonfinite],
                  [e.where for e in trace.inplace], trace.backward_calls,
                  [trace.failed_op.where] if trace.failed_op else [],
                  [trace.exception.where] if trace.exception else []):
        for w in group:
            wheres.setdefault(id(w), w)  # ops share interned Where objects: each looked at once
    places: list[tuple[str | None, int | None]] = [(w.file, w.line) for w in wheres.values()]
    places += [(s.file, s.line) for s in trace.optimizer_steps]
    places += [(h.store_file, h.store_line) for h in trace.graph_holders]
    cast = trace.precision.cast  # (the line that made the weights bf16: often an earlier cell's)
    places += [(cast.file, cast.line)] if cast is not None else []
    places += [(c.file, c.line) for s in trace.schedules  # (a scheduler's first line, and the user's own)
               for c in s.steps[:1] + [c for c in s.steps if not c.library][:1]]
    frames = [fi for st in trace.threads for fi in st.frames]
    frames += trace.exception.frames if trace.exception else []
    places += [(fi.file, fi.line) for fi in frames if fi.user and not fi.in_cell]
    return places


def keep_excerpts(trace: Trace, places: Iterable[tuple[str | None, int | None]]) -> None:
    """Copy into ``trace.excerpts`` the lines around each (file, line) of ``places`` that lies outside the
    cell (file None) and that ``linecache`` can read now; places already covered cost nothing."""
    wanted: dict[str, set[int]] = {}
    for ex in trace.excerpts:
        wanted.setdefault(ex.file, set()).update(range(ex.first, ex.first + len(ex.lines)))
    budget = MAX_EXCERPTS - len(trace.excerpts)
    for file, line in places:
        if budget <= 0:
            return
        if file is None or line is None or line < 1 or file == trace.cell_file:
            continue
        have = wanted.setdefault(file, set())
        if line in have and line - AROUND in have and line + AROUND in have:
            continue
        lines = linecache.getlines(file)
        if not lines or line > len(lines):
            continue
        missing = [n for n in range(max(1, line - AROUND), min(len(lines), line + AROUND) + 1) if n not in have]
        if not missing:
            continue
        lo, hi = missing[0], missing[-1]
        have.update(range(lo, hi + 1))
        trace.excerpts.append(SourceExcerpt(file=file, first=lo,
                                            lines=[s.rstrip("\r\n")[:MAX_LINE] for s in lines[lo - 1:hi]]))
        budget -= 1
