"""How each model was switched when it ran: ``model.train()``/``model.eval()`` and the gradient mode, read at the
forward pre-hook of an outermost module call (a model called from user code), never per op.

A module's ``training`` flag changes nothing PyTorch records per op for dropout in eval mode (``F.dropout``
returns its input, no op at all), so the rules cannot read it from the ops: it is read here, once per
combination of (model, training, gradients) for its first few calls, with the op range of that forward pass
(the op count when it began and when it ended) and the counts of its dropout and batch-norm modules, and
how many of those were in training mode. A loop of thousands of iterations adds nothing after its first ones.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(2)).eval()
>>> mode_counts(net)
(1, 0, 1, 0)
"""
from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ...trace.records import ModuleMode

#: calls kept per (model, training, gradients): enough to tell a training forward from an evaluation one
CALLS_PER_MODE = 4
#: modes kept per run: a bound whatever the cell does (many models, modes switched back and forth)
MAX_MODES = 64


def mode_counts(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """(dropout modules with p > 0, those in training mode, batch-norm modules, those in training mode)."""
    dropout = active = bn = bn_training = 0
    for m in module.modules():
        if isinstance(m, _DropoutNd) and m.p > 0:
            dropout += 1
            active += m.training
        elif isinstance(m, _BatchNorm):
            bn += 1
            bn_training += m.training
    return dropout, active, bn, bn_training


class ModeWatch:
    """The first calls of each (model, training, gradients) combination, kept weakly (``ModuleMode`` records
    with the module's id until names are resolved at the end).

    >>> from types import SimpleNamespace
    >>> from backward_doctor.trace.records import Where
    >>> count = iter(range(0, 100, 10))
    >>> cap = SimpleNamespace(_ops_so_far=lambda: next(count), _module_stack=[], _frames=SimpleNamespace(
    ...     where=lambda frame: Where(line=7)), trace=SimpleNamespace(iterations=SimpleNamespace(steps=1)))
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    >>> w = ModeWatch()
    >>> for _ in range(6):  # six evaluations under no_grad: the first CALLS_PER_MODE are kept
    ...     with torch.no_grad():
    ...         w.entered(cap, net)
    ...         w.left(cap)
    >>> [(r.module, r.training, r.grad_enabled, r.start, r.end, r.where.line) for r in w.resolve({id(net): "net"})][:2]
    [('net', True, False, 0, 10, 7), ('net', True, False, 20, 30, 7)]
    >>> len(w.records) == CALLS_PER_MODE
    True
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[int, bool, bool], int] = {}  # (module id, training, grad) -> calls kept
        self._refs: dict[int, weakref.ref] = {}
        self.records: list[tuple[int, ModuleMode]] = []
        self._open: ModuleMode | None = None

    def entered(self, cap: Any, module: torch.nn.Module) -> None:
        """An outermost module's forward begins (``cap``: the capture, for the op count, the iteration and the
        user's line, asked only for a call that is kept)."""
        key = (id(module), bool(module.training), torch.is_grad_enabled())
        kept = self._seen.get(key, 0)
        if kept >= CALLS_PER_MODE or (not kept and len(self._seen) >= MAX_MODES):
            self._open = None
            return
        counts = mode_counts(module)
        if not counts[0] and not counts[2]:
            self._seen[key] = CALLS_PER_MODE  # no dropout, no batch norm: its mode changes nothing
            self._open = None
            return
        self._seen[key] = kept + 1
        start = cap._ops_so_far()
        # (from torch's module call, two frames up: the walk finds the user's line above it)
        rec = ModuleMode(module=type(module).__name__, training=key[1], grad_enabled=key[2], start=start, end=start,
                         where=cap._frames.where(sys._getframe(2)), dropout=counts[0], dropout_active=counts[1],
                         batchnorm=counts[2], batchnorm_training=counts[3], iteration=cap.trace.iterations.steps)
        self._refs.setdefault(id(module), weakref.ref(module))
        self.records.append((id(module), rec))
        self._open = rec

    def left(self, cap: Any) -> None:
        """A module's forward ended: when it was the outermost one kept, its ops end here."""
        if self._open is not None and not cap._module_stack:
            self._open.end = cap._ops_so_far()
            self._open = None

    def resolve(self, paths: dict[int, str]) -> list[ModuleMode]:
        """The records, each named by its path from the namespace (else its class name)."""
        out = []
        for mid, rec in self.records:
            ref = self._refs.get(mid)
            if ref is not None and ref() is not None and mid in paths:
                rec.module = paths[mid]
            out.append(rec)
        return out


__all__ = ["ModeWatch", "mode_counts", "CALLS_PER_MODE", "MAX_MODES"]
