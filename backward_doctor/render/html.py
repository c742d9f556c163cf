"""The static HTML report: the panel's sections in one self-contained file.

Plots are PNGs embedded as data URIs, the graph is inline SVG, styles are inline; no
script, no CDN, nothing fetched, so it renders the same in a notebook output, on
nbviewer and from a CI artifact. Everything from the user's code is escaped.

>>> from backward_doctor.report import Report
>>> "The step ran and nothing looks wrong" in render_html(Report())
True
>>> "<script>" in render_page(Report(trace=__import__("backward_doctor").Trace(source="</script><script>")))
False
"""
from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING

from ..report.renderers import Renderer, register
from ..util.units import format_bytes
from . import sections as S, style, view, wording
from .style import esc, neutralise

if TYPE_CHECKING:
    from ..report.fix_result import FixResult
    from ..report.report import Report

log = logging.getLogger(__name__)

#: Composite modules drawn open under the graph (their insides), at most.
MAX_INNER_GRAPHS = 8


def png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _img(data: bytes, alt: str) -> str:
    return f'<img class="plot" alt="{esc(alt)}" src="{png_uri(data)}">'


def memory_section(report: "Report") -> str:
    tr = report.trace
    if not tr.memory.op_index:
        if wording.unrecorded(tr):
            return ('<div class="sub">No memory timeline: the ops ran with the recorder asleep (always on records '
                    'them only within its cost budget).</div>')
        return '<div class="sub">No memory was recorded (no op ran).</div>'
    from . import svg_plots

    data, how = view.memory_by_module(tr)
    return (svg_plots.memory_timeline_svg(tr, places=report.places)
            + f'<details><summary>Memory by module {esc(how)}</summary>'
            f"{svg_plots.memory_by_module_svg(tr, data=(data, how))}</details>")


def graph_section(report: "Report") -> str:
    from .graph import build_graph
    from .graph_svg import legend_html

    g = build_graph(report.trace, report)
    expanded = g.auto_expanded()
    out = [legend_html(), f'<div class="graph">{g.render_svg(expanded)}</div>']
    inner = g.expandable(expanded)
    target = g._highlight_path() or ""
    inner.sort(key=lambda m: not (target == m or target.startswith(m + ".")))
    for m in inner[:MAX_INNER_GRAPHS]:
        out.append(f"<details><summary>Inside <code>{esc(m)}</code></summary>"
                   f'<div class="graph">{g.render_svg(expanded | {m}, within=m)}</div></details>')
    if len(inner) > MAX_INNER_GRAPHS:
        out.append(f'<div class="muted">{len(inner) - MAX_INNER_GRAPHS} more modules can be opened in the '
                   "notebook panel.</div>")
    return "".join(out)


def ops_section(report: "Report") -> str:
    tr = report.trace
    if not tr.ops:
        return '<div class="sub">No ops were recorded.</div>'
    by_op = view.op_rows(tr, "op")
    return (S.ops_table_html(tr, "op", "time", 15, rows=by_op) +
            "<details><summary>Ops by memory allocated</summary>" + S.ops_table_html(tr, "op", "memory", 15, by_op) +
            "</details><details><summary>Modules by time</summary>" + S.ops_table_html(tr, "module", "time", 20) +
            "</details><details><summary>Lines by time</summary>" +
            S.ops_table_html(tr, "line", "time", 20, places=report.places) + "</details>")


def fixes_section(report: "Report") -> str:
    out = []
    result = getattr(report, "fix_result", None)
    if result is not None:
        out.append(fix_after_html(result))
    opts = view.applicable_fixes(report)
    if opts:
        rows = []
        for o in opts:
            pred = f"predicted peak ≥ {esc(format_bytes(o.predicted))}" if o.predicted else ""
            rows.append(f"<tr><td><code>{esc(o.arg)}</code></td><td><b>{esc(o.title)}</b><br>"
                        f'<span class="sub">{esc(o.description)}</span></td><td class="num">{pred}</td></tr>')
        out.append('<table class="t">' + "".join(rows) + "</table>")
        first = opts[0].arg
        out.append(f'<div class="sub">Try one in the notebook with the panel\'s buttons, or '
                   f'<code>%%backward_doctor --fix {esc(first)}</code>, or '
                   f'<code>bd.diagnose(source, namespace, fix="{esc(first)}")</code>.</div>')
    elif result is None:
        out.append('<div class="sub">No one-click fix applies to this report.</div>')
    out.append(refused_html(report))
    return "".join(out)


def refused_html(report: "Report") -> str:
    """The fixes the findings name that cannot be applied to this cell, each with the reason ('' if none)."""
    refused = view.refused_fixes(report)
    if not refused:
        return ""
    items = "".join(f"<li><code>{esc(name)}</code>: {S.message_html(why)}</li>" for name, why in refused)
    return f'<div class="sub bd-refused">Not offered for this cell:<ul>{items}</ul></div>'


