"""Index-range checks for the ops that index with tensors.

On CPU these ops raise a readable error themselves; on CUDA a bad index is a
device-side assert that kills the CUDA context. Checking the range before the
kernel launches turns that into an ordinary Python ``IndexError`` while the
context is still alive. The same function explains a CPU failure after the fact.

>>> import torch
>>> w, idx = torch.zeros(5, 3), torch.tensor([1, 7])
>>> index_check(torch.ops.aten.embedding.default, (w, idx), {}).bad
[7]
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ...util.process import doctors_own
from ...trace.records import IndexCheck

log = logging.getLogger(__name__)

aten = torch.ops.aten


def _range_check(values: torch.Tensor, lo: int, hi: int, argument: str, what: str,
                 ignore: int | None = None) -> IndexCheck | None:
    if values.device.type == "meta" or values.numel() == 0:
        return None
    v = values.detach().reshape(-1)
    if ignore is not None:
        v = v[v != ignore]
        if v.numel() == 0:
            return None
    bad_mask = (v < lo) | (v > hi)
    n_bad = int(bad_mask.sum())
    if not n_bad:
        return None
    bad = torch.unique(v[bad_mask])[:8].tolist()
    return IndexCheck(argument=argument, what=what, valid=[lo, hi], bad=bad, bad_count=n_bad, min=int(v.min()),
                      max=int(v.max()))


def _embedding(args, kwargs):
    weight, indices = args[0], args[1]
    return _range_check(indices, 0, weight.shape[0] - 1, "indices", f"num_embeddings={weight.shape[0]}")


def _nll(args, kwargs):
    inp, target = args[0], args[1]
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    classes = inp.shape[1] if inp.dim() >= 2 else inp.shape[0]
    return _range_check(target, 0, classes - 1, "target", f"{classes} classes", ignore=ignore)


def _dim_index(args, kwargs):
    inp, dim, index = args[0], args[1], args[2]
    size = inp.shape[dim] if inp.dim() else 1
    return _range_check(index, 0, size - 1, "index", f"size {size} of dimension {dim}")


def _advanced(args, kwargs):
    """``x[idx]`` / ``x[idx] = v`` (``aten.index`` / ``index_put``): each integer index tensor indexes the
    dimension at its position; negative values count from the end, as in Python. Boolean masks are
    checked by shape in PyTorch itself (an error on the host), so they are left alone."""
    inp, indices = args[0], args[1]
    for d, index in enumerate(indices or ()):
        if index is None or not isinstance(index, torch.Tensor) or index.dtype in (torch.bool, torch.uint8):
            continue
        if d >= inp.dim():
            return None  # (PyTorch says "too many indices" itself, before any kernel)
        size = inp.shape[d]
        found = _range_check(index, -size, size - 1, "indices", f"size {size} of dimension {d}")
        if found is not None:
            return found
    return None


def _scatter(args, kwargs):
    """``scatter``/``scatter_add``/``index_add``/``index_copy`` write at ``index`` along ``dim``: 0..size-1."""
    out, dim, index = args[0], args[1], args[2]
    size = out.shape[dim] if out.dim() else 1
    return _range_check(index, 0, size - 1, "index", f"size {size} of dimension {dim}")


_CHECKS: dict[Any, Callable] = {
    aten.embedding.default: _embedding,
    aten.nll_loss_forward.default: _nll,
    aten.nll_loss2d_forward.default: _nll,
    aten.gather.default: _dim_index,
    aten.index_select.default: _dim_index,
    # Found on an H200 (benchmarks/gpu_validation.py): a table read as ``w[ids]`` with an id past its end was a
    # device-side assert reported a line later, and the CUDA context lost. Checked before launch, as above.
    aten.index.Tensor: _advanced,
    aten.index_put.default: _advanced,
    aten.index_put_.default: _advanced,
    aten._index_put_impl_.default: _advanced,
    aten.scatter.src: _scatter,
    aten.scatter_.src: _scatter,
    aten.scatter.value: _scatter,
    aten.scatter_.value: _scatter,
    aten.scatter_add.default: _scatter,
    aten.scatter_add_.default: _scatter,
    aten.index_add.default: _scatter,
    aten.index_add_.default: _scatter,
    aten.index_copy.default: _scatter,
    aten.index_copy_.default: _scatter,
}


def has_index_check(func: Any) -> bool:
    return func in _CHECKS


@torch.no_grad()
def index_check(func: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Out-of-range index values of ``func(*args)``, or None when all are valid."""
    check = _CHECKS.get(func)
    if check is None:
        return None
    try:
        return check(args, kwargs)
    except Exception as exc:  # evidence only: never fail because the check could not run
        if not doctors_own(exc):
            raise
        log.debug("index check could not run", exc_info=True)
        return None
