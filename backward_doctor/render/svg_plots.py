"""The memory plots as inline SVG: the timeline by category and the bytes by module.

Drawn by hand, without matplotlib: a plot is ~30 KB of text made in a few milliseconds
where a PNG through matplotlib took 100-250 ms, which was most of the time between the
end of a cell and its panel on screen. Text and axes take the notebook's own colours
(JupyterLab's CSS variables, with light-theme fallbacks); the categories keep theirs.

>>> from backward_doctor.trace import Trace
>>> memory_timeline_svg(Trace()).startswith('<svg')
True
"""
from __future__ import annotations

import math
from typing import Any

from ..analysis.findings import forward_where
from .style import CATEGORY_COLORS, CATEGORY_LABELS, esc
from .view import memory_by_module, op_place
from ..trace.records import CATEGORIES, Trace
from ..util.units import format_bytes, scale_unit

#: Samples drawn per timeline at most: each bucket keeps its highest, so peaks survive.
MAX_POINTS = 800
_INK = "var(--jp-ui-font-color1, #1f2328)"
_MUTED = "var(--jp-ui-font-color2, #57606a)"
_GRID = "var(--jp-border-color2, #eef0f3)"
_RED = "#c62828"
_PHASES = {"forward": ("#4e79a7", "forward"), "backward": ("#f28e2b", "backward"),
           "optimizer": ("#59a14f", "optimizer step")}
_FONT = 'font-family="-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif" font-size="11"'


