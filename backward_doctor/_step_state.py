"""End-of-run inspection of live objects, turned into plain records for the silent-bug rules.

Runs once per cell run (never per op): which parameters got gradients, which
tensors in the namespace still carry an autograd graph and from which runs.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from . import namespace as ns_mod
from .memory import storage_key
from .trace import ParamInfo

if TYPE_CHECKING:
    from .capture import Capture

_MAX_NODES = 2000      # graph nodes walked per holder
_MAX_HOLDERS = 50


def param_infos(cap: "Capture") -> list[ParamInfo]:
    names: dict[int, str] = {}
    for root, mod in ns_mod.modules(cap.namespace):
        for name, p in mod.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), f"{root}.{name}")
    stepped_opts = {s["id"] for s in cap.trace.optimizer_steps}
    stepped: set[int] = set()
    for _, opt in ns_mod.optimizers(cap.namespace):
        if id(opt) in stepped_opts:
            stepped.update(id(p) for g in opt.param_groups for p in g["params"])
    out = []
    for p in cap.parameters():
        out.append(ParamInfo(name=names.get(id(p), f"<parameter {tuple(p.shape)}>"), key=storage_key(p) or 0,
                             requires_grad=bool(p.requires_grad), got_grad=id(p) in cap._got_grad,
                             stepped=id(p) in stepped, numel=p.numel()))
    return out


def _holders(namespace: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(path, tensor, held in a container/attribute/closure) for tensors reachable from the namespace."""
    for path, value in ns_mod.user_items(namespace, depth=2):
        if isinstance(value, torch.Tensor):
            yield path, value, "[" in path
    for root, mod in ns_mod.modules(namespace):
        for sub_name, sub in mod.named_modules():
            for attr, value in list(vars(sub).items()):
                if attr.startswith("_") or isinstance(value, nn.Parameter):
                    continue
                base = f"{root}.{sub_name}.{attr}" if sub_name else f"{root}.{attr}"
                for path, item in ns_mod._children(base, value, 1):
                    if isinstance(item, torch.Tensor):
                        yield path, item, True
    for name, value in list(namespace.items()):
        cells = getattr(value, "__closure__", None) if callable(value) else None
        for i, cell in enumerate(cells or ()):
            try:
                content = cell.cell_contents
            except ValueError:
                continue
            for path, item in ns_mod._children(f"{name}.<closure {i}>", content, 1):
                if isinstance(item, torch.Tensor):
                    yield path, item, True


def _runs_in_graph(fn: Any, start: int, earlier: list[tuple[int, int, int]]) -> set[int]:
    """Earlier runs of this cell whose autograd nodes the graph behind ``fn`` still holds.

    Nodes are numbered per thread in creation order, so a node's ``_sequence_nr()``
    says which run made it: ``earlier`` is [(run id, first seq, end seq)].
    """
    runs: set[int] = set()
    seen: set[int] = set()
    queue = collections.deque([fn])
    while queue and len(seen) < _MAX_NODES:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        if seq < start:
            run = next((r for r, lo, hi in earlier if lo <= seq < hi), None)
            if run is not None:
                runs.add(run)
                break  # one node of an earlier run is enough to know
        queue.extend(n for n, _ in node.next_functions)
    return runs


def graph_holders(cap: "Capture") -> list[dict[str, Any]]:
    """Namespace tensors that still carry an autograd graph, with the earlier runs that graph holds."""
    start = cap._seq_start
    earlier = [(r.run_id, r.seq_start, r.seq_end) for r in cap.history.runs] if cap.history else []
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for path, t, contained in _holders(cap.namespace):
        fn = t.grad_fn
        if fn is None or id(t) in seen:
            continue
        seen.add(id(t))
        seq = fn._sequence_nr()
        own_index = cap._seq_map.get(seq) if seq >= start else None
        out.append({"path": path, "shape": list(t.shape), "bytes": t.untyped_storage().nbytes(),
                    "grad_fn": type(fn).__name__, "contained": contained,
                    "earlier_runs": sorted(_runs_in_graph(fn, start, earlier)),
                    "own_run": cap._run_id if seq >= start else None, "own_index": own_index})
        if len(out) >= _MAX_HOLDERS:
            break
    return out
