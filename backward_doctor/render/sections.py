"""The report's sections as HTML fragments, shared by the static page and the widget panel.

Pure functions of a :class:`~backward_doctor.report.Report` (no IPython, no widgets, no
matplotlib). Everything that comes from the user's code, source lines, names, messages,
shapes, is escaped with :func:`esc`; a cell holding ``</script>`` shows as text.

>>> from backward_doctor.report import Report
>>> "OK" in summary_html(Report())
True
>>> esc("</script><script>alert(1)</script>")
'&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;'
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from ..analysis.findings import Finding, forward_where
from ..trace.records import CATEGORIES, TensorMeta, Trace
from ..util.units import format_bytes, format_us
from .style import CATEGORY_LABELS, COLORS, esc, sev_color
from .view import (SORT_KEYS, OpRow, _line_label, applicable_fixes, offending_record, op_rows, phase_counts,
                   source_context, tensor_bytes, verdict_parts)

if TYPE_CHECKING:
    from ..report.fix_result import FixResult
    from ..report.report import Report

def ops_table_html(trace: Trace, group: str = "op", sort: str = "time", limit: int = 25,
                   rows: list[OpRow] | None = None) -> str:
    """The top ``limit`` rows of :func:`op_rows` (pass ``rows`` to reuse them across sort orders)."""
    rows = sorted(op_rows(trace, group) if rows is None else rows, key=SORT_KEYS.get(sort, SORT_KEYS["time"]))
    total_us = sum(r.time_us for r in rows) or 1.0
    head = {"op": "op", "module": "module", "line": "line"}.get(group, group)
    out = ['<table class="t"><tr>', f"<th>{esc(head)}</th>", '<th class="num">count</th>',
           '<th class="num">time</th>', '<th class="num">% time</th>', '<th class="num">allocated</th></tr>']
    for r in rows[:limit]:
        out.append(f'<tr><td class="mono">{esc(r.name)}</td><td class="num">{r.count:,}</td>'
                   f'<td class="num">{format_us(r.time_us)}</td><td class="num">{100 * r.time_us / total_us:.1f}%</td>'
                   f'<td class="num">{esc(format_bytes(r.alloc_bytes)) if r.alloc_bytes else ""}</td></tr>')
    out.append("</table>")
    if len(rows) > limit:
        out.append(f'<div class="muted">{len(rows) - limit} more rows not shown</div>')
    return "".join(out)


def source_html(trace: Trace, line: int | None, file: str | None, caption: str = "", around: int = 3) -> str:
    ctx = source_context(trace, line, file, around)
    if not ctx:
        return ""
    where = "the cell" if file is None else file
    cap = caption or f"{where}, line {line}"
    rows = "".join(f'<div class="ln{" hit" if n == line else ""}"><span class="no">{n}</span>'
                   f"<span>{esc(text) or ' '}</span></div>" for n, text in ctx)
    return f'<div class="src"><div class="cap">{esc(cap)}</div>{rows}</div>'


def _stats_cells(m: TensorMeta) -> str:
    s = m.stats
    if not s:
        return '<td class="num muted" colspan="5">not recorded</td>'
    if s.min is not None:
        vals = "".join(f'<td class="num">{v:.4g}</td>' for v in (s.min, s.max, s.mean))
    else:
        vals = '<td class="num muted" colspan="3">no finite values</td>'
    inf = s.posinf + s.neginf
    nan = s.nan
    return (vals + f'<td class="num{" bad" if nan else ""}">{nan:,}</td>'
            f'<td class="num{" bad" if inf else ""}">{inf:,}</td>')


def tensors_html(ins: list[TensorMeta], outs: list[TensorMeta]) -> str:
    if not ins and not outs:
        return ""
    out = ['<table class="t"><tr><th></th><th>shape</th><th>dtype</th><th>device</th><th>grad</th>'
           '<th class="num">size</th><th class="num">min</th><th class="num">max</th><th class="num">mean</th>'
           '<th class="num">NaN</th><th class="num">Inf</th></tr>']
    for label, metas in (("input", ins), ("output", outs)):
        for i, m in enumerate(metas):
            out.append(f"<tr><td>{label} {i}</td><td class='mono'>{esc(list(m.shape))}</td><td>{esc(m.dtype)}</td>"
                       f"<td>{esc(m.device)}</td><td>{'yes' if m.requires_grad else ''}</td>"
                       f'<td class="num">{esc(format_bytes(tensor_bytes(m)))}</td>{_stats_cells(m)}</tr>')
    out.append("</table>")
    return "".join(out)


def summary_html(report: "Report") -> str:
    tr = report.trace
    sev, badge, headline, sentence = verdict_parts(report)
    color = sev_color(sev)
    out = [f'<div class="verdict" style="--sev:{color}"><span class="badge">{esc(badge)}</span><div>'
           f'<div class="headline">{esc(headline)}</div>']
    if sentence:
        out.append(f'<div class="sub">{_message_html(sentence)}</div>')
    out.append("</div></div>")
    if report.exception:
        first = report.exception.split("\n")[0]
        out.append(f'<div class="exc"><b>The cell raised</b> <code>{esc(first[:600])}</code></div>')
    facts = []
    phases = phase_counts(tr)
    split = ", ".join(f"{n:,} {p}" for p, n in phases.items())
    facts.append(("step time", f"{tr.duration_s:.2f} s" if tr.duration_s >= 0.1 else f"{tr.duration_s * 1e3:.0f} ms",
                  f"{tr.op_count:,} ops ({split})" if split else f"{tr.op_count:,} ops", None))
    mem = tr.memory
    cap = mem.limit_bytes or mem.device_total_bytes
    if mem.peak_bytes:
        what = "limit" if mem.limit_bytes else "device"
        sub = f"of {format_bytes(cap)} {what}" if cap else "live tensors"
        frac = mem.peak_bytes / cap if cap else None
        peak = tr.op(mem.peak_index)
        if peak is not None:
            w = forward_where(tr, peak) if peak.phase == "backward" else peak.where
            sub += f" · at {peak.op} ({peak.phase}), {_line_label(w).replace('cell line', 'line')}"
        facts.append(("peak memory", format_bytes(mem.peak_bytes), sub, frac))
    if tr.parameters.count:
        p = tr.parameters
        facts.append(("parameters", format_bytes(p.bytes), f"{p.count} tensors, {p.trainable} trainable", None))
    fixes = applicable_fixes(report)
    out.append('<div class="facts">')
    for k, v, sub, frac in facts:
        gauge = ""
        if frac is not None:
            col = COLORS["error"] if frac > 1 else COLORS["warning"] if frac > 0.85 else COLORS["ok"]
            gauge = (f'<div class="gauge"><div style="width:{min(100.0, 100 * frac):.1f}%;background:{col}">'
                     f"</div></div>")
        out.append(f'<div class="fact"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div>'
                   f'<div class="sub">{esc(sub)}</div>{gauge}</div>')
    if fixes:
        chips = "".join(f'<span class="chip">{esc(fx.arg)}</span>' for fx in fixes)
        out.append(f'<div class="fact"><div class="k">fixes that apply</div><div>{chips}</div></div>')
    out.append("</div>")
    if len(report.findings) > 1:
        rest = "".join(f'<li><b>{esc(f.title or f.kind)}</b> at {esc(f.location())}</li>'
                       for f in report.findings[1:])
        out.append(f'<div class="sub">Also found:<ul style="margin:2px 0">{rest}</ul></div>')
    for note in tr.notes:
        out.append(f'<div class="muted">note: {esc(note)}</div>')
    return "".join(out)


def _nan_chain(trace: Trace, origin: int) -> str:
    evs = [e for e in trace.nonfinite if e.origin == origin and not e.is_origin]
    if not evs:
        return ""
    items, seen = [], set()
    for e in evs:
        w = forward_where(trace, trace.op(e.index)) if e.phase == "backward" else e.where
        key = (e.op, w.line, e.phase)
        if key in seen:
            continue
        seen.add(key)
        items.append(f"<li><code>{esc(e.op)}</code> ({esc(e.phase)}) at {esc(_line_label(w))}"
                     f"{' in ' + esc(w.module) if w.module else ''}</li>")
        if len(items) >= 8:
            break
    more = len(evs) - len(items)
    tail = f'<li class="muted">… {more} more ops carried it</li>' if more > 0 else ""
    reached = [k for k, v in trace.nonfinite_reached.items() if v]
    end = f"<li><b>reached: {esc(', '.join(reached))}</b></li>" if reached else ""
    return f'<div><b>How it spread</b><ul class="chain">{"".join(items)}{tail}{end}</ul></div>'


def finding_html(report: "Report", f: Finding, detailed: bool = True) -> str:
    """One finding: where, the source in context, the op's tensors, and the teaching message."""
    tr = report.trace
    color = sev_color(f.severity)
    out = [f'<div class="finding" style="--sev:{color}">',
           f'<div><span class="badge" style="--sev:{color}">{esc(f.kind)}</span> '
           f'<b>{esc(f.title or f.kind)}</b> at {esc(f.location())}</div>']
    rec, ins, outs = offending_record(report) if detailed and f is report.root_cause else (None, [], [])
    where_bits = []
    if f.op:
        where_bits.append(f"op <code>{esc(f.op)}</code>")
    if rec is not None:
        where_bits.append(f"{esc(rec.phase)} op #{rec.index:,}" + (f" (<code>{esc(rec.op)}</code>)"
                                                                   if rec.op != f.op else ""))
    if f.module:
        where_bits.append(f"module <code>{esc(f.module)}</code>")
    if where_bits:
        out.append(f'<div class="sub">{" · ".join(where_bits)}</div>')
    out.append(source_html(tr, f.line, f.file, caption=_src_caption(f.line, f.file, "root cause")))
    if rec is not None and rec.phase == "backward":
        fw = forward_where(tr, rec)
        raw = rec.where
        if raw.line is not None and (raw.line, raw.file) not in ((fw.line, fw.file), (f.line, f.file)):
            out.append(source_html(tr, raw.line, raw.file, around=1,
                                   caption=_src_caption(raw.line, raw.file, "where backward ran")))
        if (fw.line, fw.file) != (f.line, f.file) and fw.line is not None:
            out.append(source_html(tr, fw.line, fw.file, caption=_src_caption(fw.line, fw.file, "forward line")))
    if f.file is not None and f.cell_line and f.cell_line != f.line:
        out.append(source_html(tr, f.cell_line, None, around=1,
                               caption=_src_caption(f.cell_line, None, "called from the cell")))
    if detailed and f is report.root_cause:
        out.append(tensors_html(ins, outs))
        if f.kind == "nonfinite":
            ev = next((e for e in tr.nonfinite if e.is_origin and e.reached), None)
            if ev is not None:
                out.append(_nan_chain(tr, ev.origin))
        if f.kind == "index_out_of_range" and tr.failed_op and tr.failed_op.index_check:
            ic = tr.failed_op.index_check
            out.append(f'<div>bad values <code>{esc(ic.bad)}</code>, valid range '
                       f'<code>{esc(ic.valid)}</code> ({esc(ic.what)})</div>')
    out.append(f'<div style="margin-top:6px">{_message_html(f.message)}</div>')
    ev = f.evidence
    out.append(loop_plot_html(tr, f))
    if f.kind == "oom" and ev.get("predicted_peak_text"):
        limit = ev.get("limit")
        cells = []
        for k, v in ev["predicted_peak_text"].items():
            raw = ev.get("predicted_peak", {}).get(k)
            cls = "good" if limit and raw is not None and raw <= limit else "bad" if limit else ""
            cells.append(f'<span class="chip {cls}">{esc(k)}: {esc(v)}</span>')
        out.append(f'<div class="sub">Predicted peak (lower bound): {"".join(cells)}</div>')
    if f.kind == "hang" and tr.threads:
        out.append(_threads_html(tr))
    out.append("</div>")
    return "".join(out)


