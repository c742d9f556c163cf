"""What the library callbacks share: one watch across a library's training run, the report written when it
fails or goes NaN/Inf, and the run stopped at the first non-finite loss when asked.

:class:`LoopDoctor` is told that training began (with the model and optimizer the library holds), asked
after each optimizer step whether to stop, and told how training ended. It runs an
:class:`~backward_doctor.run.open_diagnosis.OpenDiagnosis` (the sampled recorder, every iteration's loss, gradient
norm and memory, the hang watchdog) in between. When a diagnosis already runs in the process (``%backward_doctor
on``, ``%%backward_doctor``, ``diagnose()``: the cell holding ``trainer.train()`` is watched) it stands
aside: that run sees the same loop, and the callback only stops training at the first NaN/Inf.

A library may never say that training ended: ``transformers`` has no callback for an exception. Then the
watch is closed, and the report made, at the first of: the library's own end, the next training run's
start, the end of the notebook cell (IPython's ``post_run_cell``), the script's uncaught exception
(``sys.excepthook``) or the interpreter's exit; until then its hooks stay installed.

>>> LoopDoctor(on_nonfinite="never")
Traceback (most recent call last):
ValueError: on_nonfinite must be 'stop' or 'continue', not 'never'
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Any, Callable

from ..api import check_options
from ..util.process import doctors_own
from ..capture.runner import current_capture
from ..frontends.deliver import deliver
from ..report import Report
from ..report.places import Namer, cell_code_names
from ..run.step import remember
from ..run.open_diagnosis import OpenDiagnosis, active

log = logging.getLogger(__name__)
_open: list["LoopDoctor"] = []  # doctors whose watch is open (the ends a library may never announce)


class LoopDoctor:
    """One library training run watched (see the module docstring). ``output_dir``: where the report goes
    (None: the library's own output directory); ``on_nonfinite``: ``"stop"`` training at the end of the
    optimizer step whose loss or gradients were first NaN/Inf, or ``"continue"``; ``timeout``: seconds
    without a completed optimizer step before the run counts as hung and is interrupted."""

    def __init__(self, output_dir: str | os.PathLike | None = None, *, on_nonfinite: str = "stop",
                 timeout: float | None = None, memory_limit: int | str | None = None, engine: str = "auto",
                 every_iteration: bool = False, quiet: bool = False) -> None:
        if on_nonfinite not in ("stop", "continue"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'continue', not {on_nonfinite!r}")
        self.output_dir = None if output_dir is None else os.fspath(output_dir)
        self.on_nonfinite = on_nonfinite
        opts = check_options(timeout=timeout, memory_limit=memory_limit, engine=engine,
                             every_iteration=every_iteration)
        self.timeout, self.memory_limit, self.engine = opts.timeout, opts.memory_limit, opts.engine
        self.every_iteration = opts.every_iteration
        self.quiet = bool(quiet)
        self.report: Report | None = None   # the latest run's report
        self.written: list[str] = []        # the files it was written to
        self._watch: OpenDiagnosis | None = None
        self._aside = False
        self._folder: str | None = None
        self._hooks: list[Any] = []
        self._cleanup: Callable[[], None] | None = None
        #: the report's advice on the fixes its findings name (the library's knobs and where they are built)
        self.advise: Callable[[Report], dict[str, str]] | None = None

    # ---------------------------------------------------------------- the library's events
    def begin(self, namespace: dict[str, Any], output_dir: str | None = None, cell_file: str | None = None,
              find_body: Callable[[], Callable[[], Any] | None] | None = None,
              cleanup: Callable[[], None] | None = None, library: str = "") -> None:
        """Training began: watch it. ``namespace`` names the model and optimizer (``{"model": ...}``);
        ``find_body``: how to run the current iteration's step again (the replay of the iteration that
        first went NaN/Inf, see :class:`~backward_doctor.run.open_diagnosis.OpenDiagnosis`); ``cleanup``: what to
        undo when the watch ends (a wrapper the callback put on the library's objects); ``library``: whose loop it is
        (``"transformers"``, ``"lightning"``: findings then carry their iteration, the first one too)."""
        for other in list(_open):  # a run whose end was never announced (it raised, caught) ends here
            other.end(None, unannounced="when the next training run began")
        self._folder = self.output_dir or output_dir or os.getcwd()
        self.report, self.written = None, []
        self._aside = active()
        if self._aside:
            if cleanup is not None:
                cleanup()
            return
        self._cleanup = cleanup
        try:
            watch = OpenDiagnosis(namespace, cell_file=cell_file or _main_file(), timeout=self.timeout,
                          memory_limit=self.memory_limit, engine=self.engine, every_iteration=self.every_iteration,
                          build=True, stall=True, find_body=find_body, library=library, places=_cell_names())
            watch.begin()
        except Exception as exc:  # noqa: BLE001 - never the reason training fails: it runs unwatched
            self._undo_cleanup()
            print(f"backward_doctor: this training run is not watched ({exc})", file=sys.stderr)
            return
        except BaseException:
            self._undo_cleanup()
            raise
        self._watch = watch
        _open.append(self)
        self._arm_fallbacks()

    def should_stop(self) -> bool:
        """After an optimizer step: whether training should stop now (NaN/Inf seen, ``on_nonfinite="stop"``)."""
        if self.on_nonfinite != "stop":
            return False
        try:
            if self._watch is not None:
                return self._watch.first_nonfinite is not None
            cap = current_capture() if self._aside else None  # (standing aside: the running diagnosis's watch)
            return cap is not None and cap.trace.iterations.first_nonfinite is not None
        except Exception as exc:  # (the doctor's own failure: training goes on as it would without it)
            if not doctors_own(exc):
                raise
            return False

    def end(self, exc: BaseException | None = None, unannounced: str = "") -> Report | None:
        """Training ended (``exc``: what it raised). The report, written when training failed or went
        NaN/Inf; None when nothing was watched (standing aside, or already ended). ``unannounced``: when the
        library never said that training ended, when the watch was closed instead (said in the report)."""
        watch, self._watch = self._watch, None
        self._aside = False
        if watch is None:
            return None
        if self in _open:
            _open.remove(self)
        self._disarm_fallbacks()
        try:
            report = self.report = remember(watch.end(exc))
        except Exception as own:  # (the doctor's own failure: never the training's, whose outcome stands)
            watch.abandon()  # (no capture outlives the training, whatever end() left installed)
            if not doctors_own(own):
                raise
            print(f"backward_doctor: no report for this training run (the doctor's own error: "
                  f"{type(own).__name__}: {own}); the training ran as it would without the doctor", file=sys.stderr)
            return None
        finally:
            self._undo_cleanup()
        if unannounced:
            report.trace.notes.append(f"the library did not say how its training ended (it raised, and the "
                                      f"exception was caught, or it was abandoned): the watch was closed "
                                      f"{unannounced}")
        try:
            if self.advise is not None and report.findings:
                report.fix_offers = self.advise(report)
            self._tell(report)
        except Exception:  # noqa: BLE001 - the training's own outcome must not be lost to the report
            log.warning("backward_doctor: the report could not be written", exc_info=True)
        return report

    def _undo_cleanup(self) -> None:
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup()

    @property
    def watching(self) -> bool:
        return self._watch is not None

    # ---------------------------------------------------------------- the report
    def _tell(self, report: Report) -> None:
        """A failed run's report written to the output folder and shown whatever happens to the files
        (``frontends/deliver.py``); one line for a silent finding."""
        self.written = deliver(report, _show, folder=self._folder or os.getcwd(), quiet=self.quiet)

    # ---------------------------------------------------------------- ends never announced
    def _arm_fallbacks(self) -> None:
        hook = sys.excepthook

        def excepthook(etype: Any, value: Any, tb: Any) -> Any:
            self.end(value)
            return hook(etype, value, tb)

        sys.excepthook = excepthook
        self._hooks = [("excepthook", hook, excepthook)]
        shell = _ipython()
        if shell is not None:
            def post_run_cell(result: Any) -> None:
                self.end(getattr(result, "error_in_exec", None))

            shell.events.register("post_run_cell", post_run_cell)
            self._hooks.append(("post_run_cell", shell, post_run_cell))

    def _disarm_fallbacks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for kind, old, new in hooks:
            if kind == "excepthook":
                if sys.excepthook is new:
                    sys.excepthook = old
            else:
                try:
                    old.events.unregister("post_run_cell", new)
                except ValueError:  # (already gone)
                    pass


def _show(report: Report, footer: str) -> None:
    """The report where the user looks: displayed in a notebook, on stderr in a script."""
    shell = _ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        from IPython.display import display

        display(report)
        print(footer, file=sys.stderr)
        return
    print(f"{report}\n{footer}", file=sys.stderr, flush=True)


def _ipython() -> Any:
    """The running IPython shell, if this is one (without importing IPython otherwise)."""
    mod = sys.modules.get("IPython")
    get = getattr(mod, "get_ipython", None)
    return get() if get is not None else None


def _main_file() -> str | None:
    """The script being run (``python train.py``): its lines are the "cell" of the report."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(path) if isinstance(path, str) and path.endswith(".py") else None


def _cell_names() -> Namer | None:
    """In IPython (a callback on a notebook's training): code of a cell is named as IPython's tracebacks and the
    magic name it (``Cell In[2]``), not by its temporary file; None elsewhere (a script names its own file).

    >>> _cell_names() is None or callable(_cell_names())
    True
    """
    return cell_code_names(_ipython())


@atexit.register
def _at_exit() -> None:
    for doctor in list(_open):
        doctor.end(None, unannounced="when the interpreter exited")


__all__ = ["LoopDoctor"]
