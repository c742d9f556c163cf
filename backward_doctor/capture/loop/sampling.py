"""A loop's iterations sampled: which ones are recorded op by op (``loop/choosing.py``), the sleep through the
others (the recorder off, module and parameter hooks removed), and what an unrecorded step still does: count
the iteration, let the loop watch read it, check and mark its gradients.

A mixin of the captures that sample, before :class:`Capture` in their bases (its ``super()`` calls go to the
Python tier's hooks, which record a step in full): :class:`~backward_doctor.capture.native_capture.NativeCapture`
and, for always on where the native recorder is not used (CUDA),
:class:`~backward_doctor.capture.python_sampling.SampledCapture`. Their ``_ext`` switches the recorder: the
native recorder's module, or the Python tier's :class:`~backward_doctor.capture.python_sampling.ModeSwitch`
(``sleep()``, ``wake()``, ``op_count()``, ``set_optimizer_depth()``).

>>> from backward_doctor.capture.native_capture import NativeCapture
>>> issubclass(NativeCapture, LoopSampling)
True
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

import torch

_get_ident = threading.get_ident  # (read at every optimizer step of every thread)


class LoopSampling:
    """Iterations recorded or slept through (see the module docstring); fields in :meth:`_init_sampling`."""

    def _init_sampling(self, sampling: Any) -> None:
        self._sampling = sampling if self.memory_limit is None else None
        self._unmarked: dict[int, tuple[torch.optim.Optimizer, int]] = {}  # (asleep steps: see _mark_unmarked)
        self._iter_t = 0.0       # when the latest iteration the policy was asked about began (perf_counter)
        self._iter_k = 0         # and its number
        self._iter_ops = 0       # the recorder's op count then
        self._next_candidate = 0  # asleep: the first iteration the policy is asked about again
        self._compiling = 0
        self._post_counts: list[int] = []  # op count at the end of each optimizer step
        # A policy that records nothing at first (always on's): the parameter and module hooks would be
        # installed while the namespace is scanned only to come off at the first op (T5 tiny: ~0.6 ms of the
        # 47 parameters' hooks a cell). They wait for the first iteration recorded (``_wake``).
        self._hooks_deferred = self._sampling is not None and not self._sampling.records_first()

    def _start_sampling(self) -> None:
        """The run has started (the capture installed): a policy that does not record the first iteration (always
        on's) puts the recorder to sleep from the first op, nothing recorded yet, nothing open."""
        self._iter_t = time.perf_counter()
        deferred, self._hooks_deferred = self._hooks_deferred, False
        if self._sampling is not None and not self._sampling.records_first():
            self._first_recorded = False
            self._fall_asleep()
        if deferred and not self._asleep:  # (it could not sleep, or records after all: hooked as recording is)
            self._hook_parameters()
            self._add_module_hooks()

    def _hook_parameter(self, p: torch.Tensor) -> None:
        if not self._hooks_deferred:
            super()._hook_parameter(p)

    def _add_module_hooks(self) -> None:
        if not self._hooks_deferred:
            super()._add_module_hooks()

    def _compile_started(self) -> None:
        self._compiling += 1
        super()._compile_started()

    def _compile_ended(self) -> None:
        self._compiling = max(0, self._compiling - 1)
        super()._compile_ended()  # (the module hooks back: not while asleep)
        if self._asleep:
            self._remove_module_hooks()

    def _sampling_note(self) -> None:
        """The trace's note on which iterations were recorded (at the end of the run)."""
        its = self.trace.iterations
        # Counted in completed iterations (0-based, as loop variables count): the part of the cell after
        # the last step is recorded too, but it is no iteration, so the two counts add up to the steps. (None
        # recorded: always on slept throughout, and ``sampling.nothing_recorded`` says so.)
        done = [r for r in its.recorded if r < its.steps]
        if its.skipped and done:
            shown = ", ".join(map(str, done[:12])) + (", ..." if len(done) > 12 else "")
            self.trace.notes.append(
                f"training loop: {its.steps} optimizer steps; {len(done)} of the {its.steps} iterations were "
                f"recorded op by op (iterations {shown}, counted from 0), the other {its.skipped} ran with the "
                "recorder off (their ops and memory are not in the trace)"
                + ("; always on records only what fits its cost budget" if not self._first_recorded else "")
                + ". `every_iteration=True` (`--every-iteration`) records them all, at 2-4x a plain step.")

    # (torch's optimizer-step hooks: every line under the optimizer watch's guard, ``guard.py``, written inline
    # rather than in a frame of its own: an asleep iteration of a long loop pays for each call)
    def _optim_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        if _get_ident() != self._thread:  # (another thread's optimizer: not this run's)
            return None
        try:
            if self._asleep:  # an unsampled iteration: only its end is counted (and its numbers read)
                outermost = self._opt_depth == 0
                if outermost:
                    if self.history is not None and id(opt) not in self._stale_checked:
                        self._check_stale_unrecorded(opt, sys._getframe(1))
                    if not kwargs and len(args) < 2:  # (no closure, the common step: both events in one call)
                        self.watches.step_began_and_before_step(opt, args, kwargs)
                        self._opt_depth = 1
                        return None
                    self.watches.step_began(opt, args, kwargs)
                self._opt_depth += 1
                if kwargs or len(args) > 1:  # (step(closure): the gradients are read after it ran)
                    wrapped = self._wrap_closure(opt, args, kwargs,
                                                 lambda: self._before_update(opt, None, outermost))
                    if wrapped is not None:
                        return wrapped
                if outermost:  # (_before_update of an unrecorded step: no stale check, no recorded_update)
                    self.watches.before_step(opt)
                return None
            self._count = self._ext.op_count()
            wrapped = super()._optim_pre(opt, args, kwargs)
            self._ext.set_optimizer_depth(self._opt_depth)
            return wrapped
        except Exception as exc:
            if not self.guards.failed("optimizer", exc):
                raise
            return None

    def _optim_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _get_ident() != self._thread:
            return
        try:
            if self._asleep:
                depth = self._opt_depth = self._opt_depth - 1 if self._opt_depth > 0 else 0
                # (the next run, and the next recorded iteration, must know these gradients were consumed: marked
                # when the recorder wakes or the run ends, not at every step of a long loop)
                self._unmarked[id(opt)] = (opt, self._watch.backward_calls)
                if depth == 0:
                    self._iteration_ended()
                return
            super()._optim_post(opt, args, kwargs)
            self._ext.set_optimizer_depth(self._opt_depth)
            self._post_counts.append(self._ext.op_count())
            if self._opt_depth == 0:
                self._iteration_ended()
        except Exception as exc:
            if not self.guards.failed("optimizer", exc):
                raise

    def _ops_so_far(self) -> int:
        return self._ext.op_count()

    def _after_step(self) -> None:
        pass  # (_optim_post ends the iteration once the recorder's own bookkeeping is done)

    # ---------------------------------------------------------------- a long loop, sampled
    def _begin_iteration(self, iteration: int) -> None:
        """Recorded if the sampling policy picks it (``loop/choosing.py``); else the recorder sleeps. (Asleep, an
        iteration that is no candidate costs one test: a loop of thousands pays it at every step.)"""
        if self._asleep and iteration < self._next_candidate:
            return
        policy = self._sampling
        now = time.perf_counter()
        ops = None if self._asleep else self._ext.op_count() - self._iter_ops
        if policy is None or policy.records(iteration, now=now, last_s=now - self._iter_t,
                                            last_n=iteration - self._iter_k, last_ops=ops):
            if self._asleep:
                self._wake()
            if not self._asleep:  # (the Python tier's mode stays off under a mode the cell entered since)
                self._count = self._iter_ops = self._ext.op_count()
                super()._begin_iteration(iteration)
        elif not self._asleep and self._opt_depth == 0 and not self._compiling:
            self._fall_asleep()
        self._iter_t, self._iter_k = time.perf_counter(), iteration
        # (asleep, the iterations before the next candidate are not even asked about: one comparison each)
        self._next_candidate = policy.next_candidate(iteration) if policy is not None else 0

    def _fall_asleep(self) -> None:
        if self._ext.sleep():
            self._asleep = True
            # (no module stack to keep while nothing is recorded, and no gradient to see arrive: each hook
            # is a call into Python from the backward, per module and per parameter, at every step)
            self._remove_module_hooks()
            self._remove_parameter_hooks()

    def _mark_unmarked(self) -> None:
        """Mark the gradients the latest asleep step of each optimizer consumed (``_mark_stepped``), when no
        ``backward()`` has run since: then they are the ones it used. (One that ran since made or added to
        them: a later step's check sees this run's own backward, not a stale gradient.)"""
        pending, self._unmarked = self._unmarked, {}
        stopped = self.guards.stopped("loop")  # (its backward() count stopped: which gradients were used is unknown)
        for opt, calls in pending.values():
            if id(opt) not in self._stepped_opts:  # (their weights are checked for NaN/Inf at the end: end/finish.py)
                self._stepped_opts[id(opt)] = weakref.ref(opt)
            if calls == self._watch.backward_calls and not stopped:
                self._mark_stepped(opt)

    def _wake(self) -> None:
        self._mark_unmarked()
        self._ext.wake()
        self._asleep = False
        self._module_stack.clear()
        self._stack_key = ()
        self._set_stack()
        self._hook_parameters()
        if not self._compiling:
            self._add_module_hooks()

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self._asleep:
            super()._accumulated(param)


__all__ = ["LoopSampling"]
