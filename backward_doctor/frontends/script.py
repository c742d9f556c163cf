"""``python -m backward_doctor run SCRIPT.py [ARGS...]``: the script runs as ``python SCRIPT.py ARGS`` runs it,
watched as ``%backward_doctor on`` watches a notebook cell.

The script is ``__main__`` (its ``if __name__ == "__main__":`` block runs, classes it defines pickle),
``sys.argv`` is ``[SCRIPT.py, ARGS...]`` and its folder is first on ``sys.path``. It runs under the
doctor's sampled watch (a long loop costs ~1.1-1.3x); the timeout counts from the latest optimizer step.
When it fails (an exception after training began, NaN/Inf in the loss or weights, a hang, Ctrl-C) the
report is printed on stderr, then the script's own traceback (through the ``sys.excepthook`` it set, if
any, as ``python`` calls it), and written to ``--output-dir`` (``backward_doctor-report.json`` and
``.html``; where it cannot be, one line says why, and the rest stands). When it trains fine nothing is
added to its output (one line on stderr when something silent was found). The exit status is the
script's own: 0, 1 for an uncaught exception, its ``sys.exit`` code; after a Ctrl-C the process dies by
SIGINT as ``python`` does (a shell says 130). Bad arguments: 2, and nothing runs.

>>> main(["--help"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
SystemExit: 0
"""
from __future__ import annotations

import argparse
import builtins
import os
import sys
import tokenize
import traceback
import types
from typing import Any

from ..api import check_options
from ..util.process import doctors_own, one_run_at_a_time
from ..run.engine import ENGINES, choose_engine, python_tier_reason, screens_every_op
from ..run.step import run_step
from .deliver import deliver, one_line
from .running import without_doctor_frames


