"""The autograd graph of a step, collapsed by module, drawn as SVG (no graphviz needed).

Built from the trace alone: forward ops that recorded graph nodes (grad mode on, an
input requiring grad) are grouped by the module that ran them (ops outside modules
and a module's own ops by source line); edges follow the data flow between storages.
What a backward op read from the forward pass is what autograd saved for it, so
edges and nodes carry the measured bytes of *saved tensors*.

A view is a set of expanded module paths: a module that is not expanded is one node
holding everything inside it. :meth:`ModuleGraph.auto_expanded` picks the deepest
level that stays readable (a 12-layer transformer shows its 12 blocks).

>>> from backward_doctor.trace import Trace
>>> g = build_graph(Trace())
>>> "no autograd graph" in g.render_svg(set())
True
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from ..analysis.findings import forward_where
from .sections import esc, tensor_bytes
from ..trace.records import OpRecord, Trace
from ..util.units import format_bytes, format_us

if TYPE_CHECKING:
    from ..report.report import Report

MAX_NODES = 32
_NODE_H = 40
_RANK_GAP = 30
_FONT = 11
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


class ModuleGraph:
    """Forward ops of the autograd graph with data-flow edges; collapsed on demand."""

    def __init__(self, ops: dict[int, _Op], edges: list[_Edge], saved: dict[int, dict[int, int]],
                 highlight: int | None, highlight_module: str | None, has_backward: bool) -> None:
        self.ops = ops
        self.edges = edges
        self.saved = saved            # op index -> {key: bytes} of activations its backward read
        self.highlight = highlight    # op index of the finding, if it is in the graph
        self.highlight_module = highlight_module
        self.has_backward = has_backward
        paths: set[str] = set()
        for op in ops.values():
            if op.module:
                parts = op.module.split(".")
                paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        self.paths = paths
        self.composites = {p for p in paths if any(q.startswith(p + ".") for q in paths)}
        # a composite whose own ops are run too counts as composite (its own ops become line nodes)

    # ------------------------------------------------------------------ views
    def node_of(self, op: _Op, expanded: set[str]) -> tuple[str, str, bool]:
        """(node id, label, composite) that shows ``op`` when ``expanded`` modules are open."""
        if op.module:
            parts = op.module.split(".")
            for i in range(1, len(parts) + 1):
                p = ".".join(parts[:i])
                if p not in expanded:
                    return p, p, p in self.composites
            return f"{op.module}#{op.run}", op.module, False
        return f"@{op.line_key}", op.line_key, False

    def view(self, expanded: set[str], within: str | None = None) -> View:
        nodes: dict[str, Node] = {}
        node_for: dict[int, str] = {}
        for idx in sorted(self.ops):
            op = self.ops[idx]
            if within is not None and not (op.module == within or (op.module or "").startswith(within + ".")):
                continue
            nid, label, comp = self.node_of(op, expanded)
            n = nodes.get(nid)
            if n is None:
                n = nodes[nid] = Node(nid, label, "", comp, first=idx)
            n.ops.append(idx)
            n.fwd_us += op.fwd_us
            n.bwd_us += op.bwd_us
            node_for[idx] = nid
        for n in nodes.values():
            keys: dict[int, int] = {}
            for i in n.ops:
                keys.update(self.saved.get(i, {}))
            n.saved_bytes = sum(keys.values())
            n.highlight = self.highlight in n.ops if self.highlight is not None else bool(
                self.highlight_module and n.composite is False and n.id == self.highlight_module)
            if self.highlight is None and self.highlight_module and n.id and (
                    self.highlight_module == n.id or self.highlight_module.startswith(n.id + ".")):
                n.highlight = True
            if n.id.startswith("@"):
                n.detail = self.ops[n.ops[0]].line_text
            elif "#" in n.id:
                names = list(dict.fromkeys(self.ops[i].name for i in n.ops))
                n.detail = "· " + ", ".join(names[:3]) + (" …" if len(names) > 3 else "")
        edges: dict[tuple[str, str], list[_Edge]] = defaultdict(list)
        for e in self.edges:
            a, b = node_for.get(e.src), node_for.get(e.dst)
            if a is None or b is None or a == b:
                continue
            edges[(a, b)].append(e)
        return View(list(nodes.values()), dict(edges))

    def levels(self) -> list[set[str]]:
        """Expansion sets by depth: [{}, {paths of depth 1}, {depth <= 2}, ...]."""
        depth = max((p.count(".") + 1 for p in self.composites), default=0)
        return [{p for p in self.composites if p.count(".") < d} for d in range(depth + 1)]

    def auto_expanded(self, max_nodes: int = MAX_NODES) -> set[str]:
        """The deepest level of expansion that shows at most ``max_nodes`` nodes,
        plus the path down to the highlighted module when that still fits."""
        best: set[str] = set()
        for level in self.levels():
            if len(self.view(level).nodes) <= max_nodes:
                best = level
            else:
                break
        target = self._highlight_path()
        if target:
            parts = target.split(".")
            path = {".".join(parts[:i]) for i in range(1, len(parts))} & self.composites
            trial = best | path
            if len(self.view(trial).nodes) <= max_nodes * 1.5:
                best = trial
        return best

    def _highlight_path(self) -> str | None:
        if self.highlight is not None and self.highlight in self.ops:
            return self.ops[self.highlight].module
        return self.highlight_module

    def expandable(self, expanded: set[str]) -> list[str]:
        """Composite modules shown as one node in this view (candidates to expand)."""
        return [n.id for n in self.view(expanded).nodes if n.composite]

    # ------------------------------------------------------------------ drawing
    def render_svg(self, expanded: set[str], within: str | None = None, max_width: int = 980) -> str:
        v = self.view(expanded, within)
        if not v.nodes:
            msg = ("no autograd graph was recorded in this step (no forward op ran with gradients enabled "
                   "on tensors that require grad)")
            return (f'<svg xmlns="http://www.w3.org/2000/svg" width="640" height="40" role="img">'
                    f'<text x="8" y="24" font-family="sans-serif" font-size="12" fill="#57606a">{esc(msg)}</text>'
                    "</svg>")
        return _draw(v, self.has_backward, within, max_width)


def _line_key(trace: Trace, rec: OpRecord) -> tuple[str, str]:
    w = rec.where
    if w.line is None:
        return "line ?", ""
    if w.file is None:
        lines = trace.source.splitlines()
        text = lines[w.line - 1].strip() if 0 < w.line <= len(lines) else ""
        return f"cell line {w.line}", text
    import linecache

    return f"{os.path.basename(w.file)}:{w.line}", linecache.getline(w.file, w.line).strip()


def _builds_graph(op: OpRecord) -> bool:
    return op.phase == "forward" and op.grad_enabled and any(m.requires_grad for m in op.inputs)


def build_graph(trace: Trace, report: "Report | None" = None) -> ModuleGraph:
    """The step's autograd graph from ``trace`` (the report, if given, picks the node to highlight)."""
    ops: dict[int, _Op] = {}
    edges: list[_Edge] = []
    writer: dict[int, int] = {}
    line_cache: dict[tuple, tuple[str, str]] = {}
    backward_lines = {(w.line, w.file) for w in trace.backward_calls}
    runs: dict[str | None, int] = defaultdict(int)
    last_module: str | None = "\0"
    for rec in trace.ops:
        if rec.phase != "forward":
            continue
        # The ops ``loss.backward()`` makes itself (the seed gradient) are not part of the graph.
        graph_op = _builds_graph(rec) and (rec.where.line, rec.where.file) not in backward_lines
        if graph_op:
            if rec.where.module != last_module:
                runs[rec.where.module] += 1
                last_module = rec.where.module
            lk = (rec.where.line, rec.where.file)
            if lk not in line_cache:
                line_cache[lk] = _line_key(trace, rec)
            key, text = line_cache[lk]
            ops[rec.index] = _Op(rec.index, rec.where.module, key, text, name=rec.op.split("::")[-1],
                                 run=runs[rec.where.module], fwd_us=rec.duration_us)
            seen: set[int] = set()
            for k, m in zip(rec.in_keys, rec.inputs):
                p = writer.get(k)
                if k and p is not None and p in ops and k not in seen:
                    seen.add(k)
                    edges.append(_Edge(p, rec.index, k, tensor_bytes(m), list(m.shape)))
        ins = set(rec.in_keys)
        for k in rec.out_keys:
            # A view or alias shares its base's storage: the base's maker stays the writer.
            if k and (k not in ins or rec.op.endswith("_")):
                writer[k] = rec.index
    # Saved tensors: what each backward op read that its forward op had as input or output.
    saved: dict[int, dict[int, int]] = defaultdict(dict)
    has_backward = False
    fwd_keys: dict[int, dict[int, int]] = {}
    for rec in trace.ops:
        if rec.phase != "backward" or rec.fwd_index is None:
            continue
        op = ops.get(rec.fwd_index)
        if op is None:
            continue
        has_backward = True
        op.bwd_us += rec.duration_us
        op.bwd_ops += 1
        keys = fwd_keys.get(rec.fwd_index)
        if keys is None:
            f = trace.op(rec.fwd_index)
            keys = {}
            if f is not None:
                for k, m in list(zip(f.in_keys, f.inputs)) + list(zip(f.out_keys, f.outputs)):
                    if k:
                        keys[k] = tensor_bytes(m)
            fwd_keys[rec.fwd_index] = keys
        for k in rec.in_keys:
            if k in keys:
                saved[rec.fwd_index][k] = keys[k]
    # Only activations count as saved memory: parameters and input data exist anyway.
    activation_keys = {k for i in ops for k in _out_keys(trace, i)}
    for i in list(saved):
        saved[i] = {k: b for k, b in saved[i].items() if k in activation_keys}
    for e in edges:
        e.saved = e.key in saved.get(e.dst, {})
    hi, hi_module = _highlight(trace, report, ops)
    return ModuleGraph(ops, edges, dict(saved), hi, hi_module, has_backward)


