"""DataLoader workers started during a run, seen from the main process (the worker's side: ``workers/worker_side.py``).

While the run lasts, ``_MultiProcessingDataLoaderIter`` (the iterator of a DataLoader with
``num_workers > 0``) is wrapped at class level, and put back exactly on exit:

- ``__init__`` gives the workers it starts :class:`~.worker_side.WorkerInit` as their ``worker_init_fn``
  (the user's own runs inside it, unchanged; the loader and the iterator keep the user's), and
  remembers the iterator weakly;
- ``_next_index``/``_try_put_index`` note which indices went to which worker as which task (the
  worker processes its tasks in order, so the oldest one it has not delivered is the one it is on);
- ``_process_data`` fingerprints the first batches of an ``IterableDataset``'s loader with two workers or more
  (``workers/batches.py``: every worker delivering the whole stream);
- ``_shutdown_workers`` notes the workers' exit codes once it has ended them (a worker killed by a signal
  can make torch raise from its SIGCHLD handler anywhere in the loop's body: the iterator is then gone with
  the cell's frame before the run ends, and with it the processes that knew how the worker died).

Nothing else runs, and nothing at all for a loop without worker processes. When the run is stuck (the
watchdog's timeout, a Ctrl-C, the loader's own ``timeout=``), :meth:`WorkerWatch.photograph` asks every
live worker for its stacks (``SIGUSR2``, or the signal the worker chose where its own code took that one:
faulthandler in the worker writes them to a file in the run's folder) before the main process is
interrupted and tears the workers down. After the run the folder is read (the workers' own error records,
crash stacks) and removed, and what went wrong becomes ``trace.loaders``
(:class:`~backward_doctor.trace.records.LoaderRecord`); a process killed before that (SIGTERM, SIGHUP)
leaves it to its :class:`~.janitor.Janitor`.

>>> watch = WorkerWatch(None)
>>> watch.photograph()  # no worker started: nothing to do
>>> watch.loaders
[]
"""
from __future__ import annotations

import linecache
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from ...trace.stacks import FrameInfo, LoaderRecord, WorkerRecord
from .code_names import CodeNames
from ...util.process import doctors_own
from ..janitor import Janitor
from .files import crash_stack, fetching, read_errors, ready_signal, task_words, worker_stack
from .batches import BatchPrints, duplicates_possible, iter_source
from .worker_side import WorkerInit, dump_path, error_path

_WRAPPED = ("__init__", "_next_index", "_try_put_index", "_process_data", "_shutdown_workers")
_MISSING = object()
_PHOTO_WAIT_S = 2.0
#: how torch re-raises a worker's error in the main process (``ExceptionWrapper.reraise``)
_RERAISED = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.\s*\nOriginal (Traceback.*)", re.S)
_TB_FRAME = re.compile(r'^  File "(.*)", line (\d+), in (.*)$', re.M)


class _Watched:
    """What is remembered of one iterator: a weak reference, its description, the tasks it sent."""

    def __init__(self, it: Any, loader: Any) -> None:
        self.ref = weakref.ref(it)
        ds = getattr(loader, "dataset", None)
        self.dataset = type(ds).__qualname__ if ds is not None else ""
        self.num_workers = int(getattr(loader, "num_workers", 0))
        ctx = getattr(loader, "multiprocessing_context", None)
        self.context = ctx.get_start_method() if ctx is not None and hasattr(ctx, "get_start_method") else \
            _default_context()
        kw = [f"batch_size={loader.batch_size}"] if getattr(loader, "batch_size", None) is not None else []
        kw.append(f"num_workers={self.num_workers}")
        kw.extend(f"{name}=True" for name in ("persistent_workers", "pin_memory") if getattr(loader, name, False))
        if ctx is not None:
            kw.append(f"multiprocessing_context={self.context!r}")
        self.loader = f"{type(loader).__name__}({self.dataset}, {', '.join(kw)})"
        self.pids: list[int] = []
        self.sent: dict[int, tuple[int, Any]] = {}  # task -> (worker, indices)
        self.names = CodeNames([ds, getattr(loader, "collate_fn", None), getattr(loader, "worker_init_fn", None)])
        self.photos: dict[int, list[tuple[str, int, str]]] = {}  # worker -> its stack, innermost first
        self.doing: dict[int, Any] = {}  # worker -> the indices of the oldest task it had not delivered
        self.waiting: int | None = None   # the worker the main process waited for when photographed
        self.exitcodes: list[int | None] = []  # by worker, as the iterator's shutdown left them
        #: an IterableDataset with 2+ workers: its first batches' fingerprints, and the user's line iterating it
        self.prints = BatchPrints() if duplicates_possible(loader) else None
        self.iter_source = iter_source(ds) if self.prints is not None else None
        self.where: Any = None

    def started(self, it: Any) -> None:
        self.pids = [w.pid for w in it._workers]

    def ended(self, it: Any) -> None:
        """The iterator shut its workers down: how each ended (numbers only; the processes are not kept)."""
        try:
            self.exitcodes = [w.exitcode for w in it._workers]
        except Exception:  # noqa: BLE001 - a worker torch could not poll: its code stays unknown
            pass


