"""Data flow helpers the rules share: which forward ops made a value, where a value went, whose weights.

All of it reads storage keys (``in_keys``/``out_keys``) of recorded ops; nothing here decides a finding.

>>> from backward_doctor.trace import Trace
>>> graph_ops(Trace(), None), owner(["D.2.weight"]), owner(["D.0.weight", "D.2.bias"])
(set(), 'D.2', 'D')
"""
from __future__ import annotations

import os

from ...trace.records import OpRecord, Trace


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def differentiable(dtype: str) -> bool:
    """Floating and complex tensors carry gradients; integer and bool ones never do."""
    return dtype.startswith(("float", "bfloat", "complex"))


def graph_ops(trace: Trace, start: int | None, cuts: bool = False) -> set[int]:
    """Indices of the forward ops the value made by op ``start`` was computed from (``start`` included).

    A view (``t``, ``detach``) or an in-place op writes the key it reads: it does not become the
    key's producer, so the walk never jumps from one forward pass into an earlier one through a
    weight's ``t()`` view. ``cuts``: stop where a value that required grad was read without it
    (``fake.detach()``, ``.data``): what lies beyond was cut off on purpose or by mistake.
    """
    if start is None:
        return set()
    producer: dict[int, int] = {}
    tracked: set[int] = set()  # ops whose result required grad (inputs that did, gradients on)
    feeds: dict[int, list[int]] = {}
    for op in trace.ops:
        if op.index > start:
            break
        if op.phase != "forward":
            continue
        feeds[op.index] = [producer[k] for k, m in zip(op.in_keys, op.inputs) if k in producer
                           and not (cuts and not m.requires_grad and producer[k] in tracked)]
        if op.grad_enabled and any(m.requires_grad for m in op.inputs) \
                and any(differentiable(m.dtype) for m in op.outputs):
            tracked.add(op.index)
        for k in op.out_keys:
            if k and k not in op.in_keys:
                producer[k] = op.index
    seen: set[int] = set()
    todo = [start]
    while todo:
        i = todo.pop()
        if i in seen or i not in feeds:
            continue
        seen.add(i)
        todo.extend(feeds[i])
    return seen


def loss_op(trace: Trace) -> int | None:
    """The forward op that made the tensor the failing ``backward()`` started from."""
    exc = trace.exception
    writer = exc.loss.writer if exc is not None and exc.loss is not None else None
    if writer is not None:
        return writer
    found, previous = None, None
    for op in trace.ops:  # else: the first node of the last backward call
        if op.phase == "backward" and previous != "backward" and op.fwd_index is not None:
            found = op.fwd_index
        previous = op.phase
    return found


def loss_roots(trace: Trace) -> set[int]:
    """The forward op behind each ``backward()`` call's first node: the losses."""
    roots: set[int] = set()
    previous = "forward"
    for op in trace.ops:
        if op.phase == "backward" and previous != "backward" and op.fwd_index is not None:
            roots.add(op.fwd_index)
        previous = op.phase
    return roots


def trained_ops(trace: Trace) -> set[int]:
    """The forward ops a ``backward()`` call reached from its loss: what the model trains on.

    >>> trained_ops(Trace())
    set()
    """
    return set().union(*(graph_ops(trace, r) for r in loss_roots(trace)))


def joins_graph(trace: Trace, op: OpRecord) -> bool:
    """Whether what ``op`` made flows, through later forward ops, into an op that also takes a tensor
    requiring grad (``loss_a + 0.1 * mse(argmax_pred, t)``, an index into a weight): it was meant to
    take part in what is differentiated. A metric (``(pred == y).float().mean()``) never does."""
    frontier = {k for k in op.out_keys if k}
    for later in trace.ops:
        if later.index <= op.index or later.phase != "forward":
            continue
        if frontier & set(later.in_keys):
            if later.grad_enabled and any(m.requires_grad for m in later.inputs):
                return True
            frontier |= {k for k in later.out_keys if k}
        else:
            frontier -= set(later.out_keys)  # a freed storage's key reused by an unrelated tensor
    return False


def owner(names: list[str]) -> str | None:
    """The module holding these parameters (``D.2.weight`` -> ``D.2``; several -> their common prefix)."""
    names = [n for n in names if not n.startswith("<")]
    if not names:
        return None
    parts = os.path.commonprefix([n.split(".") for n in names])
    if len(set(names)) == 1 or parts == names[0].split("."):
        parts = names[0].split(".")[:-1]
    return ".".join(parts) or None
