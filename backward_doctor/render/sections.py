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

import re
from typing import TYPE_CHECKING, Any

from ..analysis.findings import Finding, forward_where
from ..report.places import line_label
from ..trace.records import CATEGORIES, TensorMeta, Trace
from ..util.units import format_bytes, format_us
from .style import CATEGORY_LABELS, COLORS, esc, sev_color
from .workers import workers_html
from .view import (SORT_KEYS, OpRow, _line_label, applicable_fixes, hang_threads, offending_record, op_place, op_rows,
                   phase_counts, source_context, tensor_bytes, used_parameters, verdict_parts)
from .wording import finding_title, fix_code_lines, fix_failed, fix_next_step, frame_label, kind_words, line_role

if TYPE_CHECKING:
    from ..report.fix_result import FixResult
    from ..report.report import Report

def ops_table_html(trace: Trace, group: str = "op", sort: str = "time", limit: int = 25,
                   rows: list[OpRow] | None = None, places: dict[str, str] | None = None) -> str:
    """The top ``limit`` rows of :func:`op_rows` (pass ``rows`` to reuse them across sort orders); the
    "allocated" column only when something in it is not empty."""
    rows = sorted(op_rows(trace, group, places) if rows is None else rows, key=SORT_KEYS.get(sort, SORT_KEYS["time"]))
    total_us = sum(r.time_us for r in rows) or 1.0
    head = {"op": "op", "module": "module", "line": "line"}.get(group, group)
    alloc = any(r.alloc_bytes for r in rows[:limit])
    out = ['<table class="t"><tr>', f"<th>{esc(head)}</th>", '<th class="num">count</th>',
           '<th class="num">time</th>', '<th class="num">% time</th>',
           '<th class="num">allocated</th>' if alloc else "", "</tr>"]
    for r in rows[:limit]:
        cell = f'<td class="num">{esc(format_bytes(r.alloc_bytes)) if r.alloc_bytes else ""}</td>' if alloc else ""
        out.append(f'<tr><td class="mono">{esc(r.name)}</td><td class="num">{r.count:,}</td>'
                   f'<td class="num">{format_us(r.time_us)}</td><td class="num">{100 * r.time_us / total_us:.1f}%</td>'
                   f"{cell}</tr>")
    out.append("</table>")
    if len(rows) > limit:
        out.append(f'<div class="muted">{len(rows) - limit} more rows not shown</div>')
    return "".join(out)


def source_html(trace: Trace, line: int | None, file: str | None, caption: str = "", around: int = 3,
                places: dict[str, str] | None = None) -> str:
    ctx = source_context(trace, line, file, around)
    if not ctx:
        return ""
    cap = caption or line_label(places or {}, line, file)
    rows = "".join(f'<div class="ln{" hit" if n == line else ""}"><span class="no">{n}</span>'
                   f"<span>{esc(text) or ' '}</span></div>" for n, text in ctx)
    return f'<div class="src"><div class="cap">{esc(cap)}</div>{rows}</div>'


def _stats_cells(m: TensorMeta) -> str:
    s = m.stats
    if not s:
        return '<td class="num muted" colspan="5"></td>'
    if s.min is not None:
        vals = "".join(f'<td class="num">{v:.4g}</td>' for v in (s.min, s.max, s.mean))
    else:
        vals = '<td class="num muted" colspan="3">no finite values</td>'
    inf = s.posinf + s.neginf
    nan = s.nan
    return (vals + f'<td class="num{" bad" if nan else ""}">{nan:,}</td>'
            f'<td class="num{" bad" if inf else ""}">{inf:,}</td>')


def tensors_html(ins: list[TensorMeta], outs: list[TensorMeta]) -> str:
    """The op's tensors; a column with nothing in it (no statistics taken, none requiring grad, one
    device) is left out rather than shown empty."""
    if not ins and not outs:
        return ""
    metas = ins + outs
    stats = any(m.stats for m in metas)
    grad = any(m.requires_grad for m in metas)
    device = len({m.device for m in metas}) > 1
    out = ['<table class="t"><tr><th></th><th>shape</th><th>dtype</th>', "<th>device</th>" if device else "",
           "<th>grad</th>" if grad else "", '<th class="num">size</th>',
           '<th class="num">min</th><th class="num">max</th><th class="num">mean</th><th class="num">NaN</th>'
           '<th class="num">Inf</th>' if stats else "", "</tr>"]
    for label, group in (("input", ins), ("output", outs)):
        for i, m in enumerate(group):
            out.append(f"<tr><td>{label} {i}</td><td class='mono'>{esc(list(m.shape))}</td><td>{esc(m.dtype)}</td>"
                       + (f"<td>{esc(m.device)}</td>" if device else "")
                       + (f"<td>{'yes' if m.requires_grad else ''}</td>" if grad else "")
                       + f'<td class="num">{esc(format_bytes(tensor_bytes(m)))}</td>'
                       + (_stats_cells(m) if stats else "") + "</tr>")
    out.append("</table>")
    if not device and metas:
        out.append(f'<div class="muted">all on {esc(metas[0].device)}</div>')
    return "".join(out)


