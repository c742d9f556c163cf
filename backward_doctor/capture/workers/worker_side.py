"""What runs inside a DataLoader worker started during a diagnosis (the main side is ``workers/main_side.py``).

A worker started with ``fork`` is a copy of the process at the moment the iterator was made, the
doctor's capture included: its dispatch mode, global hooks and native recorder would go on recording
the worker's ops into a copy nobody reads (and, for persistent workers, on after the run). So the first
thing :class:`WorkerInit` does in the worker is undo that copy (:func:`forget`). Then it leaves the
worker what the main process needs to name a worker's failure, all without changing what the worker
computes:

- ``faulthandler`` on ``SIGUSR2``: the main process asks a stuck worker for its stacks (C-level, so it
  answers even while its Python code is blocked in a lock or in C); and on a fatal signal (a crash).
  ``SIGUSR2`` may be the user's: one that has a handler already (the script's, inherited by the fork) is
  left alone and a free real-time signal taken instead, and where the user's code takes the signal later
  (its ``worker_init_fn``, checked when it returns and before every task) the watch moves to a free one,
  the user's handler put back, so that a stack request never runs the user's handler; the dump file's
  ``ready`` line says which signal it is now (``worker_files.ready_signal``);
- ``ExceptionWrapper``'s constructor, which torch calls in the worker when a fetch raises: before it
  formats the error as it always does, the worker's own frames (with class-qualified names), the task,
  the dataset index that raised (read from the frames' locals) and where a tensor requiring grad among
  them was made are written down;
- the data queue's feeder error hook: a batch that cannot be sent (a tensor requiring grad cannot
  cross processes) is printed by multiprocessing and dropped, and the main process waits for it forever;
- autograd's anomaly mode without NaN checks, so a graph node made in the worker remembers its line.

Each is undone when the run is over (the worker sees the run's folder gone at its next task), so a
persistent worker outliving the diagnosis ends up exactly as an undiagnosed one. Then the user's own
``worker_init_fn`` runs, unchanged.

>>> init = WorkerInit(None, "/nonexistent")
>>> import pickle; type(pickle.loads(pickle.dumps(init))).__name__
'WorkerInit'
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import weakref
from typing import Any, Callable

#: The signal a worker dumps its stacks on (``SIGUSR1`` is the ranks' in ``frontends/launch.py``).
DUMP_SIGNAL = signal.SIGUSR2
#: Undo steps of a capture that must not run in a forked child (CUDA cannot be touched there).
_PARENT_ONLY = ("CUDA memory history",)
_MAX_FRAMES = 40
_STACK_LINE = re.compile(r'\s*File "(.*)", line (\d+), in (.*)\n(?:\s*(.*)\n?)?')


def dump_path(folder: str, pid: int) -> str:
    return os.path.join(folder, f"{pid}.stacks")


def error_path(folder: str, pid: int) -> str:
    return os.path.join(folder, f"{pid}.errors")


class WorkerInit:
    """The ``worker_init_fn`` a DataLoader's workers get while a diagnosis runs: the doctor's part
    (see the module doc), then the user's own function with the same ``worker_id``. Picklable for the
    ``spawn``/``forkserver`` contexts (the user's function must be, as without the doctor); the capture
    a forked worker inherited is referenced weakly and not pickled (a spawned worker has none)."""

    def __init__(self, user_fn: Callable[[int], Any] | None, folder: str, capture: Any = None) -> None:
        self.user_fn = user_fn
        self.folder = folder
        self._capture = weakref.ref(capture) if capture is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {"user_fn": self.user_fn, "folder": self.folder, "_capture": None}

    def __call__(self, worker_id: int) -> None:
        inherited = self._capture() if self._capture is not None else None
        if inherited is not None:
            forget(inherited)
        try:
            _start(self.folder, worker_id)
        except Exception:  # noqa: BLE001 - the worker must run as it would without the doctor
            _stop()
        try:
            if self.user_fn is not None:
                self.user_fn(worker_id)
        finally:
            _recheck()  # (the user's function may have taken the stack request's signal)


def forget(capture: Any) -> None:
    """In a forked worker: undo this process's copy of ``capture`` (the parent's stays as it is)."""
    capture._undo.undo_all(skip=_PARENT_ONLY)
    if hasattr(capture, "_native_out"):
        capture._native_out = None  # the copy of the recorder's buffers stop() handed back


class _State:
    """This worker's part of the watch, and how to take it off again."""

    def __init__(self, folder: str, worker_id: int) -> None:
        self.folder, self.worker_id, self.pid = folder, worker_id, os.getpid()
        self.undo: list[Callable[[], None]] = []
        self.dump = open(dump_path(folder, self.pid), "a", encoding="utf-8")  # noqa: SIM115 - faulthandler keeps it
        self.signal: int | None = None  # the signal that asks for this worker's stacks (faulthandler's)


