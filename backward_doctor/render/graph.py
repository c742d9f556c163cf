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

from collections import defaultdict
from typing import TYPE_CHECKING

from ..analysis.findings import forward_where
from ..report.places import line_label
from .style import esc
from .wording import unrecorded
from .view import offending_record, tensor_bytes
from ..trace.queries import line_text
from ..trace.records import OpRecord, Trace
from .graph_svg import Node, View, _Edge, _Op, draw

if TYPE_CHECKING:
    from ..report.report import Report

MAX_NODES = 32
#: Ops autograd and the dispatcher run for themselves (``detach`` of a saved output): left out of node labels.
INTERNAL_OPS = frozenset({"detach", "alias", "lift_fresh", "_reshape_alias"})


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
        self.unrecorded = False       # the step ran with the recorder asleep (always on): nothing to draw
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
                # autograd's own bookkeeping (it detaches what it saves): not something the user wrote
                names = [m for m in names if m not in INTERNAL_OPS] or names
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
            msg = ("no autograd graph was recorded: the ops ran with the recorder asleep (always on)"
                   if self.unrecorded else "no autograd graph was recorded in this step (no forward op ran with "
                   "gradients enabled on tensors that require grad)")
            return (f'<svg xmlns="http://www.w3.org/2000/svg" width="640" height="40" role="img">'
                    f'<text x="8" y="24" font-family="sans-serif" font-size="12" fill="#57606a">{esc(msg)}</text>'
                    "</svg>")
        return draw(v, self.has_backward, within, max_width)


def _line_key(trace: Trace, rec: OpRecord, places: dict[str, str] | None = None) -> tuple[str, str]:
    """(label, source text) of the line an op ran on, named as the report names it (``Cell In[2], line 4``)."""
    w = rec.where
    if w.line is None:
        return "line ?", ""
    return line_label(places or {}, w.line, w.file), line_text(trace, w.line, w.file)


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
                line_cache[lk] = _line_key(trace, rec, getattr(report, "places", None))
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
    graph = ModuleGraph(ops, edges, dict(saved), hi, hi_module, has_backward)
    graph.unrecorded = unrecorded(trace)
    return graph


def _out_keys(trace: Trace, index: int) -> list[int]:
    rec = trace.op(index)
    return [k for k in rec.out_keys if k] if rec is not None else []


def _highlight(trace: Trace, report: "Report | None", ops: dict[int, _Op]) -> tuple[int | None, str | None]:
    if report is None or report.root_cause is None:
        return None, None

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


