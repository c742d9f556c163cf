"""Drawing a collapsed autograd graph (a :class:`View` of :class:`~backward_doctor.render.graph.ModuleGraph`)
as SVG: ranks top to bottom, one box per node with its time and saved bytes, edges labelled with
what autograd saved. Plain SVG text, every label escaped; no graphviz.

>>> one = Node(id="a", label="model.fc", detail="linear", composite=False, ops=[0])
>>> draw(View(nodes=[one], edges={}), has_backward=False, within=None, max_width=400).startswith("<svg")
True
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from .style import esc
from ..util.units import format_bytes, format_us


_NODE_H = 40


_RANK_GAP = 30


_FONT = 11
#: JupyterLab theme variables (inline SVG takes CSS variables in style attributes), light values as fallback.
_INK, _MUTED = "var(--jp-ui-font-color1,#1f2328)", "var(--jp-ui-font-color2,#57606a)"
_PAPER, _PAPER2 = "var(--jp-layout-color1,#ffffff)", "var(--jp-layout-color2,#f6f8fa)"
_PAPER3 = "var(--jp-layout-color3,#eaeef2)"


_CHAR_W = 6.7


@dataclass
class _Op:
    index: int
    module: str | None       # innermost module path, None outside modules
    line_key: str             # "cell:3" / "file.py:12"
    line_text: str
    name: str = ""            # aten op name without the namespace
    run: int = 0              # n-th uninterrupted run of ops of this module (own ops of a parent)
    fwd_us: float = 0.0
    bwd_us: float = 0.0
    bwd_ops: int = 0


@dataclass
class _Edge:
    src: int
    dst: int
    key: int
    nbytes: int
    shape: list[int]
    saved: bool = False


@dataclass
class Node:
    id: str
    label: str
    detail: str
    composite: bool
    ops: list[int] = field(default_factory=list)
    first: int = 0
    fwd_us: float = 0.0
    bwd_us: float = 0.0
    saved_bytes: int = 0
    highlight: bool = False
    rank: int = 0
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0


@dataclass
class View:
    nodes: list[Node]
    edges: dict[tuple[str, str], list[_Edge]]


# ---------------------------------------------------------------------- layout and SVG
def _tail(path: str) -> str:
    """``model.blocks.0`` -> ``blocks.0``; ``model.ln_f`` -> ``ln_f``."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 and parts[-1].isdigit() else parts[-1]


def _short_label(label: str, within: str | None, common: str) -> str:
    if within and label == within:
        return _tail(label)
    if common and label + "." == common:
        return _tail(label)
    short = label
    if within and label.startswith(within + "."):
        short = label[len(within) + 1:]
    elif common and label.startswith(common):
        short = label[len(common):]
    return _tail(label) if short[:1].isdigit() else short


def _common_prefix(labels: Iterable[str]) -> str:
    labels = [lab for lab in labels if not lab.startswith("cell line") and "." in lab]
    if len(labels) < 2:
        return ""
    parts = [lab.split(".") for lab in labels]
    out = []
    for group in zip(*parts):
        if len(set(group)) == 1:
            out.append(group[0])
        else:
            break
    return ".".join(out[:-1] if len(out) == min(len(p) for p in parts) else out) + "." if out else ""