def summary_html(report: "Report") -> str:
    tr = report.trace
    sev, badge, headline, sentence = verdict_parts(report)
    color = sev_color(sev)
    if report.root_cause is not None:
        badge = kind_words(report.root_cause.kind)
    out = [f'<div class="verdict" style="--sev:{color}"><span class="badge">{esc(badge)}</span><div>'
           f'<div class="headline">{esc(headline)}</div>']
    if sentence:
        out.append(f'<div class="sub">{message_html(sentence)}</div>')
    out.append("</div></div>")
    if report.exception:
        first = report.exception.split("\n")[0]
        out.append(f'<div class="exc"><b>The cell raised</b> <code>{esc(first[:600])}</code></div>')
    facts = []
    phases = phase_counts(tr)
    split = ", ".join(f"{n:,} {p}" for p, n in phases.items())
    facts.append(("cell time" if tr.iterations.steps > 1 else "step time", f"{tr.duration_s:.2f} s" if tr.duration_s >= 0.1 else f"{tr.duration_s * 1e3:.0f} ms",
                  f"{tr.op_count:,} ops ({split})" if split else f"{tr.op_count:,} ops", None))
    mem = tr.memory
    cap = mem.limit_bytes or mem.device_total_bytes
    if mem.peak_bytes:
        what = "limit" if mem.limit_bytes else "device"
        sub = f"of {format_bytes(cap)} {what}" if cap else "live tensors"
        frac = mem.peak_bytes / cap if cap else None
        peak = tr.op(mem.peak_index)
        if peak is not None:
            place = op_place(tr, peak, report.places)
            sub += f" · at {peak.op}" + (f" ({place})" if place else f" ({peak.phase})")
        facts.append(("peak memory", format_bytes(mem.peak_bytes), sub, frac))
    if tr.parameters.count:
        p = tr.parameters
        used = used_parameters(tr)  # the models the step ran, not every model in the namespace
        if used is None:
            facts.append(("parameters", format_bytes(p.bytes), f"{p.count} tensors, {p.trainable} trainable", None))
        else:
            facts.append(("parameters", format_bytes(used[2]), f"{used[0]} tensors, {used[1]} trainable, of the "
                          f"models this step ran ({p.count} in the namespace)", None))
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
        rest = "".join(f'<li><b>{esc(finding_title(f))}</b> at {esc(f.location())}</li>'
                       for f in report.findings[1:])
        out.append(f'<div class="sub">Also found:<ul style="margin:2px 0">{rest}</ul></div>')
    for note in tr.notes:
        out.append(f'<div class="muted">note: {esc(note)}</div>')
    return "".join(out)