_state: _State | None = None


def _start(folder: str, worker_id: int) -> None:
    global _state
    if _state is not None or not os.path.isdir(folder):
        return
    import torch
    from torch._utils import ExceptionWrapper
    from torch.utils.data._utils import worker as torch_worker
    import multiprocessing.queues as mpq

    st = _state = _State(folder, worker_id)
    st.undo.append(st.dump.close)
    _listen(st)
    if not faulthandler.is_enabled():  # a crash (SIGSEGV, SIGABRT, ...) leaves its stack too
        faulthandler.enable(file=st.dump, all_threads=True)
        st.undo.append(faulthandler.disable)
    _patch(ExceptionWrapper, "__init__", _wrapper_init, st)
    _patch(mpq.Queue, "_on_queue_feeder_error", staticmethod(_feeder_error), st)
    _patch(torch_worker.ManagerWatchdog, "is_alive", _is_alive, st)
    if not torch.is_anomaly_enabled():  # graph nodes made here remember their line (no NaN checks: no new work)
        check_nan = torch.is_anomaly_check_nan_enabled()
        torch.set_anomaly_enabled(True, False)
        st.undo.append(lambda: torch.set_anomaly_enabled(False, check_nan))


def _taken(sig: int) -> bool:
    """Whether ``sig`` has a handler in this process: a Python one, or any installed in C (``sigaction``)."""
    if signal.getsignal(sig) not in (signal.SIG_DFL, None):
        return True
    try:
        import ctypes

        act = ctypes.create_string_buffer(512)  # (a struct sigaction: the handler is its first member)
        if ctypes.CDLL(None, use_errno=True).sigaction(int(sig), None, act) != 0:
            return False
        return ctypes.c_void_p.from_buffer(act).value not in (None, 0)
    except (OSError, AttributeError, ValueError):
        return False


def _free_signal() -> int | None:
    """``SIGUSR2`` unless it has a handler; else the highest real-time signal that has none; None if none."""
    spare = range(signal.SIGRTMAX, signal.SIGRTMIN, -1) if hasattr(signal, "SIGRTMAX") else ()
    return next((int(sig) for sig in (DUMP_SIGNAL, *spare) if not _taken(sig)), None)


def _listen(st: _State) -> None:
    """faulthandler on a free signal, said in the dump file (the main process signals only a worker that is
    ready, with the signal its latest ready line names)."""
    sig = _free_signal()
    if sig is None:
        return
    faulthandler.register(sig, file=st.dump, all_threads=True, chain=False)
    st.signal = sig
    st.undo.append(lambda: faulthandler.unregister(sig))
    st.dump.write(f"worker {st.worker_id} ready {sig}\n")
    st.dump.flush()


def _recheck() -> None:
    """The user's code took the stack request's signal since (``signal.signal``): faulthandler lets go of it,
    the user's handler is put back in place (unregistering restores what was there before faulthandler), and
    the request moves to a free signal."""
    st = _state
    if st is None or st.signal is None:
        return
    try:
        mine = signal.getsignal(st.signal)
        if mine in (signal.SIG_DFL, None):
            return
        sig, st.signal = st.signal, None
        faulthandler.unregister(sig)
        signal.signal(sig, mine)
        _listen(st)
    except Exception:  # noqa: BLE001 - the worker must run as it would without the doctor
        pass


def _patch(owner: type, name: str, new: Any, st: _State) -> None:
    """Set ``owner.name`` to ``new``, the attribute it replaces kept for :func:`_original` and put back by
    :func:`_stop` (deleted again where it was inherited, not the class's own)."""
    had = name in owner.__dict__
    old = owner.__dict__.get(name)
    _ORIGINALS[(owner, name)] = getattr(owner, name)
    setattr(owner, name, new)

    def put_back() -> None:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
        _ORIGINALS.pop((owner, name), None)
    st.undo.append(put_back)


_ORIGINALS: dict[tuple[type, str], Any] = {}


def _original(owner: type, name: str) -> Any:
    return _ORIGINALS[(owner, name)]


def _stop() -> None:
    """Take the worker's part off (newest first); the worker is then as an undiagnosed one."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    for undo in reversed(st.undo):
        try:
            undo()
        except Exception:  # noqa: BLE001 - the rest must still be undone
            pass


def _is_alive(self: Any) -> bool:
    """torch's worker loop asks this before each task: the first task after the run ends the watch."""
    from torch.utils.data._utils import worker as torch_worker

    alive = _original(torch_worker.ManagerWatchdog, "is_alive")
    if _state is not None and not os.path.isdir(_state.folder):
        _stop()
    _recheck()
    return alive(self)


