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

import difflib
import html
import linecache
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from ..analysis.findings import Finding, forward_where
from ..capture.stats import format_stats
from ..trace.records import CATEGORIES, OpRecord, TensorMeta, Trace, Where
from ..util.units import format_bytes, format_us

if TYPE_CHECKING:
    from ..report.report import Report

COLORS = {"error": "#c62828", "warning": "#b26a00", "info": "#1565c0", "ok": "#2e7d32"}
#: Colours of the memory categories (plots and HTML legends use the same).
CATEGORY_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#76b7b2",
                   "activations": "#e15759", "other": "#bab0ac"}
CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
                   "activations": "saved activations", "other": "other"}

FIX_INFO = {
    "accumulate": ("Gradient accumulation",
                   "Split the batch into k micro-batches and step once: the same effective batch, "
                   "about 1/k of the activations."),
    "amp": ("Mixed precision (AMP)",
            "Run forward under autocast: 16-bit activations, fp32 master weights."),
    "checkpoint": ("Activation checkpointing",
                   "Keep activations only at module boundaries and recompute the rest in backward."),
    "sync": ("Synchronous replay",
             "Re-run with synchronous kernel launches to find the op that really failed."),
}

CSS = """
.bd{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 font-size:13px;line-height:1.45;color:#1f2328;background:#fff;max-width:1100px}
.bd *{box-sizing:border-box}
.bd h3{font-size:14px;margin:14px 0 6px;color:#1f2328;border-bottom:1px solid #e5e7eb;padding-bottom:3px}
.bd code,.bd pre,.bd .mono{font-family:"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:12px}
.bd pre{margin:0;white-space:pre-wrap;word-break:break-word}
.bd .verdict{display:flex;align-items:flex-start;gap:10px;padding:10px 12px;border-radius:6px;
 border-left:6px solid var(--sev);background:#fafafa}
.bd .badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-weight:600;
 font-size:11px;text-transform:uppercase;letter-spacing:.03em;background:var(--sev);white-space:nowrap}
.bd .headline{font-size:15px;font-weight:600}
.bd .sub{color:#57606a}
.bd .facts{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:8px;margin:10px 0}
.bd .fact{border:1px solid #e5e7eb;border-radius:6px;padding:6px 10px;background:#fff}
.bd .fact .k{color:#57606a;font-size:11px;text-transform:uppercase;letter-spacing:.04em}
.bd .fact .v{font-size:15px;font-weight:600}
.bd .gauge{height:6px;background:#eef0f3;border-radius:3px;margin-top:4px;overflow:hidden}
.bd .gauge>div{height:6px;border-radius:3px}
.bd .exc{background:#fff5f5;border:1px solid #f3c2c2;border-radius:6px;padding:6px 10px;margin:8px 0}
.bd .chip{display:inline-block;border:1px solid #d0d7de;border-radius:12px;padding:1px 9px;margin:2px 4px 2px 0;
 background:#f6f8fa;font-size:12px}
.bd .finding{border-left:4px solid var(--sev);padding:4px 10px;margin:8px 0;background:#fcfcfc}
.bd .src{border:1px solid #e5e7eb;border-radius:6px;overflow:hidden;margin:6px 0}
.bd .src .cap{background:#f6f8fa;color:#57606a;padding:2px 8px;font-size:11px;border-bottom:1px solid #e5e7eb}
.bd .src .ln{display:flex;white-space:pre;font-family:"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;
 font-size:12px;padding:0 8px}
.bd .src .ln .no{color:#8c959f;min-width:3.2em;text-align:right;padding-right:10px;user-select:none}
.bd .src .ln.hit{background:#fff1c2;font-weight:600}
.bd .src .ln.hit .no{color:#8a6d00}
.bd table.t{border-collapse:collapse;margin:6px 0;width:100%}
.bd table.t th{text-align:left;font-weight:600;color:#57606a;border-bottom:1px solid #d0d7de;padding:3px 8px;
 font-size:12px;white-space:nowrap}
.bd table.t td{border-bottom:1px solid #f0f1f3;padding:3px 8px;vertical-align:top}
.bd table.t td.num,.bd table.t th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.bd table.t tr.hit td{background:#fff1c2}
.bd .bad{color:#c62828;font-weight:600}
.bd .good{color:#2e7d32;font-weight:600}
.bd .muted{color:#8c959f}
.bd .diff{border:1px solid #e5e7eb;border-radius:6px;padding:4px 0;margin:6px 0;overflow-x:auto}
.bd .diff div{white-space:pre;padding:0 8px;font-family:"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;
 font-size:12px}
.bd .diff .add{background:#e6ffec}.bd .diff .del{background:#ffebe9}.bd .diff .hunk{color:#8250df;background:#f6f8fa}
.bd .chain{margin:4px 0;padding-left:0;list-style:none}
.bd .chain li{margin:2px 0}
.bd .chain li:before{content:"\\2192 ";color:#8c959f}
.bd .legend span{display:inline-block;margin-right:12px;font-size:12px}
.bd .legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;vertical-align:-1px}
.bd details>summary{cursor:pointer;color:#0b5cad;margin:4px 0}
.bd .graph{overflow:auto;border:1px solid #e5e7eb;border-radius:6px;background:#fff;max-height:760px}
.bd img.plot{max-width:100%;height:auto;display:block}
"""


