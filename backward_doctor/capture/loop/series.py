"""A training loop watched in every iteration, recorded op by op or not: the loss, the gradients' norm,
the learning rate and live memory, a few numbers per iteration (``Trace.iterations``).

This is what tells a divergence (the loss and the gradient norm grow for many iterations before the
first NaN) from a bad batch (all steady, then NaN at once), names the exact iteration where NaN/Inf first
showed even when the recorder was off for it, and shows memory creeping up iteration after iteration.

Nothing here dispatches an op or allocates on the device: the loss is read from its CPU storage in
place, the gradients' sum of squares is read in C++ by the native recorder (the Python tier uses a
fused ``_foreach_norm`` outside the dispatch mode), and on CUDA neither is read (a read would
synchronise the device every iteration); live memory is the allocator's count.

>>> import torch
>>> w = LoopWatch(its := Iterations(), live=lambda: 0)
>>> w.saw_backward(torch.tensor(0.5))
>>> w.iteration_ended()
>>> its.loss, its.backwards, its.first_nonfinite
([0.5], [1], None)
"""
from __future__ import annotations

import ctypes
import math
import struct
from typing import Any, Callable, Sequence

import torch

from ..recorder.memory import grad_of
from ...trace.parts import Iterations
from ..guard import nothing
from ..watches.registry import Watch
from ...util.process import doctors_own

_Tensor = torch.Tensor
_isfinite, _sqrt = math.isfinite, math.sqrt  # (module names: read at every iteration of a loop)
_MAX_POINTS = 4096  # per series; past it every other point is dropped and the stride doubles


def read_scalar(t: Any) -> float | None:
    """The value of a one-element CPU floating tensor, read from its storage in place (no op dispatched,
    nothing allocated, nothing a dispatch mode or profiler would see); None when it cannot be read so.

    >>> read_scalar(torch.tensor(1.5)), read_scalar(torch.tensor([1.0, 2.0])), read_scalar(3)
    (1.5, None, None)
    """
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or t.numel() != 1:
        return None
    if t.layout != torch.strided or not t.is_floating_point():
        return None
    try:
        ptr = t.data_ptr()
    except RuntimeError as exc:  # no storage (a fake or functional tensor)
        if not doctors_own(exc):
            raise
        return None
    if not ptr:
        return None
    dtype = t.dtype
    if dtype == torch.float32:
        return ctypes.c_float.from_address(ptr).value
    if dtype == torch.float64:
        return ctypes.c_double.from_address(ptr).value
    if dtype == torch.float16:
        return struct.unpack("<e", ctypes.string_at(ptr, 2))[0]
    if dtype == torch.bfloat16:  # the upper half of a float32
        return struct.unpack("<f", b"\0\0" + ctypes.string_at(ptr, 2))[0]
    return None


def python_sumsq(grads: Sequence[torch.Tensor]) -> float | None:
    """Sum of squares of CPU gradients by a fused norm outside any dispatch mode (the Python tier's way;
    the native recorder reads them in C++). None for gradients on another device.

    >>> round(python_sumsq([torch.ones(4), torch.ones(2)]), 4)
    6.0
    """
    from torch.utils._python_dispatch import _disable_current_modes

    if not grads:
        return 0.0
    if any(g.device.type != "cpu" for g in grads):
        return None
    with _disable_current_modes(), torch.no_grad():
        norms = torch._foreach_norm([g.detach() for g in grads])
        return float(sum(float(n) ** 2 for n in norms))


def groups_sumsq(groups: Any, sumsq: Callable[[Sequence[torch.Tensor]], float | None],
                 from_list: Callable[[list], float | None] | None = None) -> float | None:
    """The sum of squares of the gradients of an optimizer's ``param_groups`` by ``sumsq`` (``from_list``: the
    same read from a list of groups directly, the native recorder's); None when one cannot be read.

    >>> p = torch.ones(3, requires_grad=True); p.grad = torch.full((3,), 2.0)
    >>> round(groups_sumsq([{"params": [p]}], python_sumsq), 4)
    12.0
    """
    try:
        if from_list is not None and type(groups) is list:
            return from_list(groups)
        return sumsq([g for g in (grad_of(p) for group in groups for p in group["params"]) if g is not None])
    except Exception as exc:  # a gradient we cannot read is not worth failing the step for
        if not doctors_own(exc):  # (a signal handler's exception: the user's, it goes on)
            raise
        return None


