"""Rollback: copy the training state to CPU memory before a run, put it back after.

What is saved: every parameter and buffer of the namespace's modules (values and
``.grad``), their train/eval flags, optimizer state and hyper-parameters, LR
scheduler and ``GradScaler`` state (bound to a name, or held by an object there as
an attribute: ``runner.opt``, as modules are found), RNG states (Python, NumPy when imported,
torch CPU, CUDA when initialised) and the bindings of the names the cell
rebinds. Tensors bound to those names are copied (so the snapshot keeps no graph
and no device memory alive); other objects are kept by reference. What is *not*
undone: mutations of other objects (a list the cell appends to, files written).

Parameters, buffers and optimizer state are restored in place, so the model and
optimizer objects the user holds stay the same objects.

>>> import torch
>>> ns = {"w": torch.nn.Linear(2, 1)}
>>> snap = Snapshot.take(ns, rebinds={"w2"})
>>> with torch.no_grad(): _ = ns["w"].weight.add_(1)
>>> ns["w2"] = 3
>>> snap.restore(ns)
>>> "w2" in ns, snap.nbytes > 0
(False, True)
"""
from __future__ import annotations

import itertools
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..capture import namespace as ns_mod
from ..capture.elsewhere import Elsewhere, elsewhere
from ..capture.recorder.memory import grad_of
from ..capture.state import cuda_in_use
from ..util.units import available_ram

_MISSING = object()


@dataclass
class _Saved:
    """A CPU copy of a tensor and the device it goes back to."""

    value: torch.Tensor
    device: torch.device


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy (a meta tensor has no data: it is kept as it is)."""
    if t.device.type == "meta":
        return t.detach()
    # Our copies must not be seen (or counted) by a capture that may be running.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return t.detach().to("cpu", copy=True)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _modules(namespace: dict[str, Any], away: Elsewhere) -> list[tuple[str, Any]]:
    """The namespace's modules but those left alone while another thread runs PyTorch (``capture/elsewhere.py``:
    their gradients are not read, and putting them back would rewind that thread's training)."""
    return [(n, m) for n, m in ns_mod.modules(namespace) if not away.leaves(n)]


def _optimizers(namespace: dict[str, Any], away: Elsewhere) -> list[tuple[str, Any]]:
    """The optimizers bound to a name, or held by an object there (``runner.opt``): as modules are found."""
    return [(n, o) for n, o in ns_mod.held(namespace, torch.optim.Optimizer) if not away.leaves(n)]


def _schedulers(namespace: dict[str, Any], away: Elsewhere) -> Iterable[tuple[str, Any]]:
    from torch.optim.lr_scheduler import LRScheduler

    return [(n, s) for n, s in ns_mod.held(namespace, LRScheduler) if not away.leaves(n)]


def _scalers(namespace: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    classes = tuple(c for c in (getattr(torch.amp, "GradScaler", None),
                                getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)) if c is not None)
    return ns_mod.held(namespace, classes) if classes else iter(())


def state_tensors(namespace: dict[str, Any], away: Elsewhere | None = None) -> list[torch.Tensor]:
    """Parameters, buffers and their gradients, and optimizer state (each once). ``away``: what is left alone
    (``capture/elsewhere.py``; None: nothing)."""
    away = away or Elsewhere()
    seen: dict[int, torch.Tensor] = {}
    for _, mod in _modules(namespace, away):
        for t in list(mod.parameters()) + list(mod.buffers()):
            seen.setdefault(id(t), t)
    for _, opt in _optimizers(namespace, away):
        for group in opt.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def estimate_bytes(namespace: dict[str, Any], rebinds: set[str] = frozenset(), away: Elsewhere | None = None) -> int:
    """What :meth:`Snapshot.take` would copy, in bytes (given the same ``away``)."""
    total = 0
    away = away or Elsewhere()
    for t in state_tensors(namespace, away):
        total += _nbytes(t) + _nbytes(grad_of(t))
    for _, opt in _optimizers(namespace, away):
        total += sum(_nbytes(t) for t in ns_mod.optimizer_state_tensors(opt))
    for name in rebinds:
        total += _nbytes(namespace.get(name))
    return total


