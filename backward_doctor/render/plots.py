"""The before/after comparison of a fix, rendered to PNG bytes with matplotlib's Agg canvas (the memory
plots are inline SVG: ``svg_plots.py``).

Imported lazily (``import backward_doctor`` does not import matplotlib). Figures are
built with ``matplotlib.figure.Figure`` and an Agg canvas directly, never through
``pyplot``: the user's backend and pyplot's figure list are left alone, and each
figure is cleared as soon as its PNG is written.

>>> comparison_png({"peak_bytes": 10}, {"peak_bytes": 5})[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""
from __future__ import annotations

import io
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .style import CATEGORY_COLORS, CATEGORY_LABELS
from ..trace.records import CATEGORIES
from ..util.units import format_bytes, scale_unit

_FONT = {"font.size": 9, "font.family": "DejaVu Sans"}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=fig.dpi, facecolor="white")
    fig.clear()
    return buf.getvalue()


def comparison_png(before: dict[str, Any], after: dict[str, Any], *, limit: int | None = None,
                   width: float = 6.0, dpi: int = 100) -> bytes:
    """Two stacked bars (peak memory by category) before and after a fix."""
    import matplotlib

    with matplotlib.rc_context(_FONT):
        fig = Figure(figsize=(width, 2.2), dpi=dpi)
        ax = fig.add_subplot(111)
        rows = [("before", before or {}), ("after", after or {})]
        tops = [float(r.get("peak_bytes") or sum((r.get("peak_by_category") or {}).values()) or 0) for _, r in rows]
        scale, unit = scale_unit(max(tops + [float(limit or 0)]) or 1)
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
