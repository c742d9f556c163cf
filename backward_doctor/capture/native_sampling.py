"""The native recorder's side of a loop's iterations: which ones it records op by op (``sampling.py``), its
sleep through the others (observer off, module and parameter hooks removed), and what an unrecorded step
still does: count the iteration, let the loop watch read it, check and mark its gradients.

A mixin of :class:`~backward_doctor.capture.native_capture.NativeCapture` (before :class:`Capture` in its
bases: its ``super()`` calls go to the Python tier's hooks, which record a step in full).

>>> from backward_doctor.capture.native_capture import NativeCapture
>>> issubclass(NativeCapture, NativeSampling)
True
"""
from __future__ import annotations

import sys
import time
from typing import Any

import torch


class NativeSampling:
    """Iterations recorded or slept through (see the module docstring); fields in ``NativeCapture.__init__``."""

    def _optim_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        if self._asleep:  # an unsampled iteration: only its end is counted (and its numbers read)
            outermost = self._opt_depth == 0
            if outermost:
                self._outer_step_began(opt, args, kwargs)
                if self.history is not None and id(opt) not in self._stale_checked:
                    self._check_stale_unrecorded(opt, sys._getframe(1))
            self._opt_depth += 1
            if "closure" in kwargs or len(args) > 1:  # (step(closure): the gradients are read after it ran)
                wrapped = self._wrap_closure(opt, args, kwargs, lambda: self._before_update(opt, None, outermost))
                if wrapped is not None:
                    return wrapped
            if outermost:  # (_before_update of an unrecorded step: the loop watch alone)
                self._watch.before_step(opt)
            return None
        self._count = self._ext.op_count()
        wrapped = super()._optim_pre(opt, args, kwargs)
        self._ext.set_optimizer_depth(self._opt_depth)
        return wrapped

    def _optim_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._asleep:
            self._opt_depth = self._opt_depth - 1 if self._opt_depth > 0 else 0
            # (the next run, and the next recorded iteration, must know these gradients were consumed: marked
            # when the recorder wakes or the run ends, not at every step of a long loop)
            self._unmarked[id(opt)] = (opt, self._watch.backward_calls)
        else:
            super()._optim_post(opt, args, kwargs)
            self._ext.set_optimizer_depth(self._opt_depth)
            self._post_counts.append(self._ext.op_count())
        if self._opt_depth == 0:
            self._iteration_ended()

    def _after_step(self) -> None:
        pass  # (_optim_post ends the iteration once the recorder's own bookkeeping is done)

    # ---------------------------------------------------------------- a long loop, sampled
    def _begin_iteration(self, iteration: int) -> None:
        """Recorded if the sampling policy picks it (``sampling.py``); else the recorder sleeps. (Asleep, an
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
        for opt, calls in pending.values():
            if calls == self._watch.backward_calls:
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


__all__ = ["NativeSampling"]
