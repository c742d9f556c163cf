"""Other threads running PyTorch now, and what the step leaves alone because of them.

PyTorch does not make a parameter's ``.grad`` safe to read while another thread's backward() writes it (autograd's
``AccumulateGrad`` assigns it without the GIL; ``p.grad`` from Python reads a pointer being replaced). A kernel with
a thread training its own model in the background (``bg = Trainer(); bg.start()``) crashed with a segmentation
fault within a few watched cells: the doctor's scan of the namespace read ``bg.model``'s gradients, as a plain
``p.grad`` in a loop does, with no doctor (``tests/test_threads.py``).

So while another thread runs PyTorch code (a frame of its stack is in torch's package: an optimizer, a module's
forward, backward(), a DataLoader), the doctor reads only what the cell names (its identifiers, and the globals the
functions it calls read): ``bg.model`` in a cell that trains ``model`` is neither scanned before the step nor
snapshotted for a replay or a fix (putting it back would also rewind that thread's training), and the report says
so. Only code objects are read from the other threads' frames, never their locals (a snapshot of a frame's locals
would stay attached to it, holding that thread's tensors). A thread seen running PyTorch stays counted while it
is alive and was seen within the last minute (between two of its steps it is in its own code). Where the cell's text is not known (a library's
callback), nothing is left alone.

>>> import threading, torch
>>> go, done = threading.Event(), threading.Event()
>>> class Step(torch.nn.Module):
...     def forward(self): go.set(); done.wait(10)  # (inside a module's call: in torch's code)
>>> t = threading.Thread(target=Step(), name="trainer"); t.start(); _ = go.wait(10)
>>> away = elsewhere("loss = model(x).sum()", {"model": None, "bg": None})
>>> away.leaves("model"), away.leaves("bg.model")
(None, 'trainer')
>>> done.set(); t.join()
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from . import namespace as ns_mod

_MAX_FRAMES = 64   # a thread's innermost frames looked at (a deep recursion is not walked)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: the doctor's own threads (the native build, a panel's fix, the running view) hold the step's objects on purpose
_OWN_PREFIX = "backward_doctor"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REMEMBER_S = 60.0
#: threads seen running PyTorch code: ident -> (the thread, when last seen), kept while they live, for a minute
#: (the thread itself, not its name: a finished thread's ident is soon another's)
_seen: dict[int, tuple[weakref.ref, float]] = {}  # (weak: a Thread subclass may hold a model)
_seen_lock = threading.Lock()


@dataclass
class Elsewhere:
    """The other threads running PyTorch (ident -> name) and the names the cell reads (None: not known)."""

    busy: dict[int, str] = field(default_factory=dict)
    named: frozenset[str] | None = None

    def leaves(self, path: str) -> str | None:
        """The name of a busy thread when the value at ``path`` (``bg.model``, ``ns['opt']``) is left alone: another
        thread runs PyTorch and the cell does not name the variable it hangs from; else None."""
        if not self.busy or self.named is None:
            return None
        root = _IDENT.match(path)
        if root is not None and root.group(0) in self.named:
            return None
        return next(iter(self.busy.values()))

    def kept(self, namespace: dict[str, Any], notes: list[str]) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """The namespace's modules and optimizers (``namespace.py``) but those left alone, which one note in
        ``notes`` lists."""
        modules, optimizers = list(ns_mod.modules(namespace)), list(ns_mod.optimizers(namespace))
        left = [name for name, _ in modules + optimizers if self.leaves(name)]
        if left:
            notes.append(left_alone(left, self))
        return ([(n, m) for n, m in modules if n not in left], [(n, o) for n, o in optimizers if n not in left])


def _in_torch(frame: Any) -> bool:
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        if frame.f_code.co_filename.startswith(_TORCH_DIR):
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def busy_threads() -> dict[int, str]:
    """The other live threads (not the doctor's own) running PyTorch code now or seen doing it before. On a thread
    of the doctor's (a panel's fix re-runs the cell), the main thread asked for the work: not another training."""
    live = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    asked = threading.main_thread().ident if threading.current_thread().name.startswith(_OWN_PREFIX) else None
    frames = sys._current_frames()
    now = time.monotonic()
    try:
        frames.pop(me, None)  # (this thread's own frame in a local here would be a cycle holding every caller's)
        with _seen_lock:
            for ident in [i for i, (t, when) in _seen.items()  # (gone, another thread's ident now, or long ago)
                          if t() is None or live.get(i) is not t() or now - when > _REMEMBER_S]:
                del _seen[ident]
            for ident, frame in frames.items():
                thread = live.get(ident)
                if thread is not None and not thread.name.startswith(_OWN_PREFIX) and _in_torch(frame):
                    _seen[ident] = (weakref.ref(thread), now)
            return {i: live[i].name for i in _seen if i not in (me, asked)}
    finally:
        frames = frame = None  # noqa: F841 - (no frame of another thread kept past this call)


def names_read(source: str, namespace: dict[str, Any]) -> frozenset[str]:
    """The identifiers of ``source`` and the globals read by the functions it names (``train()`` defined in an
    earlier cell reads ``model``).

    >>> def train(): return model  # noqa: F821
    >>> sorted(names_read("train()", {"train": train}))
    ['model', 'train']
    """
    names = set(_IDENT.findall(source))
    for name in list(names):
        code = getattr(getattr(namespace.get(name), "__func__", namespace.get(name)), "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return frozenset(names)


def left_alone(names: list[str], away: Elsewhere) -> str:
    """The report's note for the models and optimizers the scan left alone.

    >>> print(left_alone(["bg.model", "bg.opt"], Elsewhere({1: "trainer"}, frozenset())))  # doctest: +NORMALIZE_WHITESPACE
    `bg.model` and `bg.opt` were left alone: another thread (`trainer`) is running PyTorch code, and PyTorch
    cannot read gradients safely while another thread's backward() may be writing them. The cell does not
    name them, so what they hold is not counted as existing before the step.
    """
    shown = [f"`{n}`" for n in names[:4]] + ([f"{len(names) - 4} more"] if len(names) > 4 else [])
    listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    verb, them = ("was", "it") if len(names) == 1 else ("were", "them")
    threads = ", ".join(f"`{n}`" for n in list(dict.fromkeys(away.busy.values()))[:3])
    return (f"{listed} {verb} left alone: another thread ({threads}) is running PyTorch code, and PyTorch cannot "
            "read gradients safely while another thread's backward() may be writing them. The cell does not name "
            f"{them}, so what {'it holds' if them == 'it' else 'they hold'} is not counted as existing before the step.")


def elsewhere(source: str, namespace: dict[str, Any]) -> Elsewhere:
    """What the step leaves alone: :class:`Elsewhere` of the busy threads and the names ``source`` reads (``source``
    empty: not known, nothing left alone). Never raises."""
    try:
        busy = busy_threads()
        return Elsewhere(busy, names_read(source, namespace) if busy and source.strip() else None)
    except Exception:  # noqa: BLE001 - threads that could not be read: as before, nothing left alone
        return Elsewhere()
