"""Learning-rate schedulers as they are stepped (``trace.schedules``): each outermost ``scheduler.step()`` with the
loop's iteration, the ``backward()`` calls so far, whether its optimizer had stepped since
the scheduler was made (torch's own ``_opt_called`` flag, set by the wrapper every ``LRScheduler`` puts on its
optimizer's ``step``), and the learning rate it moved.

For the run, ``LRScheduler._update_lr`` (what ``LRScheduler.step`` calls once it has warned) and the ``step`` of the
torch schedulers that define their own and do not warn (``SequentialLR``, ``ChainedScheduler``,
``CosineAnnealingWarmRestarts``) are wrapped and put back afterwards, as the precision watch's wrappers are
(``watches/patches.py``; off while torch.compile compiles). Not ``LRScheduler.step`` itself: its warnings name the frame
that called it (``stacklevel=2``), which must stay the user's line (and the warnings registry's key). A loop
without a scheduler pays nothing; one with a scheduler pays about 95 bytecodes (1 us) per ``scheduler.step()``
past its first 64, which keep their place (a frame walk) and learning rates (then every 256th is kept as the
latest). The constructor's own step (``_initial_step``) and the steps a composite scheduler makes of its
children are not counted; ``ReduceLROnPlateau`` (it follows a metric, not a count of steps) is not watched.

>>> import torch
>>> rec = []
>>> w = ScheduleWatch(rec, frames=None, iteration=lambda: 0)
>>> p = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([p], lr=0.1)
>>> import warnings
>>> w.patches.install()
>>> try:
...     with warnings.catch_warnings(record=True) as said:  # (torch warns: stepped before the optimizer)
...         warnings.simplefilter("always")
...         s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5); s.step()
... finally:
...     w.patches.remove()
>>> said[0].filename.endswith("watches/schedules.py")  # (the warning names the line that stepped, not the wrapper)
False
>>> rec[0].type, rec[0].calls, rec[0].steps[0].first, rec[0].steps[0].optimizer_stepped, rec[0].steps[0].lr_after
('StepLR', 1, True, False, 0.05)
"""
from __future__ import annotations

import inspect
import sys
import threading
import weakref
from threading import get_ident
from typing import Any, Callable

from ..guard import Guards
from .registry import Watch
from .patches import Patches, named_like
from ...trace.schedules import SchedulerCall, SchedulerRecord

_KEPT = 64  # steps kept per scheduler, with their place
#: the libraries whose own loops step a scheduler (the top-level module of the caller's frame)
_LIBRARIES = {"transformers": "transformers", "lightning": "lightning", "pytorch_lightning": "lightning",
              "accelerate": "accelerate"}


def _lr(opt: Any) -> float | None:
    """The first param group's learning rate (None: not a number)."""
    groups = getattr(opt, "param_groups", None)
    lr = groups[0].get("lr") if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _library(frame: Any) -> str:
    """The library whose module ``frame`` runs in ('' the user's code or any other): one dictionary read.

    >>> _library(sys._getframe())
    ''
    """
    name = frame.f_globals.get("__name__") if frame is not None else None
    return _LIBRARIES.get(name.partition(".")[0], "") if isinstance(name, str) else ""


def _first_step(sched: Any, counted: int) -> bool:
    """Whether this is the scheduler's first step since it was made (``counted``: torch counted it already).
    ``LRScheduler.step`` counts its steps; the composites and ``CosineAnnealingWarmRestarts`` do not: their epoch
    (0 after the constructor), or a ``ChainedScheduler``'s first child's count, says it.

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> _first_step(torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2), 0)
    True
    """
    if counted:
        return getattr(sched, "_step_count", None) == 1 + counted
    epoch = getattr(sched, "last_epoch", None)
    if isinstance(epoch, int):
        return epoch == 0
    children = getattr(sched, "_schedulers", None)
    return bool(children) and getattr(children[0], "_step_count", None) == 1


