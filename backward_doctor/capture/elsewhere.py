"""What other threads are working with now: the models, optimizers and trainable tensors their running frames hold.

PyTorch does not make a parameter's ``.grad`` safe to read while another thread's backward() writes it (autograd's
``AccumulateGrad`` assigns it without the GIL; ``p.grad`` from Python then reads a pointer being replaced). A kernel
with a thread training its own model in the background (``bg = Trainer(); bg.start()``) crashed with a segmentation
fault within a few watched cells: the doctor's scan of the namespace read ``bg.model``'s gradients, as a plain
``p.grad`` in a loop does (no doctor needed: ``tests/test_threads.py``). So what another thread holds is left alone:
not scanned before the step, not snapshotted for a replay or a fix (restoring it would also change that thread's
training), and the report says so.

Found by reading the other threads' frames (``sys._current_frames``): their locals, and one level into the
attributes of objects there (``self.model``), as :func:`~backward_doctor.capture.namespace.modules` looks into the
namespace. A thread that holds nothing of torch's now (it has not started, or it builds its model later) is not
seen: the guard covers the threads that train while the step starts, which is when the crash came.

>>> import threading, torch
>>> model = torch.nn.Linear(2, 2)
>>> go, done = threading.Event(), threading.Event()
>>> def train(m=model): go.set(); done.wait(10)
>>> t = threading.Thread(target=train, name="trainer"); t.start(); _ = go.wait(10)
>>> away = elsewhere()
>>> away.holds(model), away.holds(torch.nn.Linear(2, 2)), away.thread_of(model)
(True, False, 'trainer')
>>> done.set(); t.join()

On a thread of the doctor's own, the main thread is not "another thread": it asked for the work.

>>> found = []
>>> t = threading.Thread(target=lambda: found.append(elsewhere().holds(model)), name="backward_doctor-fix")
>>> t.start(); t.join(); found
[False]
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

_MAX_FRAMES = 64   # a thread's innermost frames looked at (a deep recursion is not walked)
_MAX_ATTRS = 64    # an object's attributes looked into (as namespace.py's _MAX_ITEMS)
#: the doctor's own threads (the native build, a panel's fix, the running view) hold the step's objects on purpose
_OWN_PREFIX = "backward_doctor"


@dataclass
class Elsewhere:
    """Ids of what other threads hold (modules and their parameters, optimizers and theirs, trainable tensors),
    each with the name of a thread that holds it."""

    threads: dict[int, str] = field(default_factory=dict)

    def holds(self, obj: Any) -> bool:
        """Whether another thread holds ``obj``, or (a module or an optimizer) one of its parameters."""
        if not self.threads:
            return False
        if id(obj) in self.threads:
            return True
        return any(id(p) in self.threads for p in _params_of(obj))

    def thread_of(self, obj: Any) -> str | None:
        """The name of a thread that holds ``obj`` or one of its parameters."""
        if id(obj) in self.threads:
            return self.threads[id(obj)]
        return next((self.threads[id(p)] for p in _params_of(obj) if id(p) in self.threads), None)


def _params_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, nn.Module):
        return obj.parameters()
    if isinstance(obj, torch.optim.Optimizer):
        return (p for g in obj.param_groups for p in g["params"])
    return ()


def _worth(value: Any) -> bool:
    return isinstance(value, (nn.Module, torch.optim.Optimizer)) or \
        isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf


def _found(locals_: dict[str, Any]) -> Iterable[Any]:
    for value in list(locals_.values()):
        if _worth(value):
            yield value
        elif not isinstance(value, (torch.Tensor, type)):
            try:  # (no __getattr__ of the thread's objects runs: a proxy's could have effects)
                attrs = object.__getattribute__(value, "__dict__")
            except Exception:  # noqa: BLE001 - an object without a __dict__: nothing found in it
                continue
            if isinstance(attrs, dict):
                yield from (a for a in list(attrs.values())[:_MAX_ATTRS] if _worth(a))


def elsewhere() -> Elsewhere:
    """What the other live threads (not the doctor's own) hold now. Never raises: a thread that cannot be
    read is skipped (it finished, its frame changed under the read)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    # On a thread of the doctor's (a panel's fix re-runs the cell): the main thread asked for it and holds
    # the step's objects while it waits, not another training.
    asked = threading.main_thread().ident if threading.current_thread().name.startswith(_OWN_PREFIX) else None
    out = Elsewhere()
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, f"thread {ident}")
        if ident in (me, asked) or name.startswith(_OWN_PREFIX):
            continue
        depth = 0
        while frame is not None and depth < _MAX_FRAMES:
            try:
                for obj in _found(frame.f_locals):
                    out.threads.setdefault(id(obj), name)
                    for p in _params_of(obj):
                        out.threads.setdefault(id(p), name)
            except Exception:  # noqa: BLE001 - a frame read as it changes: what it held is not known
                pass
            frame, depth = frame.f_back, depth + 1
    return out
