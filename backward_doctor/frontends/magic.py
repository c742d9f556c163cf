"""``%%backward_doctor``: run a cell through the shell and diagnose it.

Loaded lazily by ``%load_ext backward_doctor``; this is the only module of the
core that imports IPython. The cell runs with ``shell.run_cell`` so variables,
traceback, ``Out[]`` and history are exactly those of a normal run; the report
is displayed after it (HTML in Jupyter, text in a terminal). In Jupyter a placeholder is displayed
first and replaced by the report (``running.py``), so the verdict sits above the cell's traceback.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from typing import Any, Callable, Iterator

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.display import display

from ..api import check_options
from ..util.process import doctors_own, one_run_at_a_time
from ..capture.runner import running_progress
from ..run.engine import ENGINES, choose_engine, python_tier_reason
from ..report.places import cell_code_names, name_places
from ..run.step import remember, run_step
from .running import RunningNotice, doctor_frames_hidden

log = logging.getLogger(__name__)


@magics_class
class BackwardDoctorMagics(Magics):
    """Magics of backward_doctor."""

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--timeout", type=float, default=None, metavar="S",
                              help="seconds before the step counts as a hang and is interrupted")
    @magic_arguments.argument("--memory-limit", default=None, metavar="SIZE",
                              help="simulated device capacity, e.g. 300MB or 2GiB")
    @magic_arguments.argument("--fix", default=None, metavar="NAME",
                              help="re-run with a fix: accumulate[:k], amp, sync, checkpoint")
    @magic_arguments.argument("--no-rollback", action="store_true",
                              help="with --fix: do not restore the training state between the original and fixed runs")
    @magic_arguments.argument("--quiet", action="store_true", help="do not display the report when all is well")
    @magic_arguments.argument("--every-iteration", action="store_true",
                              help="record every iteration of a training loop (default: 0, 1, 2 and powers of two)")
    @magic_arguments.argument("--nproc", type=int, default=None, metavar="N",
                              help="run the cell on N local ranks forked from the kernel (torch.distributed: "
                                   "the cell calls init_process_group); one report for all ranks")
    @magic_arguments.argument("--memory-snapshot", default=None, metavar="PATH",
                              help="also write a memory snapshot (pickle) to PATH: open it at pytorch.org/memory_viz")
    @magic_arguments.argument("--trace", default=None, metavar="PATH",
                              help="also write a Chrome/Perfetto trace (JSON) to PATH: open it at ui.perfetto.dev")
    @magic_arguments.argument("--engine", default="auto", metavar="NAME",
                              help=f"what records the ops: {', '.join(ENGINES)} (default auto: the native "
                                   "recorder when it is built, else the Python dispatch mode)")
    @cell_magic
    def backward_doctor(self, line: str, cell: str) -> None:
        """Run the cell as usual while capturing its training step, then show a diagnosis.

        Example::

            %%backward_doctor --memory-limit 2GiB
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()

        The report is also available as ``backward_doctor.last_report()``.
        """
        args = magic_arguments.parse_argstring(self.backward_doctor, line)
        try:
            opts = check_options(timeout=args.timeout, memory_limit=args.memory_limit, fix=args.fix,
                                 engine=args.engine, nproc=args.nproc)
            timeout, limit = opts.timeout, opts.memory_limit
            engine = choose_engine(opts.engine, memory_limit=limit, build=False)
            check_export_paths(args.memory_snapshot, args.trace)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        with _exclusive():
            if args.nproc is not None:
                self._run_ranks(args, cell, timeout, engine, limit)
            else:
                self._run(args, cell, timeout, limit, engine)

    def _run_ranks(self, args: Any, cell: str, timeout: float | None, engine: str, limit: int | None) -> None:
        """``--nproc N``: the cell on N ranks forked from the kernel (``fork_ranks.py``); the combined report
        (``--memory-limit``: each rank's simulated device)."""
        from .fork_ranks import launch_cell

        try:
            report = launch_cell(cell, self.shell.user_ns, args.nproc, timeout=timeout, engine=engine,
                                 every_iteration=args.every_iteration, memory_limit=limit)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        remember(report)  # type: ignore[arg-type]  (bd.last_report(): the combined report)
        _export(report, args)
        if not (args.quiet and report.ok):
            display(report)

    def _run(self, args: Any, cell: str, timeout: float | None, limit: int | None, engine: str) -> None:
        shell = self.shell
        self._cell_ran = False
        # In Jupyter the report's place is taken before the cell runs, so it ends above the traceback.
        notice = RunningNotice(display, running_progress) if _in_kernel(shell) else None
        tracebacks: list[int] = []  # one entry per traceback IPython drew while the cell ran

        def before_traceback() -> None:
            tracebacks.append(1)
            _number_cell(shell, filename, number)
        try:
            with contextlib.ExitStack() as stack:
                if notice is not None:
                    stack.enter_context(notice)
                number = _cell_number(shell)
                filename = shell.compile.get_code_name(cell, shell.transform_cell(cell), shell.execution_count)
                stack.enter_context(doctor_frames_hidden(shell, before=before_traceback))
                if args.fix is not None:
                    report = _run_with_fix(shell, cell, args.fix, timeout, limit, not args.no_rollback)
                    name_places(report, shell.user_ns, ipython_places(shell, filename, number))
                else:
                    report = self._run_cell(args, cell, timeout, limit, engine, filename, number)
                _number_cell(shell, filename, number)  # functions defined here are "Cell In[N]" in later tracebacks
        except BaseException as exc:  # a Ctrl-C in the doctor's own code: say so where the report would be
            if notice is not None:
                notice.say(f"backward_doctor: no report ({type(exc).__name__} before it was made)")
            if not doctors_own(exc) or args.fix is not None:
                raise
            # The doctor's own error: the cell's outcome stands (it runs now, as it is, if it had not run yet).
            print(f"backward_doctor: no report (the doctor's own error: {type(exc).__name__}: {exc})", file=sys.stderr)
            if not self._cell_ran:
                shell.run_cell(cell, store_history=False)
            return None
        _export(report, args)
        if args.quiet and report.ok:
            if notice is not None:
                notice.say("")  # --quiet: the placeholder goes, nothing takes its place
            return None
        if notice is not None and not tracebacks:
            # No traceback to stay above: the report follows what the cell printed, as always on shows it
            # (replacing the placeholder would put the panel above the cell's own output). A kernel cannot
            # remove one output of a cell, so the placeholder is left empty.
            notice.say("")
            notice = None
        _show(shell, report, cell, limit, timeout, notice)
        return None

    def _run_cell(self, args: Any, cell: str, timeout: float | None, limit: int | None, engine: str,
                  filename: str, number: int) -> Any:
        """Run the cell through ``run_cell`` under the capture. ``filename``: the name ``run_cell`` gives the
        cell's code (so frames map to its lines); ``number``: its ``In[N]``."""
        shell = self.shell
        # The result of the cell that holds this magic: the inner run_cell's error is
        # copied onto it so Jupyter marks the cell failed (and "Run All" stops), as usual.
        outer = getattr(shell.displayhook, "exec_result", None)

        def run() -> BaseException | None:
            self._cell_ran = True
            result = shell.run_cell(cell, store_history=False)
            error = result.error_in_exec or result.error_before_exec
            if outer is not None:
                outer.result = result.result
                if error is not None:
                    outer.error_in_exec = error
            return error

        report = run_step(cell, shell.user_ns, timeout=timeout, memory_limit=limit, engine=engine,
                          rollback=not args.no_rollback, cell_file=filename, execute=run, build=False, fix=args.fix,
                          every_iteration=args.every_iteration, places=ipython_places(shell, filename, number))
        if args.engine == "auto" and report.trace.engine == "python":
            report.engine_note = python_tier_reason()
        from ..fixes.offers import check_offers

        check_offers(report, cell, shell.user_ns)  # a fix button only where the fix can be applied
        if report.trace.exception is not None and report.trace.exception.type == "OutOfMemoryError":
            _release_failed_frames(outer)
        return report


def _cell_number(shell: Any) -> int:
    """The ``In[N]`` of the cell holding the magic. IPython counts the cell up as it starts, so during it
    ``shell.execution_count`` is already the next cell's number; the cell's own result knows its number."""
    outer = getattr(shell.displayhook, "exec_result", None)
    number = getattr(outer, "execution_count", None)
    return number if isinstance(number, int) else shell.execution_count


def _number_cell(shell: Any, filename: str, number: int) -> None:
    """Make IPython call the cell's code ``Cell In[number]`` (the inner ``run_cell`` numbered it as the next
    cell: the "Cell In[9] under prompt [8]" of tracebacks)."""
    names = getattr(shell.compile, "_filename_map", None)
    if isinstance(names, dict) and filename in names:
        names[filename] = number


def ipython_places(shell: Any, filename: str, number: int) -> Callable[[str | None], str | None]:
    """The namer for ``report/places.py``: the cell is ``Cell In[number]``, code from other cells is named
    as IPython's tracebacks name it (``Cell In[2]``), anything else keeps its file name.

    >>> class Compile:
    ...     def format_code_name(self, name): return ("Cell", "In[2]") if name == "/t/2.py" else None
    >>> shell = type("Shell", (), {"compile": Compile()})()
    >>> name = ipython_places(shell, "/t/5.py", 5)
    >>> name(None), name("/t/5.py"), name("/t/2.py"), name("/lib/models.py")
    ('Cell In[5]', 'Cell In[5]', 'Cell In[2]', None)
    """
    others = cell_code_names(shell)

    def name(file: str | None) -> str | None:
        if file is None or file == filename:
            return f"Cell In[{number}]"
        return others(file) if others is not None else None
    return name


def _in_kernel(shell: Any) -> bool:
    """A Jupyter kernel (displays can be updated in place), not terminal IPython."""
    return getattr(shell, "kernel", None) is not None


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """One diagnosis at a time (a fix a panel runs in its thread counts): else a UsageError, nothing run."""
    guard = one_run_at_a_time()
    try:
        guard.__enter__()
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    try:
        yield
    finally:
        guard.__exit__(None, None, None)


def _show(shell: Any, report: Any, cell: str, limit: int | None, timeout: float | None,
          notice: RunningNotice | None = None) -> None:
    """The panel in a kernel that shows widgets; else the report (HTML or text) and, in a kernel
    without ipywidgets, a one-line hint to install it. With ``notice``, in the placeholder's place."""
    put = notice.replace if notice is not None else display
    if not _in_kernel(shell):  # terminal IPython, a plain InteractiveShell
        put(report)
        return
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        put(report)
        print("backward_doctor: `pip install ipywidgets` for the interactive panel (memory, graph, fix buttons)")
        return
    from .panel import Panel

    try:
        panel = Panel(report, cell, shell.user_ns, memory_limit=limit, timeout=timeout)
    except Exception as exc:  # never lose the diagnosis to a drawing problem
        log.warning("the panel could not be built", exc_info=True)
        put(report)
        print(f"backward_doctor: the panel could not be built ({type(exc).__name__}: {exc})")
        return
    put(panel)


def check_export_paths(*paths: str | None) -> None:
    """``--memory-snapshot``/``--trace``: a ``ValueError`` (nothing run) for a path whose folder is missing or
    which is a folder.

    >>> check_export_paths(None, "snap.pickle")
    >>> check_export_paths("/no/such/folder/snap.pickle")
    Traceback (most recent call last):
    ValueError: /no/such/folder/snap.pickle: no such folder: /no/such/folder
    """
    for path in paths:
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"{path}: is a folder; give a file name")
        if not os.path.isdir(folder):
            raise ValueError(f"{path}: no such folder: {folder}")