def _default_context() -> str:
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True) or "fork"


class WorkerWatch:
    """See the module doc. ``capture``: the run's :class:`~backward_doctor.capture.context.Capture` (its
    frames classify the workers' frames; a forked worker undoes its copy of it)."""

    def __init__(self, capture: Any) -> None:
        self._capture = capture
        self._folder: str | None = None
        self._janitor: Janitor | None = None
        self._watched: list[_Watched] = []
        self._by_iter: "weakref.WeakKeyDictionary[Any, _Watched]" = weakref.WeakKeyDictionary()
        self._last: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self._saved: dict[str, Any] = {}
        self._cls: Any = None
        self._reraised: tuple[int, str] | None = None
        self._pid = os.getpid()  # (a forked worker undoing its copy is another process: it leaves the folder)
        self._thread = threading.get_ident()  # (the run's: another thread's loaders run as they are)
        self.loaders: list[LoaderRecord] = []

    # ---------------------------------------------------------------- install / remove
    def install(self, undo: Any) -> None:
        from torch.utils.data import dataloader

        cls = dataloader._MultiProcessingDataLoaderIter
        undo.push("DataLoader workers", self.remove)
        self._cls = cls
        self._saved = {name: cls.__dict__.get(name, _MISSING) for name in _WRAPPED}
        init, next_index, put, process, shutdown = (getattr(cls, name) for name in _WRAPPED)
        watch = self

        # (each wrapper's own part under the watch's guard, ``guard.py``: the iterator's methods run as they would)
        def __init__(it: Any, loader: Any) -> None:
            if threading.get_ident() != watch._thread:  # (another thread's loader: not this run's, as it is)
                return init(it, loader)
            user_fn = loader.worker_init_fn
            wrapper = None
            try:
                wrapper = WorkerInit(user_fn, watch._folder_now(), watch._capture)
                loader.worker_init_fn = wrapper  # (a loader that refuses: its workers run unwatched, no failure)
                seen = watch._by_iter[it] = _Watched(it, loader)  # (before: __init__ sends the first tasks)
                frames = getattr(watch._capture, "_frames", None)
                if seen.prints is not None and frames is not None:  # (the line of the user's `for`)
                    seen.where = frames.where(sys._getframe(1))
            except Exception as exc:
                refused, loader.worker_init_fn = wrapper is not None and loader.worker_init_fn is not wrapper, user_fn
                watch._failed(exc, quietly=refused)
                return init(it, loader)
            try:
                init(it, loader)
            finally:
                loader.worker_init_fn = user_fn
            try:
                if it._worker_init_fn is wrapper:
                    it._worker_init_fn = user_fn
                seen.started(it)
                watch._watched.append(seen)
            except Exception as exc:
                watch._failed(exc)

        def _next_index(it: Any) -> Any:
            index = next_index(it)
            try:
                if it in watch._by_iter:
                    watch._last[it] = index
            except Exception as exc:
                watch._failed(exc)
            return index

        def _try_put_index(it: Any) -> None:
            before = it._send_idx
            put(it)
            try:
                seen = watch._by_iter.get(it)
                if seen is not None and it._send_idx != before:
                    seen.sent[before] = (it._task_info[before][0], watch._last.pop(it, None))
                    for old in [k for k in seen.sent if k < it._rcvd_idx - 1]:
                        del seen.sent[old]
            except Exception as exc:
                watch._failed(exc)

        def _process_data(it: Any, data: Any, *rest: Any) -> Any:
            try:  # (torch 2.13 passes the worker that delivered the batch; an older one does not: nothing counted)
                seen = watch._by_iter.get(it)
                if seen is not None and seen.prints is not None:
                    seen.prints.saw(rest[0] if rest else None, data)
            except Exception as exc:
                watch._failed(exc)
            return process(it, data, *rest)

        def _shutdown_workers(it: Any) -> None:
            try:
                shutdown(it)
            finally:  # (also from the iterator's __del__: nothing here may raise; ``ended`` catches its own)
                seen = watch._by_iter.get(it)
                if seen is not None:
                    seen.ended(it)

        for name, fn in zip(_WRAPPED, (__init__, _next_index, _try_put_index, _process_data, _shutdown_workers)):
            setattr(cls, name, fn)

    def _failed(self, exc: Exception, quietly: bool = False) -> None:
        """The watch's own part failed: it stops (``guard.py``; ``quietly``: only that loader runs unwatched), or
        the exception is re-raised when it is no failure of the doctor's (a signal handler's)."""
        guards = getattr(self._capture, "guards", None)
        if guards is None or not (doctors_own(exc) if quietly else guards.failed("workers", exc)):
            raise exc

    def unwrap(self) -> None:
        """Put the iterator's methods back (the run's end, or the watch switched off: ``guard.py``)."""
        cls, self._cls = self._cls, None
        if cls is not None:
            for name, old in self._saved.items():
                if old is _MISSING:
                    if name in cls.__dict__:
                        delattr(cls, name)
                else:
                    setattr(cls, name, old)

    def remove(self) -> None:
        """Put the iterator's methods back; read what the workers left, then remove the run's folder."""
        self.unwrap()
        folder, self._folder = self._folder, None
        janitor, self._janitor = self._janitor, None
        if os.getpid() != self._pid:  # a forked worker undoing its copy: the folder is the run's
            if janitor is not None:
                janitor.forget()
            return
        try:
            if folder is not None:
                self.loaders = [rec for w in self._watched for rec in [self._record(w, folder)] if rec is not None]
            self._add_reraised()
            if self.loaders and self._capture is not None:
                self._capture.trace.loaders = self.loaders
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if janitor is not None:
                janitor.close()

    def _folder_now(self) -> str:
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="backward_doctor-workers-")
            self._janitor = Janitor(self._folder)  # (removes it if this process is killed before the run ends)
        return self._folder

    # ---------------------------------------------------------------- a stuck run
    def photograph(self) -> None:
        """Every live worker's stacks now (from the watchdog's thread, or after an interrupt), and which
        task each was on; safe to call twice (the second does nothing)."""
        folder = self._folder
        if folder is None:
            return
        asked = []
        for seen in self._watched:
            it = seen.ref()
            if it is None or seen.photos or getattr(it, "_shutdown", True):
                continue
            try:
                tasks = dict(it._task_info)
                waiting = tasks.get(it._rcvd_idx)
                seen.waiting = waiting[0] if waiting is not None and len(waiting) == 1 else None
                for task in sorted(tasks):
                    if len(tasks[task]) == 1 and tasks[task][0] not in seen.doing:
                        seen.doing[tasks[task][0]] = seen.sent.get(task, (None, None))[1]
                workers = list(enumerate(it._workers))
            except Exception:  # noqa: BLE001 - torch's private state changed shape: stacks only
                workers = []
            for wid, proc in workers:
                path = dump_path(folder, proc.pid)
                sig = ready_signal(path) if proc.exitcode is None else None  # (None: its handler is not in)
                if sig is not None:
                    size = os.path.getsize(path)
                    try:
                        os.kill(proc.pid, sig)
                    except OSError:
                        continue
                    asked.append((seen, wid, path, size))
        deadline = time.monotonic() + _PHOTO_WAIT_S
        pending = list(asked)
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            pending = [a for a in pending if os.path.getsize(a[2]) <= a[3]]
        time.sleep(0.02 if asked else 0)  # a dump still being written: its last lines
        for seen, wid, path, size in asked:
            with open(path, encoding="utf-8", errors="replace") as fh:
                fh.seek(size)
                seen.photos[wid] = worker_stack(fh.read())

    def after_run(self, exc: BaseException | None) -> None:
        """The run ended with ``exc``: a Ctrl-C or the loader's own timeout is a hang the watchdog did not
        photograph; the workers are still alive here (the iterator is referenced by the traceback)."""
        if exc is None:
            return
        if isinstance(exc, KeyboardInterrupt) or "DataLoader timed out" in str(exc):
            self.photograph()
        m = _RERAISED.match(str(exc))
        if m:
            self._reraised = (int(m.group(2)), m.group(3))

    def _add_reraised(self) -> None:
        """A worker's error re-raised in the main process, from a loader whose workers were not watched
        (started before this run): its worker, error and frames read from the message torch formats."""
        if self._reraised is None:
            return
        worker, text = self._reraised
        if any(w.worker == worker and w.state == "raised" for rec in self.loaders for w in rec.workers):
            return
        rows = [(m.group(1), int(m.group(2)), m.group(3)) for m in _TB_FRAME.finditer(text)]
        last = [ln for ln in text.strip().splitlines() if ln and not ln.startswith(" ")]
        rec = WorkerRecord(worker=worker, state="raised", error=last[-1] if last else "")
        rec.frames = self._frames(CodeNames([]), rows)
        self.loaders.append(LoaderRecord(loader="a DataLoader whose workers were started before this run",
                                         workers=[rec]))

    # ---------------------------------------------------------------- records
    def _record(self, seen: _Watched, folder: str) -> LoaderRecord | None:
        it = seen.ref()
        procs = list(it._workers) if it is not None and hasattr(it, "_workers") else []
        workers: dict[int, WorkerRecord] = {}
        for wid, pid in enumerate(seen.pids):
            rec = WorkerRecord(worker=wid, pid=pid)
            code = procs[wid].exitcode if wid < len(procs) else \
                seen.exitcodes[wid] if wid < len(seen.exitcodes) else None
            if wid in seen.photos:
                stack = seen.photos[wid]
                rec.frames = self._frames(seen.names, [(f, ln, fn) for f, ln, fn in reversed(stack)])
                rec.state = "fetching" if fetching(stack) else "idle"
                rec.task = task_words(seen.doing.get(wid))
                rec.waited_on = seen.waiting == wid
                workers[wid] = rec
            crash = crash_stack(dump_path(folder, pid))
            if crash is not None:
                rec.state, rec.frames, rec.exitcode = "crashed", self._frames(seen.names, list(reversed(crash))), code
                workers[wid] = rec
            elif code not in (None, 0, -signal.SIGTERM) and not seen.photos:  # (SIGTERM: torch's own shutdown)
                rec.state, rec.exitcode = "exited", code
                rec.task = rec.task or task_words(next((ix for w, ix in seen.sent.values() if w == wid), None))
                workers[wid] = rec
            for err in read_errors(error_path(folder, pid))[:1]:  # its first: the task the main process reached first
                rec.state = "could not send" if err.get("kind") == "send" else "raised"
                rec.error = err.get("error", "")
                rec.task = task_words(err.get("index") if err.get("index") is not None else err.get("indices")) or \
                    rec.task or task_words(seen.sent.get(err.get("task"), (None, None))[1])
                if err.get("frames"):
                    rec.frames = self._frames(seen.names, [tuple(f) for f in err["frames"]])
                rec.made_at = self._frames(seen.names, [tuple(f[:3]) for f in err.get("made_at") or [] if f[0]])
                workers[wid] = rec
        prints = seen.prints
        duplicated = prints is not None and prints.duplicates_stream()
        if not workers and not duplicated:
            return None
        rec = LoaderRecord(loader=seen.loader, dataset=seen.dataset, num_workers=seen.num_workers,
                           context=seen.context, workers=[workers[k] for k in sorted(workers)],
                           photographed=bool(seen.photos))
        if duplicated:
            rec.batches_checked, rec.duplicated = prints.checked, prints.duplicated
            rec.loop_line = seen.where.cell_line if seen.where is not None else None
            rec.iter_file, rec.iter_line, rec.reads_worker_info = seen.iter_source or (None, None, None)
            if rec.iter_file is not None and seen.where is not None and self._user_cell(rec.iter_file):
                rec.iter_file = None  # (defined in the cell: a line of the cell, as every Where says it)
        return rec

    def _user_cell(self, file: str) -> bool:
        frames = getattr(self._capture, "_frames", None)
        return frames is not None and file == frames.cell_file

    def _frames(self, names: CodeNames, rows: list[tuple]) -> list[FrameInfo]:
        """(file, line, function) rows, outermost first, as the capture's frame records (``names``: the user's
        functions' class-qualified names); a forked worker's
        stack starts where its process did (the frames above are the parent's, copied by the fork)."""
        frames = getattr(self._capture, "_frames", None)
        start = [i for i, (file, _, fn) in enumerate(rows) if fn.endswith("_bootstrap") and
                 file.endswith(os.path.join("multiprocessing", "util/process.py"))]
        rows = rows[start[-1] + 1:] if start else rows
        out = []
        for file, line, fn in rows:
            name = names.qualname(file, fn, int(line)) if "." not in fn else fn
            code = linecache.getline(file, int(line)).strip()
            if frames is not None:
                out.append(frames.frame_info(file, int(line), name, code))
            else:
                out.append(FrameInfo(file=file, line=int(line), function=name, code=code))
        return out


__all__ = ["WorkerWatch"]