def read_source(parser: argparse.ArgumentParser, path: str) -> str:
    """The script's text, decoded as Python decodes a file (a coding line, a BOM, else UTF-8); a parser
    error (exit status 2) when it cannot be read."""
    if not os.path.isfile(path):
        parser.error(f"no such file: {path}")
    try:
        with tokenize.open(path) as fh:
            return fh.read()
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:  # binary, or an encoding it does not declare
        parser.error(f"cannot read {path} as Python source: {str(exc).splitlines()[0]}")
    except OSError as exc:
        parser.error(f"cannot read {path}: {exc.strerror or exc}")
    raise AssertionError("unreachable")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backward_doctor run",
                                description="Run a Python script as `python SCRIPT.py ARGS` would, watched: the "
                                            "doctor's report when it fails or goes NaN/Inf, nothing when it "
                                            "trains fine.",
                                epilog="Exit status: the script's own, as python gives it (0, 1 for an uncaught "
                                       "exception, its sys.exit code; death by SIGINT after a Ctrl-C), whatever "
                                       "the report found, so a watched job fails exactly when it would have; "
                                       "2 for bad arguments (nothing runs then). For a status that says whether "
                                       "a problem was found, diagnose the file: python -m backward_doctor "
                                       "SCRIPT.py.")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds without a completed optimizer step before the run counts as hung")
    p.add_argument("--memory-limit", default=None, metavar="SIZE", help="simulated device capacity, e.g. 2GiB")
    p.add_argument("--engine", default="auto", choices=ENGINES, help="what records the ops (default auto)")
    p.add_argument("--every-iteration", action="store_true",
                   help="record every iteration of a training loop (default: 0, 1, 2 and powers of two)")
    p.add_argument("--output-dir", default=".", metavar="DIR",
                   help="where the report is written when the script fails (default: the current folder)")
    p.add_argument("--quiet", action="store_true", help="no line for silent findings of a run that ended well")
    p.add_argument("script", help="the Python script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        opts = check_options(timeout=args.timeout, memory_limit=args.memory_limit, engine=args.engine)
        timeout, limit = opts.timeout, opts.memory_limit
        engine = choose_engine(opts.engine, memory_limit=limit)
    except ValueError as exc:
        parser.error(str(exc))
    out = os.path.abspath(args.output_dir)
    if os.path.exists(out) and not (os.path.isdir(out) and os.access(out, os.W_OK)):
        parser.error(f"--output-dir {args.output_dir}: not a writable folder")
    path = os.path.abspath(args.script)
    source = read_source(parser, path)
    raised: list[BaseException] = []
    ran: list[bool] = []
    with _as_main(path, args.script, args.args) as namespace:
        def execute() -> BaseException | None:
            ran.append(True)
            try:
                exec(compile(source, path, "exec"), namespace)
            except BaseException as exc:  # noqa: BLE001 - the script's outcome, reported and re-told below
                raised.append(exc)
                return exc
            return None

        try:
            with one_run_at_a_time():
                report = run_step(source, namespace, timeout=timeout, memory_limit=limit, engine=engine,
                                  rollback=screens_every_op(), cell_file=path, execute=execute, build=True,
                                  every_iteration=args.every_iteration, stall=True,
                                  places=lambda file: os.path.basename(path) if file is None else None)
            if args.engine == "auto" and report.trace.engine == "python":
                report.engine_note = python_tier_reason()  # (why not the native recorder: said once, here)
        except Exception as own:  # the doctor's own error: the script's outcome stands (it runs now if it had not)
            if not doctors_own(own):
                raise
            print(f"backward_doctor: no report (the doctor's own error: {type(own).__name__}: {own})",
                  file=sys.stderr, flush=True)
            report = None
            if not ran:
                execute()
    exc = raised[0] if raised else None
    if report is None or (isinstance(exc, SystemExit) and not report.trace.timed_out
                          and report.trace.iterations.first_nonfinite is None):
        if exc is None or isinstance(exc, SystemExit):  # (the script chose to exit: its own business)
            return _exit_code(exc) if exc is not None else 0
    else:
        deliver(report, _on_stderr, folder=out, quiet=args.quiet, offers=(source, namespace))
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        return _exit_code(exc)
    return _uncaught(exc)


def _on_stderr(report: Any, footer: str) -> None:
    """The report on stderr, then where it was written (or in one line why not): the script's outcome stands
    whatever happens here."""
    try:
        text = str(report)
    except Exception as own:  # noqa: BLE001 - the doctor's own: the script's outcome stands
        if not doctors_own(own):
            raise
        text = f"backward_doctor: no report (the doctor's own error: {one_line(own)})"
    print(f"{text}\n{footer}", file=sys.stderr, flush=True)


def _uncaught(exc: BaseException) -> int:
    """What ``python SCRIPT.py`` does with the exception the script raised: ``sys.last_*`` set and
    ``sys.excepthook`` called (the script's own, if it set one: a crash reporter) with the script's frames;
    exit status 1, or death by SIGINT after a Ctrl-C."""
    shown = without_doctor_frames(exc.__traceback__)
    exc.__traceback__ = shown  # (as python hands it over: the hook may read the exception's own traceback)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, shown
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    hook = getattr(sys, "excepthook", None)
    try:
        if hook is None:
            print("sys.excepthook is missing", file=sys.stderr)
            traceback.print_exception(type(exc), exc, shown, file=sys.stderr)
        else:
            hook(type(exc), exc, shown)
    except SystemExit as stop:  # (as python: a hook that exits sets the status)
        return _exit_code(stop)
    except BaseException as err:  # noqa: BLE001 - as python reports a hook that fails
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        print("\nOriginal exception was:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, shown, file=sys.stderr)
    sys.stderr.flush()
    if isinstance(exc, KeyboardInterrupt):
        return _interrupted()
    return 1


def _interrupted() -> int:
    """After a Ctrl-C: under ``python -m backward_doctor run`` the process ends as ``python`` ends after an
    uncaught ``KeyboardInterrupt`` (its exit handlers run, then it kills itself with SIGINT, so that its parent
    sees it die by the signal): a ``KeyboardInterrupt`` leaves ``main`` for the interpreter, which does that,
    past a ``sys.excepthook`` that prints nothing for it (the traceback was shown). Called from other code:
    130 (128 + SIGINT)."""
    entry = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(entry, "name", None) != "backward_doctor.__main__":
        return 130
    interrupt, hook = KeyboardInterrupt(), sys.excepthook

    def silent(etype: Any, value: Any, tb: Any) -> Any:
        if value is not interrupt:
            return hook(etype, value, tb)
        return None
    sys.excepthook = silent
    raise interrupt


def _exit_code(exc: SystemExit) -> int:
    """What ``python SCRIPT.py`` exits with for ``sys.exit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


class _as_main:
    """The script as ``__main__`` (a module of its own, with the globals ``python SCRIPT.py`` gives it: its
    absolute ``__file__``, a ``SourceFileLoader`` as ``__loader__``, ``__cached__`` None, ``__builtins__`` the
    module), ``sys.argv`` with the script as typed, and its folder (symbolic links resolved) first on
    ``sys.path``; put back afterwards.

    >>> with _as_main(os.path.abspath("train.py"), "train.py", ["--lr", "1"]) as ns:
    ...     sys.argv, ns["__loader__"].name, ns["__loader__"].path == ns["__file__"], ns["__builtins__"] is builtins
    (['train.py', '--lr', '1'], '__main__', True, True)
    """

    def __init__(self, path: str, typed: str, argv: list[str]) -> None:
        self.path, self.typed, self.argv = path, typed, argv

    def __enter__(self) -> dict[str, Any]:
        from importlib.machinery import SourceFileLoader

        module = types.ModuleType("__main__")
        module.__dict__.update(__annotations__={}, __builtins__=builtins, __file__=self.path, __cached__=None,
                               __loader__=SourceFileLoader("__main__", self.path))
        self._saved = (sys.modules.get("__main__"), sys.argv, list(sys.path))
        sys.modules["__main__"] = module
        sys.argv = [self.typed] + list(self.argv)
        sys.path.insert(0, os.path.dirname(os.path.realpath(self.path)))
        return module.__dict__

    def __exit__(self, *exc: Any) -> None:
        main, sys.argv, path = self._saved
        sys.path[:] = path
        if main is not None:
            sys.modules["__main__"] = main


__all__ = ["main", "read_source"]