def esc(text: Any) -> str:
    """HTML-escape anything shown to the user (quotes too, for attributes)."""
    return html.escape("" if text is None else str(text), quote=True)


def sev_color(sev: str) -> str:
    return COLORS.get(sev, COLORS["error"])


# --------------------------------------------------------------------------- derivations
def tensor_bytes(m: TensorMeta) -> int:
    """Bytes of a tensor from its metadata (0 when the dtype is unknown)."""
    n = 1
    for s in m.shape:
        n *= int(s)
    return n * _ITEMSIZE.get(m.dtype, 4)


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8}


def first_sentence(text: str) -> str:
    """The first sentence of a message (code spans in backticks are not split)."""
    depth, out = False, []
    for i, ch in enumerate(text):
        if ch == "`":
            depth = not depth
        out.append(ch)
        if ch in ".:" and not depth and (i + 1 == len(text) or text[i + 1] == " ") and i > 20:
            break
    s = "".join(out).strip()
    return s[:-1] + "." if s.endswith(":") else s


def phase_counts(trace: Trace) -> dict[str, int]:
    return dict(Counter(op.phase for op in trace.ops))


def offending_record(report: "Report") -> tuple[OpRecord | None, list[TensorMeta], list[TensorMeta]]:
    """The op behind the top finding, with the richest inputs/outputs we have (stats when known)."""
    tr = report.trace
    f = report.root_cause
    if f is None:
        return None, [], []
    if f.kind == "nonfinite":
        ev = next((e for e in tr.nonfinite if e.is_origin and e.reached), None)
        if ev is not None:
            rec = tr.op(ev.index)
            return rec, ev.inputs, [ev.output] if ev.output else (rec.outputs if rec else [])
    if f.kind == "oom" and tr.exception and tr.exception.oom:
        rec = tr.op(tr.exception.oom.get("index"))
        if rec is not None:
            return rec, rec.inputs, rec.outputs
    failed = tr.failed_op
    if failed is not None and (f.op is None or f.op == failed.op):
        rec = tr.op(failed.index)
        return rec, failed.inputs, rec.outputs if rec else []
    if f.kind == "inplace":
        idx = next((e.index for e in tr.inplace if e.op == f.op and e.where.line == f.line), None)
        rec = tr.op(idx)
        if rec is not None:
            return rec, rec.inputs, rec.outputs
    if f.op:
        cands = [op for op in tr.ops if op.op == f.op]
        hit = [op for op in cands if forward_where(tr, op).line == f.line] or cands
        if hit:
            return hit[0], hit[0].inputs, hit[0].outputs
    return None, [], []


