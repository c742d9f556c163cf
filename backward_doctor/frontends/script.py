"""``python -m backward_doctor run SCRIPT.py [ARGS...]``: the script runs as ``python SCRIPT.py ARGS`` runs it,
watched as ``%backward_doctor on`` watches a notebook cell.

The script is ``__main__`` (its ``if __name__ == "__main__":`` block runs, classes it defines pickle),
``sys.argv`` is ``[SCRIPT.py, ARGS...]`` and its folder is first on ``sys.path``. It runs under the
doctor's sampled watch (a long loop costs ~1.1-1.3x); the timeout counts from the latest optimizer step.
When it fails (an exception after training began, NaN/Inf in the loss or weights, a hang, Ctrl-C) the
report is printed on stderr, then the script's own traceback, and written to ``--output-dir``
(``backward_doctor-report.json`` and ``.html``). When it trains fine nothing is added to its output (one
line on stderr when something silent was found). The exit status is the script's own: 0, 1 for an
uncaught exception, its ``sys.exit`` code, 130 for Ctrl-C. Bad arguments: 2, and nothing runs.

>>> main(["--help"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
SystemExit: 0
"""
from __future__ import annotations

import argparse
import os
import sys
import tokenize
import traceback
import types
from typing import Any

from ..api import check_timeout
from ..capture.process import doctors_own, one_run_at_a_time
from ..run.engine import ENGINES, choose_engine, screens_every_op
from ..run.step import run_step
from ..util.units import parse_size
from .cell_watch import failed, quiet_line, write_report
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
                                            "trains fine.")
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
        timeout = check_timeout(args.timeout)
        limit = parse_size(args.memory_limit)
        engine = choose_engine(args.engine, memory_limit=limit)
    except ValueError as exc:
        parser.error(str(exc))
    out = os.path.abspath(args.output_dir)
    if os.path.exists(out) and not (os.path.isdir(out) and os.access(out, os.W_OK)):
        parser.error(f"--output-dir {args.output_dir}: not a writable folder")
    path = os.path.abspath(args.script)
    source = read_source(parser, path)
    raised: list[BaseException] = []
    ran: list[bool] = []
    with _as_main(path, args.args) as namespace:
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
    elif failed(report):
        written = write_report(report, out)
        print(f"{report}\nbackward_doctor: the report (written to {written[1]})", file=sys.stderr, flush=True)
    elif not args.quiet and quiet_line(report):
        print(quiet_line(report), file=sys.stderr, flush=True)
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        return _exit_code(exc)
    traceback.print_exception(type(exc), exc, without_doctor_frames(exc.__traceback__), file=sys.stderr)
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def _exit_code(exc: SystemExit) -> int:
    """What ``python SCRIPT.py`` exits with for ``sys.exit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


class _as_main:
    """The script as ``__main__`` (a module of its own), its ``sys.argv`` and folder on ``sys.path``; put
    back afterwards."""

    def __init__(self, path: str, argv: list[str]) -> None:
        self.path, self.argv = path, argv

    def __enter__(self) -> dict[str, Any]:
        module = types.ModuleType("__main__")
        module.__file__ = self.path
        module.__builtins__ = __builtins__  # type: ignore[attr-defined]
        self._saved = (sys.modules.get("__main__"), sys.argv, list(sys.path))
        sys.modules["__main__"] = module
        sys.argv = [self.path] + list(self.argv)
        sys.path.insert(0, os.path.dirname(self.path))
        return module.__dict__

    def __exit__(self, *exc: Any) -> None:
        main, sys.argv, path = self._saved
        sys.path[:] = path
        if main is not None:
            sys.modules["__main__"] = main


__all__ = ["main", "read_source"]
