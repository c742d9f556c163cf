"""The native recorder's buffers turned into the Python tier's records (after the step).

A mixin of :class:`~backward_doctor.capture.native_capture.NativeCapture`: the recorder hands
over flat int buffers (ops, tensors, sizes, in-place writes), the Python stack of each
op as code objects and bytecode offsets, and counts for ops past ``max_ops``; this
fills the same compact records, timeline, peak and events the Python tier fills while
it runs, so ``finish()`` and every rule work unchanged.
"""
from __future__ import annotations

import warnings
from array import array
from typing import Any

import torch

from .record import _CLEARING, _MAX_SCALARS
from ..state import PHASES
from .memory import grad_of, storage_key
from .stats import dtype_name
from ...trace.parts import NonFiniteScalar, OomInfo
from ...trace.records import CATEGORIES, InplaceEvent, NonFiniteEvent, TensorMeta, TensorStats, Where

_DTYPES: dict[int, torch.dtype] = {}
_DEVICE_TYPES: dict[int, str] = {}


def _tables(ext: Any) -> None:
    """ScalarType and DeviceType numbers -> torch objects, asked from the recorder itself."""
    if _DTYPES:
        return
    with warnings.catch_warnings():  # (quantized and complex32 dtypes warn when made)
        warnings.simplefilter("ignore")
        for dt in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:  # every dtype this torch has
            try:
                _DTYPES[ext.codes_of(torch.empty(0, dtype=dt))[0]] = dt
            except Exception:  # dtypes that have no plain empty tensor
                pass
    for dev in ("cpu", "meta"):
        _DEVICE_TYPES[ext.codes_of(torch.empty(0, device=dev))[1]] = dev


