"""What a run puts into the process, undone in order, and Ctrl-C held back while the doctor does it.

Everything process-wide a capture touches (a dispatch mode, global module and optimizer hooks, hooks
on parameters, dynamo's compile callbacks, a warnings filter, the native recorder, torch's profiler
functions, the watchdog and its SIGINT handler) goes on an :class:`UndoStack` the moment it is
installed; :meth:`UndoStack.undo_all` takes it all off in reverse order, each step attempted even if an
earlier one failed.

A diagnosis runs inside :func:`interrupts_deferred`: while the doctor sets itself up and tears itself
down, SIGINT's Python handler is one that only notes a Ctrl-C, and the Ctrl-C is delivered once the
section ends, everything undone. Only the user's own code runs with their handler in place
(:func:`interrupts_allowed`), so a Ctrl-C there interrupts their cell as usual. One hold covers the
whole diagnosis (sections nest), because in Python any function's first instruction can take a
KeyboardInterrupt: a hold that began and ended around each step would leave those instructions open.
Only the main thread receives signals; elsewhere nothing needs holding.

>>> undo = UndoStack()
>>> seen = []
>>> undo.push("a", lambda: seen.append("a")); undo.push("b", lambda: seen.append("b"))
>>> with interrupts_deferred():
...     undo.undo_all()
>>> seen
['b', 'a']
"""
from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)


class Hold:
    """The process's one hold on Ctrl-C: ``pending`` once one arrived while held; ``outer`` is the SIGINT
    handler in place outside (and inside :func:`interrupts_allowed`: the watchdog sets its own there)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.outer: Any = None
        self.active = False  # our noting handler is installed (main thread, a Python-level handler)
        self.window = False  # inside interrupts_allowed: the user's code runs, their handler in place
        #: a Ctrl-C held during set-up, handed to the user's handler as their code began: "raised" (it
        #: stopped the code before its first line), "handled" (the handler returned: the code ran), ''
        self.handover = ""

    def _note(self, signum: int, frame: Any) -> None:
        self.pending = True


HOLD = Hold()
_OFF = Hold()  # what sections off the main thread see (inactive: nothing to hold there)


def _deliver(handler: Any) -> None:
    """What the Ctrl-C held back would have done under ``handler``."""
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signal.SIGINT, None)  # default_int_handler raises KeyboardInterrupt; a user's runs
    else:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[Hold]:
    """Hold back Ctrl-C until the outermost such section ends, then deliver it (unless it raised)."""
    if threading.current_thread() is not threading.main_thread():
        yield _OFF
        return
    if HOLD.depth and not HOLD.window:  # already held: one hold, nested sections
        HOLD.depth += 1
        try:
            yield HOLD
        finally:
            HOLD.depth -= 1
        return
    # A new hold: the outermost, or one inside the user's code of another (a diagnosis in a doctored cell).
    try:
        previous = signal.getsignal(signal.SIGINT)
    except (ValueError, TypeError, OSError):  # no signals here (an embedded interpreter)
        previous = None
    if previous is None:  # a handler not set from Python cannot be put back: leave it alone
        yield _OFF
        return
    # Order matters: a Ctrl-C before the swap must find the hold's state untouched, and after it none
    # can be raised (the noting handler is in place) until the swap back, the last thing done.
    saved = (HOLD.outer, HOLD.pending, HOLD.depth, HOLD.window, HOLD.active)
    HOLD.pending = False
    signal.signal(signal.SIGINT, HOLD._note)
    HOLD.outer, HOLD.depth, HOLD.window, HOLD.active = previous, 1, False, True
    raised = False
    try:
        yield HOLD
    except BaseException:
        raised = True
        raise
    finally:
        outer, pending = HOLD.outer, HOLD.pending
        HOLD.outer, HOLD.pending, HOLD.depth, HOLD.window, HOLD.active = saved
        signal.signal(signal.SIGINT, outer)
        if pending and not raised:
            _deliver(outer)


@contextlib.contextmanager
def interrupts_allowed() -> Iterator[None]:
    """Inside a hold: the user's code, run with the outside handler (a Ctrl-C interrupts it as usual). One
    that arrived while the doctor was setting up is handed to that handler right at the code's start (the
    default one stops the code there; one that does not raise lets it run, under the capture, which stayed
    installed: ``HOLD.handover`` says which). A handler the code installs for itself is kept as the outside
    handler."""
    HOLD.handover = ""
    if not HOLD.active:
        yield
        return
    installed = HOLD.outer
    HOLD.window = True
    try:
        signal.signal(signal.SIGINT, installed)  # (from here a Ctrl-C is the user's code's)
        if HOLD.pending:
            HOLD.pending = False
            HOLD.handover = "raised"
            _deliver(installed)
            HOLD.handover = "handled"  # a handler that only notes it ("stop after this epoch"), or SIG_IGN
        yield
    finally:
        now = signal.signal(signal.SIGINT, HOLD._note)
        HOLD.window = False
        if now is not installed and now is not HOLD._note:  # the code set its own handler: it stays
            HOLD.outer = now


def complete(fn: Callable[[Hold], None]) -> None:
    """Run ``fn(hold)`` to its end with Ctrl-C held back, then deliver the Ctrl-C if one came.

    Outside a diagnosis's hold a Ctrl-C can still land in the instructions before this one's begins:
    then ``fn`` runs again, so it must be idempotent (undoing what is already undone does nothing).
    """
    done, caught = False, None
    while not done:
        try:
            with interrupts_deferred() as hold:
                fn(hold)
                done = True
        except KeyboardInterrupt as exc:
            caught = caught or exc
    if caught is not None:
        raise caught


class UndoStack:
    """Undo steps for what was installed, run last-in first-out."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], None]]] = []
        self.errors: list[str] = []

    def push(self, name: str, undo: Callable[[], None]) -> None:
        self._steps.append((name, undo))

    def __len__(self) -> int:
        return len(self._steps)

    def undo_all(self, skip: tuple[str, ...] = ()) -> None:
        """Run every step (newest first); a step that fails is recorded in ``errors`` and the rest run.
        ``skip``: names of steps dropped without running (a forked child undoing its copy: ``workers/worker_side.py``)."""
        while self._steps:
            name, undo = self._steps.pop()
            if name in skip:
                continue
            try:
                undo()
            except Exception as exc:  # noqa: BLE001 - the other steps must still run
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                log.warning("could not undo %s", name, exc_info=True)