def _nan_chain(trace: Trace, origin: int, places: dict[str, str] | None = None) -> str:
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
        items.append(f"<li><code>{esc(e.op)}</code> ({esc(e.phase)}) at {esc(_line_label(w, places))}"
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
    places = report.places
    out = [f'<div class="finding" style="--sev:{color}">',
           f'<div><span class="badge" style="--sev:{color}">{esc(kind_words(f.kind))}</span> '
           f'<b>{esc(finding_title(f))}</b> at {esc(f.location())}</div>']
    rec, ins, outs = offending_record(report) if detailed and f is report.root_cause else (None, [], [])
    where_bits = []
    if f.op:
        where_bits.append(f"op <code>{esc(f.op)}</code>")
    if rec is not None:
        where_bits.append(f"{esc(rec.phase)} op #{rec.index:,}" + (f" (<code>{esc(rec.op)}</code>)"
                                                                   if rec.op != f.op else ""))
    if f.module:
        where_bits.append(f"module <code>{esc(f.module)}</code>" + (f" ({esc(f.module_type)})" if f.module_type else ""))
    if where_bits:
        out.append(f'<div class="sub">{" · ".join(where_bits)}</div>')
    out.append(source_html(tr, f.line, f.file, caption=_src_caption(f.line, f.file, line_role(f), places)))
    if rec is not None and rec.phase == "backward":
        fw = forward_where(tr, rec)
        raw = rec.where
        if raw.line is not None and (raw.line, raw.file) not in ((fw.line, fw.file), (f.line, f.file)):
            out.append(source_html(tr, raw.line, raw.file, around=1,
                                   caption=_src_caption(raw.line, raw.file, "where backward ran", places)))
        if (fw.line, fw.file) != (f.line, f.file) and fw.line is not None:
            out.append(source_html(tr, fw.line, fw.file, caption=_src_caption(fw.line, fw.file, "forward line", places)))
    if f.file is not None and f.cell_line and f.cell_line != f.line:
        out.append(source_html(tr, f.cell_line, None, around=1,
                               caption=_src_caption(f.cell_line, None, "called from the cell", places)))
    if detailed and f is report.root_cause:
        out.append(tensors_html(ins, outs))
        if f.kind == "nonfinite":
            ev = next((e for e in tr.nonfinite if e.is_origin and e.reached), None)
            if ev is not None:
                out.append(_nan_chain(tr, ev.origin, places))
        if f.kind == "index_out_of_range" and tr.failed_op and tr.failed_op.index_check:
            ic = tr.failed_op.index_check
            out.append(f'<div>bad values <code>{esc(ic.bad)}</code>, valid range '
                       f'<code>{esc(ic.valid)}</code> ({esc(ic.what)})</div>')
    out.append(f'<div style="margin-top:6px">{message_html(f.message)}</div>')
    ev = f.evidence
    fix = "\n".join(fix_code_lines(f))  # the fix as code, as the user would write it (none: no empty block)
    if fix:
        out.append(f'<div class="src"><pre style="padding:6px 8px">{esc(fix)}</pre></div>')
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
        out.append(_threads_html(tr, places))
    if f.kind == "dataloader_worker" and tr.loaders:
        out.append(workers_html(tr, places))
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


def _src_caption(line: int | None, file: str | None, what: str, places: dict[str, str] | None = None) -> str:
    """``root cause: Cell In[2], line 12``; a file the frontend did not name (a library's) with its path after it,
    never a kernel's temporary file beside the name IPython gives it."""
    named = (places or {}).get("" if file is None else file)
    label = line_label(places or {}, line, file).replace(":", ", line ") if not named else \
        line_label(places or {}, line, file)
    if file is None and not named:
        label = f"cell, line {line}"
    return f"{what}: {label}" + (f"  ({file})" if file and not named else "")


_CODE_SPAN = re.compile(r"`([^`]+)`")


def message_html(message: str) -> str:
    """The teaching message with `code` spans as <code> (escaped first)."""
    return _CODE_SPAN.sub(lambda m: f"<code>{m.group(1)}</code>", esc(message))


def _threads_html(tr: Trace, places: dict[str, str] | None = None) -> str:
    """The stacks of the threads that ran the user's code (the main one always); the kernel's own
    threads (Heartbeat, IOPub, ...) folded to their names."""
    shown, folded = hang_threads(tr)
    out = ["<div><b>Thread stacks when it hung</b> (innermost last)</div>"]
    for st in shown[:8]:
        rows = "".join(f"<div>{esc(frame_label(fi, places))} in "
                       f"{esc(fi.function)}: <code>{esc(fi.code)}</code></div>" for fi in st.frames[-8:])
        if not st.frames:
            rows = '<div class="muted">no Python frames were seen in this thread</div>'
        out.append(f'<div class="src"><div class="cap">{esc(st.name)}{" (main)" if st.is_main else ""}</div>'
                   f'<div style="padding:2px 8px">{rows}</div></div>')
    if folded:
        out.append(f'<div class="muted">Library threads that never ran your code: {esc(", ".join(folded[:6]))}'
                   f'{", …" if len(folded) > 6 else ""}</div>')
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

    # Better or worse only between two runs that both finished: a "before" that failed in forward never
    # made its gradients, so "0 B -> 222 KiB" of gradients is not the fix making things worse.
    judged = before.get("completed", True) is not False and after.get("completed", True) is not False

    def row(label: str, b: Any, a: Any, fmt, better_lower: bool = True) -> None:
        if b is None and a is None:
            return
        cls = ""
        if judged and isinstance(b, (int, float)) and isinstance(a, (int, float)) and b != a:
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
    b_head = "before" if before.get("completed", True) is not False else "before (until it failed)"
    a_head = "after" if after.get("completed", True) is not False else "after (until it failed)"
    out = ['<table class="t" style="width:auto;min-width:360px"><tr><th></th>'
           f'<th class="num">{b_head}</th><th class="num">{a_head}</th></tr>', *rows, "</table>"]
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
    """(verdict, comparison table, diff) of a fix result, as HTML. A fix whose re-run did not complete is
    red and says what to try next; only one that worked is "after the fix" in green."""
    name = result.name
    msg = result.message
    if fix_failed(result):
        color, badge, headline = COLORS["error"], "did not work", f"{name} did not fix the step"
    elif result.cancelled:
        color, badge, headline = COLORS["warning"], "cancelled", name
    elif result.applied and result.slowdown:  # it fits, at a price the person should weigh
        color, badge = COLORS["warning"], "fits, but slow"
        headline = f"{name}: the step ran, ops up to {result.slowdown:g}x slower"
    elif result.applied:
        color, badge, headline = COLORS["ok"], "after the fix", f"{name}: the step ran"
    else:
        color, badge, headline = COLORS["warning"], "not applied", f"{name} could not be applied"
    nxt = fix_next_step(result)
    head = (f'<div class="verdict bd-fix-verdict{" bd-fix-failed" if fix_failed(result) else ""}" '
            f'style="--sev:{color}"><span class="badge">{esc(badge)}</span><div>'
            f'<div class="headline">{esc(headline)}</div><div class="sub">{message_html(msg)}</div>'
            + (f'<div class="bd-next"><b>Next:</b> {message_html(nxt)}</div>' if nxt else "") + "</div></div>")
    return head, comparison_html(result), diff_html(result.diff)


