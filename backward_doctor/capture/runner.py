"""Run a cell's source in a namespace under a :class:`Capture`, with a hang watchdog.

The watchdog interrupts a run that exceeds ``timeout``: it first photographs every
thread's stack (that is where the hang is), then raises ``KeyboardInterrupt`` in
the running thread, exactly as Ctrl-C would. Signal handlers are restored after.

>>> trace = run_source("x = 1 + 1", {})
>>> trace.completed
True
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import linecache
import signal
import threading
import time
from typing import Any, Callable, Iterator

from ..util.process import HOLD, complete, interrupts_allowed, interrupts_deferred
from .context import Capture
from .frames import UserFrames
from .history import CellHistory
from ..trace.records import Trace

_cells = itertools.count(1)
_RETRIES, _RETRY_S = 60, 0.5  # after the timeout: interrupt again every 0.5 s, for at most 30 s


class Watchdog:
    """Interrupt the calling thread after ``timeout`` seconds (None: never). With ``progress`` (a count read
    from this thread, e.g. the optimizer steps done) the time counts from the latest change of the count:
    a long run that keeps stepping is not a hang, one that stops stepping for ``timeout`` seconds is."""

    def __init__(self, timeout: float | None, frames: UserFrames,
                 progress: Callable[[], int] | None = None,
                 before_interrupt: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.progress = progress
        self._before_interrupt = before_interrupt  # more photographs (DataLoader workers' stacks)
        self.fired = False
        self.stacks: list = []
        self._frames = frames
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._target = threading.get_ident()
        self._thread: threading.Thread | None = None
        self._old_handler: Any = None

    def __enter__(self) -> "Watchdog":
        if self.timeout is None:
            return self
        try:  # (as Capture.__enter__: a Ctrl-C delivered on the way out must not leave it armed)
            self._arm()
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _arm(self) -> None:
        self._target = threading.get_ident()
        with interrupts_deferred() as deferral:
            if deferral.active:
                # Our interrupt must become a KeyboardInterrupt even where SIGINT is ignored: that handler
                # is what the section leaves in place.
                self._old_handler, deferral.outer = deferral.outer, signal.default_int_handler
            self._thread = threading.Thread(target=self._watch, name="backward_doctor-watchdog", daemon=True)
            self._thread.start()
            if deferral.pending and deferral.depth == 1:  # a Ctrl-C while arming, delivered as this ends:
                self._close(deferral)                       # disarm (in a diagnosis's hold the cell gets it)

    def _expired(self) -> bool:
        """Wait until the run ends (False) or the timeout passes without progress (True)."""
        if self.progress is None:
            return not self._done.wait(self.timeout)
        last, since = self.progress(), time.monotonic()
        while not self._done.wait(min(self.timeout, 1.0)):
            now = self.progress()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= self.timeout:
                return True
        return False

    def _watch(self) -> None:
        if not self._expired():
            return
        with self._lock:
            if self._done.is_set():
                return
            self.stacks = self._frames.thread_stacks()
            self.fired = True
            if self._before_interrupt is not None:
                self._before_interrupt()
            self._interrupt()
        # A KeyboardInterrupt can be swallowed (raised inside a weakref callback or a `__del__`,
        # or by a bare `except:` in the user's loop): keep interrupting until the run ends.
        for attempt in range(_RETRIES):
            # The first pause is longer: IPython may still be printing the first traceback.
            if self._done.wait(_RETRY_S * (3 if attempt == 0 else 1)):
                return
            with self._lock:
                if self._done.is_set():
                    return
                self._interrupt()

    def _interrupt(self) -> None:
        if self._old_handler is not None:
            signal.pthread_kill(self._target, signal.SIGINT)
        else:  # not the main thread: no signals; interrupt at the next bytecode
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target),
                                                       ctypes.py_object(KeyboardInterrupt))

    def disarm(self) -> None:
        with interrupts_deferred(), self._lock:  # a Ctrl-C must not leave the lock held
            self._done.set()

    def __exit__(self, *exc: Any) -> bool:
        complete(self._close)
        return False

    def _close(self, deferral: Any) -> None:
        """Stop the watch thread and put the SIGINT handler back, unless the cell installed its own."""
        self.disarm()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._old_handler is not None and deferral.active:
            if deferral.outer is signal.default_int_handler:  # still ours
                deferral.outer = self._old_handler
            self._old_handler = None


def make_capture(engine: str, namespace: dict[str, Any], *, every_iteration: bool = False, budget: bool = False,
                 watching: bool = False, **kwargs: Any) -> Capture:
    """A :class:`Capture` for ``engine`` ("python" or "native"; see ``tiers.choose_engine``); the native
    one samples a loop's iterations unless ``every_iteration``, within always-on's cost budget when ``budget``
    (``loop/choosing.py``). The Python tier records every op, except, once the process uses CUDA, always on's
    (``budget``) and the library callbacks' (``watching``: iterations 0, 1, 2 and powers of two, as the native
    recorder samples them), which sample too (``python_sampling.py``)."""
    if engine == "python" and (budget or watching) and not every_iteration:
        from . import python_sampling
        from .loop.choosing import CostBudget, PowersOfTwo

        if python_sampling.samples_here():
            # (no allocator history: with Python stacks it costs at every allocation, asleep or not)
            return python_sampling.SampledCapture(namespace, sampling=CostBudget() if budget else PowersOfTwo(),
                                                  **{**kwargs, "cuda_history": False})
    if engine == "native":
        from .native_capture import NativeCapture
        from .loop.choosing import CostBudget

        sampling = CostBudget() if budget and not every_iteration else None
        return NativeCapture(namespace, sample_iterations=not every_iteration, sampling=sampling, **kwargs)
    return Capture(namespace, **kwargs)


_registered: collections.deque = collections.deque()
_KEEP_SOURCES = 64  # the latest cells' sources stay in linecache (tracebacks); older ones are dropped


def _register_source(filename: str, source: str) -> None:
    """Put the cell's source in linecache (tracebacks show its lines), keeping only the latest few."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    if filename not in _registered:
        _registered.append(filename)
    while len(_registered) > _KEEP_SOURCES:
        linecache.cache.pop(_registered.popleft(), None)