def memory_by_module(trace: Trace) -> tuple[dict[str, int], str]:
    """Bytes by module at the memory peak, and how they were obtained.

    An OOM carries the ledger's exact breakdown. Otherwise tensors made in the
    forward pass are attributed to the module that made them, counted live at the
    peak when something used them at or after it (from the data flow; a lower
    bound), next to the exact parameter, gradient and optimizer-state bytes; the
    rest of the peak is shown as one remainder.
    """
    exc = trace.exception
    if exc is not None and exc.oom and exc.oom.get("by_module"):
        return dict(exc.oom["by_module"]), "at the out-of-memory point (exact, from the memory ledger)"
    peak = trace.memory.peak_index
    if peak is None or not trace.ops:
        return {}, ""
    made: dict[int, tuple[int, str, int]] = {}  # key -> (index made, module, bytes)
    last_use: dict[int, int] = {}
    for op in trace.ops:
        for k in op.in_keys:
            if k in made:
                last_use[k] = op.index
        if op.phase != "forward" or op.index > peak:
            continue
        for k, m in zip(op.out_keys, op.outputs):
            if not k or k in op.in_keys or k in made and last_use.get(k, -1) >= op.index:
                continue  # in place, a view, or the same storage again
            made[k] = (op.index, op.where.module or "(outside modules)", tensor_bytes(m))
            last_use[k] = op.index
    out: dict[str, int] = defaultdict(int)
    for k, (i, lab, nbytes) in made.items():
        if i <= peak <= last_use.get(k, i):
            out[lab] += nbytes
    cats = trace.memory.peak_by_category or {}
    for c in ("parameters", "gradients", "optimizer"):
        if cats.get(c):
            out[f"({CATEGORY_LABELS[c]})"] = cats[c]
    rest = trace.memory.peak_bytes - sum(out.values())
    if rest > 0:
        out["(other live tensors)"] = rest
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    return out, "at the peak (forward tensors by module, estimated from data flow)"


def _module_label(trace: Trace, op: OpRecord) -> str:
    if op.phase == "backward":
        w = forward_where(trace, op)
        return f"{w.module} (gradients)" if w.module else "(gradients outside modules)"
    if op.phase == "optimizer":
        return "(optimizer step)"
    return op.where.module or "(outside modules)"


@dataclass
class OpRow:
    name: str
    count: int
    time_us: float
    alloc_bytes: int
    where: str = ""


def op_rows(trace: Trace, group: str = "op") -> list[OpRow]:
    """Ops grouped by op name, module or line: count, time, bytes newly allocated."""
    rows: dict[str, OpRow] = {}
    for op in trace.ops:
        if group == "module":
            key = _module_label(trace, op)
        elif group == "line":
            w = forward_where(trace, op)
            key = _line_label(w) + (" (backward)" if op.phase == "backward" else "")
        else:
            key = op.op
        row = rows.get(key)
        if row is None:
            row = rows[key] = OpRow(key, 0, 0.0, 0)
        row.count += 1
        row.time_us += op.duration_us
        ins = set(op.in_keys)
        row.alloc_bytes += sum(tensor_bytes(m) for k, m in zip(op.out_keys, op.outputs) if k and k not in ins)
    if group == "op" and trace.ops_dropped:  # totals cover the ops dropped from the middle
        for name, (count, total) in trace.op_totals.items():
            row = rows.setdefault(name, OpRow(name, 0, 0.0, 0))
            row.count, row.time_us = int(count), float(total)
    return list(rows.values())


def _line_label(w: Where) -> str:
    if w.line is None:
        return "(unknown line)"
    return f"cell line {w.line}" if w.file is None else f"{os.path.basename(w.file)}:{w.line}"


SORT_KEYS = {"time": lambda r: -r.time_us, "memory": lambda r: -r.alloc_bytes, "count": lambda r: -r.count,
             "name": lambda r: r.name}


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


# --------------------------------------------------------------------------- fixes
@dataclass
class FixOption:
    arg: str           # what run_fix / --fix takes: "accumulate:2"
    name: str          # "accumulate"
    title: str
    description: str
    predicted: int | None = None


def applicable_fixes(report: "Report") -> list[FixOption]:
    """One option per fix the findings name, with the predicted peak where the rules gave one."""
    seen: list[FixOption] = []
    names: set[str] = set()
    for f in report.findings:
        preds = f.evidence.get("predicted_peak") or {}
        limit = f.evidence.get("limit")
        for name in f.fixes:
            if name in names:
                continue
            names.add(name)
            arg, pred = name, preds.get(name)
            if name == "accumulate":
                ks = [k for k in (2, 4, 8) if f"accumulate:{k}" in preds]
                k = next((k for k in ks if limit and preds[f"accumulate:{k}"] <= 0.9 * limit), ks[-1] if ks else None)
                if k:
                    arg, pred = f"accumulate:{k}", preds[f"accumulate:{k}"]
            title, desc = FIX_INFO.get(name, (name, ""))
            seen.append(FixOption(arg, name, title, desc, pred))
    return seen