def _trim(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def draw(v: View, has_backward: bool, within: str | None, max_width: int) -> str:
    nodes = sorted(v.nodes, key=lambda n: n.first)
    pos = {n.id: i for i, n in enumerate(nodes)}
    preds: dict[str, list[str]] = defaultdict(list)
    for (a, b) in v.edges:
        if pos[a] < pos[b]:
            preds[b].append(a)
    for n in nodes:  # longest path from the sources (back edges ignored)
        n.rank = max((next(m for m in nodes if m.id == p).rank + 1 for p in preds[n.id]), default=0) \
            if preds[n.id] else 0
    by_id = {n.id: n for n in nodes}
    common = _common_prefix(n.label for n in nodes)
    ranks: dict[int, list[Node]] = defaultdict(list)
    for n in nodes:
        ranks[n.rank].append(n)
    texts: dict[str, tuple[str, str]] = {}
    for n in nodes:
        title = _short_label(n.label, within, common)
        if n.composite:
            title = "▸ " + title
        stats = [f"{len(n.ops)} ops", f"fwd {format_us(n.fwd_us, compact=True)}"]
        if has_backward:
            stats.append(f"bwd {format_us(n.bwd_us, compact=True)}")
        if n.saved_bytes:
            stats.append(f"saved {format_bytes(n.saved_bytes)}")
        line2 = " · ".join(stats)
        if n.detail:
            title = f"{title}{': ' if n.id.startswith('@') else ' '}{n.detail}"
        texts[n.id] = (_trim(title, 64), line2)
        n.w = max(150.0, min(440.0, _CHAR_W * max(len(texts[n.id][0]), len(line2)) + 22))
    # Long edges (skipping ranks) are drawn as arcs on the right: leave room for them.
    long_edges = [(a, b) for (a, b) in v.edges if abs(by_id[b].rank - by_id[a].rank) > 1 or pos[a] > pos[b]]
    arc_room = 40 + 14 * min(len(long_edges), 8) if long_edges else 20
    row_w = {r: sum(n.w for n in ns) + 24 * (len(ns) - 1) for r, ns in ranks.items()}
    width = max(row_w.values()) + 2 * arc_room + 40
    cx = width / 2
    for r, ns in ranks.items():
        x = cx - row_w[r] / 2
        for n in ns:
            n.x = x
            n.y = 16 + r * (_NODE_H + _RANK_GAP) + (12 if r else 0)
            x += n.w + 24
    height = 16 + (max(ranks) + 1) * (_NODE_H + _RANK_GAP) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono,Menlo,Consolas,monospace" '
           f'font-size="{_FONT}" role="img" aria-label="autograd graph by module">',
           '<defs><marker id="bd-arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" markerHeight="8" '
           'markerUnits="userSpaceOnUse" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#8c959f"/></marker>'
           '<marker id="bd-arr-s" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="9" markerHeight="9" '
           'markerUnits="userSpaceOnUse" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#e15759"/></marker></defs>']
    # Edges first (under the nodes).
    arc_i = 0
    labels: list[str] = []
    for (a, b), es in sorted(v.edges.items(), key=lambda kv: (pos[kv[0][0]], pos[kv[0][1]])):
        na, nb = by_id[a], by_id[b]
        saved = {e.key: e.nbytes for e in es if e.saved}
        saved_b = sum(saved.values())
        biggest = max(es, key=lambda e: e.nbytes)
        color = "#e15759" if saved_b else "#8c959f"
        marker = "bd-arr-s" if saved_b else "bd-arr"
        sw = 1.2 + (1.6 if saved_b else 0)
        if saved_b:
            label = f"saved {format_bytes(saved_b)}"
        else:
            label = esc(str(biggest.shape).replace(" ", "")) if biggest.shape else "scalar"
        tip = esc(f"{len(es)} tensor(s) {na.label} → {nb.label}; largest {biggest.shape} "
                  f"({format_bytes(biggest.nbytes)})" + (f"; saved for backward: {format_bytes(saved_b)}"
                                                          if saved_b else "; not saved for backward"))
        forward = pos[a] < pos[b]
        if forward and nb.rank - na.rank == 1:
            x1, y1 = na.x + na.w / 2, na.y + _NODE_H
            x2, y2 = nb.x + nb.w / 2, nb.y
            my = (y1 + y2) / 2
            d = f"M{x1:.1f},{y1:.1f} C{x1:.1f},{my:.1f} {x2:.1f},{my:.1f} {x2:.1f},{y2:.1f}"
            lx, ly, anchor = (x1 + x2) / 2 + 9, my + 4, "start"
        else:
            off = 26 + 14 * (arc_i % 8)
            arc_i += 1
            side = 1 if forward else -1
            xa = na.x + (na.w if forward else 0)
            xb = nb.x + (nb.w if forward else 0)
            y1, y2 = na.y + _NODE_H / 2, nb.y + _NODE_H / 2
            xo = (max(xa, xb) + off) if forward else (min(xa, xb) - off)
            d = f"M{xa:.1f},{y1:.1f} C{xo:.1f},{y1:.1f} {xo:.1f},{y2:.1f} {xb:.1f},{y2:.1f}"
            lx, ly, anchor = xo + 3 * side, (y1 + y2) / 2, "start" if forward else "end"
        dash = "" if forward else ' stroke-dasharray="4 3"'
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{sw:.1f}"{dash} '
                   f'marker-end="url(#{marker})"><title>{tip}</title></path>')
        ink = "#b3261e" if saved_b else _MUTED
        labels.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="{anchor}" font-size="10" '
                      f'style="fill:{ink};stroke:{_PAPER}" paint-order="stroke" '
                      f'stroke-width="3">{label}</text>')
    for n in nodes:
        title, line2 = texts[n.id]
        # The theme's colours (dark in JupyterLab's dark theme); the finding's node keeps its light
        # yellow with dark red ink in both themes.
        fill = "#fff8e1" if n.highlight else _PAPER2 if n.composite else _PAPER
        stroke = "#c62828" if n.highlight else "#57606a" if n.composite else "#afb8c1"
        swn = 2.6 if n.highlight else 1.2
        tip = esc(f"{n.label}: {len(n.ops)} forward ops, forward {format_us(n.fwd_us, compact=True)}, backward {format_us(n.bwd_us, compact=True)}, "
                  f"saved for backward {format_bytes(n.saved_bytes)}" + (f"\n{n.detail}" if n.detail else "")
                  + ("\n(collapsed module: expand to see inside)" if n.composite else "")
                  + ("\nthe finding is here" if n.highlight else ""))
        dbl = (f'<rect x="{n.x + 3:.1f}" y="{n.y + 3:.1f}" width="{n.w:.1f}" height="{_NODE_H}" rx="6" '
               f'style="fill:{_PAPER3}" stroke="#afb8c1"/>') if n.composite else ""
        out.append(f'<g class="bd-node" data-id="{esc(n.id)}"><title>{tip}</title>{dbl}'
                   f'<rect x="{n.x:.1f}" y="{n.y:.1f}" width="{n.w:.1f}" height="{_NODE_H}" rx="6" '
                   f'style="fill:{fill}" stroke="{stroke}" stroke-width="{swn}"/>'
                   f'<text x="{n.x + 10:.1f}" y="{n.y + 16:.1f}" font-weight="bold" '
                   f'style="fill:{"#b3261e" if n.highlight else _INK}">{esc(title)}</text>'
                   f'<text x="{n.x + 10:.1f}" y="{n.y + 31:.1f}" font-size="10" '
                   f'style="fill:{"#57606a" if n.highlight else _MUTED}">{esc(line2)}</text>'
                   "</g>")
    out.extend(labels)
    out.append("</svg>")
    return "".join(out)


def legend_html() -> str:
    return ('<div class="sub">Forward runs top to bottom, backward bottom to top. '
            '<span style="color:#e15759;font-weight:600">Red edges</span>: tensors autograd saved for backward '
            '(bytes measured from what the backward pass read); grey edges: data that was not saved. '
            'Arcs on the right skip layers (residual connections); dashed arcs go back up. '
            '<span style="color:#c62828;font-weight:600">Red border</span>: the finding. '
            '▸ marks a collapsed module.</div>')