def _export(report: Any, args: Any) -> None:
    """Write the files ``--memory-snapshot`` and ``--trace`` ask for, and say where they went."""
    for path, save, viewer in ((args.memory_snapshot, report.save_memory_snapshot, "pytorch.org/memory_viz"),
                               (args.trace, report.save_trace, "ui.perfetto.dev")):
        if path:
            try:
                save(path)
                print(f"backward_doctor: wrote {path} (open it in {viewer})")
            except OSError as exc:  # the diagnosis above still shows
                print(f"backward_doctor: could not write {path}: {exc.strerror or exc}")


def _release_failed_frames(outer: Any) -> None:
    """Free the failed step's locals, which the traceback IPython keeps would hold forever.

    After an OOM the frames of the failed forward still reference its activations;
    clearing them lets the next cell have that memory back.
    """
    import sys

    for tb in (getattr(sys, "last_traceback", None),
               getattr(getattr(outer, "error_in_exec", None), "__traceback__", None)):
        if tb is not None:
            traceback.clear_frames(tb)


def load_ipython_extension(ipython: Any) -> None:
    from .. import native

    ipython.register_magics(BackwardDoctorMagics)
    # The native recorder compiles once per torch version (1-2 min, cached); cells run on the Python tier
    # meanwhile. Say so once, here: a first cell that runs on the slower tier, silently, looks like the
    # doctor's cost.
    line = first_use_line()
    native.build_in_background()
    if line:
        print(line)