def cell_filename() -> str:
    return f"<backward_doctor-cell-{next(_cells)}>"


def _run_disarmed_after(run: Callable[[], BaseException | None], watchdog: Watchdog,
                        notes: list[str]) -> BaseException | None:
    """The cell's run; its exception returned as data; the watchdog disarmed as soon as it ends. (Its own
    function: a `try` as the first statement of a `with` body leaves an unprotected instruction.)"""
    handed: str | None = None
    try:
        with interrupts_allowed():  # the user's code: Ctrl-C interrupts it as usual
            handed = HOLD.handover  # (read now: a diagnosis inside the cell has its own)
            return run()
    except BaseException as e:  # noqa: BLE001 - the cell's error is data here
        return e
    finally:
        watchdog.disarm()
        handed = HOLD.handover if handed is None else handed  # (the handover itself raised: no cell ran)
        if handed:
            notes.append(_HANDOVER[handed])


_HANDOVER = {
    "raised": "a Ctrl-C came while the doctor was setting up; handed to the SIGINT handler as the cell was "
              "about to start, it stopped it there: the cell did not run",
    "handled": "a Ctrl-C came while the doctor was setting up; handed to the cell's SIGINT handler as the cell "
               "was about to start, it did not stop it: the cell ran under the capture, recorded as usual",
}


_running: list[Capture] = []  # the capture of the run in progress (a nested diagnosis adds one)
#: the same list, read as a truth value (a run in progress?) where even a call is too dear: before every cell
#: while always on is on
running_captures = _running


def current_capture() -> Capture | None:
    """The capture of the run in progress, if any (the CLI reports from it when a script calls os._exit)."""
    return _running[-1] if _running else None


def running_progress() -> dict[str, Any] | None:
    """How far the run in progress has got, for a frontend's progress display: ``{"iterations": optimizer
    steps so far, "live_bytes": live memory at the latest iteration's end (None: not measured yet),
    "seconds": since the capture started}``; None when no run is in progress. Safe to call from another
    thread (it only reads a few numbers).

    >>> running_progress() is None
    True
    """
    cap = _running[-1] if _running else None
    return cap.progress() if cap is not None else None