def downsample(index: list[int], rows: list[list[int]], max_points: int = MAX_POINTS,
               keep: int | None = None) -> list[int]:
    """Positions to draw: from each of ``max_points`` buckets the sample with the largest total (and
    ``keep``, the peak's position).

    >>> downsample([0, 1, 2, 3], [[1, 5, 2, 0]], 2)
    [1, 2]
    """
    n = len(index)
    if n <= max_points:
        return list(range(n))
    totals = [sum(col) for col in zip(*rows)]
    step = -(-n // max_points)
    picked = {max(range(a, min(a + step, n)), key=totals.__getitem__) for a in range(0, n, step)}
    if keep is not None and 0 <= keep < n:
        picked.add(keep)
    return sorted(picked)


def _nice(top: float) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving about five ticks up to ``top``.

    >>> _nice(7.3), _nice(380.0)
    (2.0, 100.0)
    """
    if top <= 0:
        return 1.0
    raw = top / 5
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if raw <= m * mag)


def _op_label(trace: Trace, index: int | None, places: dict[str, str] | None = None) -> str:
    rec = trace.op(index)
    if rec is None:
        return ""
    w = forward_where(trace, rec)
    return " · ".join(b for b in (rec.op, op_place(trace, rec, places), w.module or "") if b)


def phase_spans(trace: Trace) -> list[tuple[str, int, int]]:
    """(phase, first op index, last op index) of each run of one phase."""
    spans: list[list[Any]] = []
    for op in trace.ops:
        if spans and spans[-1][0] == op.phase and op.index <= spans[-1][2] + 1 + trace.ops_dropped:
            spans[-1][2] = op.index
        else:
            spans.append([op.phase, op.index, op.index])
    return [(p, a, b) for p, a, b in spans]


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="bd-plot" viewBox="0 0 {width} {height}" '
            f'width="100%" style="max-width:{width}px" role="img" aria-label="{esc(label)}" {_FONT}>'
            + "".join(body) + "</svg>")


def memory_timeline_svg(trace: Trace, *, width: int = 1000, height: int = 320,
                        places: dict[str, str] | None = None) -> str:
    """Live bytes over the step, stacked by category, with phases, peak, limit and OOM marked; ``places``:
    the report's names of the cell and files (``Cell In[2]``), for the peak's label."""
    mem = trace.memory
    if not mem.op_index:
        return _svg(width, 60, [f'<text x="{width / 2}" y="34" text-anchor="middle" fill="{_MUTED}">no ops were '
                                "recorded</text>"], "memory timeline")
    rows = [list(mem.by_category.get(c) or [0] * len(mem.op_index)) for c in CATEGORIES]
    peak_pos = mem.op_index.index(mem.peak_index) if mem.peak_index in mem.op_index else None
    pos = downsample(mem.op_index, rows, keep=peak_pos)
    xs = [mem.op_index[i] for i in pos] + [mem.op_index[pos[-1]] + 1]  # each sample spans [i, i + 1)
    ys = [[r[i] for i in pos] for r in rows]
    cap = mem.limit_bytes or mem.device_total_bytes
    alloc = (mem.cuda or {}).get("allocated_per_op") or []
    # (the allocator's count is the whole process's: tensors made before the step and outside it too; it was drawn
    # off the top of the plot on an H200 when it was not in the scale)
    top = max(max(sum(col) for col in zip(*ys)), mem.peak_bytes or 0, max(alloc, default=0), 1)
    show_cap = bool(cap) and cap <= 4 * top
    ymax = max(top, cap if show_cap else 0) * 1.12
    scale, unit = scale_unit(ymax)
    left, right, up, down = 64, 170, 22, 38
    pw, ph = width - left - right, height - up - down
    x0, x1 = xs[0], xs[-1] if xs[-1] > xs[0] else xs[0] + 1

    def X(v: float) -> float:
        return round(left + (v - x0) / (x1 - x0) * pw, 1)

    def Y(v: float) -> float:
        return round(up + ph - v / ymax * ph, 1)

    out: list[str] = []
    span_w = x1 - x0
    for phase, a, b in phase_spans(trace):
        colour, name = _PHASES.get(phase, ("#999", phase))
        out.append(f'<rect x="{X(a)}" y="{up}" width="{max(X(b + 1) - X(a), 0.5)}" height="{ph}" fill="{colour}" '
                   f'fill-opacity="0.08"><title>{esc(name)}: ops {a}-{b}</title></rect>')
        if b - a + 1 >= 0.06 * span_w:
            out.append(f'<text x="{X((a + b + 1) / 2)}" y="{up - 6}" text-anchor="middle" fill="{_MUTED}" '
                       f'font-size="10">{esc(name)}</text>')
    step = _nice(ymax / scale)
    t = 0.0
    while t * scale <= ymax:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(t * scale)}" y2="{Y(t * scale)}" stroke="{_GRID}"/>'
                   f'<text x="{left - 6}" y="{Y(t * scale) + 4}" text-anchor="end" fill="{_MUTED}">{t:g}</text>')
        t += step
    base = [0] * len(pos)
    for c, row in zip(CATEGORIES, ys):
        if not any(row):
            continue
        tops = [b + v for b, v in zip(base, row)]
        upper = " ".join(f"{X(xs[i])},{Y(tops[i])} {X(xs[i + 1])},{Y(tops[i])}" for i in range(len(pos)))
        lower = " ".join(f"{X(xs[i + 1])},{Y(base[i])} {X(xs[i])},{Y(base[i])}" for i in reversed(range(len(pos))))
        out.append(f'<polygon points="{upper} {lower}" fill="{CATEGORY_COLORS[c]}" fill-opacity="0.95">'
                   f"<title>{esc(CATEGORY_LABELS[c])}</title></polygon>")
        base = tops
    if alloc:
        start = max(0, trace.op_count - len(alloc))
        keep = downsample(list(range(len(alloc))), [list(alloc)])
        pts = " ".join(f"{X(start + i)},{Y(alloc[i])}" for i in keep)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{_INK}" stroke-width="0.8">'
                   "<title>CUDA allocated</title></polyline>")
    if show_cap:
        what = "limit" if mem.limit_bytes else "device"
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(cap)}" y2="{Y(cap)}" stroke="{_RED}" '
                   f'stroke-dasharray="6 4" stroke-width="1.2"/><text x="{left + 4}" y="{Y(cap) - 4}" '
                   f'fill="{_RED}" font-size="10">{what} {esc(format_bytes(cap))}</text>')
    exc = trace.exception
    oom = exc.oom if exc is not None else None
    if mem.peak_index is not None and mem.peak_bytes:
        px, py = X(mem.peak_index + 0.5), Y(mem.peak_bytes)
        what = "out of memory" if oom and oom.index == mem.peak_index else "peak"
        anchor, dx = ("end", -8) if px > left + 0.6 * pw else ("start", 8)
        out.append(f'<path d="M{px - 5},{py - 9} L{px + 5},{py - 9} L{px},{py} Z" fill="{_INK}"/>'
                   f'<text x="{px + dx}" y="{py + 12}" text-anchor="{anchor}" fill="{_INK}">'
                   f'<tspan font-weight="600">{what} {esc(format_bytes(mem.peak_bytes))}</tspan>'
                   f'<tspan x="{px + dx}" dy="13" fill="{_MUTED}">{esc(_op_label(trace, mem.peak_index, places))}</tspan>'
                   "</text>")
    if oom and oom.index is not None:
        ox, oy = X(oom.index + 0.5), max(Y(oom.live or mem.peak_bytes or 0), up + 6)  # (clipped to the plot)
        out.append(f'<text x="{ox}" y="{oy + 5}" text-anchor="middle" fill="{_RED}" font-size="16" '
                   'font-weight="700">✖<title>out of memory</title></text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{up}" y2="{up + ph}" stroke="{_MUTED}"/>'
               f'<line x1="{left}" x2="{left + pw}" y1="{up + ph}" y2="{up + ph}" stroke="{_MUTED}"/>')
    for v in sorted({round(x0 + (x1 - x0) * k / 4) for k in range(5)}):
        out.append(f'<text x="{X(v)}" y="{up + ph + 14}" text-anchor="middle" fill="{_MUTED}">{int(v)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" fill="{_MUTED}">'
               "op (in the order they ran)</text>"
               f'<text transform="translate(14,{up + ph / 2}) rotate(-90)" text-anchor="middle" fill="{_MUTED}">'
               f"live tensors ({unit})</text>")
    ly = up + 4
    for c in CATEGORIES:
        out.append(f'<rect x="{left + pw + 14}" y="{ly}" width="10" height="10" fill="{CATEGORY_COLORS[c]}"/>'
                   f'<text x="{left + pw + 30}" y="{ly + 9}" fill="{_INK}">{esc(CATEGORY_LABELS[c])}</text>')
        ly += 17
    if alloc:
        out.append(f'<line x1="{left + pw + 14}" x2="{left + pw + 24}" y1="{ly + 5}" y2="{ly + 5}" stroke="{_INK}"/>'
                   f'<text x="{left + pw + 30}" y="{ly + 9}" fill="{_INK}">CUDA allocated</text>'
                   f'<text x="{left + pw + 30}" y="{ly + 22}" fill="{_MUTED}" font-size="10">(whole process)</text>')
    if cap and not show_cap:
        out.append(f'<text x="{width - 4}" y="{height - 6}" text-anchor="end" fill="{_MUTED}" font-size="10">'
                   f"device capacity {esc(format_bytes(cap))} (off the scale)</text>")
    return _svg(width, height, out, "memory timeline")


def memory_by_module_svg(trace: Trace, *, width: int = 1000, top_n: int = 14,
                         data: tuple[dict[str, int], str] | None = None) -> str:
    """Horizontal bars: bytes by module at the peak (or at the out-of-memory point)."""
    data, how = data if data is not None else memory_by_module(trace)
    items = list(data.items())[:top_n]
    rest = sum(v for _, v in list(data.items())[top_n:])
    if rest:
        items.append((f"({len(data) - top_n} more)", rest))
    if not items:
        return _svg(width, 60, [f'<text x="{width / 2}" y="34" text-anchor="middle" fill="{_MUTED}">no memory '
                                "recorded</text>"], "memory by module")
    left, bar_h, up = 330, 18, 26
    height = up + bar_h * len(items) + 12
    vmax = max(v for _, v in items) or 1
    pw = width - left - 110
    out = [f'<text x="4" y="14" fill="{_INK}" font-weight="600">memory by module {esc(how.split(" (")[0])}</text>']
    for k, (name, v) in enumerate(items):
        y = up + k * bar_h
        shown = name if len(name) <= 48 else "…" + name[-47:]
        w = max(v / vmax * pw, 1)
        out.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end" fill="{_INK}" '
                   f'font-family="DejaVu Sans Mono,Menlo,Consolas,monospace">{esc(shown)}<title>{esc(name)}</title>'
                   f'</text><rect x="{left}" y="{y + 2}" width="{round(w, 1)}" height="{bar_h - 5}" '
                   f'fill="{_bar_color(name)}"/><text x="{left + w + 4}" y="{y + 12}" fill="{_INK}">'
                   f"{esc(format_bytes(v))}</text>")
    return _svg(width, height, out, "memory by module")


def _bar_color(label: str) -> str:
    for c in CATEGORIES:
        if label == f"({CATEGORY_LABELS[c]})":
            return CATEGORY_COLORS[c]
    if "gradient" in label:
        return CATEGORY_COLORS["gradients"]
    return CATEGORY_COLORS["other"] if label.startswith("(") else CATEGORY_COLORS["activations"]


def _log_y(values: list[float | None]) -> tuple[float, float]:
    finite = [v for v in values if v is not None and v > 0]
    if not finite:
        return 0.0, 1.0
    lo, hi = math.log10(min(finite)), math.log10(max(finite))
    return (lo - 0.5, hi + 0.5) if hi - lo < 1 else (lo, hi)


def loop_series_svg(trace: Trace, series: str, *, upto: int | None = None, mark: int | None = None,
                    change: int | None = None, width: int = 1000, height: int = 220) -> str:
    """A training loop's per-iteration series (``trace.iterations``): ``"nan"`` draws the loss and the
    gradient norm on a log scale up to iteration ``upto`` with the first NaN/Inf at ``mark`` and a learning
    rate change at ``change``; ``"memory"`` draws live bytes per iteration with the limit and where it
    would be reached.

    >>> from backward_doctor.trace.parts import Iterations
    >>> t = Trace(iterations=Iterations(steps=3, loss=[1.0, 2.0, None], grad_norm=[1.0, 3.0, None]))
    >>> loop_series_svg(t, "nan", mark=2).count("<polyline")
    2
    """
    its = trace.iterations
    stride = max(1, its.stride)
    n = len(its.live_bytes) if series == "memory" else max(len(its.loss), len(its.grad_norm))
    end = n if upto is None else min(n, upto // stride + 1)
    lo = max(0, end - 400)
    xs = [i * stride for i in range(lo, end)]
    if not xs:
        return _svg(width, 60, [f'<text x="{width / 2}" y="34" text-anchor="middle" fill="{_MUTED}">no '
                                "iterations</text>"], "loop series")
    left, right, up, down = 70, 150, 16, 34
    pw, ph = width - left - right, height - up - down
    x0, x1 = xs[0], max(xs[-1], xs[0] + 1)

    def X(v: float) -> float:
        return round(left + (v - x0) / (x1 - x0) * pw, 1)

    out: list[str] = []
    if series == "memory":
        ys = [b if b >= 0 else None for b in its.live_bytes[lo:end]]
        cap = trace.memory.limit_bytes or trace.memory.device_total_bytes
        top = max([v for v in ys if v is not None] + [1])
        ymax = max(top, cap if cap and cap <= 4 * top else 0) * 1.1
        scale, unit = scale_unit(ymax)

        def Y(v: float) -> float:
            return round(up + ph - v / ymax * ph, 1)

        lines = [("live memory", "#4e79a7", ys, Y)]
        if cap and cap <= 4 * top:
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(cap)}" y2="{Y(cap)}" stroke="{_RED}" '
                       f'stroke-dasharray="6 4"/><text x="{left + 4}" y="{Y(cap) - 4}" fill="{_RED}" '
                       f'font-size="10">{"limit" if trace.memory.limit_bytes else "device"} '
                       f"{esc(format_bytes(cap))}</text>")
        step = _nice(ymax / scale)
        ticks = [(Y(k * step * scale), f"{k * step:g}") for k in range(int(ymax / scale / step) + 1)]
        y_label = f"live ({unit})"
    else:
        loss, norm = its.loss[lo:end], its.grad_norm[lo:end]
        a, b = _log_y(loss + norm)

        def Y(v: float) -> float:
            return round(up + ph - (math.log10(max(v, 1e-300)) - a) / max(b - a, 1e-9) * ph, 1)

        lines = [("loss", "#4e79a7", loss, Y), ("gradient norm", "#f28e2b", norm, Y)]
        every = max(1, math.ceil((b - a) / 6))
        ticks = [(Y(10 ** e), f"1e{e}") for e in range(math.ceil(a), math.floor(b) + 1, every)]
        y_label = "log scale"
    for y, text in ticks:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y}" y2="{y}" stroke="{_GRID}"/>'
                   f'<text x="{left - 6}" y="{y + 4}" text-anchor="end" fill="{_MUTED}">{esc(text)}</text>')
    ly = up + 4
    for name, colour, ys, Y in lines:
        pts = " ".join(f"{X(x)},{Y(v)}" for x, v in zip(xs, ys) if v is not None and (series == "memory" or v > 0))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5">'
                   f"<title>{esc(name)}</title></polyline>"
                   f'<rect x="{left + pw + 14}" y="{ly}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{left + pw + 30}" y="{ly + 9}" fill="{_INK}">{esc(name)}</text>')
        ly += 17
    if change is not None and x0 <= change <= x1:
        out.append(f'<line x1="{X(change)}" x2="{X(change)}" y1="{up}" y2="{up + ph}" stroke="{_INK}" '
                   f'stroke-dasharray="3 3"/><text x="{X(change) + 4}" y="{up + 10}" fill="{_INK}" '
                   f'font-size="10">learning rate changed ({change})</text>')
    if mark is not None and x0 <= mark <= x1:
        out.append(f'<text x="{X(mark)}" y="{up + ph / 2}" text-anchor="middle" fill="{_RED}" font-size="16" '
                   f'font-weight="700">✖<title>first NaN/Inf: iteration {mark}</title></text>'
                   f'<text x="{X(mark) - 4}" y="{up + ph - 6}" text-anchor="end" fill="{_RED}" font-size="10">'
                   f"NaN/Inf ({mark})</text>")
    out.append(f'<line x1="{left}" x2="{left}" y1="{up}" y2="{up + ph}" stroke="{_MUTED}"/>'
               f'<line x1="{left}" x2="{left + pw}" y1="{up + ph}" y2="{up + ph}" stroke="{_MUTED}"/>')
    for v in sorted({round(x0 + (x1 - x0) * k / 4) for k in range(5)}):
        out.append(f'<text x="{X(v)}" y="{up + ph + 14}" text-anchor="middle" fill="{_MUTED}">{int(v)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" fill="{_MUTED}">iteration</text>'
               f'<text transform="translate(14,{up + ph / 2}) rotate(-90)" text-anchor="middle" fill="{_MUTED}">'
               f"{esc(y_label)}</text>")
    return _svg(width, height, out, "training loop: " + ("live memory" if series == "memory" else "loss and gradient norm"))
