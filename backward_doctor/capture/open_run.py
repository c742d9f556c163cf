"""A capture opened by one call and closed by another, while the user's code keeps running in between.

:func:`~backward_doctor.capture.runner.run_under_capture` wraps one function call. A library's training
loop gives no such call to wrap: a ``transformers.TrainerCallback`` hears ``on_train_begin`` and, later,
``on_train_end`` (or nothing at all when training raises), and a notebook cell that was not expected to
train is already running when its first ``backward()`` comes. :class:`OpenRun` is the same capture and
watchdog, opened and closed as two events. Each of the two is atomic with respect to Ctrl-C (one hold
around it, as in a run of its own); between them the user's code runs with their own SIGINT handler.

>>> from backward_doctor.capture import Capture
>>> run = OpenRun(Capture({}), timeout=None)
>>> run.open()
>>> trace = run.close(None)
>>> trace.completed, run.is_open
(True, False)
"""
from __future__ import annotations

from typing import Any

from .context import Capture
from ..util.process import interrupts_deferred
from .runner import _running, traced, watchdog_for
from ..trace.records import Trace


class OpenRun:
    """``capture`` and its watchdog (``timeout`` s; ``stall``: counted from the latest optimizer step),
    opened with :meth:`open` and closed with :meth:`close`, which returns the trace."""

    def __init__(self, capture: Capture, timeout: float | None, stall: bool = False) -> None:
        self.capture = capture
        self._watchdog = watchdog_for(capture, timeout, stall)
        self.is_open = False

    def open(self) -> None:
        """Install the capture and arm the watchdog. A Ctrl-C meanwhile is delivered once all is undone."""
        try:
            with interrupts_deferred():  # (a Ctrl-C held here is delivered as it ends: uninstalled below)
                self._install()
        except BaseException:
            with interrupts_deferred():
                self._uninstall()
            raise

    def _install(self) -> None:
        _running.append(self.capture)
        self.is_open = True
        self.capture.start()
        self._watchdog.__enter__()

    def _uninstall(self) -> None:
        if not self.is_open:
            return
        self.is_open = False
        try:
            self._watchdog.__exit__(None, None, None)
        finally:
            try:
                self.capture.stop()
            finally:
                if self.capture in _running:
                    _running.remove(self.capture)

    def close(self, exc: BaseException | None) -> Trace:
        """Disarm, uninstall, and make the trace (``exc``: how the watched code ended, None when it did not
        raise)."""
        try:
            self._watchdog.disarm()
            if exc is not None and not self._watchdog.fired:  # DataLoader workers' state, while still installed
                self.capture.photograph_workers(exc)
        finally:  # (whatever failed above: nothing of the capture stays installed in the user's process)
            with interrupts_deferred():
                self._uninstall()
        return traced(self.capture, self._watchdog, exc)

    def abandon(self) -> None:
        """Uninstall without a trace: the doctor failed to close the run (its own error), and the user's
        process must not keep its capture. Nothing happens when the run is already closed."""
        with interrupts_deferred():
            self._uninstall()

    @property
    def timed_out(self) -> bool:
        """The watchdog fired (it interrupted the watched code as a hang)."""
        return self._watchdog.fired

    def __repr__(self) -> str:
        state: Any = "open" if self.is_open else "closed"
        return f"<OpenRun {state}>"


__all__ = ["OpenRun"]
