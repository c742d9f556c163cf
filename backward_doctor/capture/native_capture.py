"""The native first tier: :class:`Capture`'s records taken by a C++ observer instead of a dispatch mode.

Same hooks, same namespace scan, same ``finish()`` and rules: only the per-op
recording moves to ``native/recorder.cpp``, and its buffers are turned into the
Python tier's compact records once, when the step is over. The op that raised is
known from C++ (it ends while an exception unwinds) and its arguments are kept
while it runs, so the failing op's statistics and index values are taken as the
Python tier takes them. What it does not do: a simulated memory limit and index
checks before a kernel runs (both raise from inside an op: the Python tier's job),
and CUDA (not yet run on a GPU).

>>> import torch
>>> from backward_doctor import native
>>> x = torch.randn(4, 3, requires_grad=True)
>>> if native.load() is not None:
...     with NativeCapture() as cap:
...         (x * 2).sum().backward()
...     print([op.op for op in cap.finish().ops][:2])
... else:
...     print(['aten::mul', 'aten::sum'])
['aten::mul', 'aten::sum']
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from typing import Any, Iterator

import torch

from .. import native
from .recorder.native_records import NativeRecords, _tables
from .loop.sampling import LoopSampling
from .loop.choosing import PowersOfTwo, Sampling
from .recorder.record import _tensors
from .loop.series import LoopWatch, groups_sumsq
from .watches.registry import Watch
from .context import Capture
from .guard import nothing
from .recorder.memory import MemoryLedger, local_tensor
from ..util.process import doctors_own, patch
from ..trace.records import CATEGORIES, FailedOp, Where

_CAT = {c: i for i, c in enumerate(CATEGORIES)}


class _NativeLedger(MemoryLedger):
    """The Python ledger (weak references to what existed before the step), mirrored into the recorder."""

    def __init__(self) -> None:
        super().__init__()
        # The recorder must hear at once that a storage it was told of died (its address may be reused by
        # the next op's output): a Python callback here. (It sees only what existed before the step, so
        # this rarely runs during it; the Python tier's ledger, which sees every output, notes deaths in C.)
        self._callback = self._ref_died
        self.ext: Any = None
        self._data: dict[int, int] = {}
        self.log = None  # (the recorder keeps the ledger's history: it counts what the step makes)
        self._final_by_producer: dict[int | None, int] | None = None  # the recorder's, after the step

    def track(self, t: torch.Tensor, category: str, producer: int | None = None) -> bool:
        new = super().track(t, category, producer)
        if new:
            st = local_tensor(t).untyped_storage()
            key = st._cdata
            self._data[key] = st.data_ptr()
            if self.ext is not None:
                self.ext.register_storage(key, self._live[key], _CAT[category], self._data[key])
        return new

    def _ref_died(self, ref: Any) -> None:
        self._dead.append(ref)
        self.drain()

    def _freed(self, key: int) -> None:
        self._data.pop(key, None)
        if self.ext is not None:
            self.ext.release(key)
        super()._freed(key)

    def reclassify(self, t: torch.Tensor, category: str) -> None:
        if self.ext is None:
            super().reclassify(t, category)
            return
        if self._dead:
            self.drain()
        try:
            st = local_tensor(t).untyped_storage()
        except Exception as exc:  # sparse/nested tensors have no plain storage: not counted
            if not doctors_own(exc):
                raise
            return
        key = st._cdata
        if key in self._live:  # existed before the step: the Python side keeps its weak reference
            super().reclassify(t, category)
        # Made during the step (a gradient, optimizer state): the recorder counts it already (this
        # registers it only if it does not), and learns its memory is freed from the allocator.
        self.ext.register_storage(key, st.nbytes(), _CAT[category], st.data_ptr())
        self.ext.reclassify(key, _CAT[category])

    def detach(self) -> None:
        """Stop mirroring into the recorder (it has stopped)."""
        self.ext = None

    def attach(self, ext: Any) -> None:
        """Hand everything tracked so far to the (now running) recorder."""
        self.ext = ext
        for key, nbytes in self._live.items():
            ext.register_storage(key, nbytes, self._cat[key], self._data.get(key, 0))

    def adopt(self, totals: list[int], by_producer: dict[int, int]) -> None:
        """The recorder's figures at the end of the step (it counted what the step made)."""
        self.totals, self.total = list(totals), sum(totals)
        self._final_by_producer = {(None if p < 0 else p): n for p, n in by_producer.items()}

    def bytes_by_producer(self) -> dict[int | None, int]:
        final = self._final_by_producer
        return dict(final) if final is not None else super().bytes_by_producer()


