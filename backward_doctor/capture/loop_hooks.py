"""The capture's side of a training loop in one cell: where an iteration ends and the next begins, the
per-iteration watch (``loop_watch.py``), the loop variables of an iteration, and the run-level
``rollback`` told when an iteration begins and when NaN/Inf shows in one the recorder did not record.

A mixin of :class:`~backward_doctor.capture.context.Capture` (its fields are in ``state.py``); the
native recorder overrides ``_begin_iteration`` to sample iterations and ``_make_watch`` to read in C++.

>>> from backward_doctor.capture import Capture
>>> issubclass(Capture, LoopHooks)
True
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

from . import namespace as ns_mod
from .accum_watch import AccumulationWatch
from .loop_watch import LoopWatch, python_sumsq
from .precision_watch import PrecisionWatch
from .schedule_watch import ScheduleWatch
from ..trace.accumulation import Accumulation
from ..trace.precision import Precision
from .process import doctors_own, patch

_sequence_nr = torch._C._autograd._get_sequence_nr
_SEQUENCES = (tuple, list)


class LoopHooks:
    """Iteration bookkeeping for :class:`Capture` (see the module docstring)."""

    _seq_nr = staticmethod(_sequence_nr)  # autograd's next sequence number (the native recorder has its own)

    def _make_watch(self) -> LoopWatch:
        """The per-iteration watch (``loop_watch.py``): live bytes by the ledger, which this tier keeps op by op on
        every device (the allocator's count on a machine with a GPU read 0 for a CPU loop). On CUDA the loss and
        gradients are not read (a read would synchronise every iteration): ``read_scalar`` and ``python_sumsq``
        read CPU tensors only."""
        self.trace.iterations.live_kind = "ledger"
        return LoopWatch(self.trace.iterations, live=lambda: self._ledger.total, sumsq=python_sumsq,
                         on_nonfinite=self._went_nonfinite)

    def _watch_backward(self) -> None:
        """``torch.autograd.backward`` (what ``Tensor.backward`` calls) tells the watches the loss first: the
        accumulation watch counts the calls per optimizer step there, whatever phase the ops get, and a call it
        counts (the cell thread's, not one nested in another) is the loss the loop watch reads."""
        watch, guards = self._watch, self.guards
        accum = self._accum = AccumulationWatch(self.trace.accumulation, frames=self._frames, params=self.parameters,
                                                iteration=lambda: self.trace.iterations.steps, quiet=self._quiet_ops,
                                                scalar=watch.scalar, counter=self._accum_counter(), guards=guards)

        def wrap(real: Any) -> Any:
            def backward(*args: Any, **kwargs: Any) -> Any:
                # (each watch's part under its guard, the user's backward() outside both: ``guard.py``)
                counted = False
                try:
                    tensors = args[0] if args else kwargs.get("tensors")
                    if isinstance(tensors, _SEQUENCES) and len(tensors) == 1:  # (the loss, once for both watches)
                        tensors = tensors[0]
                    counted = accum.backward_began(tensors)
                except Exception as exc:
                    if not guards.failed("accumulation", exc):
                        raise
                if counted:  # (not a reentrant checkpoint's inner backward(), nor another thread's: not the loss)
                    try:
                        watch.saw_backward(tensors)
                    except Exception as exc:
                        if not guards.failed("loop", exc):
                            raise
                try:
                    return real(*args, **kwargs)
                finally:
                    try:
                        accum.backward_ended(counted)
                    except Exception as exc:
                        if not guards.failed("accumulation", exc):
                            raise
            return backward

        # (The undo goes on the stack before the patch: a Ctrl-C in between leaves nothing installed. The undo
        # puts the original back only while the wrapper is still the doctor's: a cell's own wrapper stays.)
        undo: list[Any] = []
        self._undo.push("torch.autograd.backward", lambda: undo and undo.pop()())
        undo.append(patch(torch.autograd, "backward", wrap))
        self._precision = PrecisionWatch(self.trace.precision, frames=self._frames, on_skipped=accum.skipped_step,
                                         iteration=lambda: self.trace.iterations.steps, guards=guards,
                                         backwards=lambda: watch.backward_calls)
        self._schedule = ScheduleWatch(self.trace.schedules, frames=self._frames, guards=guards,
                                       iteration=lambda: self.trace.iterations.steps,
                                       backwards=lambda: watch.backward_calls,
                                       scaler_skipped=lambda: self.trace.precision.scaler.skipped)
        self._undo.push("zero_grad, GradScaler and clipping wrappers", lambda: self._unpatch_training(final=True))
        self._patch_training()
        guards.on_stop("loop", watch.off)
        guards.on_stop("accumulation", accum.off)
        guards.on_stop("accumulation", lambda: setattr(self.trace, "accumulation", Accumulation()))
        guards.on_stop("precision", self._precision.off)
        guards.on_stop("precision", lambda: setattr(self.trace, "precision", Precision()))
        guards.on_stop("schedule", self._schedule.off)
        guards.on_stop("schedule", lambda: self.trace.schedules.clear())

    def _accum_counter(self) -> Any:
        """The type that counts the accumulation watch's counting-only windows in C (the native recorder's), or None."""
        return None

    def _patch_training(self) -> None:
        """``zero_grad``, ``GradScaler`` and gradient clipping wrapped for the watches (not while torch.compile
        compiles: it would trace the wrappers; never again once the capture stopped)."""
        if self._accum is None or self._training_closed:
            return
        for patches in (self._accum.patches, self._precision.patches, self._schedule.patches):
            if not patches.installed:
                patches.install()

    def _unpatch_training(self, final: bool = False) -> None:
        self._training_closed = self._training_closed or final
        for patches in (self._schedule.patches, self._precision.patches, self._accum.patches) \
                if self._accum is not None else ():
            if patches.installed:
                patches.remove()

    @contextlib.contextmanager
    def _quiet_ops(self) -> Iterator[None]:
        """The doctor's own ops (the accumulation check's copies): not seen by the dispatch mode, no graph."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.no_grad():
            yield

    def _outer_step_began(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The outermost ``optimizer.step()`` is about to run (recorded iteration or not): before its closure,
        if it has one, so that the closure's ``backward()`` counts in this step's window. (The loop watch reads
        the gradients later, in ``_before_update``: after the closure made them.)"""
        try:
            self._accum.step_began(opt, args, kwargs)
        except Exception as exc:
            if not self.guards.failed("accumulation", exc):
                raise
        try:
            self._precision.step_began(opt)
        except Exception as exc:
            if not self.guards.failed("precision", exc):
                raise

    def _went_nonfinite(self, iteration: int, what: str) -> None:
        """NaN/Inf in this iteration's loss or gradients, seen before its optimizer step: a run-level
        ``rollback`` keeps the state an iteration the recorder did not record can be replayed from."""
        if self.rollback is not None and self._asleep:
            try:
                self.rollback.went_nonfinite(iteration, what)
            except Exception as exc:
                if not self.guards.failed("rollback", exc):
                    raise
            self._note_loop_values(iteration)  # (not noted asleep: where the loop was, a library's epoch and batch)

    def _iteration_ended(self) -> None:
        """The outermost optimizer step returned: an iteration of the cell's loop ended, the next starts
        at the next op (``trace.iterations``; the native recorder also samples them)."""
        its = self.trace.iterations
        if not its.recorded and self._first_recorded:
            its.recorded.append(0)
            its.starts.append(0)
        if not self._asleep:  # the iteration that ended was recorded: what its loop variables were
            self._note_loop_values(its.steps)
        # (each watch under its guard: one failing stops only itself, ``guard.py``)
        try:
            self._watch.iteration_ended()
        except Exception as exc:
            if not self.guards.failed("loop", exc):
                raise
        try:
            self._precision.step_ended()
        except Exception as exc:
            if not self.guards.failed("precision", exc):
                raise
        try:
            self._accum.step_ended()
        except Exception as exc:
            if not self.guards.failed("accumulation", exc):
                raise
        steps = its.steps = its.steps + 1
        self._iter_seq.append(self._seq_nr())
        rollback = self.rollback
        if rollback is not None:
            try:
                rollback.iteration_began(steps)
            except Exception as exc:
                if not self.guards.failed("rollback", exc):
                    raise
        try:
            self._begin_iteration(steps)
        except Exception as exc:
            if not self.guards.failed("sampling", exc):
                raise

    def _begin_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` starts at the next op, recorded (the native recorder samples them)."""
        self.trace.iterations.recorded.append(iteration)
        self.trace.iterations.starts.append(self._count)

    def _find_library_loop(self) -> None:
        """A library's loop the cell calls (``trainer.train()``): its iterations are placed in it, with the
        library's epoch and batch (``trainers.py``)."""
        from .trainers import find_library_loop

        self._library = find_library_loop(self.namespace, self.trace.source)
        if self._library is not None:
            its = self.trace.iterations
            its.library, its.library_call, its.library_line = (self._library.library, self._library.call,
                                                               self._library.line)

    def _note_loop_values(self, iteration: int) -> None:
        """The cell's loop variables (a library's loop: its epoch and batch) as they are now, for
        ``iteration`` (strings only: nothing kept). The first 4,096 iterations, then powers of two only (a
        bounded trace)."""
        if len(self.trace.iterations.values) >= 4096 and iteration & (iteration - 1):
            return
        if self._library is not None:
            text = self._library.position()
            if text:
                self.trace.iterations.values[str(iteration)] = text
            return
        if self._loop_names is None:
            from ..util.loops import outer_loops, steps_in

            # The loops that step an optimizer: a setup loop before them (`for m in model: fully_shard(m)`) is
            # over, and its variable's last value is no position of the training loop.
            loops = outer_loops(self.trace.source)
            loops = [lp for lp in loops if steps_in(self.trace.source, lp[0])] or loops
            self._loop_names = sorted({n for _, _, names in loops for n in names})
        if self._loop_names:
            try:
                text = ns_mod.loop_values(self.namespace, self._loop_names)
            except Exception as exc:  # a value that cannot be described is not worth failing the step for
                if not doctors_own(exc):  # (a signal handler's exception, a __repr__ of the user's: theirs)
                    raise
                return
            if text:
                self.trace.iterations.values[str(iteration)] = text

    def progress(self) -> dict[str, Any]:
        """Iterations done, live bytes at the latest iteration's end, seconds since start (see
        ``runner.running_progress``: read from another thread, so plain reads only)."""
        its = self.trace.iterations
        live = its.live_bytes[-1] if its.live_bytes else None
        return {"iterations": its.steps, "live_bytes": live,
                "seconds": time.perf_counter() - self._t0 if self._t0 else 0.0}