def loop_plot_html(trace: Trace, f: Finding) -> str:
    """The loop's history behind a finding: loss and gradient norm before the first NaN/Inf, or live
    memory per iteration for graphs kept across iterations ('' for other findings)."""
    from .svg_plots import loop_series_svg

    ev, its = f.evidence, trace.iterations
    if f.kind == "nonfinite" and ev.get("history") and its.first_nonfinite is not None:
        change = (ev.get("lr_change") or {}).get("iteration")
        svg = loop_series_svg(trace, "nan", upto=its.first_nonfinite, mark=its.first_nonfinite, change=change)
        caption = "loss and gradient norm per iteration, up to the first NaN/Inf"
    elif f.kind == "graph_leak" and ev.get("growth") and its.live_bytes:
        svg = loop_series_svg(trace, "memory")
        caption = "live memory at the end of each iteration"
    else:
        return ""
    return f'<div class="sub" style="margin-top:6px">{esc(caption)}</div>{svg}'


def _src_caption(line: int | None, file: str | None, what: str) -> str:
    return f"{what}: {'cell' if file is None else os.path.basename(file)}, line {line}" + \
        (f"  ({file})" if file else "")


_CODE_SPAN = re.compile(r"`([^`]+)`")


def _message_html(message: str) -> str:
    """The teaching message with `code` spans as <code> (escaped first)."""
    return _CODE_SPAN.sub(lambda m: f"<code>{m.group(1)}</code>", esc(message))