class NativeLoopWatch(Watch):
    """:class:`LoopWatch`'s interface over the native recorder's ``LoopSeries``: ``saw_backward``, ``before_step``
    and ``iteration_ended`` are C functions (called with no Python frame, at every iteration), and so is the count
    behind ``backward_calls``; ``scalar`` is the module's in-place read, the one the C++ watch makes. ``on_nonfinite`` is held weakly by the C++ object (which the garbage collector
    cannot see into: a strong reference to the capture that owns this watch would keep both alive for good)."""

    events = LoopWatch.events

    def __init__(self, ext: Any, its: Any, live_base: int, on_nonfinite: Any) -> None:
        fallback = functools.partial(groups_sumsq, sumsq=ext.grad_sumsq)  # (param_groups that are no list)
        ref = weakref.WeakMethod(on_nonfinite) if hasattr(on_nonfinite, "__self__") else (lambda: on_nonfinite)
        self._series = ext.LoopSeries(its, live_base, ref, fallback)
        self.saw_backward, self.before_step, self.iteration_ended, self._calls = self._series.bound()
        self.its, self.scalar = its, ext.scalar_value

    @property
    def backward_calls(self) -> int:
        return self._calls()

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed, ``guard.py``): its calls do nothing."""
        self.saw_backward = self.before_step = self.iteration_ended = nothing


class NativeCapture(NativeRecords, LoopSampling, Capture):
    """:class:`Capture` with the per-op records taken in C++; ``detail=True`` screens every op's outputs
    for NaN/Inf there too (the replay that finds where it was born)."""

    def __init__(self, *args: Any, detail: bool = False, sample_iterations: bool = True,
                 sampling: Sampling | None = None, **kwargs: Any) -> None:
        super().__init__(*args, detail=detail, **kwargs)
        #: A training loop in the cell is sampled (``loop/choosing.py``): by default iterations 0-2 and each power of
        #: two are recorded, the others run with the recorder off. Not under a simulated memory limit, which the
        #: recorder enforces op by op.
        if sampling is None:
            sampling = PowersOfTwo() if sample_iterations else None
        self._init_sampling(sampling)
        if self.check_indices:
            raise ValueError("NativeCapture: check_indices needs the Python tier (Capture)")
        self._ext = native.load()
        if self._ext is None:
            raise RuntimeError(f"the native recorder is not available: {native.status()['reason']}")
        _tables(self._ext)
        self._seq_nr = self._ext.sequence_nr  # (torch's, without its pybind11 call: at every iteration)
        self.trace.engine = "native"
        self._ledger = _NativeLedger()
        self._ledger.on_free = self._on_free
        self._stack_ids: dict[tuple[int, ...], int] = {(): 0}
        self._stacks: list[tuple[int, ...]] = [()]
        self._native_out: dict[str, Any] | None = None
        self._failed: tuple | None = None  # failing op: index, overload, arguments, name and phase if not kept
        self._clearings, self._stale_pending = {}, []  # (the stale-gradient check, decided after: native_records)
        #: bytes the C++ recorder held at the end of the step (its buffers; not on the Python heap)
        self.buffer_bytes = 0

    # ---------------------------------------------------------------- lifecycle
    def _install(self) -> None:
        self._prepare()
        self._t0 = time.perf_counter()
        self.trace.started_at = time.time()
        limit = -1 if self.memory_limit is None else int(self.memory_limit)
        self._ext.start(self._frames.cell_file, True, self._max_ops, limit, self.detail)
        self._undo.push("native recorder", self._stop_recorder)
        self._undo.push("recorder's ledger", self._ledger.detach)
        self._ledger.attach(self._ext)
        self._yield_to_profiler()
        self._start_sampling()

    def _stop_recorder(self) -> None:
        if self._ext.running():
            self._native_out = self._ext.stop()

    def _yield_to_profiler(self) -> None:
        """A ``torch.profiler`` the user starts during the step needs the allocator's reporting slot
        the recorder holds: hand it over while their profiler runs (torch's own functions are
        wrapped for the step and put back in ``stop()``)."""
        import torch.autograd.profiler as prof

        ext = self._ext

        def wrap_enable(enable: Any) -> Any:
            def _enable_profiler(*args: Any, **kwargs: Any) -> Any:
                ext.suspend_memory()
                try:
                    return enable(*args, **kwargs)
                except BaseException:
                    ext.resume_memory()
                    raise
            return _enable_profiler

        def wrap_disable(disable: Any) -> Any:
            def _disable_profiler(*args: Any, **kwargs: Any) -> Any:
                try:
                    return disable(*args, **kwargs)
                finally:
                    ext.resume_memory()
            return _disable_profiler

        undo: list[Any] = []
        self._undo.push("torch's profiler functions", lambda: [u() for u in reversed(undo)])
        undo.append(patch(prof, "_enable_profiler", wrap_enable))
        undo.append(patch(prof, "_disable_profiler", wrap_disable))

    def _converted(self) -> None:
        # The recorder's buffers become records after the step (finish), not in the step's time.
        if self._native_out is not None:
            out, self._native_out = self._native_out, None
            self._convert(out)

    def finish(self):
        self._mark_unmarked()
        self._converted()
        self._resolve_stale()
        self._sampling_note()
        return super().finish()

    # ---------------------------------------------------------------- hooks
    def _compile_started(self) -> None:
        super()._compile_started()
        self._ext.pause()  # what torch.compile runs while it compiles is not the step's work

    def _compile_ended(self) -> None:
        self._ext.resume()
        super()._compile_ended()

    def _set_stack(self) -> None:
        sid = self._stack_ids.get(self._stack_key)
        self._ext.set_stack(sid if sid is not None else self._new_stack(self._stack_key))

    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        # Called inside a compiled module, a hook is traced by dynamo: ``set_stack`` (C) broke the graph. While it
        # traces, the hook is nothing (the region is seen at its edges anyway).
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:  # (or another thread's model)
            return
        super()._module_pre(module, args)
        self._guarded("modules", self._set_stack)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:
            return
        super()._module_post(module, args, output)
        self._guarded("modules", self._set_stack)

    def _new_stack(self, key: tuple[int, ...]) -> int:
        sid = self._stack_ids[key] = len(self._stacks)
        self._stacks.append(key)
        return sid

    @contextlib.contextmanager
    def _quiet_ops(self) -> Iterator[None]:
        """The doctor's own ops, not recorded by the native recorder either."""
        self._ext.pause()
        try:
            with super()._quiet_ops():
                yield
        finally:
            self._ext.resume()

    def _make_watch(self) -> Any:
        """Live bytes by the allocator's own count (what the ledger had at start plus the net bytes the
        CPU allocator handed out since: it counts while the recorder sleeps); gradients read in C++. The watch
        itself is C++ (``LoopSeries``: :class:`LoopWatch`'s reads and record, with no Python bytecode at each
        iteration), the Python class where the module has none."""
        self.trace.iterations.live_kind = "allocator"
        mem, ext = self.trace.memory, self._ext
        if hasattr(ext, "LoopSeries"):
            return NativeLoopWatch(ext, self.trace.iterations, mem.baseline_bytes, self._went_nonfinite)
        return LoopWatch(self.trace.iterations, live=ext.allocated, live_base=mem.baseline_bytes,
                         sumsq=ext.grad_sumsq, scalar=ext.scalar_value,
                         on_nonfinite=self._went_nonfinite, groups_sumsq=getattr(ext, "groups_grad_sumsq", None))

    def _accum_counter(self) -> Any:
        return getattr(self._ext, "AccumCounter", None)

    def _set_optimizer_depth(self, depth: int) -> None:
        super()._set_optimizer_depth(depth)
        self._ext.set_optimizer_depth(depth)

    # ---------------------------------------------------------------- after the step
    def record_exception(self, exc: BaseException) -> None:
        self._converted()
        super().record_exception(exc)
        if isinstance(exc, Exception) and self._failed is not None:
            self._record_failed_op(exc)

    def _record_failed_op(self, exc: BaseException) -> None:
        """The innermost op that raised (the recorder saw it unwinding), with its inputs' statistics."""
        from .recorder import checks
        from .recorder.stats import meta

        index, overload, args, light_name, light_phase = self._failed
        self._failed = None
        rec = next((r for r in self.kept_records() if r[0] == index), None)
        if rec is None:  # past max_ops: known by name and phase only
            if light_name is None:
                return
            rec = (index, light_name, light_phase, None, True, self.trace.exception.where if self.trace.exception
                   else Where())
        name = rec[1]
        tensors = _tensors(tuple(args), None)
        idx = None
        if isinstance(exc, (IndexError, RuntimeError)):
            ns, _, op = name.partition("::")
            packet = getattr(getattr(torch.ops, ns, None), op, None)
            func = getattr(packet, overload or "default", None) if packet is not None else None
            idx = checks.index_check(func, tuple(args), {}) if func is not None else None
        with torch.no_grad():
            inputs = [meta(t, with_stats=True) for t in tensors]
        del tensors, args
        self.trace.failed_op = FailedOp(
            index=index, op=name, phase=rec[2], inputs=inputs, where=rec[5],
            error=f"{type(exc).__name__}: {exc}".split("\n")[0][:500], fwd_index=rec[3], index_check=idx)


def native_available(build: bool = False) -> bool:
    """True when the recorder is built (``build``: or can be built now) and usable here (CPU-only torch)."""
    if torch.cuda.is_available() or not native.enabled() or torch._C._autograd._profiler_enabled():
        return False  # (a profiler already running holds the allocator's reporting slot)
    ext = native.load() if build else native.ready()
    # One recorder per process: a diagnose() inside a doctored cell runs on the Python tier.
    return ext is not None and not ext.running()


__all__ = ["NativeCapture", "native_available"]
