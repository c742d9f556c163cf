"""Gradient accumulation as it ran: ``backward()`` calls per optimizer step, where gradients were
zeroed, how each loss was scaled on its way into ``backward()``, and, once per run, the measured
equivalence of the accumulated gradient with one full batch (``trace.accumulation``).

Counted from ``torch.autograd.backward`` (the loop watch's wrapper calls :meth:`AccumulationWatch.
backward_began`), the optimizer step hooks and ``zero_grad`` (``Optimizer.zero_grad`` and
``Module.zero_grad`` wrapped for the run), never from the ops' phases: a window runs from the end of one
optimizer step to the end of the next, so the ``backward()`` a closure runs inside ``optimizer.step``
(Lightning's automatic optimization, L-BFGS) counts with the step it feeds. A ``zero_grad`` inside a step
(a closure evaluated again) starts the window afresh.

What it costs a loop without accumulation: a counter per ``backward()``, a flag per ``zero_grad()``, a
few dictionary reads per step; the first windows also record where each call was made. The measured
check copies the gradients (on the host, only if twice their size fits in a quarter of the free RAM,
at most 1 GiB) for one window, the first that accumulated, and frees them at its step.

>>> import torch
>>> from backward_doctor.trace.accumulation import Accumulation
>>> w = AccumulationWatch(acc := Accumulation(), frames=None, iteration=lambda: 0, params=list)
>>> w.backward_began(torch.tensor(2.0)), w.backward_began(torch.tensor(2.0))  # (both counted)
(True, True)
>>> w.step_began(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), (), {}); w.iteration_ended()
>>> acc.per_step
[0, 0, 1]
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
import zlib
from typing import Any, Callable

import torch

from ...trace.accumulation import Accumulation, AccumulationCheck, BackwardCall, StepWindow, ZeroGradCall
from .accumulation_check import EquivalenceCheck, divisor, number
from .accumulation_libraries import accelerate_state as _accelerate_state, library_division, settings as _settings
from ..guard import nothing
from .registry import Watch
from .patches import Patches, named_like
from ...util.process import doctors_own
from ...util.units import available_ram, format_bytes

_DETAILED = 16      # windows recorded in detail (where each call was made), then only counted
_ANOMALIES = 8      # further windows kept because they zeroed gradients inside or stepped off a library's sync
_CALLS = 8          # backward() calls kept per window
_BUCKETS = 33       # per_step[32] counts steps fed by 32 or more backward() calls
_CHECK_CAP = 1 << 30
_graph_task_id = torch._C._current_graph_task_id
_get_ident = threading.get_ident  # (read at every backward() and zero_grad() of a loop)


class AccumulationWatch(Watch):
    """Writes ``record`` (see the module docstring). ``frames``: the capture's ``UserFrames``;
    ``iteration()``: optimizer steps so far; ``params()``: the parameters the capture knows;
    ``quiet``: a context in which the doctor's own ops are neither recorded nor counted; ``counter``: the native
    recorder's ``AccumCounter`` type, which counts the counting-only windows in C (see :meth:`_count_natively`)."""

    events = ("backward_began", "backward_ended", "step_began", "skipped_step", "iteration_ended", "zeroed_first",
              "finish")

    def __init__(self, record: Accumulation, *, frames: Any, iteration: Callable[[], int],
                 params: Callable[[], list[torch.Tensor]],
                 quiet: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 scalar: Callable[[Any], float | None] = lambda t: None, counter: Any = None,
                 guards: Any = None) -> None:
        self.record = record
        self.guards = guards  # the run's (guard.py): its zero_grad wrapper's failure switches it off
        self._frames, self._iteration, self._params = frames, iteration, params
        self._quiet, self._scalar = quiet, scalar
        self._thread = threading.get_ident()
        self._depth = 0          # optimizer steps open (a closure's backward() runs inside one)
        self._n_step = 0         # backward() calls of the window when its step began
        self._check: EquivalenceCheck | None = None
        self._checked = False    # the check ran (or was refused) once: never again this run
        self._first_backward = True
        self._calls: list[BackwardCall] = []
        self._zeros: list[tuple[ZeroGradCall, Any]] = []
        self._sites: set[int] = set()
        self._syncs: set[bool] = set()  # Accelerate's sync flag as backward() saw it (both: accumulate() ran)
        self._accelerate = sys.modules.get("accelerate.state")  # (imported before the run, or not in use)
        # Every detailed window kept, no library's sync flag to read: a window of one backward() and no
        # zero_grad() after it is only counted (iteration_ended's first branch).
        self._counting = False
        self._counter_type = counter  # the native recorder's AccumCounter (counting-only windows in C), or None
        self._core: Any = None        # the counter counting now (see _count_natively)
        self._new_window()
        self.patches = Patches()
        self.patches.add(torch.optim.Optimizer, "zero_grad", lambda real: self._wrap_zero(real, "optimizer"))
        self.patches.add(torch.nn.Module, "zero_grad", lambda real: self._wrap_zero(real, "module"))

    def _new_window(self) -> None:
        """The next window; its lists are new only where the last one filled them (kept in a record)."""
        self._n = 0
        self._zeroed = False
        if self._calls:
            self._calls = []
        if self._zeros:
            self._zeros = []
        if self._sites:
            self._sites = set()

    def zeroed_first(self) -> bool:
        """Whether this window's gradients were zeroed (or None) before its first ``backward()``."""
        self._leave_counting()
        return self._zeroed

    def _detailed(self) -> bool:
        return len(self.record.windows) < _DETAILED

    def _where(self) -> Any:
        """Where the user is: the innermost user frame outside torch and the doctor."""
        return self._frames.where(sys._getframe(2)) if self._frames is not None else None

    # ---------------------------------------------------------------- backward()
    def backward_began(self, t: Any) -> bool:
        """``backward()`` is about to run on ``t`` (the loss; the caller unpacks a one-element sequence). A
        backward() run from inside another (reentrant checkpointing recomputes and backpropagates a segment) is
        part of that one: not counted. Returns whether it was counted, for :meth:`backward_ended`."""
        if _get_ident() != self._thread or _graph_task_id() != -1:
            return False
        n = self._n = self._n + 1
        if self._counting and self._check is None:
            return True  # (past the detailed windows, no library's flag, no check: what follows would do nothing)
        if self._accelerate is not None:
            sync, _ = _accelerate_state(self._accelerate)
            if sync is not None:
                self._syncs.add(sync)
        if self._first_backward:  # the run's first window: gradients nobody zeroed may be None already
            self._first_backward = False
            self._zeroed = self._zeroed or all(p.grad is None for p in self._params())
        if n <= _CALLS and (len(self.record.windows) < _DETAILED or self._check is not None):  # (_detailed)
            call = self._call(t)
            self._calls.append(call)
            self._sites.add(call.site)
        if n == 2 and self._may_check():
            self._start_check()
        if self._check is not None:
            d, _ = divisor(t) if isinstance(t, torch.Tensor) else (1.0, "")
            self._check.divisors.append(d)
            self._measure("began")
        return True

    def _call(self, t: Any) -> BackwardCall:
        w = self._where()
        d, root = divisor(t) if isinstance(t, torch.Tensor) else (1.0, "")
        site = zlib.crc32(f"{w.file}:{w.line}:{w.lasti}".encode()) if w is not None else 0  # (stable in the JSON)
        lib, lib_d = library_division(sys._getframe(2))
        return BackwardCall(line=getattr(w, "line", None), file=getattr(w, "file", None),
                            cell_line=getattr(w, "cell_line", None), function=getattr(w, "function", None),
                            site=site, loss=self._scalar(t), divisor=d, root=root, library=lib, library_divisor=lib_d)

    def backward_ended(self, counted: bool = True) -> None:
        """The backward() that began last returned (or raised); ``counted``: what its
        :meth:`backward_began` returned."""
        if counted and self._check is not None:
            self._measure("ended")

    def _measure(self, when: str) -> None:
        """The check's own work, never an error of the user's step (it is dropped, and says why)."""
        try:
            with self._quiet():
                getattr(self._check, when)()
        except Exception as exc:  # a gradient of a subclass, a sparse one: no measurement this run
            if not doctors_own(exc):  # (a signal handler's exception, a hook of the user's: theirs, it goes on)
                raise
            self.record.check = AccumulationCheck(iteration=self._check.iteration, micro_batches=0,
                                                  why_not=f"{type(exc).__name__}: {exc}"[:200])
            self._check = None

    def _may_check(self) -> bool:
        return not self._checked and self._zeroed and len(self._sites) == 1 and self._detailed()

    def _start_check(self) -> None:
        """The second backward() of a window that began with zeroed gradients, or a zero_grad() after its
        first: what ``.grad`` holds now is what the backward() calls so far added. Measure this window (once
        per run)."""
        self._checked = True
        params = [p for p in self._params() if p.requires_grad]
        need = 2 * 4 * sum(p.numel() for p in params)
        avail = available_ram()
        cap = min(_CHECK_CAP, avail // 4) if avail else _CHECK_CAP
        if need > cap:
            self.record.check = AccumulationCheck(
                iteration=self._iteration(), micro_batches=0,
                why_not=f"the check copies the gradients twice ({format_bytes(need)}): more than {format_bytes(cap)}")
            return
        try:
            with self._quiet():
                self._check = EquivalenceCheck(params, self._iteration())
        except Exception as exc:  # a gradient that cannot be copied (a subclass): no measurement
            if not doctors_own(exc):
                raise
            self.record.check = AccumulationCheck(iteration=self._iteration(), micro_batches=0,
                                                  why_not=f"{type(exc).__name__}: {exc}")
        if self._check is not None and self._calls:
            self._check.divisors.append(self._calls[0].divisor)

    # ---------------------------------------------------------------- zero_grad()
    def _wrap_zero(self, real: Callable[..., Any], target: str) -> Callable[..., Any]:
        watch = self

        def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                watch.zeroing(self, target)
            except Exception as exc:  # (the watch's own failure: it stops, the user's zero_grad() runs)
                if watch.guards is None or not watch.guards.failed("accumulation", exc):
                    raise
            return real(self, *args, **kwargs)

        return named_like(zero_grad, real)

    def zeroing(self, obj: Any, target: str) -> None:
        """``obj.zero_grad()`` is about to run."""
        if _get_ident() != self._thread:
            return
        if self._n == 0:  # before the window's first backward()
            self._zeroed = True
            return
        if self._depth > 0 and self._n > self._n_step:
            # A closure evaluated again inside one step (L-BFGS): its earlier evaluation is dropped, not
            # a micro-batch's gradient.
            self._n = self._n_step
            del self._calls[self._n:]
            return
        if self._check is None and self._may_check():  # (before it throws away what is to be measured)
            self._start_check()
        if len(self._zeros) < _CALLS:
            w = self._where()
            call = ZeroGradCall(after=self._n, target=target, type=type(obj).__name__, line=getattr(w, "line", None),
                                file=getattr(w, "file", None), cell_line=getattr(w, "cell_line", None),
                                function=getattr(w, "function", None))
            self._zeros.append((call, weakref.ref(obj)))

    # ---------------------------------------------------------------- optimizer.step()
    def step_began(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """The outermost ``optimizer.step()`` begins (its closure's backward() still counts)."""
        self._depth += 1
        self._opt, self._n_step = opt, self._n
        self._step_where = self._where() if len(self.record.windows) < _DETAILED or self._zeros else None

    def iteration_ended(self) -> None:
        """The outermost optimizer step returned: its window closes."""
        if self._counting and self._n == 1 and not self._zeros and self._check is None:
            # A long loop's common window, once the detailed ones are kept: one backward(), no zero_grad() after
            # it, no check running: only counted (what the general path below would do for it, in a fraction of
            # the bytecodes: this runs at every step).
            self._depth = self._depth - 1 if self._depth > 0 else 0
            self._opt = None
            self.record.per_step[1] += 1
            self._new_window()
            if self._counter_type is not None:  # (back from Python: a skipped step, zeroed_first())
                self._count_natively()
            return
        self._depth = max(0, self._depth - 1)
        opt, self._opt = getattr(self, "_opt", None), None
        rec, n = self.record, self._n
        bucket = n if n < _BUCKETS else _BUCKETS - 1
        per_step = rec.per_step
        while len(per_step) <= bucket:
            per_step.append(0)
        per_step[bucket] += 1
        sync, num = _accelerate_state(self._accelerate) if self._accelerate is not None else (None, 0)
        zeros = [self._stepped(z, ref, opt) for z, ref in self._zeros] if self._zeros else []
        # (a step off Accelerate's sync only while this run saw the flag both ways, i.e. an accumulate() ran:
        # False alone is the process-wide state an earlier run left, and finish() drops it)
        odd = n >= 2 and any(z.stepped for z in zeros) or (sync is False and len(self._syncs) == 2)
        if len(rec.windows) < _DETAILED or (odd and len(rec.windows) < _DETAILED + _ANOMALIES):  # (_detailed)
            w = self._step_where
            rec.windows.append(StepWindow(
                iteration=self._iteration(), backward=n, calls=self._calls, zero_grads=zeros,
                zeroed_first=self._zeroed, optimizer=type(opt).__name__ if opt is not None else "",
                line=getattr(w, "line", None), file=getattr(w, "file", None), cell_line=getattr(w, "cell_line", None),
                function=getattr(w, "function", None), accumulate=num, sync=sync))
        if self._check is not None:
            if n >= 2:
                rec.check = self._check.result(n)
            else:  # one backward() after all: not an accumulating window, measure a later one
                self._checked = False
            self._check = None
        self._new_window()
        # (Accelerate loaded, as in any process that imported transformers, but its sync flag never both ways in
        # this run's detailed windows: no accumulate() ran, its process-wide state is an earlier run's or none;
        # finish() drops it. So only counting, as without it.)
        self._counting = len(rec.windows) >= _DETAILED and len(per_step) > 1 and len(self._syncs) < 2
        if self._counting and self._check is None:
            self._count_natively()

    # ---------------------------------------------------------------- counting-only windows, in C
    _NATIVE = ("backward_began", "zeroing", "step_began", "iteration_ended")  # (the order of AccumCounter.bound())

    def _count_natively(self) -> None:
        """From the next window on, only counting (past the detailed windows, no library's flag, no check): the
        four methods a window calls become the native counter's C functions, instance attributes over the
        class's methods, until something only the Python path records happens (the counter then calls
        :meth:`_leave_counting`). What they write is what the fast path of :meth:`iteration_ended` writes
        (``tests/test_native_loop_watch.py`` holds the three ways to the same record)."""
        if self._counter_type is None or self._core is not None or self._depth:
            return
        core = self._core = self._counter_type(weakref.ref(self), self._thread)
        for name, fn in zip(self._NATIVE, core.bound()):
            setattr(self, name, fn)

    def _leave_counting(self) -> None:
        """The window as the counter has it, back in this object's fields (and its counts in the record); the
        class's methods again."""
        core, self._core = self._core, None
        if core is None:
            return
        for name in self._NATIVE:
            self.__dict__.pop(name, None)
        self._n, self._zeroed, self._depth, self._n_step, self._opt, counted = core.state()
        self._step_where = None  # (what step_began sets past the detailed windows, with no zero_grad() in them)
        per_step = self.record.per_step
        for bucket, k in enumerate(counted):
            if k:
                while len(per_step) <= bucket:
                    per_step.append(0)
                per_step[bucket] += k

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed, ``guard.py``): the wrappers put back for
        good; ``backward_began`` still says which ``backward()`` is the loss (the loop watch reads it), the rest
        does nothing, and a window's start counts as zeroed (nothing is called stale on this watch's word)."""
        core, self._core, self._counter_type, self._check = self._core, None, None, None
        if core is not None:
            for name in self._NATIVE:
                self.__dict__.pop(name, None)
        self.patches.disable()
        thread = self._thread
        self.backward_began = lambda t: _get_ident() == thread and _graph_task_id() == -1  # type: ignore
        self.zeroed_first = lambda: True  # type: ignore[method-assign]
        for name in ("backward_ended", "zeroing", "step_began", "iteration_ended", "skipped_step"):
            setattr(self, name, nothing)

    def cleared(self, trace: Any) -> None:
        trace.accumulation = Accumulation()

    def skipped_step(self) -> None:
        """A GradScaler skipped the optimizer step (inf/NaN gradients): the window ends without a step."""
        self._leave_counting()
        self._check = None
        self._new_window()

    @staticmethod
    def _stepped(call: ZeroGradCall, ref: Any, opt: Any) -> ZeroGradCall:
        """Whether the zero_grad cleared gradients of the parameters ``opt`` then stepped (a wrapper such as
        Lightning's or Accelerate's optimizer zeroes the parameters of the one it wraps)."""
        obj = ref()
        if obj is None or opt is None or obj is opt:
            return call
        try:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            params = obj.parameters() if call.target == "module" else (p for g in obj.param_groups for p in g["params"])
            call.stepped = any(id(p) in ids for p in params)
        except Exception as exc:  # an object that does not list its parameters: assume it cleared them
            if not doctors_own(exc):
                raise
        return call

    def finish(self, namespace: dict[str, Any]) -> None:
        """After the run: backward() calls no step used, and the accumulation libraries were set up for."""
        self._leave_counting()
        self.record.trailing = self._n
        self._check = None
        self.record.settings = list(_settings(namespace))
        if len(self._syncs) < 2:  # Accelerate's process-wide state left from an earlier run, not this one's
            for w in self.record.windows:
                w.sync, w.accumulate = None, 0


__all__ = ["AccumulationWatch", "Patches", "divisor", "named_like", "number"]