def _out_keys(trace: Trace, index: int) -> list[int]:
    rec = trace.op(index)
    return [k for k in rec.out_keys if k] if rec is not None else []


def _highlight(trace: Trace, report: "Report | None", ops: dict[int, _Op]) -> tuple[int | None, str | None]:
    if report is None or report.root_cause is None:
        return None, None
    from .sections import offending_record

    f = report.root_cause
    rec, _, _ = offending_record(report)
    if rec is not None:
        idx = rec.fwd_index if rec.phase == "backward" else rec.index
        if idx in ops:
            return idx, None
        w = forward_where(trace, rec)
        if w.module:
            return None, w.module
    return None, f.module


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


def _draw(v: View, has_backward: bool, within: str | None, max_width: int) -> str:
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
        labels.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="{anchor}" font-size="10" '
                      f'fill="{"#b3261e" if saved_b else "#6e7781"}" paint-order="stroke" stroke="#fff" '
                      f'stroke-width="3">{label}</text>')
    for n in nodes:
        title, line2 = texts[n.id]
        fill = "#fff8e1" if n.highlight else "#f6f8fa" if n.composite else "#ffffff"
        stroke = "#c62828" if n.highlight else "#57606a" if n.composite else "#afb8c1"
        swn = 2.6 if n.highlight else 1.2
        tip = esc(f"{n.label}: {len(n.ops)} forward ops, forward {format_us(n.fwd_us, compact=True)}, backward {format_us(n.bwd_us, compact=True)}, "
                  f"saved for backward {format_bytes(n.saved_bytes)}" + (f"\n{n.detail}" if n.detail else "")
                  + ("\n(collapsed module: expand to see inside)" if n.composite else "")
                  + ("\nthe finding is here" if n.highlight else ""))
        dbl = (f'<rect x="{n.x + 3:.1f}" y="{n.y + 3:.1f}" width="{n.w:.1f}" height="{_NODE_H}" rx="6" '
               f'fill="#eaeef2" stroke="#afb8c1"/>') if n.composite else ""
        out.append(f'<g class="bd-node" data-id="{esc(n.id)}"><title>{tip}</title>{dbl}'
                   f'<rect x="{n.x:.1f}" y="{n.y:.1f}" width="{n.w:.1f}" height="{_NODE_H}" rx="6" fill="{fill}" '
                   f'stroke="{stroke}" stroke-width="{swn}"/>'
                   f'<text x="{n.x + 10:.1f}" y="{n.y + 16:.1f}" font-weight="bold" '
                   f'fill="{"#b3261e" if n.highlight else "#1f2328"}">{esc(title)}</text>'
                   f'<text x="{n.x + 10:.1f}" y="{n.y + 31:.1f}" font-size="10" fill="#57606a">{esc(line2)}</text>'
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
