"""Plots of a report, rendered to PNG bytes with matplotlib's Agg canvas.

Imported lazily (``import backward_doctor`` does not import matplotlib). Figures are
built with ``matplotlib.figure.Figure`` and an Agg canvas directly, never through
``pyplot``: the user's backend and pyplot's figure list are left alone, and each
figure is cleared as soon as its PNG is written.

>>> from backward_doctor.trace import Trace
>>> memory_timeline_png(Trace())[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..analysis.findings import forward_where
from .style import CATEGORY_COLORS, CATEGORY_LABELS
from .view import memory_by_module
from ..trace.records import CATEGORIES, Trace
from ..util.units import format_bytes

#: Points drawn per timeline at most: buckets keep their highest sample, so peaks survive.
MAX_POINTS = 1500
_PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fdf0e4", "optimizer": "#eaf6ee"}
_PHASE_LABELS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}
_FONT = {"font.size": 9, "font.family": "DejaVu Sans"}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=fig.dpi, facecolor="white")
    fig.clear()
    return buf.getvalue()


def _unit(n: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return float(scale), name
    return 1.0, "B"


def downsample(x: np.ndarray, ys: np.ndarray, max_points: int = MAX_POINTS,
               keep: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Keep, from each of ``max_points`` buckets, the sample with the largest total.

    ``ys`` is (categories, n). Positions in ``keep`` are always kept.

    >>> x = np.arange(10); ys = np.array([[0, 1, 9, 1, 0, 0, 2, 0, 0, 1]])
    >>> downsample(x, ys, 5)[1].tolist()
    [[1, 9, 0, 2, 1]]
    """
    n = x.shape[0]
    if n <= max_points:
        return x, ys
    step = -(-n // max_points)
    total = ys.sum(axis=0)
    pad = (-n) % step
    t = np.concatenate([total, np.full(pad, -1, dtype=total.dtype)]) if pad else total
    idx = t.reshape(-1, step).argmax(axis=1) + np.arange(0, n + pad, step)
    idx = np.unique(np.concatenate([idx[idx < n], np.asarray([k for k in keep if 0 <= k < n], dtype=idx.dtype)]))
    return x[idx], ys[:, idx]


def phase_spans(trace: Trace) -> list[tuple[str, int, int]]:
    """(phase, first op index, last op index) of each run of one phase."""
    spans: list[list[Any]] = []
    for op in trace.ops:
        if spans and spans[-1][0] == op.phase and op.index <= spans[-1][2] + 1 + trace.ops_dropped:
            spans[-1][2] = op.index
        else:
            spans.append([op.phase, op.index, op.index])
    return [(p, a, b) for p, a, b in spans]


def _op_label(trace: Trace, index: int | None) -> str:
    rec = trace.op(index)
    if rec is None:
        return ""
    w = forward_where(trace, rec)
    where = "" if w.line is None else (f"line {w.line}" if w.file is None else f"{w.file.rsplit('/', 1)[-1]}:{w.line}")
    if where and rec.phase == "backward":
        where = "backward of " + where
    bits = [rec.op, where, w.module or ""]
    return " · ".join(b for b in bits if b)


def memory_timeline_png(trace: Trace, *, width: float = 10.0, height: float = 3.6, dpi: int = 100,
                        max_points: int = MAX_POINTS) -> bytes:
    """Live bytes over the step, stacked by category, with phases, peak, limit and OOM marked."""
    import matplotlib

    mem = trace.memory
    with matplotlib.rc_context(_FONT):
        fig = Figure(figsize=(width, height), dpi=dpi)
        ax = fig.add_subplot(111)
        x = np.asarray(mem.op_index, dtype=np.int64)
        if x.size == 0:
            ax.text(0.5, 0.5, "no ops were recorded", ha="center", va="center", transform=ax.transAxes,
                    color="#57606a")
            ax.set_axis_off()
            return _png(fig)
        ys = np.vstack([np.asarray(mem.by_category.get(c) or [0] * x.size, dtype=np.float64) for c in CATEGORIES])
        keep = tuple(int(i) for i in np.flatnonzero(x == mem.peak_index)) if mem.peak_index is not None else ()
        x, ys = downsample(x, ys, max_points, keep)
        # Each sample is the memory *after* its op: draw it over [i, i + 1) so the last op shows too.
        x = np.append(x, x[-1] + 1)
        ys = np.hstack([ys, ys[:, -1:]])
        cap = mem.limit_bytes or mem.device_total_bytes
        top = max(float(ys.sum(axis=0).max()), float(mem.peak_bytes or 0))
        show_cap = bool(cap) and cap <= 4 * top
        scale, unit = _unit(max(top, cap if show_cap else 0))
        # Phase bands behind everything.
        xmin, xmax = float(x[0]), float(x[-1]) if x[-1] > x[0] else float(x[0]) + 1
        span_w = xmax - xmin
        labelled: set[str] = set()
        for phase, a, b in phase_spans(trace):
            ax.axvspan(a, b + 1, color=_PHASE_COLORS.get(phase, "#f4f4f4"), lw=0, zorder=0)
            if (b - a + 1) >= 0.06 * span_w or phase not in labelled and (b - a + 1) >= 0.02 * span_w:
                labelled.add(phase)
                ax.text((a + b + 1) / 2, 1.0, _PHASE_LABELS.get(phase, phase), transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=8, color="#57606a")
        ax.stackplot(x, ys / scale, colors=[CATEGORY_COLORS[c] for c in CATEGORIES],
                     labels=[CATEGORY_LABELS[c] for c in CATEGORIES], step="post", lw=0, alpha=0.95, zorder=2)
        cuda = mem.cuda or {}
        alloc = cuda.get("allocated_per_op") or []
        if alloc:
            start = max(0, trace.op_count - len(alloc))
            ax_x = np.arange(start, start + len(alloc))
            ay = np.asarray(alloc, dtype=np.float64)[None, :]
            ax_x, ay = downsample(ax_x, ay, max_points)
            ax.plot(ax_x, ay[0] / scale, color="#1f2328", lw=0.8, zorder=3, label="CUDA allocated")
            if cuda.get("max_reserved"):
                ax.axhline(cuda["max_reserved"] / scale, color="#6f42c1", ls=":", lw=1.2, zorder=3,
                           label=f"CUDA reserved (max {format_bytes(cuda['max_reserved'])})")
        if show_cap:
            what = "limit" if mem.limit_bytes else "device"
            ax.axhline(cap / scale, color="#c62828", ls="--", lw=1.2, zorder=4)
            ax.text(xmin, cap / scale, f" {what} {format_bytes(cap)}", color="#c62828", va="bottom", ha="left",
                    fontsize=8, zorder=5)
        exc = trace.exception
        oom = exc.oom if exc is not None else None
        if mem.peak_index is not None and mem.peak_bytes:
            px, py = mem.peak_index, mem.peak_bytes / scale
            ax.plot([px], [py], marker="v", color="#1f2328", ms=7, zorder=6)
            frac = (px - xmin) / span_w if span_w else 0.5
            label = f"peak {format_bytes(mem.peak_bytes)}\n{_op_label(trace, px)}"
            if oom and oom.index == px:
                label = f"out of memory: {format_bytes(mem.peak_bytes)}\n{_op_label(trace, px)}"
            ax.annotate(label, (px, py), xytext=(-8 if frac > 0.6 else 8, -4), textcoords="offset points",
                        ha="right" if frac > 0.6 else "left", va="top", fontsize=8, zorder=7,
                        bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#d0d7de", "alpha": 0.92})
        if oom and oom.index is not None:
            ox = oom.index
            oy = (oom.live or mem.peak_bytes or 0) / scale
            ax.plot([ox], [oy], marker="X", color="#c62828", ms=11, mec="white", mew=1.2, zorder=8,
                    label="out of memory")
        ax.set_xlim(xmin, xmax)
        ax.set_ylim(0, max(top, cap if show_cap else 0) / scale * 1.12 or 1)
        ax.set_ylabel(f"live tensors ({unit})")
        ax.set_xlabel("op (in the order they ran)")
        ax.spines[["top", "right"]].set_visible(False)
        ax.margins(x=0)
        ax.grid(axis="y", color="#eef0f3", lw=0.8, zorder=1)
        ax.set_axisbelow(True)
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False, fontsize=8, borderaxespad=0)
        fig.subplots_adjust(left=0.07, right=0.82, top=0.91, bottom=0.14)
        if not show_cap and cap:
            fig.text(0.82, 0.02, f"device capacity {format_bytes(cap)} (off the scale)", ha="right", fontsize=7,
                     color="#57606a")
        return _png(fig)


def memory_by_module_png(trace: Trace, *, width: float = 10.0, dpi: int = 100, top_n: int = 14,
                         data: tuple[dict[str, int], str] | None = None) -> bytes:
    """Horizontal bars: bytes by module at the peak (or at the OOM point).

    ``data``: what :func:`~backward_doctor.render.sections.memory_by_module` returned, if already computed.
    """
    import matplotlib

    data, how = data if data is not None else memory_by_module(trace)
    items = list(data.items())[:top_n]
    rest = sum(v for _, v in list(data.items())[top_n:])
    if rest:
        items.append((f"({len(data) - top_n} more)", rest))
    with matplotlib.rc_context(_FONT):
        fig = Figure(figsize=(width, 0.6 + 0.26 * max(3, len(items))), dpi=dpi)
        ax = fig.add_subplot(111)
        if not items:
            ax.text(0.5, 0.5, "no memory recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            return _png(fig)
        names = [_short(k, 48) for k, _ in items][::-1]
        vals = np.asarray([v for _, v in items][::-1], dtype=np.float64)
        scale, unit = _unit(float(vals.max()))
        colors = [_bar_color(k) for k, _ in items][::-1]
        bars = ax.barh(range(len(vals)), vals / scale, color=colors, height=0.7)
        ax.set_yticks(range(len(vals)), names, fontsize=8, fontfamily="DejaVu Sans Mono")
        for b, v in zip(bars, vals):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {format_bytes(v)}", va="center", fontsize=8)
        ax.set_xlabel(unit)
        ax.set_xlim(0, float(vals.max()) / scale * 1.18)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_title(f"memory by module {how.split(' (')[0]}", fontsize=9, loc="left", color="#1f2328")
        fig.tight_layout()
        return _png(fig)


def _bar_color(label: str) -> str:
    for c in CATEGORIES:
        if label == f"({CATEGORY_LABELS[c]})":
            return CATEGORY_COLORS[c]
    if "gradient" in label:
        return CATEGORY_COLORS["gradients"]
    return CATEGORY_COLORS["other"] if label.startswith("(") else CATEGORY_COLORS["activations"]


def _short(name: str, n: int) -> str:
    return name if len(name) <= n else "…" + name[-(n - 1):]


def comparison_png(before: dict[str, Any], after: dict[str, Any], *, limit: int | None = None,
                   width: float = 6.0, dpi: int = 100) -> bytes:
    """Two stacked bars (peak memory by category) before and after a fix."""
    import matplotlib

    with matplotlib.rc_context(_FONT):
        fig = Figure(figsize=(width, 2.2), dpi=dpi)
        ax = fig.add_subplot(111)
        rows = [("before", before or {}), ("after", after or {})]
        tops = [float(r.get("peak_bytes") or sum((r.get("peak_by_category") or {}).values()) or 0) for _, r in rows]
        scale, unit = _unit(max(tops + [float(limit or 0)]) or 1)
        for y, (label, r) in enumerate(rows[::-1]):
            cats = r.get("peak_by_category") or {}
            left = 0.0
            if not cats and r.get("peak_bytes"):
                cats = {"other": r["peak_bytes"]}
            for c in CATEGORIES:
                v = float(cats.get(c) or 0) / scale
                if v:
                    ax.barh(y, v, left=left, color=CATEGORY_COLORS[c], height=0.6,
                            label=CATEGORY_LABELS[c] if y == 0 else None)
                    left += v
            ax.text(left, y, f" {format_bytes(r.get('peak_bytes') or left * scale)}", va="center", fontsize=8)
        if limit:
            ax.axvline(limit / scale, color="#c62828", ls="--", lw=1.2)
            ax.text(limit / scale, 1.42, f"limit {format_bytes(limit)}", color="#c62828", fontsize=8, ha="center")
        ax.set_yticks([0, 1], ["after", "before"])
        ax.set_xlabel(f"peak live tensors ({unit})")
        ax.set_xlim(0, max(tops + [float(limit or 0)]) / scale * 1.25 or 1)
        ax.set_ylim(-0.5, 1.7)
        ax.spines[["top", "right"]].set_visible(False)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        ax.legend(seen.values(), seen.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
        fig.tight_layout()
        return _png(fig)
