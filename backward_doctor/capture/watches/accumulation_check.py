"""The pieces of the accumulation watch that read what a loss and its gradients hold: the divisor a loss
was scaled by before ``backward()`` (from the constants of its root nodes, read in place), and the
measured equivalence check of one accumulation window against one full batch (``AccumulationCheck``).

>>> import torch
>>> x = torch.ones(3, requires_grad=True)
>>> divisor(x.sum() / 4), divisor(x.sum() * 0.5), divisor(x.sum())
((4.0, 'DivBackward0'), (2.0, 'MulBackward0'), (1.0, 'SumBackward0'))
"""
from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from ...trace.accumulation import AccumulationCheck

_NUMBERS = {torch.int64: ctypes.c_int64, torch.int32: ctypes.c_int32, torch.float64: ctypes.c_double,
            torch.float32: ctypes.c_float}


def number(t: Any) -> float | None:
    """A one-element CPU tensor's value read in place (nothing dispatched): a divisor a loss was scaled by.

    >>> number(torch.tensor(4)), number(torch.tensor([0.5])), number(torch.zeros(2))
    (4.0, 0.5, None)
    """
    kind = _NUMBERS.get(getattr(t, "dtype", None))
    if kind is None or t.numel() != 1 or t.device.type != "cpu" or t.layout != torch.strided:
        return None
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no storage (a fake tensor)
        return None
    return float(kind.from_address(ptr).value) if ptr else None


def divisor(t: Any) -> tuple[float, str]:
    """What the loss ``t`` was divided by just before ``backward()`` (``loss / 4``, ``loss * 0.25``: 4.0),
    read from the constant operands of the Div/Mul nodes at its root; a GradScaler's multiplication (a
    power of two of at least 256) is not a division. Returns (divisor, the root node's name)."""
    fn = getattr(t, "grad_fn", None)
    root = type(fn).__name__ if fn is not None else ""
    d = 1.0
    for _ in range(6):
        name = type(fn).__name__
        if name not in ("DivBackward0", "MulBackward0"):
            break
        try:
            other = fn._saved_other
        except Exception:  # an operand that requires grad is not a constant: the loss itself
            break
        v = number(other) if isinstance(other, torch.Tensor) and not other.requires_grad else None
        if not v or not math.isfinite(v):
            break
        if name == "MulBackward0" and v >= 256 and math.log2(v).is_integer():
            pass  # the GradScaler's loss scale, not a division for accumulation
        else:
            d = d * v if name == "DivBackward0" else d / v
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return d, root


class EquivalenceCheck:
    """The measured equivalence check over one window: ``full`` adds up what each backward() added to
    ``.grad`` (``now - before``); after each backward() the dot products of the step's gradient (``.grad``
    now) with it are kept, so a clip or an unscale before the step changes nothing."""

    def __init__(self, params: list[torch.Tensor], iteration: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.iteration = iteration
        self.full = [self._copy(p.grad, p) for p in self.params]  # the first micro-batch: what .grad holds
        self.before = [f.clone() for f in self.full]
        self.stats: tuple[float, float, float] | None = None
        self.divisors: list[float] = []

    @staticmethod
    def _copy(g: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
        if g is None:
            return torch.zeros(p.shape, dtype=torch.float32)
        return g.detach().to("cpu", torch.float32, copy=True)

    def began(self) -> None:
        for b, p in zip(self.before, self.params):
            b.copy_(p.grad.detach()) if p.grad is not None else b.zero_()

    def ended(self) -> None:
        dot = ss = ff = 0.0
        for f, b, p in zip(self.full, self.before, self.params):
            now = self._copy(p.grad, p)
            f.add_(now - b)
            dot += float(torch.dot(now.flatten().double(), f.flatten().double()))
            ss += float(now.double().pow(2).sum())
            ff += float(f.double().pow(2).sum())
        self.stats = (dot, ss, ff)

    def result(self, k: int) -> AccumulationCheck:
        d = self.divisors[0] if self.divisors else 1.0
        out = AccumulationCheck(iteration=self.iteration, micro_batches=k, divisor=d)
        if self.stats is None or any(x != self.divisors[0] for x in self.divisors):
            out.why_not = "the micro-batches' losses were scaled differently" if self.stats else "no backward() ended"
            return out
        dot, ss, ff = self.stats
        if not all(map(math.isfinite, (dot, ss, ff))) or ff == 0:
            out.why_not = "the gradients were zero or not finite"
            return out
        w = min(1.0, d / k)  # each micro-batch's share of the full batch (1: its loss already was one)
        out.factor = dot / (w * ff)
        out.rel_diff = math.sqrt(max(0.0, ss - 2 * w * dot + w * w * ff)) / (w * math.sqrt(ff))
        out.norm_step, out.norm_full = math.sqrt(ss), w * math.sqrt(ff)
        out.sum_rel_diff = math.sqrt(max(0.0, ss - 2 * dot + ff)) / math.sqrt(ff)
        return out


__all__ = ["EquivalenceCheck", "divisor", "number"]