def run_under_capture(run: Callable[[], BaseException | None], capture: Capture,
                      timeout: float | None, stall: bool = False) -> Trace:
    """Call ``run()`` (which returns the cell's exception or None) under capture and watchdog. ``stall``:
    the timeout counts from the latest optimizer step (a loop that keeps stepping is not hung)."""
    with interrupts_deferred():  # set-up and tear-down hold Ctrl-C; the cell itself does not
        _running.append(capture)
        try:
            return _run_under_capture(run, capture, watchdog_for(capture, timeout, stall))
        finally:
            _running.remove(capture)


def watchdog_for(capture: Capture, timeout: float | None, stall: bool = False) -> Watchdog:
    """The watchdog of ``capture``'s run; with ``stall`` it counts time from the run's latest optimizer step."""
    its = capture.trace.iterations
    capture.trace.timeout_stall = bool(stall and timeout is not None)
    return Watchdog(timeout, capture._frames, progress=(lambda: its.steps) if stall else None,
                    before_interrupt=capture.photograph_workers)


def _run_under_capture(run: Callable[[], BaseException | None], capture: Capture, watchdog: Watchdog) -> Trace:
    exc: BaseException | None = None
    try:
        # Capture first: its start-up (a one-time torch import) is not the cell's time.
        with capture:
            with watchdog:
                exc = _run_disarmed_after(run, watchdog, capture.trace.notes)
            if exc is not None and not watchdog.fired:
                capture.photograph_workers(exc)
    except KeyboardInterrupt as e:  # the interrupt landed after the cell ended
        exc = exc or e
    try:
        return traced(capture, watchdog, exc)
    finally:
        # The exception's traceback holds _run_disarmed_after's frame, whose f_back is this one: a cycle through
        # `exc` that kept every tensor of the failed step (an OOM's activations) until the garbage collector ran.
        # Measured on an H200: 1.3 GB still allocated after diagnosing an OOM, so the fixes that would fit ran
        # out of memory too. Without the cycle it is freed as the plain cell's is, at once.
        exc = None


def traced(capture: Capture, watchdog: Watchdog, exc: BaseException | None) -> Trace:
    """The trace of a stopped capture: the watchdog's verdict and stacks, the run's exception as evidence."""
    trace = capture.trace
    trace.timeout_s = watchdog.timeout
    if watchdog.fired:
        trace.timed_out = True
        trace.threads = watchdog.stacks
    with _modes_off():  # the doctor's own ops after the cell: a dispatch mode the cell left on must not see them
        if exc is not None:
            capture.record_exception(exc)
            if isinstance(exc, KeyboardInterrupt) and not trace.threads:
                trace.threads = capture._frames.thread_stacks()
        del exc
        try:
            return capture.finish()
        finally:
            capture.release()


@contextlib.contextmanager
def _modes_off() -> Iterator[None]:
    """Every dispatch mode off meanwhile (only a cell's own can be on here: the doctor's is off), then on
    again as they were."""
    import torch

    if not torch._C._len_torch_dispatch_stack():
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def run_source(source: str, namespace: dict[str, Any], *, timeout: float | None = None,
               memory_limit: int | None = None, filename: str | None = None,
               history: CellHistory | None = None, detail: bool = True, engine: str = "python",
               every_iteration: bool = False, rollback: Any = None, stall: bool = False,
               budget: bool = False) -> Trace:
    """Execute ``source`` in ``namespace`` (like ``exec``) and return its trace.

    ``rollback``: told when iterations begin and go non-finite (``run/iteration_replay.py``). ``stall``: the
    timeout counts from the latest optimizer step. ``budget``: record iterations only within always-on's cost
    budget (``capture/loop/choosing.py``).

    ``engine``: ``"python"`` (the dispatch-mode :class:`Capture`) or ``"native"``
    (:class:`~backward_doctor.capture.native_capture.NativeCapture`, first tier only).
    """
    filename = filename or cell_filename()
    # Register the source so tracebacks and reports can show the cell's lines.
    _register_source(filename, source)
    capture = make_capture(engine, namespace, cell_file=filename, source=source, memory_limit=memory_limit,
                           history=history, detail=detail, every_iteration=every_iteration, budget=budget)
    capture.rollback = rollback

    def run() -> BaseException | None:
        code = compile(source, filename, "exec")
        exec(code, namespace)
        return None

    return run_under_capture(run, capture, timeout, stall)
