"""Text and HTML for the combined report of a distributed run: the verdict, a line (a table row) per
rank, then the findings, each naming its rank; each rank's own report folds out below in HTML.

>>> from backward_doctor.report.combined import CombinedReport
>>> from backward_doctor.trace.distributed import RankRecord
>>> r = CombinedReport(ranks=[RankRecord(0, 2, exitcode=0, wrote_report=True)], nproc=1)
>>> print(ranks_text(r).splitlines()[2])
  rank 0: exited 0; 0 collectives
"""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from ..analysis.findings import Finding
from ..report.report import Report
from ..trace.distributed import RankRecord
from ..trace.queries import line_text
from ..trace.records import Trace
from .style import CSS, esc, lines, neutralise, sev_color

if TYPE_CHECKING:
    from ..report.combined import CombinedReport

_WIDTH = 100


def _rank_line(r: RankRecord) -> str:
    """``exited 1 - RuntimeError: ...; 12 collectives; waiting in all_reduce at line 9``."""
    from ..analysis.distributed import rank_error
    from ..analysis.rank_rules import position

    parts = [r.ended()]
    err = rank_error(r)
    if err:
        parts[0] += f" - {err[:160]}"
    issued = sum(c.count or (1 if c.pending else 0) for c in r.collectives)
    parts.append(f"{issued} collective{'s' if issued != 1 else ''}")
    words, _, _ = position(r)
    if r.waiting_in is not None or r.stopped:
        parts.append(words)
    elif r.collectives:
        parts.append(f"last: {r.collectives[-1].label()}")
    if r.unused:
        parts.append(f"{len(r.unused[0].names)} parameters without a gradient")
    return "; ".join(parts)


def _code(report: "CombinedReport", f: Finding) -> str:
    """The finding's line, from the report alone: the script's source, or the excerpts its rank recorded."""
    if f.line is None:
        return ""
    if f.file is None:
        lines = report.source.splitlines()
        if 0 < f.line <= len(lines):
            return lines[f.line - 1].strip()
    return line_text(_trace_for(report, f.rank), f.line, f.file)


def _verdict(report: "CombinedReport") -> str:
    if report.ok:
        return f"backward_doctor: OK - {_n(report.nproc)} ran and nothing looks wrong"
    top = report.root_cause
    what = f"{top.kind} at {top.location()}" if top else "a rank did not complete"
    return f"backward_doctor: PROBLEM - {what} ({_n(report.nproc)})"


def _n(nproc: int) -> str:
    return f"{nproc} rank{'s' if nproc != 1 else ''}"


def ranks_text(report: "CombinedReport") -> str:
    """The combined report as plain text (see the module's example)."""
    took = f" in {report.duration_s:.1f} s" if report.duration_s else ""
    out = [_verdict(report), f"  {_n(report.nproc)} of {report.script or 'the script'}{took}"
           + (f" (timeout {report.timeout_s:g} s)" if report.timeout_s else "")]
    out += [f"  rank {r.rank}{_placed(report, r)}: {_rank_line(r)}" for r in report.ranks]
    for i, f in enumerate(report.findings, 1):
        out.append("")
        out.append(f"[{i}] {f.kind} ({f.severity}) at {f.location()}{' - ' + f.title if f.title else ''}")
        code = _code(report, f)
        if code:
            out.append(f"    > {f.line:>4} | {code}")
        out.extend(textwrap.wrap(f.message, _WIDTH, initial_indent="    ", subsequent_indent="    "))
    stuck = [r for r in report.ranks if r.stopped and r.stacks]
    if stuck:
        out.append("")
        out.append("where the ranks stopped (main thread, innermost last):")
        for r in stuck:
            main = next((s for s in r.stacks if s.is_main), r.stacks[0])
            out.append(f"  rank {r.rank}:")
            # The user's frames, and the innermost one (where it waits), not the doctor's wrappers.
            frames = [fi for fi in main.frames[:-1] if fi.user] + main.frames[-1:]
            out += [f"    {fi.file.rsplit('/', 1)[-1]}:{fi.line} in {fi.function}: {fi.code}" for fi in frames[-6:]]
    out += [f"  note: {n}" for n in report.notes]
    out += _own_errors(report)
    return lines(out)


