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
from .state import PHASES
from .memory import storage_key
from .stats import dtype_name
from ..trace.parts import NonFiniteScalar, OomInfo
from ..trace.records import CATEGORIES, InplaceEvent, NonFiniteEvent, TensorMeta, TensorStats, Where

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
    """Mixin: ``_convert(out)`` with ``out`` from the recorder's ``stop()``."""

    def _convert(self, out: dict[str, Any]) -> None:
        """The recorder's buffers -> the Python tier's records, timeline, peak and events."""
        recs, tens, sizes, inplace = (array("q", out[k]) for k in ("recs", "tensors", "sizes", "inplace"))
        codes, lastis, names = out["codes"], out["lastis"], out["names"]
        width, tw = out["width"], out["tensor_width"]
        roots = iter(out["roots"])
        seq_map: dict[int, int] = {}
        where_cache: dict[tuple, Where] = {}
        metas: dict[tuple, tuple] = {}
        last_phase = "forward"
        idx_where: dict[int, Where] = {}
        idx_fwd: dict[int, tuple[str, int | None]] = {}  # op index -> (phase, forward op index)
        stack_of = self._stacks
        for r in range(len(recs) // width):
            rec = recs[r * width:(r + 1) * width]
            index, name = rec[0], names[rec[1]]
            phase = PHASES[rec[2]]
            if phase == "forward":
                for s in range(rec[4], rec[5]):
                    seq_map[s] = index
                fwd = None
            else:
                fwd = seq_map.get(rec[3]) if phase == "backward" else None
            fkey = tuple(zip(map(id, codes[rec[10]:rec[10] + rec[11]]), lastis[rec[10]:rec[10] + rec[11]]))
            stack = stack_of[rec[19]] if phase == "forward" else ()
            wkey = (fkey, stack)
            where = where_cache.get(wkey)
            if where is None:
                where = where_cache[wkey] = self._frames.where_recorded(codes, lastis, rec[10], rec[11])
                if stack:
                    self._where_stacks.append((where, stack))
            if phase == "backward" and last_phase != "backward":
                self.trace.backward_calls.append(where)
                self.trace.backward_roots.append(next(roots, "").split("evaluate_function: ")[-1])
                self._roots.append(fwd)
            last_phase = phase
            idx_where[index] = where
            idx_fwd[index] = (phase, fwd)
            ins, outs = [], []
            for j in range(rec[8] + rec[9]):
                t = tens[(rec[7] + j) * tw:(rec[7] + j + 1) * tw]
                key, dtype, dev_type, dev_index, rg, ndim, off = t[0], t[1], t[2], t[3], t[4], t[5], t[6]
                shape = tuple(sizes[off:off + ndim])
                mkey = (shape, dtype, dev_type, dev_index, rg)
                m = metas.get(mkey)
                if m is None:
                    dev = _DEVICE_TYPES.get(dev_type, "cpu")
                    device = torch.device(dev if dev_index < 0 else f"{dev}:{dev_index}")
                    m = metas[mkey] = (torch.Size(shape), _DTYPES.get(dtype, torch.float32), device, bool(rg))
                (ins if j < rec[8] else outs).append((m, key))
            live = rec[12]
            totals = list(rec[13:18])
            us = rec[17] / 1e3
            self._append(index, name, phase, fwd, bool(rec[6]), where, [m for m, _ in ins + outs],
                         [k for _, k in ins + outs], len(ins), live, us)
            for _, k in outs:
                if k:
                    self._writer[k] = index
            self._sample(index, totals, live)
            tot = self._op_totals.setdefault(name, [0, 0.0])
            tot[0] += 1
            tot[1] += us
            if rec[18] and len(self._nf_scalars) < _MAX_SCALARS:
                self._nf_scalars[index] = NonFiniteScalar(index=index, line=where.line, file=where.file)
        self._count = out["count"]
        if self._count:  # the end of the last op (a failed step's time stops there, as on the Python tier)
            self._t_last = self._t0 + out["last_op_end_s"]
        self.buffer_bytes = out["buffer_bytes"]
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
        self._inplace_events(inplace, tens, sizes, tw, idx_where)
        if "detail" in out:
            self._nonfinite_events(out["detail"], names, idx_where, idx_fwd)
        self._ledger.adopt(out["totals"], out["by_producer"])

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

    def _inplace_events(self, inplace: array, tens: array, sizes: array, tw: int, idx_where: dict) -> None:
        last_post = self._post_counts[-1] if self._post_counts else -1
        cleared: set[int] = set()
        events = self.trace.inplace
        for e in range(len(inplace) // 5):
            index, key, version, producer, toff = inplace[e * 5:(e + 1) * 5]
            name = self._op_name(index)
            if name in _CLEARING and index >= last_post:
                cleared.add(key)
            if len(events) >= 2000:
                continue
            t = tens[toff * tw:(toff + 1) * tw]
            events.append(InplaceEvent(
                index=index, op=name or "?", key=key, version=version, shape=list(sizes[t[6]:t[6] + t[5]]),
                requires_grad=bool(t[4]), where=idx_where.get(index, Where()),
                producer_index=None if producer < 0 else producer,
                producer_op=self._op_name(producer) if producer >= 0 else None))
        if cleared and self.history is not None:
            # zero_grad(set_to_none=False) after this run's last step: those gradients are not stale.
            for p in self.parameters():
                g = p.grad
                if g is not None and storage_key(g) in cleared:
                    self.history.stepped_grads.pop(g, None)