class NativeRecords:
    """Mixin: ``_convert(out)`` with ``out`` from the recorder's ``stop()``. The stale-gradient check waits for the
    buffers: a gradient zeroed in place (``zero_grad(set_to_none=False)``, ``p.grad.zero_()``) is an op the
    recorder saw, which only the buffers tell (:meth:`_stale_step`, :meth:`_resolve_stale`)."""

    _clearings: dict[int, list[int]]  # storage key -> indices of the ops that zeroed it in place
    _stale_pending: list[tuple[Any, list[tuple[int, tuple]]]]

    def _stale_step(self, step: Any, stale: list[tuple[Any, tuple]]) -> None:
        """A step on gradients an earlier step consumed, unless an op zeroed them in between: decided once the
        buffers are read (keys and marks kept, no tensor). The zeroing counts up to now, when the update is about to
        use the gradients, not only up to the step's call: a closure (Lightning's) zeroes them inside the step."""
        used = max(step.index, self._ops_so_far())
        self._stale_pending.append((step, used, [(storage_key(grad_of(p)) or 0, mark) for p, mark in stale]))

    def _resolve_stale(self) -> None:
        pending, self._stale_pending = self._stale_pending, []
        for step, used, stale in pending:
            kept = [(None, mark) for key, mark in stale if not self._zeroed_between(key, mark, used)]
            if kept:
                super()._stale_step(step, kept)

    def _zeroed_between(self, key: int, mark: tuple, index: int) -> bool:
        """Whether an op zeroed storage ``key`` in place after the step that marked it (``mark``: run id, line, ops
        so far then; an earlier run's mark: any time in this run) and before op ``index``."""
        low = mark[2] if mark[0] == self._run_id and len(mark) > 2 else -1
        return any(low <= i < index for i in self._clearings.get(key, ()))

    def _convert(self, out: dict[str, Any]) -> None:
        """The recorder's buffers -> the Python tier's records, timeline, peak and events.

        One pass over the ops with plain int indexing: the recorder has already interned what
        repeats (stacks, tensor descriptions, names), so each distinct one becomes a Python object
        once, and the records go straight into the flat arrays ``finish()`` reads."""
        recs, tens, sizes, inplace = (array("q", out[k]) for k in ("recs", "tensors", "sizes", "inplace"))
        codes, lastis, names = out["codes"], out["lastis"], out["names"]
        width, tw = out["width"], out["tensor_width"]
        roots = iter(out["roots"])
        n_recs = len(recs) // width
        if self._n_kept + n_recs > self._max_ops:  # (never with the recorder's own bound: kept for safety)
            raise RuntimeError("native records past max_ops")
        meta_ids = self._native_metas(out)
        name_ids = [self._intern_name(n) for n in names]
        seq_map: dict[int, int] = {}
        where_cache: dict[tuple[int, int, int], int] = {}
        stack_of, wheres, where_ids = self._stacks, self._wheres, self._where_ids
        backward_calls, backward_roots = self.trace.backward_calls, self.trace.backward_roots
        last_phase = 0
        idx_where: dict[int, Where] = {}
        idx_fwd: dict[int, tuple[str, int | None]] = {}  # op index -> (phase, forward op index)
        rec_ints, rec_io, rec_us, writer = self._rec_ints, self._rec_io, self._rec_us, self._writer
        rec_t0 = self._rec_t0
        counts, times = [0] * len(names), [0.0] * len(names)
        tl_index, tl_flat = array("q"), array("q")
        peak, peak_at = self._peak, -1
        # (the recorder keeps in-place writes of single tensors only: a foreach zero_grad(set_to_none=False) clears a
        # list, read here from the op's inputs for the stale-gradient check)
        list_zero = names.index("aten::_foreach_zero_") if "aten::_foreach_zero_" in names else -1
        list_cleared: list[tuple[int, int]] = []
        for b in range(0, n_recs * width, width):
            index, name_id, phase = recs[b], recs[b + 1], recs[b + 2]
            if phase == 0:
                for s in range(recs[b + 4], recs[b + 5]):
                    seq_map[s] = index
                fwd = -1
            else:
                fwd = seq_map.get(recs[b + 3], -1) if phase == 1 else -1
            stack_id = recs[b + 20] if phase == 0 else 0
            wkey = (recs[b + 10], recs[b + 11], stack_id)
            where_id = where_cache.get(wkey)
            if where_id is None:
                where = self._frames.where_recorded(codes, lastis, wkey[0], wkey[1])
                if stack_id:
                    self._where_stacks.append((where, stack_of[stack_id]))
                where_id = where_cache[wkey] = where_ids[id(where)] = len(wheres)
                wheres.append(where)
            where = wheres[where_id]
            if phase == 1 and last_phase != 1:
                backward_calls.append(where)
                backward_roots.append(next(roots, "").split("evaluate_function: ")[-1])
                self._roots.append(None if fwd < 0 else fwd)
            last_phase = phase
            idx_where[index] = where
            idx_fwd[index] = (PHASES[phase], None if fwd < 0 else fwd)
            t0, n_in, n = recs[b + 7], recs[b + 8], recs[b + 8] + recs[b + 9]
            if name_id == list_zero:
                list_cleared.extend((index, tens[j]) for j in range(t0 * tw, (t0 + n_in) * tw, tw))
            live = recs[b + 12]
            us = recs[b + 18] / 1e3  # (the recorder's layout: recorder.cpp, kWidth)
            rec_ints.extend((index, name_ids[name_id], phase, fwd, recs[b + 6], where_id, n_in, n - n_in,
                             len(rec_io), live))
            for j in range(t0 * tw, (t0 + n) * tw, tw):
                rec_io.append(meta_ids[tens[j + 8]])
                rec_io.append(tens[j])
            for j in range((t0 + n_in) * tw, (t0 + n) * tw, tw):
                if tens[j]:
                    writer[tens[j]] = index
            rec_us.append(us)
            rec_t0.append(recs[b + 21] / 1e3)
            tl_index.append(index)
            tl_flat.extend(recs[b + 13:b + 18])
            if live > peak:
                peak, peak_at = live, b
            counts[name_id] += 1
            times[name_id] += us
            if recs[b + 19] and len(self._nf_scalars) < _MAX_SCALARS:
                self._nf_scalars[index] = NonFiniteScalar(index=index, line=where.line, file=where.file)
        self._n_kept += n_recs
        self._timeline.extend(tl_index, tl_flat, len(CATEGORIES))
        if peak_at >= 0:
            self._peak, self._peak_index = peak, recs[peak_at]
            self._peak_by_category = dict(zip(CATEGORIES, recs[peak_at + 13:peak_at + 18]))
        for name_id, count in enumerate(counts):
            if count:
                tot = self._op_totals.setdefault(names[name_id], [0, 0.0])
                tot[0] += count
                tot[1] += times[name_id]
        self._count = out["count"]
        if self._count:  # the end of the last op (a failed step's time stops there, as on the Python tier)
            self._t_last = self._t0 + out["last_op_end_s"]
        self.buffer_bytes = out["buffer_bytes"]
        self._storage_log = (out["storage_log"], out["storage_dropped"])
        self._light(out, names)
        if out["failed_index"] >= 0:
            self._failed = (out["failed_index"], out["failed_overload"], list(out["failed_args"]),
                            names[out["failed_name"]] if out["failed_name"] >= 0 else None,
                            PHASES[out["failed_phase"]])
        if "oom" in out:  # the simulated device ran out (an allocation failed inside this op)
            oom = out["oom"]
            self._oom = OomInfo(index=oom["index"], requested=oom["requested"], live=oom["live"],
                                by_category=dict(zip(CATEGORIES, oom["totals"])), simulated=True)
            self._oom_producers = dict(oom["by_producer"])
        self._inplace_events(inplace, tens, sizes, tw, idx_where, list_cleared)
        if "detail" in out:
            self._nonfinite_events(out["detail"], names, idx_where, idx_fwd)
        self._ledger.adopt(out["totals"], out["by_producer"])

    def _native_metas(self, out: dict[str, Any]) -> list[int]:
        """The recorder's tensor descriptions as the records' meta ids (each distinct one made once)."""
        table, sizes = array("q", out["metas"]), out["meta_sizes"]
        ids, known, metas = [], self._meta_ids, self._metas
        for i in range(0, len(table), 6):
            dtype, dev_type, dev_index, rg, ndim, off = table[i:i + 6]
            dev = _DEVICE_TYPES.get(dev_type, "cpu")
            m = (torch.Size(sizes[off:off + ndim]), _DTYPES.get(dtype, torch.float32),
                 torch.device(dev if dev_index < 0 else f"{dev}:{dev_index}"), bool(rg))
            mid = known.get(m)
            if mid is None:
                mid = known[m] = len(metas)
                metas.append(m)
            ids.append(mid)
        return ids

    def _intern_name(self, name: str) -> int:
        name_id = self._name_ids.get(name)
        if name_id is None:
            name_id = self._name_ids[name] = len(self._names)
            self._names.append(name)
        return name_id

    def _nonfinite_events(self, d: dict[str, Any], names: list[str], idx_where: dict, idx_fwd: dict) -> None:
        """Detail: the recorder's NaN/Inf events (as ``_record.OpRecorder._screen`` makes them)."""
        self._nf_origin.update(d["nf_origin"])
        self._nf_by_index.update(d["nf_by_index"])
        ev, metas, sizes, stats = d["events"], d["metas"], d["sizes"], d["stats"]
        events = self.trace.nonfinite

        def meta(m: int) -> TensorMeta:
            dtype, dev_type, dev_index, rg, ndim, off, st = metas[m * 7:(m + 1) * 7]
            dev = _DEVICE_TYPES.get(dev_type, "cpu")
            t = TensorMeta(list(sizes[off:off + ndim]), dtype_name(_DTYPES.get(dtype, torch.float32)),
                           dev if dev_index < 0 else f"{dev}:{dev_index}", bool(rg))
            if st >= 0:
                numel, nan, pinf, ninf, has_finite, lo, hi, mean = stats[st:st + 8]
                t.stats = TensorStats(numel=int(numel), nan=int(nan), posinf=int(pinf), neginf=int(ninf))
                if has_finite:
                    t.stats.min, t.stats.max, t.stats.mean = lo, hi, mean
            return t

        for e in range(len(ev) // 6):
            index, origin, kind, var_key, first, n = ev[e * 6:(e + 1) * 6]
            phase, fwd = idx_fwd.get(index, ("forward", None))
            events.append(NonFiniteEvent(
                index=index, op=self._op_name(index) or "?", phase=phase, where=idx_where.get(index, Where()),
                origin=origin, is_origin=origin == index, kind=("op", "input", "weights")[kind],
                variable=self._ns_names.get(var_key) if var_key else None, output=meta(first),
                inputs=[meta(first + j) for j in range(1, n)], fwd_op=self._op_name(fwd), fwd_index=fwd))

    def _light(self, out: dict[str, Any], names: list[str]) -> None:
        """Ops past ``max_ops``: counted per name, a bounded timeline and the peak (not one by one)."""
        self._tail_count = out["count"] - self._n_kept
        for name_id, (count, ns) in out["light_totals"].items():
            tot = self._op_totals.setdefault(names[name_id], [0, 0.0])
            tot[0] += count
            tot[1] += ns / 1e3
        flat, w = out["light_timeline"], 2 + len(CATEGORIES)
        for i in range(0, len(flat), w):
            self._timeline.add(flat[i], list(flat[i + 2:i + w]), flat[i + 1])
        peak = out["light_peak"]
        if peak:
            self._sample(peak[0], list(peak[2:]), peak[1], timeline=False)

    def _sample(self, index: int, totals: list[int], live: int, timeline: bool = True) -> None:
        """Live bytes after op ``index``: into the timeline, and the peak if it is one."""
        if timeline:
            self._timeline.add(index, totals, live)
        if live > self._peak:
            self._peak, self._peak_index = live, index
            self._peak_by_category = dict(zip(CATEGORIES, totals))

    def _inplace_events(self, inplace: array, tens: array, sizes: array, tw: int, idx_where: dict,
                        list_cleared: list[tuple[int, int]] = ()) -> None:  # type: ignore[assignment]
        last_post = self._post_counts[-1] if self._post_counts else -1
        cleared: set[int] = set()
        for index, key in list_cleared:  # ((op index, storage key) a foreach zero_ cleared)
            self._clearings.setdefault(key, []).append(index)
            if index >= last_post:
                cleared.add(key)
        events = self.trace.inplace
        for e in range(len(inplace) // 7):  # (7 ints a write: recorder.cpp)
            index, key, version, producer, toff, base_off, base_ndim = inplace[e * 7:(e + 1) * 7]
            name = self._op_name(index)
            if name in _CLEARING:
                self._clearings.setdefault(key, []).append(index)
                if index >= last_post:
                    cleared.add(key)
            if len(events) >= 2000:
                continue
            t = tens[toff * tw:(toff + 1) * tw]
            events.append(InplaceEvent(
                index=index, op=name or "?", key=key, version=version, shape=list(sizes[t[6]:t[6] + t[5]]),
                requires_grad=bool(t[4]), where=idx_where.get(index, Where()),
                producer_index=None if producer < 0 else producer,
                producer_op=self._op_name(producer) if producer >= 0 else None,
                base_shape=None if base_off < 0 else list(sizes[base_off:base_off + base_ndim])))
        if cleared and self.history is not None:
            # zero_grad(set_to_none=False) after this run's last step: those gradients are not stale.
            for p in self.parameters():
                g = grad_of(p)
                if g is not None and storage_key(g) in cleared:
                    self.history.stepped_grads.pop(g, None)
