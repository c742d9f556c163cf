"""Capture one training step: every aten op, live memory, non-finite values, failures.

:class:`Capture` is the public context manager; a private dispatch mode hands it
each op (forward, backward and optimizer step alike). Everything is turned into
strings and numbers as it happens (see ``trace.py``); tensors and modules are
only ever weakly referenced, and every global touched (dispatch mode, module and
optimizer hooks, per-parameter hooks) is restored on exit, exceptions included.

>>> import torch
>>> x = torch.randn(4, 3, requires_grad=True)
>>> with Capture() as cap:
...     (x * 2).sum().backward()
>>> [op.phase for op in cap.trace.ops][:2]
['forward', 'forward']
"""
from __future__ import annotations

import collections
import itertools
import sys
import time
import weakref
from array import array
from typing import TYPE_CHECKING, Any

import torch
import torch.optim.optimizer as _optim
from torch.nn.modules import module as _nn_module

from . import checks, namespace as ns_mod
from ._mode import _DoctorMode
from .frames import UserFrames
from .memory import MemoryLedger, storage_key
from .stats import meta, screen_nonfinite
from .trace import (CATEGORIES, FailedOp, InplaceEvent, NonFiniteEvent, OpRecord, Trace, Where)
from .units import format_bytes

if TYPE_CHECKING:
    from .history import CellHistory

_META_KEY = "backward_doctor"  # key in autograd Node.metadata: (run id, forward op index)
_run_ids = itertools.count(1)
_MAX_EVENTS = 200


_current_node = torch._C._current_autograd_node
_CLEARING = ("aten::zero_", "aten::_foreach_zero_")  # what zero_grad(set_to_none=False) does
_FUNCS: dict[Any, tuple[str, tuple[int, ...], bool, bool]] = {}


def _func_info(func: Any) -> tuple[str, tuple[int, ...], bool, bool]:
    """(name, positions of arguments it writes into, is a view, has an index check), cached."""
    schema = func._schema
    mutated = tuple(i for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only)
    is_view = not mutated and any(r.alias_info is not None for r in schema.returns)
    info = (schema.name, mutated, is_view, checks.has_index_check(func))
    _FUNCS[func] = info
    return info


