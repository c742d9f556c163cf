"""``%backward_doctor on``: every later cell that trains is watched, and the diagnosis is already there the
first time one fails.

While on, the shell's ``run_cell`` is wrapped (an instance attribute) and ``torch.autograd.backward`` replaced
by a trigger (``cell_watch.BackwardTrigger``), armed except while a watched cell runs; ``off`` puts both back.

- a cell that will train, by a guess from its text and the code of the notebook functions it calls
  (``frontends/trains.py``, microseconds), runs under :func:`~backward_doctor.run.step.run_step` exactly as
  ``%%backward_doctor`` runs it (a loop sampled, every iteration's loss, gradient norm and memory watched,
  the iteration where NaN/Inf first showed replayed from the state kept at its start), the timeout
  counted from the latest optimizer step;
- any other cell runs as it is. Nothing is installed, nothing is recorded: a cell that calls no
  ``backward()`` pays for the guess; run again, a cell decided by its text (no call, ``x = 1``) or by its
  text and its names being data (``n = len(x)``) pays for a dictionary lookup and those names' types. A
  ``backward()`` the guess did not expect finds the cell itself (IPython's ``ExecutionResult`` of the cell
  running, which knows its text) and opens a :class:`~backward_doctor.run.open_diagnosis.OpenDiagnosis` there,
  for the rest of the cell, ended by IPython's ``post_run_cell`` event for that cell (no cell pays for arming the trigger).

When a watched cell fails (an exception after the step began, NaN/Inf in the loss or weights, a hang
past ``--timeout``, a Ctrl-C, an OOM) the report (the panel in Jupyter) is displayed, then IPython's
traceback: the traceback is held back while the cell runs and shown after the report. When it succeeds
nothing is shown, or one quiet line when something silent was found (a leak, stale gradients, starved
parameters). ``bd.last_report()`` always has the latest watched cell's report; nothing else of the cell
is kept (the previous report is replaced, the state kept for a replay released).
"""
from __future__ import annotations

import functools
import logging
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..util.process import doctors_own, one_run_at_a_time
from ..capture.runner import running_captures
from .trains import INERT, is_data, might_train, names_of
from ..report import Report
from ..run.engine import choose_engine
from ..run.step import run_step
from ..run.open_diagnosis import OpenDiagnosis
from .magic import _release_failed_frames, _show, ipython_places
from ..util.units import format_bytes
from .cell_watch import BackwardTrigger, HeldTracebacks, Outer, failed
from .deliver import deliver

log = logging.getLogger(__name__)
_DOCTOR_MAGIC = ("%%backward_doctor", "%backward_doctor")
#: what a cell must contain to run anything that could train: a call, a decorator, a magic or a shell escape
_CALLS = re.compile(r"[(@%!]")
_search, _get_ident = _CALLS.search, threading.get_ident
_DATA_CELLS, _DATA_CELL_CHARS = 256, 2000  # cells' texts kept by the installed wrapper: at most ~0.5 MB


@dataclass
class Options:
    """What ``%backward_doctor on`` was given (the cell magic's options that apply to every cell)."""

    timeout: float | None = None
    memory_limit: int | None = None
    quiet: bool = False
    engine: str = "auto"
    every_iteration: bool = False

    def words(self) -> str:
        """The options in words, for ``status``.

        >>> Options(timeout=60.0).words()
        'timeout 60 s from the latest optimizer step'
        """
        bits = [f"timeout {self.timeout:g} s from the latest optimizer step" if self.timeout else "",
                f"memory limit {format_bytes(self.memory_limit)}" if self.memory_limit else "",
                "quiet" if self.quiet else "", f"engine {self.engine}" if self.engine != "auto" else "",
                "every iteration recorded" if self.every_iteration else ""]
        return ", ".join(b for b in bits if b) or "default options"


