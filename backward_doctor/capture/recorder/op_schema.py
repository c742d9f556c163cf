"""What an aten op's schema says, read once per op overload: its name, the arguments it writes into, whether
it returns a view, whether it has an index check (``recorder/checks.py``), and the tensor lists whose version counters
a dispatch mode must bump itself; the tensor arguments of a call. The per-op hot path (``recorder/record.py``) looks
these up in :data:`_FUNCS`.

>>> import torch
>>> _func_info(torch.ops.aten.add_.Tensor)[:3]
('aten::add_', (0,), False)
>>> len(_tensors((torch.ones(1), [torch.ones(2), 3]), {"out": torch.ones(3)}))
3
"""
from __future__ import annotations

from typing import Any

import torch

from . import checks

#: op overload -> (name, positions it writes into, is a view, has an index check, tensor lists whose
#: versions the dispatch mode must bump itself)
_FUNCS: dict[Any, tuple[str, tuple[int, ...], bool, bool, tuple[int, ...]]] = {}


def _func_info(func: Any) -> tuple[str, tuple[int, ...], bool, bool, tuple[int, ...]]:
    schema = func._schema
    mutated = tuple(i for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only)
    is_view = not mutated and any(r.alias_info is not None for r in schema.returns)
    # Under a Python dispatch mode an in-place foreach op (a foreach optimizer's `_foreach_add_` on the
    # weights) leaves the tensors' version counters where they were, where a plain run bumps them
    # (pytorch/pytorch#191154): autograd would then miss a step that changed weights a graph saved,
    # and compute wrong gradients instead of raising. We bump them as PyTorch does without the mode.
    bump = tuple(i for i in mutated if str(schema.arguments[i].type) == "List[Tensor]") \
        if schema.name.startswith("aten::_foreach_") else ()
    info = (schema.name, mutated, is_view, checks.has_index_check(func), bump)
    _FUNCS[func] = info
    return info


def _bump_versions(args: tuple, positions: tuple[int, ...]) -> None:
    """What the ADInplaceOrView kernel does for an in-place foreach op outside a dispatch mode."""
    for i in positions:
        if i < len(args) and isinstance(args[i], (list, tuple)):
            torch._C._increment_version([t for t in args[i] if isinstance(t, torch.Tensor)])


def passed_on(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op run as it would run without the doctor, unrecorded (the recorder was switched off: ``guard.py``)."""
    __tracebackhide__ = True
    out = func(*args, **kwargs)
    info = _FUNCS.get(func) or _func_info(func)
    if info[4]:
        _bump_versions(args, info[4])
    return out


def _tensors(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """Tensor arguments, looking one level into lists/tuples (``cat``'s list) — faster than pytree."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def filled_by_peers(name: str) -> bool:
    """Whether what the op returns is filled by the other ranks, possibly after it returns (gloo's async work):
    a collective's output, and FSDP's all-gather buffer (old bits until the all-gather lands). The recorder
    screens these only to carry an origin on (``recorder.cpp`` does the same).

    >>> filled_by_peers("c10d::allreduce_"), filled_by_peers("fsdp::all_gather_copy_in"), filled_by_peers("aten::add")
    (True, True, False)
    """
    return name.startswith("c10d::") or name == "fsdp::all_gather_copy_in"