def _tensors(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """Tensor arguments, looking one level into lists/tuples (``cat``'s list) — faster than pytree."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


class Capture:
    """Record the ops and memory of the code run inside ``with Capture(...)``.

    ``namespace``: the user's globals, read to name variables and modules and to
    count what existed before. ``memory_limit``: simulated device capacity in
    bytes; the op that pushes live bytes past it raises ``torch.OutOfMemoryError``.
    ``check_indices``: validate index ranges before index ops run (default: on
    CUDA only, where a bad index would otherwise kill the context).
    """

    def __init__(self, namespace: dict[str, Any] | None = None, *, cell_file: str = "<cell>",
                 source: str = "", memory_limit: int | None = None, max_ops: int = 100_000,
                 tail_ops: int = 10_000, check_indices: bool | None = None,
                 history: "CellHistory | None" = None) -> None:
        self.namespace = namespace if namespace is not None else {}
        self.memory_limit = memory_limit
        self.check_indices = check_indices
        self.trace = Trace(source=source, cell_file=cell_file, torch_version=torch.__version__)
        self.trace.memory.limit_bytes = memory_limit
        self._frames = UserFrames(cell_file)
        self._ledger = MemoryLedger()
        self._ledger.on_free = self._on_free
        self._max_ops, self._tail = max_ops, collections.deque(maxlen=tail_ops)
        self._detail_budget = 8  # non-finite origins that get full statistics
        self._tail_count = 0  # records that went to the ring buffer (some since overwritten)
        self._run_id = next(_run_ids)
        self.trace.run_id = self._run_id
        self.history = history
        self._got_grad: set[int] = set()  # ids of parameters autograd accumulated into
        self._handles: list[Any] = []
        self._mode: _DoctorMode | None = None
        self._modules: dict[int, tuple[weakref.ref, str]] = {}
        self._module_stack: list[int] = []
        self._where_stacks: list[tuple[Where, tuple[int, ...]]] = []
        self._params: dict[int, weakref.ref] = {}
        self._opt_depth = 0
        self._pending: list[tuple[weakref.ref, int]] = []
        self._writer: dict[int, int] = {}      # storage key -> last op that wrote it
        self._nf_origin: dict[int, int] = {}   # storage key -> op index that first made its NaN/Inf
        self._nf_by_index: dict[int, int] = {}
        self._ns_names: dict[int, str] = {}    # storage key -> variable name (at start)
        self._last_phase = "forward"
        self._roots: list[int | None] = []  # forward op of each backward's root node
        self._oom: dict[str, Any] | None = None
        self._timeline = {c: array("q") for c in CATEGORIES}
        self._timeline_arrays = [self._timeline[c] for c in CATEGORIES]
        self._timeline_index = array("q")
        self._cuda = torch.cuda.is_available()
        self._cuda_alloc = array("q")
        self._t0 = 0.0

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Capture":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.stop()
        return False

    def start(self) -> None:
        import torch._dynamo  # noqa: F401  (the first dispatch mode imports it: keep that out of step time)

        self._scan_namespace()
        if self.history is not None:
            self._forget_zeroed_grads()
        self.trace.memory.baseline_bytes = self._ledger.total
        self._handles += [
            _nn_module.register_module_forward_pre_hook(self._module_pre),
            _nn_module.register_module_forward_hook(self._module_post, always_call=True),
            _optim.register_optimizer_step_pre_hook(self._optim_pre),
            _optim.register_optimizer_step_post_hook(self._optim_post),
        ]
        if self._cuda:
            from . import cuda as _cuda
            _cuda.start(self)
        self._t0 = time.perf_counter()
        self._mode = _DoctorMode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Pop the mode and remove every hook; safe to call twice."""
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
            self.trace.duration_s = time.perf_counter() - self._t0
            if self._cuda:
                from . import cuda as _cuda
                _cuda.stop(self)

    # ---------------------------------------------------------------- namespace
    def _scan_namespace(self) -> None:
        led = self._ledger
        for name, mod in ns_mod.modules(self.namespace):
            self._register_module(mod)
        for name, opt in ns_mod.optimizers(self.namespace):
            for group in opt.param_groups:
                for p in group["params"]:
                    self._register_param(p)
            for t in ns_mod.optimizer_state_tensors(opt):
                led.track(t, "optimizer")
        for name, t in ns_mod.tensors(self.namespace):
            key = storage_key(t)
            if key is not None:
                self._ns_names.setdefault(key, name)
            led.track(t, "other")
            if t.grad_fn is not None:
                self.trace.carriers.append({"variable": name, "shape": list(t.shape),
                                            "grad_fn": type(t.grad_fn).__name__, "key": key or 0})

    def _forget_zeroed_grads(self) -> None:
        """Gradients zeroed since their step (e.g. by zero_grad in another cell) are not stale."""
        marks = self.history.stepped_grads
        with torch.no_grad():
            for grad in list(marks.keys()):
                if not bool(grad.any()):
                    marks.pop(grad, None)

    def _register_module(self, mod: torch.nn.Module) -> None:
        for sub in mod.modules():
            if id(sub) in self._modules:
                continue
            self._modules[id(sub)] = (weakref.ref(sub), type(sub).__name__)
            for p in sub.parameters(recurse=False):
                self._register_param(p)

    def _register_param(self, p: torch.Tensor) -> None:
        if id(p) in self._params:
            return
        self._params[id(p)] = weakref.ref(p)
        self._ledger.track(p, "parameters")
        if p.grad is not None:
            self._ledger.track(p.grad, "gradients")
        if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, param: torch.Tensor) -> None:
        self._got_grad.add(id(param))
        if param.grad is not None:
            self._ledger.reclassify(param.grad, "gradients")

    def parameters(self) -> list[torch.Tensor]:
        """The live parameters seen during the run (strong refs only for the caller's use)."""
        return [p for p in (r() for r in self._params.values()) if p is not None]

    # ---------------------------------------------------------------- hooks
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) not in self._modules:
            self._register_module(module)
        self._module_stack.append(id(module))

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._module_stack
        if stack and stack[-1] == id(module):
            stack.pop()
        elif id(module) in stack:  # an exception skipped inner post-hooks
            del stack[stack.index(id(module)):]

    def _optim_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._opt_depth += 1
        for group in opt.param_groups:
            for p in group["params"]:
                self._register_param(p)
        where = self._frames.where(sys._getframe(1))
        step = {"index": self.trace.op_count, "optimizer": type(opt).__name__, "id": id(opt),
                "line": where.line, "file": where.file, "cell_line": where.cell_line}
        self.trace.optimizer_steps.append(step)
        if self.history is not None:
            self._check_stale(opt, step)

    def _check_stale(self, opt: torch.optim.Optimizer, step: dict[str, Any]) -> None:
        """A gradient an earlier step already consumed, never cleared since: accumulation by accident."""
        marks = self.history.stepped_grads
        stale = [(p, marks[p.grad]) for g in opt.param_groups for p in g["params"]
                 if p.grad is not None and p.grad in marks]
        if stale:
            self.trace.stale_steps.append({**step, "params": len(stale),
                                           "since_run": min(m[0] for _, m in stale),
                                           "previous_line": stale[0][1][1]})

    def _optim_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._opt_depth = max(0, self._opt_depth - 1)
        for t in ns_mod.optimizer_state_tensors(opt):
            self._ledger.reclassify(t, "optimizer")
        if self.history is not None:
            line = self.trace.optimizer_steps[-1]["line"] if self.trace.optimizer_steps else None
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        self.history.stepped_grads[p.grad] = (self._run_id, line)

    def _on_free(self, key: int) -> None:
        self._writer.pop(key, None)
        self._nf_origin.pop(key, None)

    # ---------------------------------------------------------------- per op
    def _where(self) -> Where:
        w = self._frames.where(sys._getframe(2))
        if self._module_stack:
            self._where_stacks.append((w, tuple(self._module_stack)))
        return w

    def _flush_pending(self) -> None:
        # Autograd attaches grad_fn after the dispatch mode returns, so outputs of
        # the previous op are tagged now: backward ops then find their forward op.
        pending, self._pending = self._pending, []
        for ref, index in pending:
            t = ref()
            if t is None:
                continue
            fn = t.grad_fn
            if fn is not None:
                md = fn.metadata
                if _META_KEY not in md:
                    md[_META_KEY] = (self._run_id, index)

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._pending:
            self._flush_pending()
        info = _FUNCS.get(func) or _func_info(func)
        name = info[0]
        trace = self.trace
        index = trace.op_count
        trace.op_count += 1
        node = _current_node()
        fwd_index = None
        if node is not None:
            phase = "backward"
            tag = node.metadata.get(_META_KEY)
            if tag is not None and tag[0] == self._run_id:
                fwd_index = tag[1]
        else:
            phase = "optimizer" if self._opt_depth else "forward"
        grad_enabled = torch.is_grad_enabled()
        ins = _tensors(args, kwargs)
        where = self._where()
        if phase == "backward" and self._last_phase != "backward":
            trace.backward_calls.append(where)
            trace.backward_roots.append(node.name())
            self._roots.append(fwd_index)
        self._last_phase = phase
        led = self._ledger
        in_keys = [storage_key(t) or 0 for t in ins]
        for t, k in zip(ins, in_keys):
            if k and not led.known(k):
                led.track(t, "other")
        t_op = time.perf_counter()
        try:
            if info[3] and (self.check_indices or (self.check_indices is None and any(t.is_cuda for t in ins))):
                self._check_indices(func, name, args, kwargs)
            out = func(*args, **kwargs)
        except BaseException as exc:
            self._record_failure(index, name, phase, ins, where, exc, func, args, kwargs, fwd_index)
            raise
        t_op = time.perf_counter() - t_op
        # Our own bookkeeping ops must never become part of the user's graph.
        torch._C._set_grad_enabled(False)
        try:
            self._after(info, args, index, phase, grad_enabled, ins, in_keys, out, where, fwd_index, t_op)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        return out

    def _check_indices(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        bad = checks.index_check(func, args, kwargs)
        if bad is not None:
            raise IndexError(f"{name}: {bad['argument']} value(s) {bad['bad']} out of range "
                             f"[{bad['valid'][0]}, {bad['valid'][1]}] ({bad['what']}); "
                             "checked by backward_doctor before the kernel ran")

    def _after(self, info, args, index, phase, grad_enabled, ins, in_keys, out, where, fwd_index, t_op) -> None:
        name, mutated, is_view = info[0], info[1], info[2]
        trace = self.trace
        led = self._ledger
        outs = _tensors((out,), None)
        out_keys = [storage_key(o) or 0 for o in outs]
        builds_graph = grad_enabled and phase == "forward" and any(t.requires_grad for t in ins)
        if phase == "forward":
            category = "activations" if builds_graph else "other"
        else:
            category = "other" if phase == "backward" else "optimizer"
        before = led.total
        writer = self._writer
        for o, k in zip(outs, out_keys):
            if k:
                led.track(o, category, index)
                writer[k] = index
        if mutated and phase == "forward":
            self._record_inplace(index, name, args, mutated, where)
            if name in _CLEARING and self.history is not None and args:
                cleared = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                for t in cleared:  # zero_grad(set_to_none=False) zeroes in place
                    self.history.stepped_grads.pop(t, None)
        if builds_graph:
            self._pending.extend((weakref.ref(o), index) for o in outs)
        if not is_view:  # a view shows values its base already had: nothing new to screen
            self._screen(index, name, phase, ins, in_keys, outs, out_keys, where, fwd_index, mutated)
        total = led.total
        totals = led.totals
        for arr, value in zip(self._timeline_arrays, totals):
            arr.append(value)
        self._timeline_index.append(index)
        if self._cuda:
            self._cuda_alloc.append(torch.cuda.memory_allocated())
        mem = trace.memory
        if total > mem.peak_bytes:
            mem.peak_bytes, mem.peak_index, mem.peak_by_category = total, index, led.snapshot()
        rec = OpRecord(index=index, op=name, phase=phase, inputs=[meta(t) for t in ins],
                       outputs=[meta(o) for o in outs], where=where, fwd_index=fwd_index,
                       grad_enabled=grad_enabled, in_keys=in_keys, out_keys=out_keys, live_bytes=total,
                       duration_us=t_op * 1e6)
        if len(trace.ops) < self._max_ops:
            trace.ops.append(rec)
        else:
            self._tail_count += 1
            self._tail.append(rec)
        tot = trace.op_totals.get(name)
        if tot is None:
            trace.op_totals[name] = [1, rec.duration_us]
        else:
            tot[0] += 1
            tot[1] += rec.duration_us
        if self.memory_limit is not None and total > self.memory_limit:
            self._raise_simulated_oom(index, name, total - before, where)

    # ---------------------------------------------------------------- evidence
    def _record_inplace(self, index: int, name: str, args: tuple, mutated: tuple[int, ...], where: Where) -> None:
        if len(self.trace.inplace) >= 10 * _MAX_EVENTS:
            return
        for i in mutated:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                t = args[i]
                key = storage_key(t) or 0
                # The version counter is bumped above this dispatch level, after we return: +1.
                producer = self._ledger.producer(key)
                prod = self.trace.op(producer)
                self.trace.inplace.append(InplaceEvent(
                    index=index, op=name, key=key, version=int(t._version) + 1, shape=list(t.shape),
                    requires_grad=bool(t.requires_grad), where=where, producer_index=producer,
                    producer_op=prod.op if prod else None))

    def _screen(self, index, name, phase, ins, in_keys, outs, out_keys, where, fwd_index, mutated) -> None:
        for o, k in zip(outs, out_keys):
            if not screen_nonfinite(o):
                continue
            origin = next((self._nf_origin[ik] for ik in in_keys if ik in self._nf_origin), None)
            kind, variable = "op", None
            if origin is None:
                written = {in_keys[i] for i in mutated if i < len(in_keys)}
                bad_inputs = [(t, ik) for t, ik in zip(ins, in_keys) if ik not in written and screen_nonfinite(t)]
                if bad_inputs:
                    kind = "input"
                    variable = self._ns_names.get(bad_inputs[0][1])
                origin = index
            if k:
                self._nf_origin[k] = origin
            self._nf_by_index.setdefault(index, origin)
            events = self.trace.nonfinite
            if origin != index and len(events) >= _MAX_EVENTS:
                return
            fwd = self.trace.op(fwd_index)
            # Statistics cost a few reductions: the first origins get them, not every echo.
            detail = origin == index and self._detail_budget > 0
            self._detail_budget -= detail
            events.append(NonFiniteEvent(
                index=index, op=name, phase=phase, where=where, origin=origin, is_origin=origin == index,
                kind=kind, variable=variable, output=meta(o, with_stats=detail),
                inputs=[meta(t, with_stats=detail) for t in ins], fwd_op=fwd.op if fwd else None,
                fwd_index=fwd_index))
            return

    def _record_failure(self, index, name, phase, ins, where, exc, func, args, kwargs, fwd_index) -> None:
        if isinstance(exc, torch.OutOfMemoryError) and self._oom is None:
            self._oom = self._memory_breakdown(index, requested=None)
        if not isinstance(exc, Exception):
            return  # KeyboardInterrupt etc.: not this op's fault
        idx = checks.index_check(func, args, kwargs) if isinstance(exc, (IndexError, RuntimeError)) else None
        self.trace.failed_op = FailedOp(
            index=index, op=name, phase=phase, inputs=[meta(t, with_stats=True) for t in ins], where=where,
            error=f"{type(exc).__name__}: {exc}".split("\n")[0][:500], fwd_index=fwd_index, index_check=idx)

    def _memory_breakdown(self, index: int, requested: int | None) -> dict[str, Any]:
        by_module: dict[int, int] = {}
        for producer, nbytes in self._ledger.bytes_by_producer().items():
            by_module[producer if producer is not None else -1] = nbytes
        return {"index": index, "requested": requested, "live": self._ledger.total,
                "by_category": self._ledger.snapshot(), "by_producer": by_module}

    def _raise_simulated_oom(self, index: int, name: str, requested: int, where: Where) -> None:
        self._oom = self._memory_breakdown(index, requested)
        self._oom["simulated"] = True
        limit = self.memory_limit or 0
        raise torch.OutOfMemoryError(
            f"Simulated device out of memory (backward_doctor memory_limit={format_bytes(limit)}). "
            f"Tried to allocate {format_bytes(requested)} in {name}; {format_bytes(self._ledger.total - requested)} "
            f"already live, {format_bytes(max(0, limit - self._ledger.total + requested))} free.")

    # ---------------------------------------------------------------- results
    def record_exception(self, exc: BaseException) -> None:
        """Turn the cell's exception into text and evidence (keeps no frame or tensor)."""
        from ._finish import record_exception

        record_exception(self, exc)

    def finish(self) -> Trace:
        """Resolve names, downsample the timeline, decide what NaN/Inf reached; returns the trace."""
        from ._finish import finish

        return finish(self)