def _wrapper_init(self: Any, exc_info: Any = None, where: str = "in background") -> None:
    """``ExceptionWrapper.__init__`` in the worker: write down the failure, then format it as torch does."""
    from torch._utils import ExceptionWrapper

    if exc_info is None:
        exc_info = sys.exc_info()
    try:
        _write_failure(exc_info, where)
    except Exception:  # noqa: BLE001 - the user's error must surface as it would
        pass
    _original(ExceptionWrapper, "__init__")(self, exc_info, where)


def _feeder_error(e: BaseException, obj: Any) -> None:
    """The data queue's feeder thread could not send ``obj``: write it down, then print as multiprocessing does."""
    import multiprocessing.queues as mpq

    try:
        st = _state
        if st is not None and os.path.isdir(st.folder):
            task = obj[0] if isinstance(obj, tuple) and obj and isinstance(obj[0], int) else None
            made = _made_at(obj[1] if isinstance(obj, tuple) and len(obj) > 1 else obj)
            _append(st, {"kind": "send", "task": task, "error": _error_text(e), "made_at": made})
    except Exception:  # noqa: BLE001
        pass
    _original(mpq.Queue, "_on_queue_feeder_error")(e, obj)


def _write_failure(exc_info: Any, where: str) -> None:
    st = _state
    if st is None or not os.path.isdir(st.folder) or exc_info[1] is None:
        return
    exc, tb = exc_info[1], exc_info[2]
    frames, task, indices, index, held = [], None, None, None, []
    getitem = _getitem_code()
    while tb is not None:
        f = tb.tb_frame
        code = f.f_code
        frames.append([code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name)])
        local = f.f_locals
        if code.co_name == "_worker_loop":
            task, indices = local.get("idx"), local.get("index")
        elif code.co_name == "<listcomp>" and "idx" in local and code.co_filename.endswith("fetch.py"):
            index = local.get("idx")  # (Python 3.11: the fetcher's comprehension has a frame of its own)
        elif getitem is not None and code is getitem and code.co_argcount > 1:
            index = local.get(code.co_varnames[1], index)
        held.extend(v for v in local.values() if isinstance(v, (list, tuple, dict)) or _is_tensor(v))
        tb = tb.tb_next
    _append(st, {"kind": "init" if "fetch" not in "".join(fr[2] for fr in frames) else "fetch",
                 "where": where, "task": task if isinstance(task, int) else None, "indices": _short(indices),
                 "index": _short(index), "error": _error_text(exc), "frames": frames[-_MAX_FRAMES:],
                 "made_at": _made_at(held)})


def _getitem_code() -> Any:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    fn = getattr(type(info.dataset), "__getitem__", None) if info is not None else None
    return getattr(fn, "__code__", None)


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def _made_at(obj: Any, depth: int = 0) -> list:
    """Where the first tensor requiring grad in ``obj`` (nested lists, tuples, dicts) got its graph: the
    creation stack (anomaly mode) of the earliest node of that graph made here, as ``[file, line,
    function, code]`` rows, outermost first (for a batch stacked from samples that came out of a model:
    the model's call in the dataset, not the stacking in ``collate``)."""
    if depth > 3:
        return []
    if _is_tensor(obj):
        if not obj.requires_grad:
            return []
        stack = _earliest_stack(obj.grad_fn) if obj.grad_fn is not None else None
        if not stack:
            return [["", 0, "(a leaf tensor requiring grad: made with requires_grad=True)", ""]]
        return [[m.group(1), int(m.group(2)), m.group(3), (m.group(4) or "").strip()]
                for m in (_STACK_LINE.match(s) for s in stack) if m][-_MAX_FRAMES:]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in list(values)[:64]:
        found = _made_at(v, depth + 1)
        if found:
            return found
    return []


def _earliest_stack(node: Any, limit: int = 256) -> list[str] | None:
    """The creation stack of the node made first (lowest sequence number) among the first ``limit``
    nodes of the graph behind ``node`` that have one."""
    best, seen, todo = None, set(), [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        stack = n.metadata.get("traceback_") if hasattr(n, "metadata") else None
        if stack and (best is None or n._sequence_nr() < best[0]):
            best = (n._sequence_nr(), stack)
        todo.extend(nxt for nxt, _ in n.next_functions)
    return best[1] if best else None


def _short(value: Any) -> Any:
    """An index or a batch of indices, JSON-ready and bounded (64 numbers)."""
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_short(v) for v in list(value)[:64]] + (["..."] if len(value) > 64 else [])
    if hasattr(value, "tolist"):
        return _short(value.tolist())
    return repr(value)[:80]


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def _append(st: _State, record: dict[str, Any]) -> None:
    record.update(worker=st.worker_id, pid=st.pid)
    with open(error_path(st.folder, st.pid), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, default=repr) + "\n")


__all__ = ["DUMP_SIGNAL", "WorkerInit", "dump_path", "error_path", "forget"]