class ScheduleWatch(Watch):
    """Appends a :class:`SchedulerRecord` per scheduler stepped to ``record`` (see the module docstring).
    ``iteration()``: optimizer steps completed; ``backwards()``: the run's ``backward()`` calls so far;
    ``scaler_skipped()``: GradScaler steps skipped so far. ``guards``: the run's (``guard.py``)."""

    def __init__(self, record: list[SchedulerRecord], *, frames: Any, iteration: Callable[[], int],
                 backwards: Callable[[], int] = lambda: 0, scaler_skipped: Callable[[], int] = lambda: 0,
                 guards: Guards | None = None) -> None:
        self.record = record
        self._frames, self._iteration, self._backwards, self._skipped = frames, iteration, backwards, scaler_skipped
        self._guards = guards
        self._thread = threading.get_ident()
        self._depth = 0  # inside a scheduler's step (a composite stepping its children: not counted again)
        self._mine: dict[int, tuple[Any, SchedulerRecord]] = {}  # id -> (weakref, its record)
        self.patches = Patches()
        from torch.optim import lr_scheduler

        base = lr_scheduler.LRScheduler
        inner = "_update_lr" in base.__dict__  # (older torch: no such step; its own step wrapped, warnings and all)
        self.patches.add(base, "_update_lr" if inner else "step", lambda real: self._wrap(real, 2 if inner else 1))
        for cls in vars(lr_scheduler).values():
            if inspect.isclass(cls) and issubclass(cls, base) and cls is not base and "step" in cls.__dict__ and \
                    not issubclass(cls, lr_scheduler.ReduceLROnPlateau):
                self.patches.add(cls, "step", lambda real: self._wrap(real, 1))

    def _failed(self, exc: Exception) -> None:
        if self._guards is None or not self._guards.failed("schedule", exc):
            raise exc

    def _wrap(self, real: Callable[..., Any], up: int) -> Callable[..., Any]:
        """``real`` wrapped; ``up``: frames from the wrapper to the code that called ``scheduler.step()`` (2 for
        ``_update_lr``, whose caller is ``LRScheduler.step``)."""
        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            if get_ident() != self._thread:  # (another thread's scheduler: as without the doctor, not counted)
                return real(sched, *args, **kwargs)
            call = None
            try:
                if self._depth == 0:
                    got = self._mine.get(id(sched))
                    rec = got[1] if got is not None else None
                    if rec is not None and rec.calls >= _KEPT and (rec.calls + 1) % 256 and got[0]() is sched:
                        rec.calls += 1  # (past the first 64 and not a 256th: only counted, here, in few bytecodes)
                    elif not getattr(sched, "_is_initial", False):  # (not the constructor's own step)
                        call = self.before(sched, sys._getframe(up), counted=up - 1)
            except Exception as exc:
                self._failed(exc)
            self._depth += 1
            try:
                return real(sched, *args, **kwargs)
            finally:
                self._depth -= 1
                if call is not None:
                    try:
                        call.lr_after = _lr(getattr(sched, "optimizer", None))
                    except Exception as exc:
                        self._failed(exc)
        return named_like(step, real)

    def before(self, sched: Any, caller: Any, counted: int = 0) -> SchedulerCall | None:
        """``sched.step()`` is about to run, called from ``caller``: counted; the call's record when it is kept.
        ``counted``: 1 when torch already counted this step in the scheduler's ``_step_count``."""
        got = self._mine.get(id(sched))
        if got is None or got[0]() is not sched:
            opt = getattr(sched, "optimizer", None)
            rec = SchedulerRecord(type=type(sched).__name__, optimizer=type(opt).__name__ if opt is not None else "",
                                  library=_library(caller))
            self.record.append(rec)
            got = self._mine[id(sched)] = (weakref.ref(sched), rec)
        rec = got[1]
        rec.calls += 1
        if rec.calls > _KEPT and rec.calls % 256:  # (past the first 64: every 256th kept as the last, cheaply)
            return None
        opt = getattr(sched, "optimizer", None)
        # (torch sets ``_opt_called`` the first time the step it wrapped runs: no flag yet is "not stepped")
        flag = getattr(opt, "_opt_called", False) if hasattr(getattr(opt, "step", None), "_wrapped_by_lr_sched") \
            else None
        where = self._frames.where(caller) if self._frames is not None else None
        call = SchedulerCall(iteration=self._iteration(), backwards=self._backwards(),
                             first=_first_step(sched, counted),
                             optimizer_stepped=flag if isinstance(flag, bool) else None,
                             scaler_skipped=self._skipped(), lr_before=_lr(opt), library=_library(caller),
                             line=getattr(where, "line", None), file=getattr(where, "file", None),
                             cell_line=getattr(where, "cell_line", None), function=getattr(where, "function", None))
        if rec.calls <= _KEPT:
            rec.steps.append(call)
        else:
            rec.last = call
        return call

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed): the wrappers put back for good."""
        self.patches.disable()

    def cleared(self, trace: Any) -> None:
        trace.schedules.clear()


__all__ = ["ScheduleWatch"]
