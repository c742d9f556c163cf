"""End-of-run inspection of live objects, turned into plain records for the silent-bug rules.

Runs once per cell run (never per op): which parameters got gradients, which
tensors in the namespace still carry an autograd graph and from which runs.
"""
from __future__ import annotations

import bisect
import collections
import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from .. import namespace as ns_mod
from ... import native as _native
from ..recorder.memory import shape_of, storage_key, storage_nbytes
from .object_holders import object_tensors
from ...util.stores import class_line, store_line_in_file
from ...trace.parts import GraphHolder
from ...trace.records import ParamInfo

if TYPE_CHECKING:
    from ..recorder.record import OpRecorder

_MAX_NODES = 2000      # graph nodes walked per holder
_MAX_HOLDERS = 50


def param_infos(cap: "OpRecorder") -> list[ParamInfo]:
    names: dict[int, str] = {}
    for root, mod in ns_mod.modules(cap.namespace):
        for name, p in mod.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), f"{root}.{name}")
    for name, t in ns_mod.tensors(cap.namespace):  # e.g. logit_scale = nn.Parameter(...)
        if isinstance(t, nn.Parameter):
            names.setdefault(id(t), name)
    stepped = cap._stepped_params  # (an optimizer a library holds is not in the namespace: its hook saw it)
    # The models the step ran, by identity (not by name: a model reached only through a library's internals,
    # Lightning's `trainer.strategy`, has none): the outermost module of each recorded op's module stack.
    in_run: set[int] = set()
    for outer in {stack[0] for _, stack in cap._where_stacks if stack}:
        mod = cap._modules.get(outer, (lambda: None, ""))[0]()
        if mod is not None:
            in_run.update(id(p) for p in mod.parameters())
    out = []
    for p in cap.parameters():
        out.append(ParamInfo(name=names.get(id(p), f"<parameter {tuple(shape_of(p))}>"), key=storage_key(p) or 0,
                             requires_grad=bool(p.requires_grad), got_grad=id(p) in cap._got_grad,
                             stepped=id(p) in stepped, numel=p.numel(),
                             grad_fn=None if p.is_leaf else type(p.grad_fn).__name__,
                             nbytes=p.numel() * p.element_size(), in_run_model=id(p) in in_run))
    return out


_HOLDS = (torch.Tensor, dict, list, tuple)


