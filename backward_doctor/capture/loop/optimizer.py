"""The capture's side of ``optimizer.step()``: the step recorded where it was called, a closure's work
recorded as the forward and backward it is (Lightning, L-BFGS), the gradients read before the update
uses them, the stale-gradient check, and the end of a loop's iteration when the outermost step returns.

A mixin of :class:`~backward_doctor.capture.context.Capture` (its fields are in ``state.py``); the native
recorder overrides ``_optim_pre``/``_optim_post`` to count unsampled iterations only.

>>> from backward_doctor.capture import Capture
>>> issubclass(Capture, OptimizerHooks)
True
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from typing import Any

import torch

from .. import namespace as ns_mod
from ..recorder.memory import grad_of
from ...trace.parts import OptimizerStep, StaleStep

_get_ident = threading.get_ident  # (read at every optimizer step of every thread)


class OptimizerHooks:
    """Optimizer-step bookkeeping for :class:`Capture` (see the module docstring)."""

    # The hooks torch calls (``register_optimizer_step_pre_hook``/``post_hook``): the bookkeeping under the
    # optimizer watch's guard (``guard.py``), so that its failure never fails the user's step. (The sampling
    # captures' own hooks guard their asleep path inline: no frame more at every step of a long loop.)
    def _optim_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        if _get_ident() != self._thread:  # (another thread's optimizer: not this run's)
            return None
        try:
            return self._recorded_step_began(opt, args, kwargs)
        except Exception as exc:
            if not self.guards.failed("optimizer", exc):
                raise
            return None  # (the step runs with its own arguments)

    def _optim_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _get_ident() != self._thread:
            return
        try:
            self._recorded_step_ended(opt)
        except Exception as exc:
            if not self.guards.failed("optimizer", exc):
                raise

    def _recorded_step_began(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        outermost = self._opt_depth == 0
        if outermost:  # (before its closure, if it has one: the closure's backward() counts in this step's window)
            self.watches.step_began(opt, args, kwargs)
        self._opt_depth += 1
        self._where_cache.clear()
        if self._unhooked:
            self._unfrozen()
        for group in opt.param_groups:
            for p in group["params"]:
                self._register_param(p)
                self._stepped_params.add(id(p))
        where = self._frames.where(sys._getframe(2))
        step = OptimizerStep(index=self._count, optimizer=type(opt).__name__, id=id(opt),
                             line=where.line, file=where.file, cell_line=where.cell_line, function=where.function)
        self.trace.optimizer_steps.append(step)
        wrapped = self._wrap_closure(opt, args, kwargs, lambda: self._before_update(opt, step, outermost))
        if wrapped is None:  # no closure: the gradients the update uses are there now
            self._before_update(opt, step, outermost)
        return wrapped

    def _before_update(self, opt: torch.optim.Optimizer, step: OptimizerStep | None, outermost: bool) -> None:
        """The optimizer's own update is about to use the gradients (after its closure, if it got one):
        the watches read them, and whether an earlier step had already used them."""
        if outermost:
            self.watches.before_step(opt)
        if self.history is not None and step is not None:
            self._check_stale(opt, step)
        if step is not None:  # (a recorded step: an asleep one does not look)
            self.watches.recorded_update(opt, step)

    def _wrap_closure(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict,
                      first_returned: Any) -> tuple[tuple, dict] | None:
        """``step(closure)`` (L-BFGS; Lightning runs ``training_step`` and ``backward`` in one): the new
        (args, kwargs) with the closure wrapped so that what it runs is recorded as the forward and backward
        it is, not as the optimizer's update, and ``first_returned`` is called when it first returns (the
        update uses the gradients it left). None when there is no closure. The wrapper calls the closure
        with the same arguments and returns what it returns: the step computes exactly the same."""
        # (args[0] is the optimizer itself: torch passes the bound call's arguments)
        if callable(kwargs.get("closure")):
            kwargs = dict(kwargs, closure=self._closure_wrapper(kwargs["closure"], first_returned))
        elif len(args) > 1 and callable(args[1]):
            args = (args[0], self._closure_wrapper(args[1], first_returned)) + tuple(args[2:])
        else:
            return None
        return args, kwargs

    def _closure_wrapper(self, closure: Any, first_returned: Any) -> Any:
        capture, pending = self, [first_returned]

        @functools.wraps(closure)
        def closure_under_doctor(*a: Any, **kw: Any) -> Any:
            __tracebackhide__ = True
            depth = capture._opt_depth
            capture._guarded("optimizer", capture._set_optimizer_depth, 0)  # (its ops: not the update's own)
            try:
                out = closure(*a, **kw)
            finally:
                capture._guarded("optimizer", capture._set_optimizer_depth, depth)
            if pending:
                capture._guarded("optimizer", pending.pop())
            return out

        return closure_under_doctor

    def _set_optimizer_depth(self, depth: int) -> None:
        """Inside (depth > 0) or outside the optimizer's own update, from the next op on."""
        self._opt_depth = depth
        self._where_cache.clear()

    def _check_stale(self, opt: torch.optim.Optimizer, step: OptimizerStep) -> None:
        """A gradient an earlier step already consumed, never cleared since: accumulation by accident."""
        self._stale_checked.add(id(opt))  # (the unrecorded steps after it need not look again)
        marks = self.history.stepped_grads
        # Only gradients this run's backward added to: a step cell fed by another cell's backward
        # cannot see whether that cell zeroed them in between.
        stale = [(p, marks[grad_of(p)]) for g in opt.param_groups for p in g["params"]
                 if grad_of(p) is not None and id(p) in self._got_grad and grad_of(p) in marks]
        if stale:
            self._stale_step(step, stale)

    def _stale_step(self, step: OptimizerStep, stale: list[tuple[Any, tuple[int, int | None]]]) -> None:
        """``step`` used the gradients of ``stale`` ((parameter, its mark), non-empty) an earlier step had used."""
        self.trace.stale_steps.append(StaleStep(**dataclasses.asdict(step), params=len(stale),
                                                since_run=min(m[0] for _, m in stale), previous_line=stale[0][1][1]))

    def _check_stale_unrecorded(self, opt: torch.optim.Optimizer, frame: Any) -> None:
        """:meth:`_check_stale` for a step the recorder did not record (always on sleeps through a single step),
        once per optimizer and run: no parameter hook said which gradients this run's backward added to, so a
        gradient whose version moved since the run began says it (a ``zero_grad()`` before this window's
        backward, which moves it too, means nothing is stale)."""
        self._stale_checked.add(id(opt))
        if not self._mark_versions or self._watch.backward_calls == 0 or self.watches.zeroed_first():
            return
        marks, versions = self.history.stepped_grads, self._mark_versions
        stale = [(p, marks[g]) for group in opt.param_groups for p in group["params"]
                 if (g := grad_of(p)) is not None and id(g) in versions and g._version != versions[id(g)]
                 and g in marks]
        if stale:
            where = self._frames.where(frame)
            self._stale_step(OptimizerStep(index=self._count, optimizer=type(opt).__name__, id=id(opt),
                                           line=where.line, file=where.file, cell_line=where.cell_line,
                                           function=where.function), stale)

    def _recorded_step_ended(self, opt: torch.optim.Optimizer) -> None:
        self._opt_depth = max(0, self._opt_depth - 1)
        self.watches.recorded_step_ended(self.trace.iterations.steps)
        for t in ns_mod.optimizer_state_tensors(opt):
            self._ledger.reclassify(t, "optimizer")
        self._mark_stepped(opt)
        self._after_step()

    def _mark_stepped(self, opt: torch.optim.Optimizer) -> None:
        """The gradients this step consumed, for the next run's stale-gradient check."""
        if self.history is not None:
            line = self.trace.optimizer_steps[-1].line if self.trace.optimizer_steps else None
            for g in opt.param_groups:
                for p in g["params"]:
                    grad = grad_of(p)
                    if grad is not None:
                        self.history.stepped_grads[grad] = (self._run_id, line, self._ops_so_far())

    def _ops_so_far(self) -> int:
        """Ops dispatched so far in this run (a gradient marked now was cleared if a later op zeroed it)."""
        return self._count

    def _after_step(self) -> None:
        if self._opt_depth == 0:
            self._iteration_ended()