def patch(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> Callable[[], None]:
    """Replace ``owner.name`` with a wrapper of ``make(original)``; returns the undo. Undoing behaves as a
    stack would: the original goes back only while the attribute is still the doctor's wrapper. Code that
    wrapped it again meanwhile (a cell's own wrapper of ``torch.autograd.backward``) keeps its wrapper,
    and the doctor's, which that one calls, then only forwards to the original (and holds nothing).

    >>> import types
    >>> box = types.SimpleNamespace(f=lambda x: x + 1)
    >>> real = box.f
    >>> undo = patch(box, "f", lambda f: lambda x: f(x) * 10)
    >>> ours = box.f; box.f(1)
    20
    >>> box.f = lambda x: ours(x) + 1000          # the user's wrapper, on top of the doctor's
    >>> undo(); box.f(1), box.f is real            # theirs stays; ours only forwards now
    (1002, False)
    """
    original = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
    inner: list[Any] = [make(original)]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        fn = inner[0]
        return fn(*args, **kwargs) if fn is not None else original(*args, **kwargs)

    def undo() -> None:
        inner[0] = None
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if current is wrapper:
            setattr(owner, name, original)

    setattr(owner, name, wrapper)
    return undo


def doctors_own(exc: BaseException) -> bool:
    """True when ``exc``, caught in the doctor's bookkeeping, is the bookkeeping's own failure, so that it may be
    swallowed and said: anything its code raised, torch's, the standard library's, or a user's object it asked
    something of (a tensor subclass it described, a ``__repr__`` of a loop variable, a container the user's
    optimizer holds): the user's code would not have run it without the doctor, so it must not fail their step.
    False for what the caller must re-raise: an exception raised by a signal handler (a cell's own SIGALRM time
    limit raises its TimeoutError wherever the main thread is, the doctor's code included: a frame of its
    traceback runs a Python handler installed now), and every ``BaseException`` (Ctrl-C, ``SystemExit``).

    >>> import signal
    >>> def failing(raiser):
    ...     try:
    ...         raiser()
    ...     except BaseException as e:
    ...         return doctors_own(e)
    >>> def alarm(signum, frame):
    ...     raise TimeoutError("the cell's time limit")
    >>> def ctrl_c():
    ...     raise KeyboardInterrupt
    >>> old = signal.signal(signal.SIGUSR1, alarm)
    >>> failing(lambda: 1 / 0), failing(lambda: signal.raise_signal(signal.SIGUSR1)), failing(ctrl_c)
    (True, False, False)
    >>> _ = signal.signal(signal.SIGUSR1, old)
    """
    if not isinstance(exc, Exception):
        return False
    tb = exc.__traceback__
    if tb is None:
        return True
    handlers = _handler_codes()
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return False
        tb = tb.tb_next
    return True


def _handler_codes() -> set[Any]:
    """The code objects of the Python signal handlers installed now (read on the exception path only)."""
    codes = set()
    for sig in signal.valid_signals():
        try:
            h = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(h):
            fn = getattr(h, "__func__", h)
            code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
            if code is not None:
                codes.add(code)
    return codes


_owner_lock = threading.Lock()
_owner: int | None = None  # the thread running a diagnosis
_depth = 0                 # diagnoses it runs inside one another (a diagnose() inside a doctored cell)


@contextlib.contextmanager
def one_run_at_a_time() -> Iterator[None]:
    """One diagnosis at a time in the process (the hooks a capture installs are process-wide), with
    Ctrl-C held back around it (see the module doc). A call from another thread while one runs gets a
    ``RuntimeError`` before anything runs (the same thread may nest).

    >>> with one_run_at_a_time():
    ...     with one_run_at_a_time():
    ...         pass
    """
    with interrupts_deferred():
        claim_run()
        try:
            yield
        finally:
            release_run()


def claim_run() -> None:
    """Mark a diagnosis running in this thread (``RuntimeError`` if another thread runs one), for a run whose
    start and end are two events (``capture/open_run.py``): no Ctrl-C hold spans it. Pair with
    :func:`release_run`."""
    global _owner, _depth
    me = threading.get_ident()
    with interrupts_deferred(), _owner_lock:  # a Ctrl-C must not leave the lock held
        if _owner is not None and _owner != me:
            name = next((t.name for t in threading.enumerate() if t.ident == _owner), f"thread {_owner}")
            raise RuntimeError(f"backward_doctor is already diagnosing a step (in {name}); it diagnoses "
                               "one step at a time per process: run this one when that one is done")
        _owner, _depth = me, _depth + 1


def release_run() -> None:
    """The end of a run :func:`claim_run` marked."""
    global _owner, _depth
    with interrupts_deferred(), _owner_lock:
        _depth -= 1
        if _depth == 0:
            _owner = None


def exclusive(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``fn`` to run under :func:`one_run_at_a_time`."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_run_at_a_time():
            return fn(*args, **kwargs)
    return wrapper
