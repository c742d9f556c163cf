"""The doctor's own failures kept out of the user's code: every part a run installs into the user's calls is
named here, and its bookkeeping runs under its guard.

A guarded part is what the doctor installs into the user's calls for one purpose: the capture's own (the op
recorder, the module and optimizer-step hooks, the collective log, ...) and each training watch of the registry
(``watches/registry.py``: the GradScaler wrappers, the ``backward()`` wrapper's counting, ...). Each place where
the user's call enters the doctor runs the part's bookkeeping in ``try``/``except``, never the user's own call, and hands an exception to
:meth:`Guards.failed`: when it is the doctor's own (``process.doctors_own``: anything but a signal handler's
exception or a ``BaseException``), that part is switched off for the rest of the run (its ``off`` callback: its
wrappers put back, its methods made to do nothing, its partial record dropped), the report says so in a note, and
the user's call goes on exactly as it would without the doctor. (``try`` costs nothing in Python 3.11 until it
catches, so the hooks of a loop's every iteration keep their cost.)

:data:`GUARDED` lists them: a part that is not listed cannot be guarded, and the fault-injection test
(``tests/test_watch_faults.py``) breaks each listed one on purpose and checks the user's run is bit-identical.

>>> notes = []
>>> g = Guards(notes)
>>> g.on_stop("precision", lambda: notes.append("(wrappers removed)"))
>>> try:
...     {}["_scale"]
... except Exception as exc:
...     g.failed("precision", exc)
True
>>> g.stopped("precision"), notes[0]
(True, '(wrappers removed)')
>>> notes[1].split(": at")[0], notes[1].split("line 2: ")[1][:15]
('the precision watch (GradScaler and gradient clipping) stopped', "KeyError: '_sca")
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from ..util.process import doctors_own

log = logging.getLogger(__name__)

#: Every part a run can install: name -> (what it is, what the report lacks once it stopped).
GUARDED: dict[str, tuple[str, str]] = {
    "recorder": ("the op recorder", "the ops after that point are not in the trace"),
    "modules": ("the module hooks", "ops after that point are not attributed to modules"),
    "gradients": ("the parameter hooks", "which parameters got gradients after that point is not known"),
    "optimizer": ("the optimizer-step hooks", "optimizer steps and iterations after that point were not counted"),
    "loop": ("the loop watch (loss, gradient norm, learning rate per iteration)",
             "the per-iteration series stop there, and NaN/Inf after that point is seen only by the final checks"),
    "accumulation": ("the accumulation watch (backward() and zero_grad() per optimizer step)",
                     "the gradient-accumulation checks did not run"),
    "precision": ("the precision watch (GradScaler and gradient clipping)", "the mixed-precision checks did not run"),
    "frozen": ("the frozen-parameter watch (values sampled around an optimizer step)",
               "frozen parameters the optimizer changed after that point are not known"),
    "orphans": ("the optimizer-membership watch (parameters no optimizer holds)",
                "modules of a model that no optimizer holds are not known"),
    "schedule": ("the scheduler watch (learning-rate scheduler steps)", "the learning-rate scheduler checks did not run"),
    "sampling": ("the loop sampler", "iterations after that point were recorded (or not) as the one before"),
    "rollback": ("the iteration rollback", "the iteration that went wrong cannot be replayed in detail"),
    "compile": ("the torch.compile watch", "the doctor no longer steps aside while torch.compile compiles"),
    "workers": ("the DataLoader worker watch", "DataLoader workers started after that point are not watched"),
    "collectives": ("the collective log", "collectives after that point are not in this rank's log"),
    "library": ("the library-loop callback", "the library's loop after that point was not watched"),
    "trigger": ("always on's backward() trigger", "always on no longer opens a watch at a backward() it missed"),
}


class Guards:
    """One run's switches: every watch on until its bookkeeping fails once (see the module docstring). ``notes``:
    the trace's notes, which get one line per watch that stopped."""

    def __init__(self, notes: list[str]) -> None:
        self._notes = notes
        self._off: dict[str, list[Callable[[], None]]] = {}
        self._stopped: dict[str, str] = {}

    def on_stop(self, name: str, off: Callable[[], None]) -> None:
        """``off()`` switches watch ``name`` off (called once, when it fails)."""
        if name not in GUARDED:
            raise ValueError(f"unknown part {name!r}: add it to guard.GUARDED")
        self._off.setdefault(name, []).append(off)

    def stopped(self, name: str) -> bool:
        return name in self._stopped

    @property
    def stopped_watches(self) -> dict[str, str]:
        """Watch name -> the error that stopped it."""
        return dict(self._stopped)

    def failed(self, name: str, exc: BaseException) -> bool:
        """Call in the ``except`` clause of watch ``name``'s bookkeeping: True when ``exc`` is the doctor's own (the
        watch is now off and noted; carry on with the user's call), False when the caller must re-raise it (a
        signal handler's exception, Ctrl-C: theirs)."""
        if not doctors_own(exc):
            return False
        if name not in self._stopped:
            self._stop(name, exc)
        return True

    def _stop(self, name: str, exc: BaseException) -> None:
        self._stopped[name] = f"{type(exc).__name__}: {exc}"
        for off in self._off.get(name, ()):
            try:
                off()
            except Exception:  # noqa: BLE001 - switching off must not fail the user's call either
                log.debug("could not switch off the %s watch", name, exc_info=True)
        what, lost = GUARDED.get(name, (f"the {name} watch", "what it records is missing"))
        self._notes.append(f"{what} stopped: {_where(exc)}{type(exc).__name__}: {str(exc).splitlines()[0][:200]} "
                           f"(the doctor's own error: the step ran on as it would without the doctor, and {lost}). "
                           "Please report it.")


def _where(exc: BaseException) -> str:
    """``"at watches/precision.py, line 97: "``: the innermost frame of ``exc``, the doctor's line that failed."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"at {os.path.basename(tb.tb_frame.f_code.co_filename)}, line {tb.tb_lineno}: "


def nothing(*args: object, **kwargs: object) -> None:
    """What a watch's method does once the watch is off."""
    return None


__all__ = ["GUARDED", "Guards", "nothing"]
