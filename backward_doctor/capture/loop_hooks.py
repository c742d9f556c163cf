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

import time
from typing import Any

import torch

from . import namespace as ns_mod
from .loop_watch import LoopWatch, python_sumsq
from .process import doctors_own, patch

_sequence_nr = torch._C._autograd._get_sequence_nr


class LoopHooks:
    """Iteration bookkeeping for :class:`Capture` (see the module docstring)."""

    def _make_watch(self) -> LoopWatch:
        """The per-iteration watch (``loop_watch.py``): live bytes by the allocator on CUDA (the loss and
        gradients there are not read: a read would synchronise every iteration), by the ledger here."""
        if self._cuda:
            return LoopWatch(self.trace.iterations, live=torch.cuda.memory_allocated,
                             on_nonfinite=self._went_nonfinite)
        self.trace.iterations.live_kind = "ledger"
        return LoopWatch(self.trace.iterations, live=lambda: self._ledger.total, sumsq=python_sumsq,
                         on_nonfinite=self._went_nonfinite)

    def _watch_backward(self) -> None:
        """``torch.autograd.backward`` (what ``Tensor.backward`` calls) tells the watch the loss first."""
        watch = self._watch

        def wrap(real: Any) -> Any:
            def backward(*args: Any, **kwargs: Any) -> Any:
                watch.saw_backward(args[0] if args else kwargs.get("tensors"))
                return real(*args, **kwargs)
            return backward

        # (The undo goes on the stack before the patch: a Ctrl-C in between leaves nothing installed.)
        undo: list[Any] = []
        self._undo.push("torch.autograd.backward", lambda: undo and undo.pop()())
        undo.append(patch(torch.autograd, "backward", wrap))

    def _went_nonfinite(self, iteration: int, what: str) -> None:
        """NaN/Inf in this iteration's loss or gradients, seen before its optimizer step: a run-level
        ``rollback`` keeps the state an iteration the recorder did not record can be replayed from."""
        if self.rollback is not None and self._asleep:
            self.rollback.went_nonfinite(iteration, what)

    def _iteration_ended(self) -> None:
        """The outermost optimizer step returned: an iteration of the cell's loop ended, the next starts
        at the next op (``trace.iterations``; the native recorder also samples them)."""
        its = self.trace.iterations
        if not its.recorded:
            its.recorded.append(0)
            its.starts.append(0)
        if not self._asleep:  # the iteration that ended was recorded: what its loop variables were
            self._note_loop_values(its.steps)
        self._watch.iteration_ended()
        its.steps += 1
        self._iter_seq.append(_sequence_nr())
        if self.rollback is not None:
            self.rollback.iteration_began(its.steps)
        self._begin_iteration(its.steps)

    def _begin_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` starts at the next op, recorded (the native recorder samples them)."""
        self.trace.iterations.recorded.append(iteration)
        self.trace.iterations.starts.append(self._count)

    def _note_loop_values(self, iteration: int) -> None:
        """The cell's loop variables as they are now, for ``iteration`` (strings only: nothing kept). The
        first 4,096 iterations, then powers of two only (a bounded trace)."""
        if len(self.trace.iterations.values) >= 4096 and iteration & (iteration - 1):
            return
        if self._loop_names is None:
            from ..util.loops import outer_loops

            self._loop_names = sorted({n for _, _, names in outer_loops(self.trace.source) for n in names})
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