def fix_after_html(result: "FixResult", with_code: bool = True) -> str:
    """The after-view of a fix: verdict, comparison table beside the bars, warnings, diff, code to keep."""
    comp = result.comparison or {}
    plot = ""
    if comp.get("before") and comp.get("after"):
        try:
            from . import plots

            original = result.original
            limit = (original.get("trace", {}).get("memory", {}).get("limit_bytes")
                     if isinstance(original, dict) else None)
            plot = _img(plots.comparison_png(comp["before"], comp["after"], limit=limit), "before and after")
        except ImportError:
            pass
    head, table, diff = S.fix_result_parts(result)
    out = [head, '<div style="display:flex;flex-wrap:wrap;gap:16px;align-items:center">'
           f'<div style="flex:0 0 auto">{table}</div><div style="flex:1 1 380px;max-width:600px">{plot}</div></div>']
    for w in result.warnings or []:
        out.append(f'<div class="sub">⚠ {esc(w)}</div>')
    elsewhere = result.elsewhere or {}
    if elsewhere and result.applied:  # knobs an earlier cell built: the edit is there, the run set them live
        out.append(elsewhere_html(elsewhere))
    elif diff:
        out.append("<div><b>The change</b></div>" + diff)
    code = result.code
    if code and with_code and result.applied and result.fits:  # a fix that did not work is no code to keep
        out.append(f'<div><b>Code to keep</b></div><div class="src"><pre style="padding:6px 8px">{esc(code)}</pre></div>')
    return "".join(out)


def elsewhere_html(elsewhere: dict) -> str:
    """Where a library's knobs were built (an earlier cell): the edit there, as a diff named as IPython names
    the cell, or, where that cell was not found, the assignment on the live object.

    >>> "Cell In[3], line 5" in elsewhere_html({"place": "Cell In[3], line 5", "setting": "bf16=True", "diff": ""})
    True
    """
    if not elsewhere.get("place"):
        return (f'<div><b>The change</b> <span class="sub">the cell that built these arguments is not in this '
                f'kernel\'s input history: set them on the live object</span></div><div class="src"><pre '
                f'style="padding:6px 8px">{esc(elsewhere.get("live") or "")}</pre></div>')
    return (f'<div><b>The change, where the arguments are built</b> <code>{esc(elsewhere["place"])}</code>: '
            f'<code>{esc(elsewhere.get("setting") or "")}</code></div>' + S.diff_html(elsewhere.get("diff") or "")
            + '<div class="sub">Or insert the code below as a new cell: it sets them on the live objects and '
              "runs the cell again, as the doctor measured it.</div>")


def render_html(report: "Report") -> str:
    """The report as one HTML fragment (``<style>`` scoped to ``.bd``); a distributed run's combined
    report as its ranks' table and findings (``ranks.py``)."""
    if hasattr(report, "ranks"):
        from .ranks import ranks_html

        return ranks_html(report)
    tr = report.trace
    parts = [f"<style>{style.CSS}</style>", '<div class="bd">',
             '<div class="muted" style="font-size:11px">backward_doctor report</div>', S.summary_html(report)]
    sections = [("Memory timeline", memory_section), ("Root cause" if report.findings else "Findings",
                                                      lambda r: S.findings_html(r)),
                ("Autograd graph by module", graph_section), ("Ops", ops_section), ("Fixes", fixes_section)]
    if getattr(report, "fix_result", None) is not None:  # a fixed run: what the fix did comes first
        sections.insert(0, sections.pop())
    for title, fn in sections:
        try:
            body = fn(report)
        except Exception as exc:  # a section that cannot be drawn must not hide the others
            log.warning("report section %r could not be drawn", title, exc_info=True)
            body = f'<div class="bad">This section could not be drawn: {esc(type(exc).__name__)}: {esc(exc)}</div>'
        parts.append(f"<h3>{esc(title)}</h3>{body}")
    parts.append(f'<div class="muted bd-footer" style="margin-top:10px;font-size:11px">torch {esc(tr.torch_version)} · '
                 f"device {esc(tr.device)} · {tr.op_count:,} ops recorded by {esc(wording.recorder_words(report))}"
                 "</div></div>")
    return neutralise("".join(parts), keep="\n\t")  # (every value went through esc: this is the second lock)


def render_page(report: "Report", title: str = "backward_doctor report") -> str:
    """A complete, self-contained HTML document (what ``report.save_html`` writes)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
            "<style>body{margin:16px;background:#fff}</style></head><body>"
            f"{render_html(report)}</body></html>\n")


@register
class HtmlRenderer(Renderer):
    """``report.to_html()``: one self-contained fragment (what notebooks display)."""

    name, suffix = "html", ".html"

    def render(self, report: "Report") -> str:
        return render_html(report)


@register
class PageRenderer(Renderer):
    """``report.save_html(path)``: a whole HTML document."""

    name, suffix = "page", ".html"

    def render(self, report: "Report") -> str:
        return render_page(report)