def _holders(namespace: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """(path, tensor, where it is stored) for tensors reachable from the namespace.

    The third item says where to look for the statement that stores it: the cell
    (``{"cell": [name]}``), a module's class, whose source is read only when needed
    (``{"cls", "target": ["self", attr], "module"}``)
    or a closure's function (``{"file", "first", "target": [freevar]}``).
    """
    for path, value in ns_mod.user_items(namespace, depth=2):
        if isinstance(value, torch.Tensor):
            yield path, value, {"cell": [path.split("[", 1)[0].split(".", 1)[0]], "contained": "[" in path}
    for root, mod in ns_mod.modules(namespace):
        for sub_name, sub in mod.named_modules():
            mod_path = f"{root}.{sub_name}" if sub_name else root
            # (only tensors and the containers that may hold them are looked into: a module's other
            # attributes, its config, flags and sizes, are most of what it holds)
            # (the name first: most of a module's attributes are torch's own, `_parameters`, `_forward_hooks`...,
            # dicts that would pass the type test: half the time of this scan on T5's 103 modules)
            attrs = [(a, v) for a, v in vars(sub).items() if a[0] != "_" and isinstance(v, _HOLDS)
                     and not isinstance(v, nn.Parameter)]
            attrs += [(a, v) for a, v in sub._buffers.items() if v is not None]  # buffers can hold graphs too
            for attr, value in attrs:
                for path, item in ns_mod._children(f"{mod_path}.{attr}", value, 1):
                    if isinstance(item, torch.Tensor):
                        yield path, item, {"cls": type(sub), "target": ["self", attr], "module": mod_path,
                                           "contained": True}
    yield from object_tensors(namespace)  # (a trainer's own lists: ``self.seen.append(outputs.logits)``)
    for name, value in list(namespace.items()):
        if isinstance(value, types.MethodType):
            value = value.__func__
        if not isinstance(value, types.FunctionType):  # (a closure is a function: other objects are not asked,
            continue                                   # a proxy's ``__getattr__`` may raise for any name)
        code, cells = value.__code__, value.__closure__
        if not cells:
            continue
        for var, cell in zip(code.co_freevars, cells):
            try:
                content = cell.cell_contents
            except ValueError:
                continue
            for path, item in ns_mod._children(f"{name}.<closure {var}>", content, 1):
                if isinstance(item, torch.Tensor):
                    yield path, item, {"file": code.co_filename, "first": code.co_firstlineno, "target": [var],
                                       "contained": True}


_SAVED_ATTRS: dict[type, list[str]] = {}


@functools.lru_cache(maxsize=256)
def _class_source(cls: type) -> tuple[str | None, int]:
    """(file, first line) of a module class's source. Looked up only for a holder that keeps an earlier
    run's graph: ``inspect.getsourcelines`` reads and tokenizes the whole file (a ``transformers`` modeling
    file is thousands of lines), far too slow to do for every submodule on every run."""
    try:
        return inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
    except (TypeError, OSError):  # a class defined in a notebook cell: ``__main__`` has no file
        return _class_from_code(cls)


def _class_from_code(cls: type) -> tuple[str | None, int]:
    """(file, first line) of a class from its methods' code objects, which still name the cell's file
    (IPython keeps the cell's lines in ``linecache``): the ``class`` statement around them there."""
    codes = [getattr(v, "__func__", v).__code__ for v in vars(cls).values()
             if hasattr(getattr(v, "__func__", v), "__code__")]
    if not codes:
        return None, 0
    file = codes[0].co_filename
    return file, class_line(file, cls.__name__, min(c.co_firstlineno for c in codes)) or 0


def _nodes(fn: Any, seen: dict[int, Any] | None = None, limit: int = _MAX_NODES) -> Iterator[Any]:
    """The autograd nodes behind ``fn``, breadth first, at most ``limit``; ``seen``: nodes not to visit, by
    id (filled with those visited; kept, not only their ids: a node's Python object that died could hand its
    id to another node's while the walk goes on)."""
    seen = {} if seen is None else seen
    limit = len(seen) + limit
    queue = collections.deque([fn])
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        queue.extend(n for n, _ in node.next_functions)


def _saved_bytes(fn: Any, seen_keys: set[int]) -> int:
    """Bytes of tensors the graph behind ``fn`` still saves for a backward (bounded walk)."""
    total = 0
    for node in _nodes(fn):
        names = _SAVED_ATTRS.get(type(node))
        if names is None:
            names = _SAVED_ATTRS[type(node)] = [a for a in dir(node) if a.startswith("_saved_")]
        for attr in names:
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed by a backward
                continue
            if isinstance(value, torch.Tensor):
                key = storage_key(value)
                if key and key not in seen_keys:
                    seen_keys.add(key)
                    total += storage_nbytes(value)
    return total


def _runs_in_graph(fn: Any, start: int, earlier: list[tuple[int, int, int]], clean: dict[int, Any],
                   limit: int = _MAX_NODES) -> set[int]:
    """Earlier runs of this cell whose autograd nodes the graph behind ``fn`` still holds.

    Nodes are numbered per thread in creation order, so a node's ``_sequence_nr()``
    says which run made it: ``earlier`` is [(run id, first seq, end seq)]. ``clean``: nodes (by id) whose
    whole graph was walked before and holds no earlier run's node (a model's outputs share most of their
    graph: the loss's walk covers the logits'); this walk's nodes join it when it ends the same way.
    """
    if not earlier:
        return set()
    seen = dict(clean)
    for node in _nodes(fn, seen, limit):
        seq = node._sequence_nr()
        if seq < start:
            run = next((r for r, lo, hi in earlier if lo <= seq < hi), None)
            if run is not None:
                return {run}  # one node of an earlier run is enough to know
    if len(seen) - len(clean) < limit:  # (walked to the end: every node behind these is clean too)
        clean.update(seen)
    return set()


def _oldest_seq(fn: Any, start: int, limit: int = _MAX_NODES) -> int:
    """The smallest sequence number of this run's nodes behind ``fn`` (bounded walk)."""
    return min((s for s in (n._sequence_nr() for n in _nodes(fn, None, limit)) if s >= start), default=start)


class GraphWalks:
    """The two walks :func:`graph_holders` makes from each tensor that carries a graph: the earlier run of the
    cell whose node it reaches first (walks share what they found clean), and the oldest node of this run. In
    C++ where the native recorder is loaded (``GraphWalk``: the same walk, node for node, ~1 ms less a cell on a
    T5 tiny step), else in Python. ``earlier``: (run id, first sequence number, end) of the earlier runs.

    >>> x = torch.ones(2, requires_grad=True)
    >>> start = torch._C._autograd._get_sequence_nr()
    >>> y = (x * 2).sum()
    >>> w = GraphWalks(start, [], native=False)
    >>> w.earlier_runs(y), w.oldest_seq(y) == start
    ([], True)
    """

    def __init__(self, start: int, earlier: list[tuple[int, int, int]], limit: int = _MAX_NODES,
                 native: bool = True) -> None:
        self.start, self.earlier, self.limit = start, earlier, limit
        self._clean: dict[int, Any] = {}  # (the Python walk's nodes, alive until the walks are done)
        ext = _native.ready() if native else None
        self._c = ext.GraphWalk(start, earlier, limit) if ext is not None and hasattr(ext, "GraphWalk") else None

    def earlier_runs(self, t: torch.Tensor) -> list[int]:
        """The earlier run the graph behind ``t`` holds a node of (a list of at most one), else []."""
        if not self.earlier:
            return []
        if self._c is not None:
            run = self._c.earlier_run(t)
            return [] if run is None else [run]
        return sorted(_runs_in_graph(t.grad_fn, self.start, self.earlier, self._clean, self.limit))

    def oldest_seq(self, t: torch.Tensor) -> int:
        """The smallest sequence number >= start behind ``t`` (start when none)."""
        if self._c is not None:
            return self._c.oldest_seq(t)
        return _oldest_seq(t.grad_fn, self.start, self.limit)


def graph_holders(cap: "OpRecorder") -> list[GraphHolder]:
    """Namespace tensors that still carry an autograd graph, with the earlier runs that graph holds and,
    in a loop, the iterations its graph comes from (a graph kept from an earlier iteration is a leak)."""
    start = cap._seq_start
    its = cap.trace.iterations
    bounds = cap._iter_seq  # the sequence number each iteration after the first began at
    # the iteration running when the run ended: its own graphs (`loss`, `out`) are expected
    current = its.steps if cap.trace.exception is not None else its.steps - 1
    earlier = [(r.run_id, r.seq_start, r.seq_end) for r in cap.history.runs] if cap.history else []
    out: list[GraphHolder] = []
    seen: set[int] = set()
    saved_keys: set[int] = set()
    walks = GraphWalks(start, earlier)
    for path, t, store in _holders(cap.namespace):
        fn = t.grad_fn
        if fn is None or id(t) in seen:
            continue
        seen.add(id(t))
        seq = fn._sequence_nr()
        own_index = cap._seq_map.get(seq) if seq >= start else None
        runs = walks.earlier_runs(t)
        holder = GraphHolder(path=path, shape=list(shape_of(t)), bytes=storage_nbytes(t), grad_fn=type(fn).__name__,
                             contained=store["contained"], earlier_runs=runs,
                             own_run=cap._run_id if seq >= start else None, own_index=own_index,
                             module=store.get("module"))
        kept_from_loop = False
        if seq >= start and its.steps > 1:
            # (nodes made after the last step belong to the last iteration's body)
            holder.iteration = min(current, bisect.bisect_right(bounds, seq))
            holder.from_iteration = min(current, bisect.bisect_right(bounds, walks.oldest_seq(t)))
            kept_from_loop = holder.from_iteration < current
        if runs or kept_from_loop:
            holder.graph_bytes = _saved_bytes(fn, saved_keys)
            if "cell" in store:
                holder.target = store["cell"]
            else:
                # (an object's attribute may be filled by the cell itself: `runner.log.append(loss)`)
                holder.target = [store["object"], store["target"][1]] if "object" in store else None
                file, first = _class_source(store["cls"]) if "cls" in store else (store.get("file"), store.get("first", 0))
                if file:
                    holder.store = "module" if "module" in store else "object" if "object" in store else "closure"
                    holder.store_file = file
                    holder.store_line = store_line_in_file(file, store["target"], first)
        out.append(holder)
        if len(out) >= _MAX_HOLDERS:
            break
    return out