class AlwaysOn:
    """The wrapper of one shell's ``run_cell`` (see the module docstring)."""

    def __init__(self, shell: Any, options: Options) -> None:
        self.shell = shell
        self.options = options
        self.watched = 0
        self.last: Report | None = None  # (the latest watched cell's report: strings and numbers)
        self._depth = 0
        self._original: Callable[..., Any] | None = None
        self._trigger = BackwardTrigger()
        self._running: Any = None  # (the ExecutionResult of the cell whose backward() opened a watch)
        self._opened: dict[str, Any] = {}  # (what that watch opened with)
        self._main = threading.main_thread().ident  # (the thread cells run in; a fixed number while it lives)
        self._data_cells: dict[str, tuple[str, ...]] = {}  # a cell's text -> its names (see install, _remember)
        self._open = self._open_at  # (bound once: what the trigger is armed with)

    # ---------------------------------------------------------------- on / off
    def install(self) -> None:
        original = self._original = self.shell.run_cell
        shell, method, data_cells, remember = self.shell, self.run_cell, self._data_cells, self._remember

        @functools.wraps(original)
        def run_cell(raw_cell: str, *args: Any, **kwargs: Any) -> Any:
            # A cell that ran before and was decided by its text alone (no call: `x = 1`), or by its text and
            # its names being data (`n = len(x)`): the same decision in as little as can be (~2% of such a
            # cell's time is the budget; in IPython's wake every object made and every call costs 0.3-1% of it,
            # measured: no regex search, no bound method, trains.is_data written out, not called). It runs as
            # it is, whether nested, silent or in another thread: the trigger asks those at a backward().
            names = data_cells.get(raw_cell) if type(raw_cell) is str else None
            if names is not None:
                ns = shell.user_ns
                for name in names:
                    if type(ns.get(name)) not in INERT:
                        break
                else:
                    return original(raw_cell, *args, **kwargs)
            elif type(raw_cell) is str and not _search(raw_cell):  # (the commonest cell: no call, passed on)
                remember(raw_cell, ())
                return original(raw_cell, *args, **kwargs)
            return method(raw_cell, *args, **kwargs)

        run_cell.__backward_doctor__ = self  # type: ignore[attr-defined]
        self._trigger.install()
        self._trigger.arm(self._open)
        self.shell.run_cell = run_cell

    def uninstall(self) -> None:
        if getattr(vars(self.shell).get("run_cell"), "__backward_doctor__", None) is self:
            del self.shell.run_cell  # the class's own method again
        self._trigger.uninstall()  # (a watch a cell opened is still ended, and its report shown, at its end)

    # ---------------------------------------------------------------- each cell
    def run_cell(self, raw_cell: str, *args: Any, **kwargs: Any) -> Any:
        if (self._depth or type(raw_cell) is not str or not _search(raw_cell)
                or (args[1] if len(args) > 1 else kwargs.get("silent")) or _get_ident() != self._main
                or running_captures):
            # No call, no magic, no shell command (`x = 1`, `loss`): nothing that could train runs, so not even
            # the guess (a cell like this costs ~100 us in IPython: the guess would be 5%). A nested run (the
            # cell magic's own), a silent request, another thread's, a diagnosis already running: the cell as
            # it is (the trigger passes their backward() on).
            return self._original(raw_cell, *args, **kwargs)
        if raw_cell.lstrip().startswith(_DOCTOR_MAGIC):  # (it wins: the trigger stays out of its way)
            return self._unarmed(lambda: self._original(raw_cell, *args, **kwargs))
        ns = self.shell.user_ns
        try:
            trains = might_train(raw_cell, ns)
        except Exception as exc:  # (the guess's own failure: the cell runs as it is; the trigger still watches)
            if not doctors_own(exc):
                raise
            return self._original(raw_cell, *args, **kwargs)
        if not trains:
            names = names_of(raw_cell)
            if names is not None and is_data(names, ns):
                # (decided by its text and its names' types alone, might_train's first test: the installed
                # wrapper tests those next time, once per cell's text asked here)
                self._remember(raw_cell, names)
            return self._original(raw_cell, *args, **kwargs)
        self._depth += 1
        try:
            return self._unarmed(lambda: self._watched(raw_cell, args, kwargs))
        finally:
            self._depth -= 1

    def _remember(self, raw_cell: str, names: tuple[str, ...]) -> None:
        """Keep a cell decided by its text (and ``names`` being data) for the installed wrapper (not a long one)."""
        if len(raw_cell) <= _DATA_CELL_CHARS:
            if len(self._data_cells) >= _DATA_CELLS:
                self._data_cells.clear()
            self._data_cells[raw_cell] = names

    def _unarmed(self, run: Callable[[], Any]) -> Any:
        """``run()`` with the trigger paused (out of every iteration: the cell's capture records them), then armed."""
        self._trigger.pause()
        try:
            return run()
        finally:
            self._trigger.resume(self._open)

    def _cell_file(self, raw_cell: str, number: int) -> tuple[str, str]:
        """(the cell as Python, the file name ``run_cell`` compiles it under)."""
        shell = self.shell
        source = shell.transform_cell(raw_cell)
        return source, shell.compile.get_code_name(raw_cell, source, number)

    def _watched(self, raw_cell: str, args: tuple, kwargs: dict) -> Any:
        """The cell under ``run_step``, as ``%%backward_doctor`` runs it."""
        shell, opts = self.shell, self.options
        number = shell.execution_count
        try:
            source, filename = self._cell_file(raw_cell, number)
            engine = choose_engine(opts.engine, memory_limit=opts.memory_limit, build=False)
        except Exception:  # noqa: BLE001 - IPython reports a cell it cannot transform; run it as it is
            log.debug("always on: the cell could not be prepared; it runs unwatched", exc_info=True)
            return self._original(raw_cell, *args, **kwargs)
        box: list[Any] = []

        def execute() -> BaseException | None:
            try:
                result = self._original(raw_cell, *args, **kwargs)
            except BaseException as exc:  # (IPython's own machinery raised: it goes on after the report)
                box.append(exc)
                raise
            box.append(result)
            return result.error_in_exec

        guard = one_run_at_a_time()
        try:
            guard.__enter__()
        except RuntimeError:  # a fix runs in the panel's thread: this cell runs as it is
            return self._original(raw_cell, *args, **kwargs)
        held = HeldTracebacks(shell)
        try:
            with held:
                report = run_step(source, shell.user_ns, timeout=opts.timeout, memory_limit=opts.memory_limit,
                                  engine=engine, rollback=True, cell_file=filename, execute=execute,
                                  build=False, every_iteration=opts.every_iteration, stall=True, budget=True,
                                  places=ipython_places(shell, filename, number))
        except BaseException as exc:
            held.show()  # a Ctrl-C in the doctor's own code: the user's traceback all the same
            if not doctors_own(exc):
                raise
            # The doctor's own error: the cell's outcome stands (run now as it is, if it had not run yet).
            log.warning("always on: no report for this cell (the doctor's own error)", exc_info=True)
            if not box:
                return self._original(raw_cell, *args, **kwargs)
            report = None
        finally:
            guard.__exit__(None, None, None)
        result = box[0] if box else RuntimeError("backward_doctor: the cell did not run")
        if isinstance(result, BaseException):  # IPython's own machinery raised: as it would have without us
            held.show()
            raise result
        if report is not None:
            self._after(report, source, held, result)
        return result

    def _open_at(self, frame: Any) -> OpenDiagnosis | None:
        """The watch a cell not expected to train opens at its first ``backward()`` (``frame``, its caller), or
        None: no cell running (a widget's callback), another thread's, a silent run, a diagnosis records it."""
        if _get_ident() != self._main or running_captures:  # (a training thread's backward: asked at each)
            return None
        shell, opts = self.shell, self.options
        outer = getattr(shell.displayhook, "exec_result", None)  # (IPython's result of the cell running)
        info = getattr(outer, "info", None)
        raw_cell = getattr(info, "raw_cell", None)
        if not isinstance(raw_cell, str) or getattr(info, "silent", False):
            return None
        if self._running is None:  # (its end: IPython's post_run_cell for this result, see _cell_ended)
            self._running = outer
            shell.events.register("post_run_cell", self._cell_ended)
        opened = self._opened = {}
        number = getattr(outer, "execution_count", None)  # (the cell's number: its result knows it)
        number = number if isinstance(number, int) else shell.execution_count
        source, filename = self._cell_file(raw_cell, number)
        while frame is not None and frame.f_code.co_filename != filename:
            frame = frame.f_back
        opened.update(source=source, file=filename, line=frame.f_lineno if frame is not None else None)
        del frame
        watch = OpenDiagnosis(shell.user_ns, source=source, cell_file=filename, timeout=opts.timeout,
                      memory_limit=opts.memory_limit, engine=opts.engine, every_iteration=opts.every_iteration,
                      places=ipython_places(shell, filename, number))
        held = opened["held"] = HeldTracebacks(shell).__enter__()  # (from here: a traceback waits for the report)
        try:
            watch.begin()
        except BaseException:
            held.restore()
            raise
        return watch

    def _cell_ended(self, result: Any = None) -> None:
        """IPython's ``post_run_cell``: when the cell whose ``backward()`` opened a watch ends (not a cell it ran
        itself), the watch ends, its report shows (as a watched cell's), then the held traceback; the trigger
        is armed again. ``result`` is None when IPython's own machinery raised (it goes on after this); when it
        raised in the watched cell and left its result in place, the next cell's end (not its run) ends it."""
        if result is not None and result is not self._running:
            frame, file = sys._getframe(1), self._opened.get("file")
            while frame is not None and frame.f_code.co_filename != file:
                frame = frame.f_back
            if frame is not None:  # (a cell the watched one runs itself)
                return
        self.shell.events.unregister("post_run_cell", self._cell_ended)
        self._running = None
        watch = self._trigger.disarm()
        self._trigger.arm(self._open)  # (nothing when `off` ran in between)
        if watch is None:  # (the watch could not begin: the trigger said so)
            return
        opened = self._opened
        try:
            report = watch.end(None if result is None else result.error_in_exec)
        except Exception as exc:  # (the doctor's own failure: the cell's outcome and traceback stand)
            watch.abandon()
            if not doctors_own(exc):
                raise
            log.warning("always on: no report for this cell (the doctor's own error)", exc_info=True)
            print(f"backward_doctor: no report for this cell (the doctor's own error: {type(exc).__name__}: "
                  f"{exc})", file=sys.stderr)
            opened["held"].show()
            return
        if result is None:
            opened["held"].show()
            return
        report.trace.notes.append(f"always on: the watch began at the cell's first backward() (line "
                                  f"{opened.get('line')}); what ran before it was not recorded")
        self._after(report, opened.get("source", ""), opened["held"], result)

    def _after(self, report: Report, source: str, held: HeldTracebacks, result: Any) -> None:
        """The report when the cell failed, one quiet line when it found something silent; then the held
        traceback."""
        self.watched += 1
        self.last = report
        opts = self.options
        try:
            # (a fix button only where it can be applied; the quiet line in the cell's output, not on stderr)
            deliver(report, lambda shown, _: _show(self.shell, shown, source, opts.memory_limit, opts.timeout),
                    quiet=opts.quiet, offers=(source, self.shell.user_ns), quiet_to=sys.stdout)
        except Exception:  # noqa: BLE001 - never lose the user's traceback to the report
            log.warning("always on: the report could not be shown", exc_info=True)
        held.show()
        if report.trace.exception is not None and report.trace.exception.type == "OutOfMemoryError":
            _release_failed_frames(Outer(result))

    def status(self) -> str:
        last = ""
        if self.last is not None:
            last = f"; the latest: {'a problem' if failed(self.last) else 'nothing found' if self.last.ok else 'a finding'}"
        from .. import native

        recorder = ("the native recorder" if native.ready() is not None and self.options.engine != "python" else
                    "the Python recorder until the native one is built" if native.status()["building"] else
                    "the Python recorder")
        return (f"backward_doctor: always on ({self.options.words()}); {self.watched} cell"
                f"{'s' if self.watched != 1 else ''} watched{last}; recording with {recorder}")


def turn_on(shell: Any, options: Options) -> AlwaysOn:
    """Wrap ``shell.run_cell`` (replacing an earlier ``on``'s options; the cells it watched and its latest report
    stay: ``on`` while on changes the options, ``off`` then ``on`` starts anew)."""
    before = current(shell)
    turn_off(shell)
    on = AlwaysOn(shell, options)
    if before is not None:
        on.watched, on.last = before.watched, before.last
    on.install()
    return on


def turn_off(shell: Any) -> bool:
    """Put the shell's own ``run_cell`` back; True when always-on was on."""
    on = current(shell)
    if on is None:
        return False
    on.uninstall()
    return True


def current(shell: Any) -> AlwaysOn | None:
    """The shell's always-on wrapper, if it is on."""
    return getattr(vars(shell).get("run_cell"), "__backward_doctor__", None)


__all__ = ["AlwaysOn", "Options", "turn_on", "turn_off", "current"]