def _placed(report: "CombinedReport", r: RankRecord) -> str:
    """`` (node 1, local rank 0, on b)`` when the run spanned several nodes (one node's ranks need no such name)."""
    several = len({x.node for x in report.ranks if x.node is not None}) > 1
    return f" ({r.where_ran()})" if several else ""


def _own_errors(report: "CombinedReport") -> list[str]:
    """The notes of ranks where a watch of the doctor's failed and switched off: what was not seen (the same
    note on several ranks once, with their numbers)."""
    by_note: dict[str, list[int]] = {}
    for r in report.ranks:
        for n in r.trace.notes if r.trace is not None else []:
            if "doctor's own error" in n:
                by_note.setdefault(n, []).append(r.rank)
    return [f"  note (rank{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}): {n}" for n, ks in by_note.items()]


def _trace_for(report: "CombinedReport", rank: int | None) -> Trace:
    """The trace whose source shows a finding's line: its rank's, else any rank's."""
    traces = [r.trace for r in report.ranks if r.trace is not None and (rank is None or r.rank == rank)]
    traces = traces or [r.trace for r in report.ranks if r.trace is not None]
    if traces:
        return traces[0]
    return Trace(source=report.source, cell_file=report.script)


def ranks_html(report: "CombinedReport") -> str:
    """The combined report as one HTML fragment: verdict, a row per rank, findings, each rank's report.

    >>> from backward_doctor.report.combined import CombinedReport
    >>> "<th>rank</th>" in ranks_html(CombinedReport(ranks=[RankRecord(0, 1, exitcode=0)], nproc=1))
    True
    """
    from . import sections as S
    from ..report.renderers import renderer

    render_html = renderer("html").render  # (by name: html.py hands combined reports to this module)

    sev = "ok" if report.ok else (report.root_cause.severity if report.root_cause else "error")
    out = [f"<style>{CSS}</style>", '<div class="bd">',
           '<div class="muted" style="font-size:11px">backward_doctor report · distributed run</div>',
           f'<div class="verdict" style="--sev:{sev_color(sev)}"><span class="badge">'
           f'{"OK" if report.ok else "PROBLEM"}</span><div><div class="headline">'
           f"{esc(_verdict(report).split(' - ', 1)[-1])}</div></div></div>",
           '<h3>Ranks</h3><table class="t"><tr><th>rank</th><th>ended</th><th>collectives</th><th>where</th>'
           "<th>error</th></tr>"]
    from ..analysis.distributed import rank_error
    from ..analysis.rank_rules import position

    for r in report.ranks:
        issued = sum(c.count or (1 if c.pending else 0) for c in r.collectives)
        where = position(r)[0] if (r.waiting_in is not None or r.stopped or not r.collectives) else \
            f"last: {r.collectives[-1].label()}"
        out.append(f'<tr><td class="num">{esc(r.rank)}{esc(_placed(report, r))}</td><td>{esc(r.ended())}</td><td class="num">{esc(issued)}</td>'
                   f'<td class="mono">{esc(where)}</td><td class="mono">{esc(rank_error(r)[:300])}</td></tr>')
    out.append("</table>")
    out.append("<h3>Root cause</h3>" if report.findings else '<div class="sub">No findings.</div>')
    for f in report.findings:
        out.append(S.finding_html(Report(findings=[f], trace=_trace_for(report, f.rank)), f, detailed=False))
    for r in report.ranks:
        if r.trace is None:
            continue
        own = Report(findings=[f for f in report.findings if f.rank == r.rank], trace=r.trace,
                     exception=r.trace.exception.summary() if r.trace.exception else None)
        out.append(f"<details><summary>Rank {esc(r.rank)}: its own report</summary>{render_html(own)}</details>")
    out.extend(f'<div class="sub">note: {esc(n)}</div>' for n in report.notes)
    out.append("</div>")
    return neutralise("".join(out), keep="\n\t")
