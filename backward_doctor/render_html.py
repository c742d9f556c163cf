"""Simple static HTML report (the widget panel comes later); all user text escaped.

>>> from backward_doctor.report import Report
>>> "OK" in render_html(Report())
True
"""
from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from .findings import source_line
from .render_text import summary_line

if TYPE_CHECKING:
    from .report import Report

_COLORS = {"error": "#b00020", "warning": "#b26a00", "info": "#0b5cad", "ok": "#1b7f3b"}


def render_html(report: "Report") -> str:
    tr = report.trace
    if report.ok:
        head = f'<b style="color:{_COLORS["ok"]}">backward_doctor: OK</b> - the step ran and nothing looks wrong'
    else:
        top = report.findings[0] if report.findings else None
        color = _COLORS.get(top.severity if top else "error", _COLORS["error"])
        verdict = escape(f"{top.kind} at {top.location()}") if top else "the step did not complete"
        head = f'<b style="color:{color}">backward_doctor: PROBLEM</b> - {verdict}'
    parts = [f'<div class="backward-doctor" style="font-family:sans-serif;font-size:13px">',
             f"<div>{head}</div>", f'<div style="color:#555">{escape(summary_line(report))}</div>']
    if report.exception:
        parts.append(f"<div><code>{escape(report.exception.splitlines()[0])}</code></div>")
    for f in report.findings:
        code = source_line(tr, f.line, f.file)
        parts.append('<div style="margin:8px 0;padding:6px 10px;border-left:4px solid '
                     f'{_COLORS.get(f.severity, "#b00020")}">')
        parts.append(f"<div><b>{escape(f.kind)}</b> at {escape(f.location())}"
                     f"{' - ' + escape(f.title) if f.title else ''}</div>")
        if code:
            parts.append(f"<pre style='margin:4px 0;background:#f6f6f6'>{f.line:>4} | {escape(code)}</pre>")
        if f.op:
            parts.append(f"<div>op: <code>{escape(f.op)}</code></div>")
        parts.append(f"<div>{escape(f.message)}</div>")
        if f.fixes:
            parts.append(f"<div>fixes: {escape(', '.join(f.fixes))}</div>")
        parts.append("</div>")
    parts.append("</div>")
    return "\n".join(parts)