def _threads_html(tr: Trace) -> str:
    out = ["<div><b>Thread stacks when it hung</b> (innermost last)</div>"]
    for st in tr.threads[:8]:
        rows = "".join(f"<div>{esc('cell' if fi.in_cell else os.path.basename(fi.file))}:{fi.line} in "
                       f"{esc(fi.function)}: <code>{esc(fi.code)}</code></div>" for fi in st.frames[-8:])
        out.append(f'<div class="src"><div class="cap">{esc(st.name)}{" (main)" if st.is_main else ""}</div>'
                   f'<div style="padding:2px 8px">{rows}</div></div>')
    return "".join(out)


def findings_html(report: "Report") -> str:
    if not report.findings:
        return '<div class="sub">No findings.</div>'
    return "".join(finding_html(report, f, detailed=i == 0) for i, f in enumerate(report.findings))


def comparison_html(result: "FixResult") -> str:
    """Before/after table of a fix result (``report.fix_result``)."""
    comp = result.comparison or {}
    before, after = comp.get("before") or {}, comp.get("after") or {}
    rows = []

    def row(label: str, b: Any, a: Any, fmt, better_lower: bool = True) -> None:
        if b is None and a is None:
            return
        cls = ""
        if isinstance(b, (int, float)) and isinstance(a, (int, float)) and b != a:
            cls = "good" if (a < b) == better_lower else "bad"
        rows.append(f"<tr><td>{esc(label)}</td><td class='num'>{esc(fmt(b))}</td>"
                    f"<td class='num {cls}'>{esc(fmt(a))}</td></tr>")

    row("peak memory", before.get("peak_bytes"), after.get("peak_bytes"), format_bytes)
    pb, pa = before.get("peak_by_category") or {}, after.get("peak_by_category") or {}
    for c in CATEGORIES:
        if pb.get(c) or pa.get(c):
            row(f"  {CATEGORY_LABELS[c]}", pb.get(c), pa.get(c), format_bytes)
    row("step time", before.get("step_s"), after.get("step_s"), lambda v: "—" if v is None else f"{v:.3f} s")
    row("loss", before.get("loss"), after.get("loss"), lambda v: "—" if v is None else f"{v:.6g}", better_lower=False)
    err = comp.get("grad_max_rel_err")
    out = ['<table class="t" style="width:auto;min-width:360px"><tr><th></th><th class="num">before</th>'
           '<th class="num">after</th></tr>', *rows, "</table>"]
    if err is not None:
        ok = err < 1e-3
        out.append(f'<div>Gradients vs. the original step: max relative error '
                   f'<span class="{"good" if ok else "bad"}">{err:.2e}</span></div>')
    return "".join(out)


def diff_html(diff: str) -> str:
    if not diff:
        return ""
    rows = []
    for line in diff.splitlines():
        cls = "hunk" if line.startswith("@@") else "add" if line.startswith("+") and not line.startswith("+++") \
            else "del" if line.startswith("-") and not line.startswith("---") else ""
        rows.append(f'<div class="{cls}">{esc(line) or " "}</div>')
    return f'<div class="diff">{"".join(rows)}</div>'


def fix_result_parts(result: "FixResult") -> tuple[str, str, str]:
    """(verdict, comparison table, diff) of a fix result, as HTML."""
    name = result.name
    applied = result.applied
    msg = result.message
    cancelled = result.cancelled
    fits = result.fits
    color = COLORS["ok"] if applied and fits is not False else COLORS["warning"]
    badge = "cancelled" if cancelled else "after the fix" if applied else "not applied"
    head = (f'<div class="verdict" style="--sev:{color}"><span class="badge">{esc(badge)}</span><div>'
            f'<div class="headline">{esc(name)}</div><div class="sub">{esc(msg)}</div></div></div>')
    return head, comparison_html(result), diff_html(result.diff)