class LoopWatch(Watch):
    """The per-iteration series of one run, written into ``its`` (an :class:`Iterations`).

    ``live``: live bytes now (plus ``live_base``: a C function's count from a start, called as it is);
    ``sumsq``: sum of squares of a list of gradients (None: not readable);
    ``scalar``: a one-element tensor's value read in place (None: not readable);
    ``on_nonfinite(iteration, what)``: called once, when the first NaN/Inf loss reaches ``backward()`` or,
    for NaN/Inf gradients from a finite loss, before the optimizer step that would write them into the
    weights.
    """

    events = ("saw_backward", "before_step", "iteration_ended")

    def __init__(self, its: Iterations, *, live: Callable[[], int | None],
                 sumsq: Callable[[Sequence[torch.Tensor]], float | None] | None = None,
                 scalar: Callable[[Any], float | None] = read_scalar,
                 on_nonfinite: Callable[[int, str], None] | None = None,
                 groups_sumsq: Callable[[list], float | None] | None = None, live_base: int = 0) -> None:
        self.its = its
        self.scalar = scalar  # (the accumulation watch reads the losses it keeps so too)
        self._live, self._live_base = live, live_base
        self._sumsq = sumsq
        self._groups_sumsq = groups_sumsq  # the same from an optimizer's param_groups (the native recorder's)
        self.on_nonfinite = on_nonfinite
        self._loss: float | None = None
        self._norm: float | None = None
        self._lr: float | None = None
        self._bad = ""  # "loss" / "gradients": this iteration's NaN/Inf, seen before its step
        self._backwards = 0  # backward() calls since the last step (micro-batches of gradient accumulation)
        self.backward_calls = 0  # all of the run's

    # ---------------------------------------------------------------- during an iteration
    def saw_backward(self, loss: Any) -> None:
        """``backward()`` was called on ``loss`` (its tensor, or what it was given when that is not one tensor:
        the wrapper in ``loop/hooks.py`` unpacks a one-element sequence): a one-element tensor is the loss."""
        self._backwards += 1
        self.backward_calls += 1
        if not isinstance(loss, _Tensor):
            return
        value = self.scalar(loss)
        if value is None:
            return
        if _isfinite(value):
            self._loss = value
            return
        self._loss = None  # (the series keeps finite values only: JSON has no NaN; first_nonfinite says it)
        if not self._bad:
            self._bad = "loss"
            # Seen before its backward (and, with gradient accumulation, in the very micro-batch that
            # made it): the state to replay from is the one of this moment.
            self._first("loss")

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """The outermost ``optimizer.step()`` is about to run: the gradients it will use, its lr."""
        groups = opt.param_groups  # (read once: this runs at every step of a loop)
        group = groups[0] if groups else {}
        lr = group.get("lr")
        self._lr = float(lr) if isinstance(lr, (int, float)) else None
        if self.its.base_lr is None:  # (a scheduler keeps the configured rate as "initial_lr")
            base = group.get("initial_lr", lr)
            self.its.base_lr = float(base) if isinstance(base, (int, float)) else None
        if self._sumsq is not None:
            ss = groups_sumsq(groups, self._sumsq, self._groups_sumsq)
            if ss is not None:
                if _isfinite(ss):
                    self._norm = _sqrt(ss)
                else:  # (kept out of the series, as the loss: first_nonfinite says it)
                    self._bad = self._bad or "gradients"
        if self._bad:
            self._first(self._bad)

    def _first(self, what: str) -> None:
        if self.its.first_nonfinite is None:
            self.its.first_nonfinite, self.its.first_nonfinite_in = self.its.steps, what
            if self.on_nonfinite is not None:
                self.on_nonfinite(self.its.steps, what)

    # ---------------------------------------------------------------- between iterations
    def iteration_ended(self) -> None:
        """Iteration ``its.steps`` ended (called before it is counted): its numbers join the series."""
        its = self.its
        if its.steps % its.stride == 0:  # (the values are finite or None already: read so above)
            its.loss.append(self._loss)
            its.grad_norm.append(self._norm)
            its.lr.append(self._lr)
            live = self._live()
            its.live_bytes.append(-1 if live is None else int(live) + self._live_base)
            its.backwards.append(self._backwards)
            if len(its.loss) > _MAX_POINTS:
                for series in (its.loss, its.grad_norm, its.lr, its.live_bytes, its.backwards):
                    del series[1::2]
                its.stride *= 2
        self._loss = self._norm = self._lr = None
        self._bad = ""
        self._backwards = 0

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed, ``guard.py``): its calls do nothing."""
        self.saw_backward = self.before_step = self.iteration_ended = nothing  # type: ignore[method-assign]


__all__ = ["LoopWatch", "read_scalar", "python_sumsq", "groups_sumsq"]