# --------------------------------------------------------------------------- pieces
def source_context(trace: Trace, line: int | None, file: str | None, around: int = 3) -> list[tuple[int, str]]:
    """(number, text) of the lines around ``line`` in the cell or in ``file``."""
    if line is None:
        return []
    if file is None:
        lines = trace.source.splitlines()
    else:
        lines = [s.rstrip("\n") for s in linecache.getlines(file)]
    if not 0 < line <= len(lines):
        return []
    lo, hi = max(1, line - around), min(len(lines), line + around)
    return [(i, lines[i - 1]) for i in range(lo, hi + 1)]


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
    if "min" in s:
        vals = "".join(f'<td class="num">{s[k]:.4g}</td>' for k in ("min", "max", "mean"))
    else:
        vals = '<td class="num muted" colspan="3">no finite values</td>'
    inf = (s.get("posinf") or 0) + (s.get("neginf") or 0)
    nan = s.get("nan") or 0
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


def verdict_parts(report: "Report") -> tuple[str, str, str, str]:
    """(severity, badge, headline, one sentence)."""
    tr = report.trace
    if report.ok:
        return "ok", "OK", "The step ran and nothing looks wrong", ""
    top = report.root_cause
    if top is None:
        what = "timed out" if tr.timed_out else "did not complete"
        return "error", "problem", f"The step {what}", (report.exception or "").split("\n")[0]
    title = top.title or top.kind.replace("_", " ")
    return top.severity, top.severity if top.severity != "error" else "problem", \
        f"{title} at {top.location()}", first_sentence(top.message)


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
    if tr.parameters.get("count"):
        p = tr.parameters
        facts.append(("parameters", format_bytes(p.get("bytes")),
                      f"{p['count']} tensors, {p.get('trainable', 0)} trainable", None))
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
            out.append(f'<div>bad values <code>{esc(ic.get("bad"))}</code>, valid range '
                       f'<code>{esc(ic.get("valid"))}</code> ({esc(ic.get("what"))})</div>')
    out.append(f'<div style="margin-top:6px">{_message_html(f.message)}</div>')
    ev = f.evidence
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


def legend_html(categories: Iterable[str] = CATEGORIES) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{CATEGORY_COLORS[c]}"></i>{esc(CATEGORY_LABELS[c])}</span>'
        for c in categories) + "</div>"


# --------------------------------------------------------------------------- fix results
def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def comparison_html(result: Any) -> str:
    """Before/after table of a fix result (``report.fix_result``)."""
    comp = _get(result, "comparison") or {}
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
    err = comp.get("grad_max_rel_err", _get(result, "grad_max_rel_err"))
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


def make_diff(before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "cell", "cell (fixed)"))


def fix_result_parts(result: Any) -> tuple[str, str, str]:
    """(verdict, comparison table, diff) of a fix result, as HTML."""
    name = _get(result, "name", "fix")
    applied = _get(result, "applied", False)
    msg = _get(result, "message", "")
    cancelled = _get(result, "cancelled", False)
    fits = _get(result, "fits", None)
    color = COLORS["ok"] if applied and fits is not False else COLORS["warning"]
    badge = "cancelled" if cancelled else "after the fix" if applied else "not applied"
    head = (f'<div class="verdict" style="--sev:{color}"><span class="badge">{esc(badge)}</span><div>'
            f'<div class="headline">{esc(name)}</div><div class="sub">{esc(msg)}</div></div></div>')
    diff = _get(result, "diff") or ""
    original = _get(result, "original")
    if not diff and _get(result, "code") and isinstance(original, str):
        diff = make_diff(original, _get(result, "code"))
    return head, comparison_html(result), diff_html(diff)


def fix_result_html(result: Any) -> str:
    """The after-view: what was applied, the comparison, the diff."""
    head, table, diff = fix_result_parts(result)
    return head + table + ("<div><b>The change</b></div>" + diff if diff else "")
