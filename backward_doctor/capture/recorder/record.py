"""The per-op hot path: what happens for every aten op while a step is captured.

Kept lean on purpose (see benchmarks/): each op appends a fixed number of ints to
flat ``array`` buffers (op name, tensor metadata and source position are interned:
an id per distinct value) and the trace's dataclasses are built once, at the end
(``_finish.py``). No Python object is kept per op: objects the garbage collector
tracks would make it run during the user's step, and a full collection of a
process with torch loaded takes ~0.2 s. Evidence that needs the tensors
themselves (statistics, index values, in-place versions) is taken right here,
because after the op returns the tensors may be gone.

Backward ops find their forward op through autograd's per-thread sequence
number: the node an op creates takes the counter's value just before the op is
dispatched, and ``node._sequence_nr()`` gives it back in backward. No tensor,
node or frame is kept.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from . import checks
from .op_schema import _FUNCS, _bump_versions, _func_info, _tensors, filled_by_peers, passed_on
from .memory import shape_of, storage_key
from ...util.process import doctors_own
from ..state import _NODE_BUDGET, PHASES, CaptureState
from .stats import meta, screen_nonfinite
from ...trace.parts import NonFiniteScalar, OomInfo
from ...trace.records import FailedOp, InplaceEvent, NonFiniteEvent, Where
from ...util.units import allocator_request, format_bytes

_current_node = torch._C._current_autograd_node
_graph_task_id = torch._C._current_graph_task_id
_sequence_nr = torch._C._autograd._get_sequence_nr
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_now = time.perf_counter
_MAX_EVENTS = 200
#: Ops that allocate without writing: their output's bits are not values, NaN patterns included.
_UNINITIALISED = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                            "aten::new_empty_strided", "aten::empty_permuted"})
_MAX_SCALARS = 64  # non-finite scalar outputs the first tier remembers
_CLEARING = ("aten::zero_", "aten::_foreach_zero_")  # what zero_grad(set_to_none=False) does

#: per kept op in ``Capture._rec_ints``: index, name id, phase id, forward op (-1: none), grad mode,
#: where id, inputs, outputs, offset in ``_rec_io`` (meta id and storage key per tensor), live bytes
_PHASE_ID = {p: i for i, p in enumerate(PHASES)}


class OpRecorder(CaptureState):
    """Mixin of :class:`~backward_doctor.capture.Capture`: the dispatch mode calls ``dispatch``."""

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # IPython leaves the doctor's frames out of the user's traceback
        try:  # (the bookkeeping before the op, under the recorder's guard: ``guard.py``; the op itself outside it)
            info = _FUNCS.get(func) or _func_info(func)
            name = info[0]
            index = self._count
            self._count = index + 1
            # Asking autograd for the running node gives it a Python wrapper that lives as long as the
            # node, and freeing a very long chain of wrapped nodes overflows the C stack (a crash in
            # the user's next gc). So the node is asked for a bounded number of backward ops; past
            # that, only the phase is known (from the graph task id, which wraps nothing).
            unattributed = False
            if self._node_budget > 0:
                node = _current_node()
                if node is not None:
                    self._node_budget -= 1
            else:
                node = None
                unattributed = _graph_task_id() != -1
            if node is not None:
                phase = "backward"
                fwd_index = self._seq_map.get(node._sequence_nr())
                if self._last_phase != "backward":  # a new backward() call starts at its root node
                    self._where_cache.clear()
                    where = self._where(cached=True)
                    self.trace.backward_calls.append(where)
                    self.trace.backward_roots.append(node.name())
                    self._roots.append(fwd_index)
                else:
                    where = self._where(cached=True)
            elif not unattributed:
                phase = "optimizer" if self._opt_depth else "forward"
                fwd_index = None
                where = self._where(cached=phase == "optimizer")
            if not unattributed:
                self._last_phase = phase
                grad_enabled = _grad_enabled()
                ins = _tensors(args, kwargs)
                led = self._ledger
                if led._dead:  # storages that died since the last op: counted out before their keys are looked up
                    led.drain()
                in_keys = tuple([storage_key(t) or 0 for t in ins])
                live = led._live
                for t, k in zip(ins, in_keys):
                    if k and k not in live:  # a tensor made before the step and not found in the namespace
                        led.track(t, "other")
                seq = _sequence_nr()
                check = info[3] and (self.check_indices or (self.check_indices is None
                                                             and any(t.is_cuda for t in ins)))
        except Exception as exc:
            if not self.guards.failed("recorder", exc):
                raise
            return passed_on(func, args, kwargs)
        if unattributed:
            return self._dispatch_unattributed(func, args, kwargs, info, index)
        t_op = _now()
        try:
            if check:
                self._check_indices(func, name, args, kwargs)
            out = func(*args, **kwargs)
        except BaseException as exc:
            self._failure_safely(index, name, phase, ins, where, exc, func, args, kwargs, fwd_index)
            raise
        if info[4]:
            _bump_versions(args, info[4])
        self._t_last = now = _now()
        t_op = now - t_op
        if phase == "forward" and seq != self._last_seq:
            # The counter moved since the previous op: this op's autograd node took seq - 1.
            self._seq_map[seq - 1] = index
            self._last_seq = seq
        self._after_safely(info, args, index, phase, grad_enabled, ins, in_keys, out, where, fwd_index, t_op)
        return out

    def _failure_safely(self, *args: Any) -> None:
        """:meth:`_record_failure` for the op that raised; the recorder's own failure there is said and swallowed
        (the user's exception, being raised, must stay the one raised)."""
        __tracebackhide__ = True
        try:
            self._record_failure(*args)
        except Exception as own:
            if not self.guards.failed("recorder", own):
                raise

    def _after_safely(self, *args: Any) -> None:
        """Record the op's results; what cannot be recorded is skipped and said, never raised into the
        user's step (only the simulated device's OutOfMemoryError is meant for the step)."""
        __tracebackhide__ = True
        try:
            self._after(*args)
        except BaseException as exc:  # noqa: BLE001 - a tensor kind the recorder cannot describe
            if _grad_enabled() is not args[4]:  # (it landed in the screens before their `finally` put grad
                _set_grad(args[4])              # mode back: the user's mode, as the op ran under it)
            if isinstance(exc, torch.OutOfMemoryError) or not isinstance(exc, Exception) or not doctors_own(exc):
                raise  # the simulated device's OOM; a signal handler's or the user's code's, as without the doctor
            self._unrecorded += 1
            if self._unrecorded == 1:
                self.trace.notes.append(f"some ops could not be recorded (the first: {args[0][0]}: "
                                        f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}); they ran as usual")

    def _dispatch_unattributed(self, func: Any, args: tuple, kwargs: dict, info: tuple, index: int) -> Any:
        """A backward op past the node budget: recorded, without its forward op."""
        __tracebackhide__ = True
        try:
            if not self._budget_noted:
                self._budget_noted = True
                self.trace.notes.append(f"backward ops after the first {_NODE_BUDGET} are not linked to their "
                                        "forward op (a very deep graph)")
            where = self._where(cached=True)
            self._last_phase = "backward"
            ins = _tensors(args, kwargs)
            in_keys = tuple([storage_key(t) or 0 for t in ins])
        except Exception as exc:
            if not self.guards.failed("recorder", exc):
                raise
            return passed_on(func, args, kwargs)
        t_op = _now()
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            self._failure_safely(index, info[0], "backward", ins, where, exc, func, args, kwargs, None)
            raise
        if info[4]:
            _bump_versions(args, info[4])
        self._t_last = now = _now()
        # (the grad mode the op ran under, put back after the screens: a checkpoint's recomputation runs in backward
        # with grad on, and must go on so, or it saves fewer tensors than its forward did: CheckpointError)
        self._after_safely(info, args, index, "backward", _grad_enabled(), ins, in_keys, out, where, None,
                           now - t_op)
        return out

    def _after(self, info, args, index, phase, grad_enabled, ins, in_keys, out, where, fwd_index, t_op) -> None:
        __tracebackhide__ = True
        name, mutated, is_view = info[0], info[1], info[2]
        led = self._ledger
        outs = _tensors((out,), None)
        out_keys = tuple(storage_key(o) or 0 for o in outs)
        if phase == "forward":
            category = "other"
            if grad_enabled:
                for t in ins:
                    if t.requires_grad:
                        category = "activations"
                        break
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
        if not is_view and (self.detail or (phase == "forward" and outs and outs[0].dim() == 0)):
            # A view shows values its base already had: nothing new to screen. The screens run
            # torch ops of our own, which must never join the user's graph: grad mode off.
            _set_grad(False)
            try:
                if self.detail:
                    written: Any = ()
                    if mutated:  # (what it writes into; a list for `_foreach_mul_`)
                        wrote = _tensors(tuple(args[i] for i in mutated if i < len(args)), None)
                        written = {storage_key(t) or 0 for t in wrote}
                        if not outs:  # (in place, returning nothing: `_foreach_mul_`, `_fused_adamw_`)
                            outs, out_keys = wrote, tuple(storage_key(o) or 0 for o in wrote)
                    self._screen(index, name, phase, ins, in_keys, outs, out_keys, where, fwd_index, written)
                else:
                    self._screen_scalar(index, outs[0], where)
            finally:
                _set_grad(grad_enabled)
        total = led.total
        self._timeline.add(index, led.totals, total)
        if self._cuda:
            self._cuda_alloc.append(self._cuda_allocated())
        if total > self._peak:
            self._peak, self._peak_index, self._peak_by_category = total, index, led.snapshot()
        self._keep(index, name, phase, fwd_index, grad_enabled, where, ins, outs, in_keys, out_keys, total,
                   t_op * 1e6)
        tot = self._op_totals.get(name)
        if tot is None:
            self._op_totals[name] = [1, t_op * 1e6]
        else:
            tot[0] += 1
            tot[1] += t_op * 1e6
        if self.memory_limit is not None and total > self.memory_limit:
            self._raise_simulated_oom(index, name, total - before)

    def _keep(self, index, name, phase, fwd_index, grad_enabled, where, ins, outs, in_keys, out_keys, total,
              us) -> None:
        """Append the op's record as ints (interning name, tensor metadata and position)."""
        try:
            metas = [(t.shape, t.dtype, t.device, t.requires_grad) for t in ins]
            metas += [(t.shape, t.dtype, t.device, t.requires_grad) for t in outs]
        except RuntimeError as exc:  # a strided nested tensor has no single shape
            if not doctors_own(exc):
                raise
            metas = [(shape_of(t), t.dtype, t.device, t.requires_grad) for t in list(ins) + list(outs)]
        self._append(index, name, phase, fwd_index, grad_enabled, where, metas, list(in_keys) + list(out_keys),
                     len(ins), total, us)

    def _append(self, index: int, name: str, phase: str, fwd_index: int | None, grad_enabled: bool, where: Where,
                metas: list[tuple], keys: list[int], n_in: int, total: int, us: float) -> None:
        """One op's record from its tensors' (shape, dtype, device, requires_grad) and storage keys
        (inputs first); shared with the native tier, which has these without the tensors."""
        name_id = self._name_ids.get(name)
        if name_id is None:
            name_id = self._name_ids[name] = len(self._names)
            self._names.append(name)
        where_id = self._where_ids.get(id(where))
        if where_id is None:  # every Where is kept in _wheres, so its id() is never reused
            where_id = self._where_ids[id(where)] = len(self._wheres)
            self._wheres.append(where)
        meta_ids, known = self._meta_ids, self._metas
        io = []
        for m, k in zip(metas, keys):
            mid = meta_ids.get(m)
            if mid is None:
                mid = meta_ids[m] = len(known)
                known.append(m)
            io += (mid, k)
        fwd = -1 if fwd_index is None else fwd_index
        start = (self._t_last - self._t0) * 1e6 - us  # (_t_last: this op's end)
        if self._n_kept < self._max_ops:
            n_ints, n_io, n_us, n_t0 = len(self._rec_ints), len(self._rec_io), len(self._rec_us), len(self._rec_t0)
            try:  # all four or none: an exception from a signal handler may land between any two
                self._rec_ints.extend((index, name_id, _PHASE_ID[phase], fwd, grad_enabled, where_id, n_in,
                                       len(metas) - n_in, n_io, total))
                self._rec_io.extend(io)
                self._rec_us.append(us)
                self._rec_t0.append(start)
            except BaseException:
                del self._rec_ints[n_ints:], self._rec_io[n_io:], self._rec_us[n_us:], self._rec_t0[n_t0:]
                raise
            self._n_kept += 1
        else:  # past max_ops: a ring buffer of the last ops (a tuple each, bounded)
            self._tail_count += 1
            self._tail.append((index, name_id, _PHASE_ID[phase], fwd, grad_enabled, where_id, n_in,
                               tuple(io), total, us))
            self._tail_t0.append(start)

    # ---------------------------------------------------------------- evidence
    def _check_indices(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        __tracebackhide__ = True
        bad = checks.index_check(func, args, kwargs)
        if bad is not None:
            raise IndexError(f"{name}: {bad.argument} value(s) {bad.bad} out of range "
                             f"[{bad.valid[0]}, {bad.valid[1]}] ({bad.what}); "
                             "checked by backward_doctor before the kernel ran")

    def _record_inplace(self, index: int, name: str, args: tuple, mutated: tuple[int, ...], where: Where) -> None:
        if name in _CLEARING and self.history is not None and args:
            cleared = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            for t in cleared:  # zero_grad(set_to_none=False) zeroes in place: not stale any more
                self.history.stepped_grads.pop(t, None)
        if len(self.trace.inplace) >= 10 * _MAX_EVENTS:
            return
        for i in mutated:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                t = args[i]
                key = storage_key(t) or 0
                producer = self._ledger.producer(key)
                # `h[:, 0] = 0.0` writes a view of `h` (same storage, producer, version counter); PyTorch's
                # error names the base's shape, so that is kept too (`_base`: the root, however deep the view).
                base = t._base  # (the version counter is bumped above this dispatch level, after we return: +1)
                self.trace.inplace.append(InplaceEvent(
                    index=index, op=name, key=key, version=int(t._version) + 1, shape=list(shape_of(t)),
                    requires_grad=bool(t.requires_grad), where=where, producer_index=producer,
                    producer_op=self._op_name(producer),
                    base_shape=None if base is None else list(shape_of(base))))

    def _screen_scalar(self, index: int, out: torch.Tensor, where: Where) -> None:
        """First tier: a NaN/Inf scalar forward output; the detailed run is needed if it was the loss or a
        value the cell kept (decided in ``finish()``)."""
        if len(self._nf_scalars) < _MAX_SCALARS and screen_nonfinite(out):
            if not self._nf_scalars and self.rollback is not None:  # (a forward: the weights are still the
                self.rollback.went_nonfinite(self.trace.iterations.steps, "scalar")  # iteration's own)
            self._nf_scalars[index] = NonFiniteScalar(index=index, line=where.line, file=where.file)

    def _screen(self, index, name, phase, ins, in_keys, outs, out_keys, where, fwd_index, written) -> None:
        if name in _UNINITIALISED or (filled_by_peers(name) and not any(k in self._nf_origin for k in in_keys)):
            return  # fresh memory's bits are not values (DDP's buckets); what peers fill only carries an origin on
        first, origin, kind, variable = None, None, "op", None
        for o, k in zip(outs, out_keys):
            if not screen_nonfinite(o):
                continue
            if first is None:  # (the first NaN/Inf output is the event; every one carries its origin on)
                first = o
                origin = next((self._nf_origin[ik] for ik in in_keys if ik in self._nf_origin), None)
                if origin is None:
                    bad_inputs = [(t, ik) for t, ik in zip(ins, in_keys) if ik not in written and screen_nonfinite(t)]
                    if bad_inputs:
                        # NaN weights (an earlier step's doing) are not bad data.
                        kind = "weights" if self._ledger.category(bad_inputs[0][1]) == "parameters" else "input"
                        variable = self._ns_names.get(bad_inputs[0][1])
                    origin = index
            if k:
                self._nf_origin[k] = origin
        if first is None:
            return
        self._nf_by_index.setdefault(index, origin)
        events = self.trace.nonfinite
        if origin != index and len(events) >= _MAX_EVENTS:
            return
        # Statistics cost a few reductions: the first origins get them, not every echo.
        stats = origin == index and self._detail_budget > 0
        self._detail_budget -= stats
        events.append(NonFiniteEvent(
            index=index, op=name, phase=phase, where=where, origin=origin, is_origin=origin == index,
            kind=kind, variable=variable, output=meta(first, with_stats=stats),
            inputs=[meta(t, with_stats=stats) for t in ins], fwd_op=self._op_name(fwd_index),
            fwd_index=fwd_index))

    def _record_failure(self, index, name, phase, ins, where, exc, func, args, kwargs, fwd_index) -> None:
        if isinstance(exc, torch.OutOfMemoryError) and self._oom is None:
            self._oom = self._memory_breakdown(index, requested=allocator_request(str(exc)))
        if not isinstance(exc, Exception):
            return  # KeyboardInterrupt etc.: not this op's fault
        idx = checks.index_check(func, args, kwargs) if isinstance(exc, (IndexError, RuntimeError)) else None
        self.trace.failed_op = FailedOp(
            index=index, op=name, phase=phase, inputs=[meta(t, with_stats=True) for t in ins], where=where,
            error=f"{type(exc).__name__}: {exc}".split("\n")[0][:500], fwd_index=fwd_index, index_check=idx)

    def _memory_breakdown(self, index: int | None, requested: int | None) -> OomInfo:
        """Live bytes now by category; by producing op into ``_oom_producers`` (named by module at the end)."""
        by_producer: dict[int, int] = {}
        for producer, nbytes in self._ledger.bytes_by_producer().items():
            by_producer[producer if producer is not None else -1] = nbytes
        self._oom_producers = by_producer
        return OomInfo(index=index, requested=requested, live=self._ledger.total, by_category=self._ledger.snapshot())

    def _raise_simulated_oom(self, index: int, name: str, requested: int) -> None:
        __tracebackhide__ = True
        self._oom = self._memory_breakdown(index, requested)
        self._oom.simulated = True
        limit = self.memory_limit or 0
        live = self._ledger.total
        if requested <= 0:  # nothing new: what already existed is more than the device holds
            raise torch.OutOfMemoryError(
                f"Simulated device out of memory (backward_doctor memory_limit={format_bytes(limit)}): "
                f"{format_bytes(live)} of tensors are live at {name} (most of them made before the step), "
                "more than the device holds.")
        raise torch.OutOfMemoryError(
            f"Simulated device out of memory (backward_doctor memory_limit={format_bytes(limit)}). "
            f"Tried to allocate {format_bytes(requested)} in {name}; {format_bytes(live - requested)} "
            f"already live, {format_bytes(max(0, limit - live + requested))} free.")
