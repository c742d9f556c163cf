"""The capture's side of a training loop in one cell: where an iteration ends and the next begins, the training
watches made from the registry (``watches/registry.py``, ``watches/training.py``) and told the loop's events, the loop
variables of an iteration, and the run-level ``rollback`` told when an iteration begins and when NaN/Inf shows in
one the recorder did not record.

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

from .. import namespace as ns_mod
from ..watches import training as training_watches  # noqa: F401  (the doctor's watches registered)
from .series import LoopWatch, python_sumsq
from ...util.process import doctors_own, patch
from ..watches.registry import WatchContext, Watches

_sequence_nr = torch._C._autograd._get_sequence_nr


class LoopHooks:
    """Iteration bookkeeping for :class:`Capture` (see the module docstring)."""

    _seq_nr = staticmethod(_sequence_nr)  # autograd's next sequence number (the native recorder has its own)

    def _make_watch(self) -> LoopWatch:
        """The per-iteration watch (``loop/series.py``): live bytes by the ledger, which this tier keeps op by op on
        every device (the allocator's count on a machine with a GPU read 0 for a CPU loop). On CUDA the loss and
        gradients are not read (a read would synchronise every iteration): ``read_scalar`` and ``python_sumsq``
        read CPU tensors only."""
        self.trace.iterations.live_kind = "ledger"
        return LoopWatch(self.trace.iterations, live=lambda: self._ledger.total, sumsq=python_sumsq,
                         on_nonfinite=self._went_nonfinite)

    def _make_watches(self) -> None:
        """The registered watches made for this run (``watches/registry.py``), their wrappers installed, and
        ``torch.autograd.backward`` (what ``Tensor.backward`` calls) wrapped to tell them the loss first: the
        accumulation watch counts the calls per optimizer step there, whatever phase the ops get, and a call a
        watch counts (the cell thread's, not one nested in another) is the loss the loop's series reads."""
        loop, its = self._watch, self.trace.iterations
        watches = self.watches = Watches.made(WatchContext(
            trace=self.trace, frames=self._frames, guards=self.guards, iteration=lambda: its.steps,
            backwards=lambda: loop.backward_calls, quiet=self._quiet_ops, params=self.parameters, scalar=loop.scalar,
            loop=loop, counter=self._accum_counter(), left_alone=lambda path: self.elsewhere.leaves(path) is not None))

        # (The undo goes on the stack before the patch: a Ctrl-C in between leaves nothing installed. The undo
        # puts the original back only while the wrapper is still the doctor's: a cell's own wrapper stays.)
        undo: list[Any] = []
        self._undo.push("torch.autograd.backward", lambda: undo and undo.pop()())
        undo.append(patch(torch.autograd, "backward", watches.backward_wrapper))
        self._undo.push("the watches' wrappers (zero_grad, GradScaler, clipping, schedulers)",
                        lambda: self._unpatch_training(final=True))
        self._patch_training()

    def _accum_counter(self) -> Any:
        """The type that counts the accumulation watch's counting-only windows in C (the native recorder's), or None."""
        return None

    def _patch_training(self) -> None:
        """``zero_grad``, ``GradScaler`` and gradient clipping wrapped for the watches (not while torch.compile
        compiles: it would trace the wrappers; never again once the capture stopped)."""
        if self.watches is None or self._training_closed:
            return
        for patches in self.watches.patches():
            if not patches.installed:
                patches.install()

    def _unpatch_training(self, final: bool = False) -> None:
        self._training_closed = self._training_closed or final
        for patches in reversed(self.watches.patches()) if self.watches is not None else ():
            if patches.installed:
                patches.remove()

    @contextlib.contextmanager
    def _quiet_ops(self) -> Iterator[None]:
        """The doctor's own ops (the accumulation check's copies): not seen by the dispatch mode, no graph."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.no_grad():
            yield


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
        self.watches.iteration_ended()  # (each watch under its guard: one failing stops only itself)
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
        library's epoch and batch (``loop/trainers.py``)."""
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
            from ...util.loops import outer_loops, steps_in

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