@dataclass
class Snapshot:
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]] = field(default_factory=list)
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    optimizers: list[tuple[Any, dict, list[dict]]] = field(default_factory=list)
    stateful: list[tuple[Any, dict]] = field(default_factory=list)   # schedulers, scalers
    names: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0

    @classmethod
    def take(cls, namespace: dict[str, Any], rebinds: set[str] = frozenset(),
             away: Elsewhere | None = None) -> "Snapshot":
        """``away``: what is left alone while another thread runs PyTorch (``capture/elsewhere.py``; None: nothing)."""
        snap = cls()
        away = away or Elsewhere()
        for t in state_tensors(namespace, away):
            grad = grad_of(t)
            snap.tensors.append((t, _cpu_copy(t), None if grad is None else _cpu_copy(grad), t.requires_grad))
            snap.nbytes += _nbytes(t) + _nbytes(grad)
        for _, mod in _modules(namespace, away):
            snap.training.extend((m, m.training) for m in mod.modules())
        for _, opt in _optimizers(namespace, away):
            state: dict = {}
            for p, s in opt.state.items():
                state[p] = {k: _Saved(_cpu_copy(v), v.device) if isinstance(v, torch.Tensor) else _copy_value(v)
                            for k, v in s.items()}
                snap.nbytes += sum(_nbytes(v) for v in s.values())
            groups = [{k: (_cpu_copy(v) if isinstance(v, torch.Tensor) else _copy_value(v))
                       for k, v in g.items() if k != "params"} for g in opt.param_groups]
            snap.optimizers.append((opt, state, groups))
        for _, obj in list(_schedulers(namespace, away)) + list(_scalers(namespace)):
            snap.stateful.append((obj, _copy_value(obj.state_dict())))
        snap.add_names(namespace, set(rebinds))
        snap.rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if "numpy" in sys.modules:
            snap.rng["numpy"] = sys.modules["numpy"].random.get_state()
        if cuda_in_use():
            snap.rng["cuda"] = torch.cuda.get_rng_state_all()
        return snap

    def add_names(self, namespace: dict[str, Any], names: set[str]) -> None:
        """Also remember the current bindings of ``names`` not remembered yet (the rewritten cell's new names)."""
        owned = {id(t) for t, *_ in self.tensors}
        for name in names:
            if name in self.names:
                continue
            value = namespace.get(name, _MISSING)
            if isinstance(value, torch.Tensor) and id(value) not in owned:
                self.nbytes += _nbytes(value)
                copy = _cpu_copy(value)
                if value.requires_grad and value.is_leaf:
                    copy.requires_grad_(True)
                value = _Saved(copy, value.device)
            self.names[name] = value

    def restore(self, namespace: dict[str, Any]) -> None:
        """Put everything back (in place for parameters, buffers and optimizer state)."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.no_grad():
            for t, value, grad, requires_grad in self.tensors:
                if t.device.type == "meta" or value.device.type == "meta":
                    pass  # no data to put back
                elif t.shape == value.shape and t.dtype == value.dtype:
                    t.copy_(value)
                else:
                    t.data = value.to(t.device)
                # A new tensor object for .grad: nothing that marked the old one carries over.
                t.grad = None if grad is None else grad.to(t.device, copy=True)
                if t.is_leaf:
                    t.requires_grad_(requires_grad)
            for opt, state, groups in self.optimizers:
                for p in list(opt.state):
                    if p not in state:
                        del opt.state[p]
                for p, s in state.items():
                    live = opt.state[p]
                    for k in list(live):
                        if k not in s:
                            del live[k]
                    for k, v in s.items():
                        cur = live.get(k)
                        if isinstance(v, _Saved):
                            if isinstance(cur, torch.Tensor) and cur.shape == v.value.shape \
                                    and cur.dtype == v.value.dtype and cur.device == v.device:
                                cur.copy_(v.value)
                            else:
                                live[k] = v.value.to(v.device, copy=True)
                        else:
                            live[k] = _copy_value(v)
                for g, saved in zip(opt.param_groups, groups):
                    for k, v in saved.items():
                        if isinstance(v, torch.Tensor) and isinstance(g.get(k), torch.Tensor):
                            g[k].copy_(v)
                        else:
                            g[k] = _copy_value(v)
        for m, training in self.training:
            m.training = training
        for obj, state in self.stateful:
            if state:
                obj.load_state_dict(_copy_value(state))
            if hasattr(obj, "_per_optimizer_states"):  # a GradScaler between steps
                from collections import defaultdict

                from torch.amp.grad_scaler import _refresh_per_optimizer_state
                obj._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        for name, value in self.names.items():
            if value is _MISSING:
                namespace.pop(name, None)
            elif isinstance(value, _Saved):
                t = value.value.detach().to(value.device, copy=True)
                namespace[name] = t.requires_grad_(value.value.requires_grad)
            else:
                namespace[name] = value
        random.setstate(self.rng["python"])
        torch.set_rng_state(self.rng["torch"])
        if "numpy" in self.rng:
            sys.modules["numpy"].random.set_state(self.rng["numpy"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])


_CONTAINERS = (list, dict, set)
_NESTED = 64  # the items of a container looked into for containers of its own


class Bindings:
    """The namespace as a run left it, for a replay to put back exactly: every name bound to the same object, and
    the contents of the lists, dicts and sets its names hold (two levels deep: a replay appends to them too).

    >>> ns = {"log": [1], "h": {"loss": [0.5]}, "loss": 1.0}
    >>> left = Bindings(ns)
    >>> ns["log"].append(2); ns["h"]["loss"].append(0.4); ns["loss"] = 2.0; ns["new"] = 1
    >>> left.restore(ns)
    >>> ns == {"log": [1], "h": {"loss": [0.5]}, "loss": 1.0}
    True
    """

    def __init__(self, namespace: dict[str, Any], contents: bool = True) -> None:
        self.names = dict(namespace)
        self.contents: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        if contents:  # (False: the names only, what the containers hold left as the replay leaves it)
            self._keep([v for k, v in self.names.items() if not k.startswith("__")], 2, seen)

    def _keep(self, values: Iterable[Any], depth: int, seen: set[int]) -> None:
        for v in values:
            if type(v) not in _CONTAINERS or id(v) in seen:
                continue
            seen.add(id(v))
            self.contents.append((v, type(v)(v)))
            if depth > 1:  # (the first items only: a list of 10k batches is not walked)
                inner = v.values() if type(v) is dict else v if type(v) is list else ()
                self._keep(itertools.islice(inner, _NESTED), depth - 1, seen)

    def restore(self, namespace: dict[str, Any]) -> None:
        """Names the replay bound unbound, the others bound to their objects again, the containers' items back."""
        for name in [n for n in namespace if n not in self.names]:
            del namespace[name]
        for name, value in self.names.items():
            if namespace.get(name, _MISSING) is not value:
                namespace[name] = value
        for container, contents in self.contents:
            if type(container) is list:
                container[:] = contents
            else:  # (no comparison first: a tensor's ``==`` has no truth value)
                container.clear()
                container.update(contents)


def _copy_value(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy_value(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_copy_value(x) for x in v)
    if isinstance(v, torch.Tensor):
        return _cpu_copy(v)
    return v


def take_if_it_fits(namespace: dict[str, Any], rebinds: set[str] = frozenset(),
                    source: str = "") -> tuple[Snapshot | None, str]:
    """The rollback snapshot of ``namespace`` (and the names the cell rebinds), or None and why not: the
    copy would take more than 80% of the free RAM, or the state could not be copied. The one place both
    the NaN replay (``engine.snapshot_for``) and the fixes (``fixes.apply``) take theirs."""
    from ..util.units import format_bytes

    # (one look at the other threads for both: the estimate sizes exactly what is taken)
    away = elsewhere(source, namespace)
    need, avail = estimate_bytes(namespace, rebinds, away), available_ram()
    if avail is not None and need > 0.8 * avail:
        return None, f"the snapshot needs {format_bytes(need)} of RAM and only {format_bytes(avail)} is available"
    try:
        return Snapshot.take(namespace, rebinds, away), ""
    except Exception as exc:  # never lose the diagnosis to the snapshot
        return None, f"the state could not be copied ({type(exc).__name__}: {exc})"
