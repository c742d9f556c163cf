"""What one cell watched by ``%backward_doctor on`` puts in place, and what it shows afterwards.

- :class:`HeldTracebacks`: IPython's traceback kept while the cell runs and shown after the report, so the
  diagnosis sits above it (the doctor's own frames left out);
- :class:`BackwardTrigger`: ``torch.autograd.backward`` replaced from ``on`` to ``off`` by a function that,
  armed (between watched cells), opens a :class:`~backward_doctor.run.open_diagnosis.OpenDiagnosis` at the first
  ``backward()`` of a cell that was not expected to train;
- :func:`failed` and :func:`quiet_line`: whether a report takes the screen, or one line, or nothing;
  :func:`write_report`: where it goes when a script or a library's loop failed.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import types
from typing import Any, Callable

import torch

from ..util.process import doctors_own
from ..report import Report
from ..render.view import verdict_parts
from ..report.renderers import renderer
from ..run.open_diagnosis import OpenDiagnosis
from ..util.writing import write_atomic
from .running import without_doctor_frames

log = logging.getLogger(__name__)
REPORT_NAME = "backward_doctor-report"  # .json and .html in the output folder


class HeldTracebacks:
    """While a watched cell runs, ``shell.showtraceback`` keeps the traceback instead of showing it;
    :meth:`show` shows it after the report (the doctor's own frames left out), with the shell's own method
    back in place. Idempotent."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.held: list[tuple[tuple, tuple, dict]] = []
        self._had = "showtraceback" in vars(shell)
        self._saved = vars(shell).get("showtraceback")
        self._original = shell.showtraceback
        self._on = False

    def __enter__(self) -> "HeldTracebacks":
        def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841 - read by IPython
            info = exc_tuple if exc_tuple is not None else sys.exc_info()
            if info[0] is None:
                return self._original(exc_tuple, *args, **kwargs)
            self.held.append((tuple(info), args, kwargs))
            return None

        self.shell.showtraceback = showtraceback
        self._on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def restore(self) -> None:
        if self._on:
            self._on = False
            if self._had:
                self.shell.showtraceback = self._saved
            else:
                vars(self.shell).pop("showtraceback", None)

    def show(self) -> None:
        self.restore()
        held, self.held = self.held, []
        for (etype, value, tb), args, kwargs in held:
            try:
                tb = without_doctor_frames(tb) or tb
            except Exception:  # noqa: BLE001 - never lose the user's traceback to the trimming
                pass
            self._original((etype, value, tb), *args, **kwargs)


def failed(report: Report) -> bool:
    """What makes a watched cell's report worth the screen: the step raised after it began (a PyTorch op
    ran, or it was interrupted), hung, or went NaN/Inf. A typo's ``NameError`` before any op is not the
    doctor's to explain.

    >>> failed(Report())
    False
    """
    tr = report.trace
    if tr.timed_out or tr.iterations.first_nonfinite is not None:
        return True
    if report.exception is not None:  # (always on's recorder may have slept: then a completed step says it began)
        return tr.op_count > 0 or tr.iterations.steps > 0 or (
            tr.exception is not None and tr.exception.type == "KeyboardInterrupt")
    return any(f.kind in ("nonfinite", "inf") for f in report.findings)


def quiet_line(report: Report) -> str:
    """The one line a cell that ran to its end gets when something silent was found ('' when nothing was).

    >>> quiet_line(Report())
    ''
    """
    if report.ok or not report.findings:
        return ""
    _, _, headline, _ = verdict_parts(report)
    more = len(report.findings) - 1
    also = f" (and {more} more)" if more else ""
    return f"backward_doctor: {headline}{also}. `backward_doctor.last_report()` has the report."


class Outer:
    """What ``magic._release_failed_frames`` reads of a cell's result (``outer.error_in_exec``)."""

    def __init__(self, result: Any) -> None:
        self.error_in_exec = getattr(result, "error_in_exec", None)


class BackwardTrigger:
    """``torch.autograd.backward`` replaced, from ``install`` to ``uninstall``, by a function that, while
    *armed*, asks its opener at each call whether a watch opens there: ``open_watch(frame)`` (``frame``: the
    caller of ``backward``) returns the watch it began, or None to let the call pass (no cell running, another
    thread, one already watched). Once a watch opens the trigger disarms itself and the call goes through the
    capture's own wrapper, so that first loss is watched too; disarmed, it passes every call straight on. Its
    owner arms it again when the cell that opened the watch ends, and pauses it (out of the function) while a
    watched cell runs.

    >>> trigger = BackwardTrigger()
    >>> trigger.arm(lambda frame: None)  # (not installed: arming does nothing)
    >>> trigger.disarm() is None
    True
    """

    def __init__(self) -> None:
        self._opener: Callable[[types.FrameType], OpenDiagnosis | None] | None = None
        self.watch: OpenDiagnosis | None = None
        self._real: Any = None
        self._fn: Any = None
        self._paused = False

    def install(self) -> None:
        real = self._real = torch.autograd.backward

        @functools.wraps(real)
        def backward(*args: Any, **kwargs: Any) -> Any:
            opener = self._opener
            if opener is not None:
                try:
                    watch = opener(sys._getframe(1))
                except Exception as exc:  # the user's backward() runs whatever happens here (``guard.py``)
                    if not doctors_own(exc):  # (a signal handler's exception: theirs)
                        raise
                    log.warning("always on: the watch could not begin at backward()", exc_info=True)
                    self._opener = None  # (not asked again before the owner re-arms: one warning a cell)
                    watch = None
                if watch is not None:
                    self._opener, self.watch = None, watch
                    if torch.autograd.backward is not backward:
                        return torch.autograd.backward(*args, **kwargs)  # (through the capture's wrapper)
            return real(*args, **kwargs)

        self._fn = torch.autograd.backward = backward

    def uninstall(self) -> None:
        """Put ``torch.autograd.backward`` back (when something wrapped it since, this one stays disarmed in
        between: it passes calls on)."""
        self._opener = None
        if self._fn is not None and torch.autograd.backward is self._fn:
            torch.autograd.backward = self._real
        self._fn, self._paused = None, False

    def pause(self) -> None:
        """Disarmed and out of the way while a watched cell runs: ``torch.autograd.backward`` is the real one
        again when this one is on top (the cell's capture wraps that: one Python call fewer at every
        ``backward()`` of its loop). :meth:`resume` puts it back."""
        self.disarm()
        if self._fn is not None and torch.autograd.backward is self._fn:
            torch.autograd.backward = self._real
            self._paused = True

    def resume(self, open_watch: Callable[[types.FrameType], OpenDiagnosis | None]) -> None:
        """Back in place after :meth:`pause` (over what the cell left there, if it wrapped ``backward`` itself:
        this one was not in that chain), and armed with ``open_watch``."""
        if self._paused:
            self._paused = False
            if self._fn is not None:  # (not when `off` ran in the cell)
                if torch.autograd.backward is self._real:
                    torch.autograd.backward = self._fn
                else:
                    self.install()
        self.arm(open_watch)

    def arm(self, open_watch: Callable[[types.FrameType], OpenDiagnosis | None]) -> None:
        """Ask ``open_watch`` at the next ``backward()`` calls (nothing while not installed)."""
        if self._fn is not None:
            self.watch, self._opener = None, open_watch

    def disarm(self) -> OpenDiagnosis | None:
        """Disarm; the watch it opened since it was armed, if one did (still open: the caller ends it)."""
        self._opener = None
        watch, self.watch = self.watch, None
        return watch


def write_report(report: Report, folder: str) -> list[str]:
    """The report as ``backward_doctor-report.json`` and ``.html`` in ``folder`` (made if missing); the paths.

    Each file is written whole or not at all, and never through a link planted at its name
    (``util/writing.py``). When one cannot be written (a full disk, a quota, a folder at its name, a
    read-only folder) the other is still tried, then the first ``OSError`` is raised (one line: the file and
    why), nothing half-written left behind; its ``written`` lists the files that were written."""
    base = os.path.join(folder, REPORT_NAME)
    files = [(base + ".json", lambda: json.dumps(report.to_dict())),
             (base + ".html", lambda: renderer("page").render(report))]
    written: list[str] = []
    errors: list[OSError] = []
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        errors.append(exc)
    for path, data in files if not errors else ():
        try:
            write_atomic(path, data())
            written.append(path)
        except OSError as exc:
            errors.append(exc)
    if errors:
        errors[0].written = written  # type: ignore[attr-defined]
        raise errors[0]
    return written


__all__ = ["BackwardTrigger", "HeldTracebacks", "Outer", "failed", "quiet_line", "write_report", "REPORT_NAME"]
