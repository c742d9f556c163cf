"""Parts of a model an optimizer trains that no optimizer holds (``trace.unoptimized``).

An optimizer holds the parameters it was given when it was built. A head, a resized embedding or a LoRA adapter put
on the model afterwards gets a gradient at every ``backward()`` and is in none of its param groups: it never
changes, and nothing raises. Read once, at the end of the run: every optimizer the namespace holds (a trainer's
``trainer.optimizer`` included) and every one a recorded step ran (a library's), their param groups against the
parameters of each model the namespace holds. A model no optimizer holds any part of (a teacher, an EMA copy, a
model only evaluated) is not looked at; for the others, the largest modules none of whose parameters an optimizer
holds are recorded, each with the optimizer that holds the rest of the model. Only names, keys and sizes are kept;
whether they got a gradient is the step's (``ParamInfo``).

>>> import torch, torch.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> model.add_module("head", nn.Linear(4, 2))
>>> w = OrphanWatch([])
>>> w.finish({"model": model, "opt": opt})
>>> [(u.module, u.cls, u.params, u.numel, u.optimizer, u.held) for u in w.record]
[('model.head', 'Linear', ['model.head.weight', 'model.head.bias'], 10, 'opt', 20)]
>>> w2 = OrphanWatch([]); w2.finish({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}); w2.record
[]
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import namespace as ns_mod
from ..recorder.memory import grad_of, storage_key
from ...trace.orphans import UnoptimizedModule
from .registry import Watch

_MODULES = 64   # records per run, at most (a model with adapters in every layer: the first ones tell it)


class OrphanWatch(Watch):
    """Records into ``record`` (``trace.unoptimized``) at the end of the run (see the module docstring); the
    optimizers of recorded steps are remembered weakly (a library's, which the namespace does not name)."""

    events = ("recorded_update", "finish")

    def __init__(self, record: list[UnoptimizedModule], left_alone: Any = lambda path: False) -> None:
        self.record = record
        self._left_alone = left_alone  # (a model another thread trains: its gradients are not read)
        self._seen: dict[int, Any] = {}

    def recorded_update(self, opt: torch.optim.Optimizer, step: Any = None) -> None:
        if id(opt) not in self._seen:
            self._seen[id(opt)] = weakref.ref(opt)

    def finish(self, namespace: dict[str, Any]) -> None:
        opts: dict[int, tuple[str, Any]] = {}
        # (a variable's name before an attribute's: ``opt`` before ``trainer.optimizer``, Accelerate's wrapper of it)
        for name, opt in sorted(ns_mod.held(namespace), key=lambda item: "." in item[0]):
            if not self._left_alone(name):
                opts.setdefault(id(opt), (name, opt))
        for key, ref in self._seen.items():
            opt = ref()
            if opt is not None:
                opts.setdefault(key, ("", opt))
        if not opts:
            return
        holder: dict[int, int] = {}  # id(parameter) -> id(optimizer)
        for key, (_, opt) in opts.items():
            for group in opt.param_groups:
                for p in group["params"]:
                    holder.setdefault(id(p), key)
        models: list[tuple[str, torch.nn.Module]] = []
        in_modules: set[int] = set()
        for name, mod in ns_mod.modules(namespace):
            if all(mod is not m for _, m in models) and not self._left_alone(name):
                models.append((name, mod))
                in_modules.update(id(p) for p in mod.parameters())
        done: set[int] = set()  # (a model the namespace also holds inside another, PEFT's base: recorded once)
        for name, mod in models:
            for u in _unheld(name, mod, holder, opts, in_modules, done):
                if len(self.record) < _MODULES:
                    self.record.append(u)
        self._seen.clear()

    def off(self) -> None:
        self._seen.clear()

    def cleared(self, trace: Any) -> None:
        trace.unoptimized = []  # (a part-written read of the models: none beats a wrong one)


def _unheld(root: str, model: torch.nn.Module, holder: dict[int, int], opts: dict[int, tuple[str, Any]],
            in_modules: set[int], done: set[int]) -> list[UnoptimizedModule]:
    """The largest modules of ``model`` none of whose parameters an optimizer holds, each with a trainable one
    (not in ``done``, the ids of those recorded already; added to it); none when every trainable parameter is held,
    or when no optimizer holds any of the model."""
    named = list(model.named_parameters())
    if all(id(p) in holder for _, p in named if p.requires_grad):
        return []
    by_opt: dict[int, int] = {}
    held_under: set[str] = set()  # module paths (relative; '' the model) with a held parameter under them
    for name, p in named:
        if id(p) in holder:
            by_opt[holder[id(p)]] = by_opt.get(holder[id(p)], 0) + p.numel()
            parts = name.split(".")[:-1]
            held_under.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    if not by_opt:
        return []
    main = max(by_opt, key=by_opt.__getitem__)
    opt_name, opt = opts[main]
    replaced = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in in_modules)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in named:
        if id(p) in holder or not p.requires_grad or id(p) in done:
            continue
        done.add(id(p))
        parts = name.split(".")[:-1]
        group = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                      if ".".join(parts[:i]) not in held_under), name)
        groups.setdefault(group, []).append((name, p))
    names = {n for n, _ in named}
    out = []
    for group, params in groups.items():
        cls = "Parameter" if group in names else type(model.get_submodule(group)).__name__
        out.append(UnoptimizedModule(model=root, module=f"{root}.{group}", cls=cls,
                                     params=[f"{root}.{n}" for n, _ in params],
                                     keys=[storage_key(p) or 0 for _, p in params],
                                     numel=sum(p.numel() for _, p in params), optimizer=opt_name,
                                     optimizer_cls=type(opt).__name__, optimizer_id=main, held=by_opt[main],
                                     replaced=replaced, grads=sum(grad_of(p) is not None for _, p in params)))
    return out


__all__ = ["OrphanWatch"]
