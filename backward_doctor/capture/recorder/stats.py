"""Small, safe statistics of tensors, taken at record time (never the tensor itself).

Statistics are over finite values, with explicit NaN/Inf counts (the lovely-tensors
convention), so a single NaN does not hide the range of the rest.

>>> import torch
>>> tensor_stats(torch.tensor([1.0, float("nan"), 3.0])).nan
1
"""
from __future__ import annotations

import logging
import math

import torch

from .memory import shape_of
from ...util.process import doctors_own
from ...trace.records import TensorMeta, TensorStats

log = logging.getLogger(__name__)

_NO_DATA_DEVICES = ("meta",)


def _has_data(t: torch.Tensor) -> bool:
    if t.device.type in _NO_DATA_DEVICES or t.numel() == 0:
        return False
    # Tensor subclasses (FakeTensor, functional wrappers) may carry no readable data.
    return type(t) in (torch.Tensor, torch.nn.Parameter)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def meta(t: torch.Tensor, with_stats: bool = False) -> TensorMeta:
    """Shape/dtype/device (and optionally statistics) of ``t``."""
    m = TensorMeta(list(shape_of(t)), dtype_name(t.dtype), str(t.device), t.requires_grad)
    if with_stats:
        m.stats = tensor_stats(t)
    return m


@torch.no_grad()
def tensor_stats(t: torch.Tensor) -> TensorStats | None:
    """min/max/mean over finite values plus NaN/+Inf/-Inf counts (None if unreadable)."""
    if not _has_data(t):
        return None
    try:
        x = t.detach()
        if x.is_complex():
            x = x.abs()
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        numel = x.numel()
        out = TensorStats(numel=int(numel))
        finite = x
        if x.is_floating_point():
            mask = torch.isfinite(x)
            n_finite = int(mask.sum())
            if n_finite != numel:  # only then count what kind of non-finite it is
                out.nan = int(torch.isnan(x).sum())
                out.posinf = int((x == float("inf")).sum())
                out.neginf = numel - n_finite - out.nan - out.posinf
                finite = x[mask]
        if finite.numel():
            lo, hi = torch.aminmax(finite)
            out.min, out.max = float(lo), float(hi)
            out.mean = float(finite.double().mean())
        return out
    except Exception as exc:  # statistics are evidence, never a reason to fail the user's step
        if not doctors_own(exc):  # (a signal handler's exception is the user's: it goes on)
            raise
        log.debug("no statistics for a %s tensor", getattr(t, "layout", "?"), exc_info=True)
        return None


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def screen_nonfinite(t: torch.Tensor) -> bool:
    """Cheap check: True when ``t`` (floating point) holds NaN or Inf.

    One reduction screens the tensor: a NaN or Inf anywhere makes the sum non-finite.
    Only when the sum is non-finite (which finite values can also cause, by
    overflow) does the exact element-wise check run. Callers disable grad mode.
    """
    if not t.is_floating_point() or not _has_data(t):
        return False
    try:
        s = t.sum(dtype=torch.float32) if t.dtype in _LOW_PRECISION else t.sum()
        if math.isfinite(s.item()):
            return False
        return not bool(torch.isfinite(t).all())
    except Exception as exc:
        if not doctors_own(exc):
            raise
        log.debug("no NaN/Inf screen for a %s tensor", getattr(t, "layout", "?"), exc_info=True)
        return False

