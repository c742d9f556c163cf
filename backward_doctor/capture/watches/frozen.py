"""Frozen parameters an optimizer step still changes (``trace.frozen_updates``).

torch's optimizers skip a parameter whose ``.grad`` is None, whatever its ``requires_grad``; a parameter frozen
after the optimizer was built whose gradient ``zero_grad(set_to_none=False)`` keeps as zeros is not skipped, and
weight decay, momentum or Adam's moments from before the freeze keep moving it. Which of the stepped parameters
are frozen with a gradient is read at each *recorded* step (an asleep iteration pays nothing: the recorder's
sampling decides, as for every op-level check); for those, a few hundred values are read before the update and
compared after it. The values are copied into small tensors of the doctor's own (the parameter is only weakly
referenced), with the recorders paused (``quiet``), and only a change that really happened is recorded.

>>> import contextlib, torch
>>> w = FrozenWatch([], quiet=contextlib.nullcontext)
>>> p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.zeros(4); _ = p.requires_grad_(False)
>>> opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.5)
>>> w.recorded_update(opt); opt.step(); w.recorded_step_ended()
>>> [(u.sampled, u.moved, round(u.max_change, 3), u.grad_zero) for u in w.record]
[(4, 4, 0.05, True)]
>>> w.recorded_update(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)); w.recorded_step_ended()
>>> len(w.record)  # (nothing frozen: nothing more)
1
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, ContextManager

import torch

from ..recorder.memory import storage_key
from ...trace.frozen import FrozenUpdate
from ...trace.parts import OptimizerStep
from .registry import Watch

_PER_PARAM = 256   # values sampled per frozen parameter
_PARAMS = 64       # frozen parameters sampled per step, at most
_KEPT = 64         # records per run: the first steps that moved frozen weights tell it


def _sample(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` at these flat offsets, as float64 on the CPU (a gather: no copy of ``t``, any
    strides, any device)."""
    flat_index = torch.unravel_index(offsets.to(t.device), tuple(t.shape)) if t.dim() > 1 else (offsets.to(t.device),)
    return t[flat_index].to(device="cpu", dtype=torch.float64)


class FrozenWatch(Watch):
    """Samples the frozen parameters with a gradient around one optimizer step (see the module docstring).
    ``quiet``: a context under which the doctor's own ops are neither recorded nor part of any graph."""

    events = ("recorded_update", "recorded_step_ended")

    def __init__(self, record: list[FrozenUpdate], quiet: Callable[[], ContextManager[Any]]) -> None:
        self.record = record
        self._quiet = quiet
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor, bool]] = []
        self._step: OptimizerStep | None = None
        self.kept = 0

    def recorded_update(self, opt: torch.optim.Optimizer, step: OptimizerStep | None = None) -> None:
        """The update is about to use the gradients: sample the frozen parameters that have one. ``step``: where
        it was called (the records carry it)."""
        self._pending = []
        if self.kept >= _KEPT:
            return
        frozen = [p for g in opt.param_groups for p in g["params"]
                  if isinstance(p, torch.Tensor) and not p.requires_grad and p.grad is not None
                  and p.is_floating_point() and p.numel() > 0]  # (the common case: none, one pass over the params)
        # (plain strided tensors with memory only: a DTensor's shard, a meta or sparse tensor is not read)
        frozen = [p for p in frozen if type(p.detach()) is torch.Tensor and p.layout == torch.strided
                  and p.device.type != "meta"]
        if not frozen:
            return
        self._step = step or OptimizerStep(index=0, optimizer=type(opt).__name__, id=id(opt))
        with self._quiet():
            for p in frozen[:_PARAMS]:
                n = p.numel()
                offsets = torch.arange(0, n, max(1, n // _PER_PARAM))[:_PER_PARAM]
                before = _sample(p.detach(), offsets)
                grad = p.grad
                zero = grad is not None and grad.shape == p.shape and not bool(_sample(grad.detach(), offsets).any())
                self._pending.append((weakref.ref(p), offsets, before, zero))

    def recorded_step_ended(self, iteration: int = 0) -> None:
        """The step of the loop's ``iteration`` returned: the sampled frozen parameters it changed join the
        record."""
        pending, self._pending = self._pending, []
        out: list[FrozenUpdate] = []
        if not pending:
            return
        with self._quiet():
            for ref, offsets, before, zero in pending:
                p = ref()
                if p is None:
                    continue
                after = _sample(p.detach(), offsets)
                change = (after - before).abs()
                moved = int((change > 0).sum())
                if moved:
                    out.append(FrozenUpdate(**dataclasses.asdict(self._step), iteration=iteration,
                                            key=storage_key(p) or 0, numel=p.numel(), sampled=len(offsets), moved=moved,
                                            max_change=float(change.max()), max_abs=float(before.abs().max()),
                                            grad_zero=zero))
        self.kept += len(out)
        self.record.extend(out)

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed, ``guard.py``)."""
        self._pending = []
        self.kept = _KEPT

    def cleared(self, trace: Any) -> None:
        pass  # (what it recorded before it stopped happened: each record is a change measured whole)


__all__ = ["FrozenWatch"]