def first_use_line() -> str:
    """The one line ``%load_ext`` prints when the native recorder is not ready: it is being built in the
    background, or why it cannot be ('' when the cached build just loads).

    >>> isinstance(first_use_line(), str)
    True
    """
    from .. import native

    if not native.enabled():
        return ""
    if native.status()["reason"]:
        return (f"backward_doctor: the Python recorder records the ops here (the native one could not be built: "
                f"{native.status()['reason']})")
    if not native.needs_build():
        return ""
    missing = native.missing_tool()
    if missing:
        return (f"backward_doctor: no {missing} here, so the Python recorder records the ops (about 1.2x a step, "
                "every iteration of a loop recorded; `pip install ninja` and a C++ compiler give the native one)")
    return (f"backward_doctor: building the native recorder in the background (once per torch version; "
            f"{native.build_time_words()}). Until it is ready cells run on the Python recorder, which records "
            "every iteration of a loop (slower), and each report's footer says which recorder ran")


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing global is left installed between cells, so there is nothing to undo."""


def _run_with_fix(shell: Any, cell: str, fix: str, timeout: float | None, limit: int | None,
                  rollback: bool) -> Any:
    """``--fix``: the original cell, then the rewritten one (``backward_doctor.fixes``); the fixed report.

    The cell is marked failed (so "Run All" stops) when the step still fails after the fix.
    """
    from ..fixes import run_fix

    outer = getattr(shell.displayhook, "exec_result", None)
    report = run_fix(cell, shell.user_ns, fix, timeout=timeout, memory_limit=limit, rollback=rollback)
    if outer is not None and report.exception is not None:
        outer.error_in_exec = RuntimeError(f"backward_doctor --fix {fix}: the step still fails: "
                                           f"{report.exception.splitlines()[0]}")
    return report
