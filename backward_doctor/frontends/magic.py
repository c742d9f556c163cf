"""``%%backward_doctor``: run a cell through the shell and diagnose it.

Loaded lazily by ``%load_ext backward_doctor``; this is the only module of the
core that imports IPython. The cell runs with ``shell.run_cell`` so variables,
traceback, ``Out[]`` and history are exactly those of a normal run; the report
is displayed after it (HTML in Jupyter, text in a terminal).
"""
from __future__ import annotations

import logging
import contextlib
import traceback
from typing import Any, Iterator

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.display import display

from ..api import check_engine, check_fix, check_timeout
from ..capture.process import one_run_at_a_time
from ..run.engine import ENGINES, choose_engine
from ..run.step import remember, run_step
from ..util.units import parse_size

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
            timeout = check_timeout(args.timeout)
            limit = parse_size(args.memory_limit)
            check_fix(args.fix)
            engine = choose_engine(check_engine(args.engine), memory_limit=limit, build=False)
            if args.nproc is not None:
                from .launch import check_nproc

                check_nproc(args.nproc)
                if args.fix or limit:
                    raise ValueError("--nproc runs the cell as it is: --fix and --memory-limit apply to one process")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        with _exclusive():
            if args.nproc is not None:
                self._run_ranks(args, cell, timeout, engine)
            else:
                self._run(args, cell, timeout, limit, engine)

    def _run_ranks(self, args: Any, cell: str, timeout: float | None, engine: str) -> None:
        """``--nproc N``: the cell on N ranks forked from the kernel (``fork_ranks.py``); the combined report."""
        from .fork_ranks import launch_cell

        try:
            report = launch_cell(cell, self.shell.user_ns, args.nproc, timeout=timeout, engine=engine,
                                 every_iteration=args.every_iteration)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        remember(report)  # type: ignore[arg-type]  (bd.last_report(): the combined report)
        if not (args.quiet and report.ok):
            display(report)

    def _run(self, args: Any, cell: str, timeout: float | None, limit: int | None, engine: str) -> None:
        shell = self.shell
        if args.fix is not None:
            _run_with_fix(shell, cell, args.fix, timeout, limit, not args.no_rollback, args.quiet)
            return None
        # The same name run_cell will give the cell's code object, so frames map to its lines.
        filename = shell.compile.get_code_name(cell, shell.transform_cell(cell), shell.execution_count)
        # The result of the cell that holds this magic: the inner run_cell's error is
        # copied onto it so Jupyter marks the cell failed (and "Run All" stops), as usual.
        outer = getattr(shell.displayhook, "exec_result", None)

        def run() -> BaseException | None:
            result = shell.run_cell(cell, store_history=False)
            error = result.error_in_exec or result.error_before_exec
            if outer is not None:
                outer.result = result.result
                if error is not None:
                    outer.error_in_exec = error
            return error

        report = run_step(cell, shell.user_ns, timeout=timeout, memory_limit=limit, engine=engine,
                          rollback=not args.no_rollback, cell_file=filename, execute=run, build=False, fix=args.fix,
                          every_iteration=args.every_iteration)
        if report.trace.exception is not None and report.trace.exception.type == "OutOfMemoryError":
            _release_failed_frames(outer)
        if args.quiet and report.ok:
            return None
        _show(shell, report, cell, limit, timeout)
        return None


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


def _show(shell: Any, report: Any, cell: str, limit: int | None, timeout: float | None) -> None:
    """The panel in a kernel that shows widgets; else the report (HTML or text) and, in a kernel
    without ipywidgets, a one-line hint to install it."""
    if getattr(shell, "kernel", None) is None:  # terminal IPython, a plain InteractiveShell
        display(report)
        return
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        display(report)
        print("backward_doctor: `pip install ipywidgets` for the interactive panel (memory, graph, fix buttons)")
        return
    from .panel import Panel

    try:
        panel = Panel(report, cell, shell.user_ns, memory_limit=limit, timeout=timeout)
    except Exception as exc:  # never lose the diagnosis to a drawing problem
        log.warning("the panel could not be built", exc_info=True)
        display(report)
        print(f"backward_doctor: the panel could not be built ({type(exc).__name__}: {exc})")
        return
    display(panel)


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
    # The native recorder compiles once (~40 s, cached); cells run on the Python tier meanwhile.
    native.build_in_background()


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing global is left installed between cells, so there is nothing to undo."""


def _run_with_fix(shell: Any, cell: str, fix: str, timeout: float | None, limit: int | None, rollback: bool,
                  quiet: bool) -> None:
    """``--fix``: the original cell, then the rewritten one (``backward_doctor.fixes``); show the fixed report.

    The cell is marked failed (so "Run All" stops) when the step still fails after the fix.
    """
    from ..fixes import run_fix

    outer = getattr(shell.displayhook, "exec_result", None)
    report = run_fix(cell, shell.user_ns, fix, timeout=timeout, memory_limit=limit, rollback=rollback)
    if outer is not None and report.exception is not None:
        outer.error_in_exec = RuntimeError(f"backward_doctor --fix {fix}: the step still fails: "
                                           f"{report.exception.splitlines()[0]}")
    if quiet and report.ok:
        return
    _show(shell, report, cell, limit, timeout)
