"""A diagnosis opened by one event and closed by another: :func:`run_step` for code the doctor cannot wrap.

``run_step`` runs a cell: it calls it, so it knows when it begins and ends. A library's loop is called by
the user, not by the doctor: a ``transformers`` or Lightning callback hears that training began and,
later, that it ended or raised; a notebook cell the doctor did not expect to train is already running
when its first ``backward()`` comes. :class:`OpenDiagnosis` is the same run (engine, capture in the sampled mode,
the loop watch, the hang watchdog, the replay of the iteration where a cell's loop first went
NaN/Inf, the rules, the report) between :meth:`OpenDiagnosis.begin` and :meth:`OpenDiagnosis.end`.

One diagnosis at a time: :meth:`OpenDiagnosis.begin` raises ``RuntimeError`` while another thread diagnoses a
step, and ``active()`` says whether one runs in this process (a callback inside a doctored cell stands
aside: the cell's own run sees its loop).

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2))
>>> watch = OpenDiagnosis({"w": w}, engine="python")
>>> watch.begin()
>>> (w * 2).sum().backward()
>>> report = watch.end()
>>> report.ok, report.trace.op_count > 0
(True, True)
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..capture.open_run import OpenRun
from ..util.process import claim_run, release_run
from ..capture.runner import cell_filename, current_capture, make_capture
from ..report import Report
from ..report.places import Namer
from ..util.loops import training_loop
from .engine import choose_engine, screens_every_op
from .plan import iteration_replay, replayed, rollback_for
from .step import finished_report

log = logging.getLogger(__name__)


def active() -> bool:
    """A diagnosis (a doctored cell, ``diagnose()``, an open watch) is running in this process."""
    return current_capture() is not None


class OpenDiagnosis:
    """What :func:`~backward_doctor.run.step.run_step` does around a cell, for code already running.

    ``namespace``: what names the modules and optimizers and counts the memory there before (a callback
    passes ``{"model": ..., "optimizer": ...}``); ``source``/``cell_file``: the cell being watched, when
    there is one (its loop's iteration can then be replayed); ``timeout``: seconds without a completed
    optimizer step before the run counts as hung (``stall=False``: seconds from :meth:`begin`);
    ``build``: whether the native recorder may be built now (~40 s once); ``find_body``: for a library's loop,
    a function asked when an unrecorded iteration goes NaN/Inf or raises, for a function that runs that
    iteration's step again (``run/iteration_replay.py``). Other arguments as ``run_step``.
    """

    def __init__(self, namespace: dict[str, Any], *, source: str = "", cell_file: str | None = None,
                 timeout: float | None = None, memory_limit: int | None = None, engine: str = "auto",
                 every_iteration: bool = False, places: Namer | None = None, build: bool = False,
                 stall: bool = True, find_body: Callable[[], Callable[[], Any] | None] | None = None,
                 library: str = "") -> None:
        self.namespace = namespace
        self.timeout = timeout
        self._engine_asked = engine
        self._places = places
        self._claimed = False
        self.engine = choose_engine(engine, memory_limit=memory_limit, build=build)
        detail = screens_every_op()
        # The iteration where NaN/Inf first showed, unrecorded, is replayed alone (``plan.py``, as ``run_step``
        # decides it): the body of the cell's loop, or a library's step (``find_body``, asked then: its batch bound in).
        kind = iteration_replay(self.engine, detail=detail, every_iteration=every_iteration, memory_limit=memory_limit,
                                wanted=find_body is not None or training_loop(source) is not None)
        self.rollback = rollback_for(kind, source, namespace, find_body)
        capture = make_capture(self.engine, namespace, cell_file=cell_file or cell_filename(), source=source,
                               memory_limit=memory_limit, detail=detail, every_iteration=every_iteration,
                               watching=True)
        capture.rollback = self.rollback
        if library:  # a library's own loop, seen from its callback: its iterations are numbered from the first
            capture.trace.iterations.library = library
        self._run = OpenRun(capture, timeout, stall=stall)

    # ---------------------------------------------------------------- the two events
    def begin(self) -> None:
        """Start watching (the capture installed, the watchdog armed). ``RuntimeError`` when another thread
        is diagnosing a step; nothing is installed then."""
        claim_run()
        try:
            self._run.open()
        except BaseException:
            release_run()
            raise
        self._claimed = True

    def end(self, exc: BaseException | None = None) -> Report:
        """Stop watching and diagnose what ran (``exc``: the exception the watched code ended with)."""
        try:
            trace = self._run.close(exc)
        finally:
            self._release()
        trace = replayed(trace, self.rollback, self.namespace, timeout=self.timeout, engine=self.engine)
        self.rollback = None
        return finished_report(trace, self.namespace, places=self._places, engine_asked=self._engine_asked)

    def abandon(self) -> None:
        """Uninstall what is still installed and release the run, without a report: a frontend calls it when
        :meth:`end` failed (the doctor's own error), so that no capture outlives the training it watched."""
        try:
            self._run.abandon()
        except Exception:  # noqa: BLE001 - already the doctor's failure: said in the log, never raised on
            log.warning("backward_doctor: the watch could not be uninstalled cleanly", exc_info=True)
        finally:
            self.rollback = None
            self._release()

    def _release(self) -> None:
        """Let another diagnosis run (once: ``end`` and ``abandon`` may both come)."""
        if self._claimed:
            self._claimed = False
            release_run()

    # ---------------------------------------------------------------- while it runs
    @property
    def is_open(self) -> bool:
        return self._run.is_open

    @property
    def steps(self) -> int:
        """Optimizer steps (iterations) seen so far."""
        return self._run.capture.trace.iterations.steps

    @property
    def first_nonfinite(self) -> int | None:
        """The iteration whose loss or gradients first held NaN/Inf (None: none so far). A plain read: cheap
        enough for every step of a callback."""
        return self._run.capture.trace.iterations.first_nonfinite


__all__ = ["OpenDiagnosis", "active"]
