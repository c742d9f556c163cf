"""The one "deliver the report" step of the runs nobody asked a report of in advance: a script under
``python -m backward_doctor run``, a library's training under the callbacks (``integrations/watching.py``)
and a cell under always on (``always_on.py``).

A run that failed (``cell_watch.failed``: it raised after training began, hung, or went NaN/Inf) gets its
fixes checked (a button or a ``--fix`` only where it applies), its report saved where a folder is given,
and shown where the user looks, with one footer line saying where the files went, or why they could not
be written: a full disk costs the file, never the report. A run that ended with a silent finding gets one
line; a clean run gets nothing. (``%%backward_doctor`` and ``diagnose()`` always show or return theirs:
they were asked.)

>>> from backward_doctor.report import Report
>>> deliver(Report(), show=lambda report, footer: print("shown"))
[]
"""
from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

from ..util.process import doctors_own
from ..report import Report
from .cell_watch import failed, quiet_line, write_report


def one_line(exc: BaseException) -> str:
    """An error on one line: ``IsADirectoryError: Is a directory: '/out/backward_doctor-report.json'``.

    >>> one_line(OSError(28, "No space left on device", "/out/r.json"))
    "OSError: No space left on device: '/out/r.json'"
    """
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror + (f": {exc.filename!r}" if exc.filename else "")
    return f"{type(exc).__name__}: {' '.join(text.split())}"[:500]


def save(report: Report, folder: str) -> tuple[list[str], str]:
    """The report written to ``folder`` (``cell_watch.write_report``): the files written, and the footer line
    that says where, or why not (then the report is still shown above it).

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as d:
    ...     written, footer = save(Report(), d)
    ...     [os.path.basename(p) for p in written], footer.startswith("backward_doctor: the report (written to ")
    (['backward_doctor-report.json', 'backward_doctor-report.html'], True)
    """
    try:
        written = write_report(report, folder)
        return written, f"backward_doctor: the report (written to {written[-1]})"
    except Exception as exc:  # noqa: BLE001 - an OSError above all: the file is lost, never the report
        if not (isinstance(exc, OSError) or doctors_own(exc)):
            raise
        written = list(getattr(exc, "written", []))
        if written:
            return written, (f"backward_doctor: the report above is saved only in part: {', '.join(written)} was "
                             f"written, the rest could not be ({one_line(exc)})")
        return written, (f"backward_doctor: the report above is not saved: it could not be written to {folder} "
                         f"({one_line(exc)})")


def _check_offers(report: Report, source: str, namespace: dict) -> None:
    """Which fixes apply where the code is (the report's advice says why not the others); without them when
    the check itself fails (the doctor's own error: the report is delivered anyway)."""
    try:
        from ..fixes.offers import check_offers

        check_offers(report, source, namespace)
    except Exception as own:  # noqa: BLE001
        if not doctors_own(own):
            raise


def deliver(report: Report, show: Callable[[Report, str], None], *, folder: str | None = None,
            quiet: bool = False, offers: tuple[str, dict[str, Any]] | None = None,
            quiet_to: TextIO | None = None) -> list[str]:
    """Deliver ``report`` as the module docstring says; the files written.

    ``show(report, footer)`` puts it where the user looks (stderr, ``display``, the panel); ``footer`` is ''
    without a ``folder``. ``offers``: the source and namespace the fixes would apply to. ``quiet``: no line
    for a silent finding. ``quiet_to``: where that line goes (stderr by default)."""
    if failed(report):
        if offers is not None:
            _check_offers(report, *offers)
        written, footer = save(report, folder) if folder is not None else ([], "")
        show(report, footer)
        return written
    line = "" if quiet else quiet_line(report)
    if line:
        print(line, file=quiet_to if quiet_to is not None else sys.stderr, flush=True)
    return []


__all__ = ["deliver", "one_line", "save"]
