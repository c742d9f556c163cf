"""While a doctored cell runs in Jupyter: a placeholder where the report will go, kept up to date with
the run's progress, and the doctor's own frames kept out of the traceback the user reads.

The placeholder is displayed *before* the cell runs (with a ``display_id``), so the report that
replaces it sits above the cell's traceback: the verdict is the first thing on the screen, not
something to scroll to under 200 lines of red.

>>> progress_text({"seconds": 12.34, "iterations": 340, "live_bytes": 1288490189})
'backward_doctor: running… 12.3 s, 340 iterations, 1.2 GiB live'
>>> progress_text(None)
'backward_doctor: running…'
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator

from ..util.units import format_bytes

#: Every file of the package: frames from these are the doctor's, not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: How often the placeholder is refreshed: often enough to look alive, rarely enough to cost nothing.
POLL_S = 0.5


def progress_text(progress: dict[str, Any] | None) -> str:
    """The placeholder's line for a ``runner.running_progress()`` reading (None: nothing known yet)."""
    text = "backward_doctor: running…"
    if not progress:
        return text
    bits = [f"{progress.get('seconds') or 0.0:.1f} s"]
    its = progress.get("iterations") or 0
    if its:
        bits.append(f"{its:,} iteration{'s' if its != 1 else ''}")
    if progress.get("live_bytes") is not None:
        bits.append(f"{format_bytes(progress['live_bytes'])} live")
    return f"{text} {', '.join(bits)}"


class _Line:
    """What the placeholder displays: one line, as text and as quiet HTML."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        import html

        if not self.text:  # an empty output: what is left of the placeholder under --quiet
            return {"text/plain": ""}
        return {"text/plain": self.text,
                "text/html": f'<div class="bd-running" style="color:var(--jp-ui-font-color2,#57606a);'
                             f'font-family:var(--jp-ui-font-family,sans-serif);font-size:13px">'
                             f"{html.escape(self.text)}</div>"}


class RunningNotice:
    """The placeholder and the thread that refreshes it; ``replace(obj)`` puts the report in its place.

    ``read`` returns the progress (``runner.running_progress``); ``display`` is IPython's ``display``
    (passed in: this module does not import IPython). The thread runs in a copy of the caller's
    context, so in ipykernel its messages belong to the cell that started it.

    >>> shown = []
    >>> class Handle:
    ...     def update(self, obj): shown.append(obj.text if hasattr(obj, "text") else obj)
    >>> with RunningNotice(lambda obj, display_id: Handle(), read=lambda: None, interval=0.01) as n:
    ...     pass
    >>> n.replace("the report"); shown[-1]
    'the report'
    """

    def __init__(self, display: Callable[..., Any], read: Callable[[], dict[str, Any] | None],
                 interval: float = POLL_S) -> None:
        self._display, self._read, self._interval = display, read, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: Any = None
        self._last = ""

    def __enter__(self) -> "RunningNotice":
        self._last = progress_text(None)
        try:
            self._handle = self._display(_Line(self._last), display_id=True)
        except Exception:  # noqa: BLE001 - a front end that cannot show it: the cell runs all the same
            self._handle = None
            return self
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._poll,), daemon=True,
                                        name="backward_doctor-progress")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop refreshing (idempotent; also what a Ctrl-C in the doctor's own code ends in)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                text = progress_text(self._read())
                if text != self._last and not self._stop.is_set():
                    self._last = text
                    self._handle.update(_Line(text))
            except Exception:  # noqa: BLE001 - a progress line must never disturb the cell
                return

    def replace(self, obj: Any) -> None:
        """Show ``obj`` (the panel, the report) where the placeholder was."""
        self.stop()
        if self._handle is not None:
            self._handle.update(obj)
        else:  # the placeholder could not be shown: the report goes where it would have gone anyway
            self._display(obj)

    def say(self, text: str) -> None:
        """Replace the placeholder with one line (no report could be made)."""
        self.replace(_Line(text))


def is_doctor_frame(frame: types.FrameType) -> bool:
    """True for a frame running the doctor's own code (the capture's hooks, its simulated OOM).

    >>> import sys
    >>> is_doctor_frame(sys._getframe())  # a doctest's frame is not the doctor's
    False
    """
    return frame.f_code.co_filename.startswith(_PACKAGE_DIR)


def without_doctor_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """A copy of the traceback chain ``tb`` without the doctor's frames (the user's stay in order).

    The exception keeps its own ``__traceback__``: only what is shown changes.

    >>> try:
    ...     raise ValueError("x")
    ... except ValueError as exc:
    ...     tb = exc.__traceback__
    >>> shown = without_doctor_frames(tb)  # a doctest's frames are the user's: all kept, a copy
    >>> shown is not tb and shown.tb_frame is tb.tb_frame
    True
    """
    kept = []
    while tb is not None:
        if not is_doctor_frame(tb.tb_frame):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for t in reversed(kept):
        out = types.TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


@contextlib.contextmanager
def doctor_frames_hidden(shell: Any, before: Callable[[], None] | None = None) -> Iterator[None]:
    """While the cell runs, ``shell.showtraceback`` shows tracebacks without the doctor's frames.

    IPython's ``__tracebackhide__`` never hides the innermost frame, and a simulated OOM is raised by
    the doctor itself, so the shown chain is trimmed instead. The shell's own method is back in place
    afterwards, whatever happens. ``before()`` runs before each traceback is drawn (the magic numbers
    the cell there).

    >>> class Shell:
    ...     def showtraceback(self, exc_tuple=None): return "shown"
    >>> sh = Shell()
    >>> with doctor_frames_hidden(sh):
    ...     "showtraceback" in vars(sh)
    True
    >>> "showtraceback" in vars(sh)  # the class's own method again
    False
    """
    had = "showtraceback" in vars(shell)
    saved = vars(shell).get("showtraceback")
    original = shell.showtraceback

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - read by IPython
        try:
            if before is not None:
                before()
            etype, value, tb = exc_tuple if exc_tuple is not None else sys.exc_info()
            if tb is not None and value is not None:
                exc_tuple = (etype, value, without_doctor_frames(tb) or tb)
        except Exception:  # noqa: BLE001 - never lose the user's traceback to the trimming
            pass
        return original(exc_tuple, *args, **kwargs)

    shell.showtraceback = showtraceback
    try:
        yield
    finally:
        if had:
            shell.showtraceback = saved
        else:
            del shell.showtraceback
