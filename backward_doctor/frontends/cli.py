"""Command line: ``python -m backward_doctor FILE.py`` diagnoses a file as one cell;
``python -m backward_doctor run SCRIPT.py [ARGS...]`` runs a script as ``python`` does, watched, and reports only
when it fails (``script.py``); ``python -m backward_doctor render REPORT.json [--as NAME] [-o OUT]`` renders a saved report again
(``--json`` writes one) with any registered renderer (``text``, ``html``, ``page``, ``json``, and the
exporters ``memory_viz`` and ``perfetto``), as pyinstrument's ``--load`` does; ``--memory-snapshot OUT``
and ``--trace OUT`` write those two files of a run. ``--nproc N`` runs the file on N local ranks (``launch.py``: one report for
all ranks); ``python -m backward_doctor combine FOLDER`` combines ranks run under ``torchrun -m
backward_doctor.run.rank FILE.py FOLDER``.

Exit status of a diagnosis (``FILE.py``, ``--nproc``, ``combine``): 0 when the step ran and nothing was found,
1 when a problem was found, 2 for bad arguments (nothing is run then). With ``--fix NAME`` the report
(and the status) is that of the fixed run, with the code to keep. ``render`` diagnoses nothing: 0 once it
rendered, whatever the report found (the run that saved it gave that status), 2 for bad arguments. Each
command's ``--help`` says its own.

>>> main(["--help"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
SystemExit: 0
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from ..api import check_options, diagnose
from ..report.combined import load_report
from ..report.places import name_places
from ..report.schema import ReportError, loads
from ..report.renderers import names, renderer
from ..run.engine import choose_engine
from ..util.files import read_bounded
from ..util.units import parse_size
from ..util.writing import write_atomic
from .script import read_source as _read


#: what a diagnosis's exit status means (the file, --nproc, combine), as each ``--help`` says it
DIAGNOSIS_STATUS = ("Exit status: 0 when nothing was found, 1 when a problem was found, 2 for bad arguments "
                    "(nothing is run then).")
#: ``render`` re-draws a report: its status says whether it rendered, not what the report found
RENDER_STATUS = ("Exit status: 0 when it rendered, whatever the report found (the diagnosis that saved it gave "
                 "that status); 2 for bad arguments, a file that is not a report, or a report this format cannot "
                 "hold (nothing is written then).")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backward_doctor",
                                description="Run a training-step script as one cell and diagnose it.",
                                epilog=DIAGNOSIS_STATUS + " With --fix: the fixed run's status.")
    p.add_argument("file", help="Python file with the training step")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds before it counts as a hang")
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="simulated device capacity, e.g. 2GiB (each rank's, with --nproc)")
    p.add_argument("--fix", default=None, metavar="NAME", help="re-run with a fix (accumulate[:k], amp, sync, checkpoint)")
    p.add_argument("--no-rollback", action="store_true",
                   help="with --fix: do not restore the training state between the original and the fixed run")
    p.add_argument("--engine", default="auto", choices=("auto", "native", "python"),
                   help="what records the ops (default auto: the native recorder where it can be used)")
    p.add_argument("--every-iteration", action="store_true",
                   help="record every iteration of a training loop (default: 0, 1, 2 and powers of two)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="run FILE on N local ranks as torchrun would (the script calls init_process_group); "
                        "one combined report (default --timeout there: 300 s)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON to OUT")
    p.add_argument("--html", default=None, metavar="OUT",
                   help="also write the report as one self-contained HTML page to OUT")
    _export_options(p)
    return p


def _export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-snapshot", default=None, metavar="OUT",
                   help="also write a memory snapshot (pickle) to OUT: open it at pytorch.org/memory_viz")
    p.add_argument("--trace", default=None, metavar="OUT",
                   help="also write a Chrome/Perfetto trace (JSON) to OUT: open it at ui.perfetto.dev")


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("--json", "--html", "--memory-snapshot", "--trace"):
        _check_output(parser, flag, getattr(args, flag[2:].replace("-", "_"), None))


def _check_output(parser: argparse.ArgumentParser, flag: str, path: str | None, make: bool = False) -> None:
    """An output path must be writable before the step runs (else the report would be lost after it).
    ``make``: its folder may be missing, to be created when the file is written (``render -o runs/step/...``),
    so the nearest folder that exists must be one the missing ones can be made in."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder; give a file name")
    if make:
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            parser.error(f"{flag} {path}: {folder} is not a folder")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: no such folder: {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"{flag} {path}: not writable")


def _emit(report: Any, args: argparse.Namespace) -> None:
    print(report, flush=True)
    if args.json:  # (whole or not at all, never through a link at its name: util/writing.py)
        write_atomic(args.json, json.dumps(report.to_dict()))
    if args.html:
        report.save_html(args.html)
    if getattr(args, "memory_snapshot", None):
        report.save_memory_snapshot(args.memory_snapshot)
    if getattr(args, "trace", None):
        report.save_trace(args.trace)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["render"]:
        return render_main(argv[1:])
    if argv[:1] == ["combine"]:
        return combine_main(argv[1:])
    if argv[:1] == ["run"]:  # the script as `python SCRIPT.py ARGS` runs it, watched (frontends/script.py)
        from .script import main as run_main

        return run_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        limit = check_options(timeout=args.timeout, memory_limit=args.memory_limit, fix=args.fix, engine=args.engine,
                              every_iteration=args.every_iteration, nproc=args.nproc).memory_limit
        if args.engine == "native":
            choose_engine("native", memory_limit=limit)
    except ValueError as exc:
        parser.error(str(exc))
    _check_outputs(parser, args)
    source = _read(parser, args.file)
    if args.nproc is not None:
        return _distributed(parser, args)
    path = os.path.abspath(args.file)
    namespace = {"__name__": "__main__", "__file__": path}
    sys.path.insert(0, os.path.dirname(path))  # imports next to the script work, as with `python FILE`
    real_exit = os._exit
    os._exit = _exit_with_report(real_exit, args)
    try:
        report = diagnose(source, namespace, timeout=args.timeout, memory_limit=limit, fix=args.fix,
                          engine=args.engine, rollback=not args.no_rollback, every_iteration=args.every_iteration)
    finally:
        os._exit = real_exit
        sys.path.remove(os.path.dirname(path))
    # The script is the "cell": its lines are named as Python's tracebacks name them ("step.py, line 4").
    name_places(report, namespace, lambda file: os.path.basename(path) if file is None else None)
    _emit(report, args)
    return 0 if report.ok else 1


def _distributed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--nproc N``: the script on N local ranks, one combined report (``launch.py``)."""
    from .launch import launch

    report = launch(args.file, args.nproc, timeout=args.timeout, engine=args.engine,
                    every_iteration=args.every_iteration, memory_limit=parse_size(args.memory_limit))
    _emit(report, args)
    return 0 if report.ok else 1


def _exit_with_report(real_exit: Callable[[int], Any], args: argparse.Namespace) -> Callable[[int], Any]:
    """``os._exit`` for the script's run: it ends the process at once, so first the report of the run
    as far as it went (the capture stopped, the exit as its exception), then the real exit. A process
    forked during the run (a DataLoader worker, ``multiprocessing``) inherits this function and ends with
    ``os._exit`` as its normal exit: there it is the real exit, and no report (the run is the parent's)."""
    parent = os.getpid()

    def _exit(code: int = 0) -> Any:
        if os.getpid() != parent:
            real_exit(code)
        os._exit = real_exit
        try:
            from ..api import build_report
            from ..capture.runner import current_capture

            cap = current_capture()
            if cap is not None:
                caller = sys._getframe(1)
                cap.stop()
                exc = SystemExit(f"the script called os._exit({code}) at {os.path.basename(caller.f_code.co_filename)}"
                                 f":{caller.f_lineno}: the run ends there, and the report covers it up to there")
                del caller
                cap.record_exception(exc)
                _emit(build_report(cap.finish()), args)
        except BaseException as err:  # noqa: BLE001 - the exit must happen whatever went wrong
            print(f"backward_doctor: no report ({type(err).__name__}: {err})", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            real_exit(code)
    return _exit


def combine_main(argv: list[str]) -> int:
    """``combine FOLDER``: one report from the files ranks wrote under ``torchrun -m
    backward_doctor.run.rank FILE.py FOLDER`` (several machines: gather their folders into one first)."""
    from .combine import combine_folder

    p = argparse.ArgumentParser(prog="python -m backward_doctor combine",
                                description="Combine the ranks' files of a torchrun run into one report.",
                                epilog=DIAGNOSIS_STATUS)
    p.add_argument("folder", help="the folder given to backward_doctor.run.rank on every rank")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON to OUT")
    p.add_argument("--html", default=None, metavar="OUT", help="also write the report as an HTML page to OUT")
    _export_options(p)
    args = p.parse_args(argv)
    _check_outputs(p, args)
    try:
        report = combine_folder(args.folder)
    except (ValueError, OSError) as exc:  # no rank files, a file that is not a rank's, an unreadable folder
        p.error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    try:
        _emit(report, args)
    except OSError as exc:
        p.error(f"cannot write {exc.filename or 'a file'}: {exc.strerror or exc}")
    except (ReportError, ArithmeticError) as exc:  # an export of a crafted rank file (a number past its range)
        p.error(f"{args.folder}: {_one_line(exc)}")
    return 0 if report.ok else 1


def render_main(argv: list[str]) -> int:
    """``render REPORT.json``: a saved report (``--json``, or ``report.to_dict()``) rendered again; no
    step runs. Exit status 0 once it rendered, whatever the report found (a CI step that re-renders an
    artifact must not fail because the run it shows did: that run's own command gave its status); 2 bad
    arguments. ``-o`` into a folder that does not exist yet creates it (parents too) once the render
    succeeded, as ``-o runs/step/events.out.tfevents.bd`` for TensorBoard needs."""
    p = argparse.ArgumentParser(prog="python -m backward_doctor render",
                                description="Render a saved report (JSON) again; nothing is run.",
                                epilog=RENDER_STATUS)
    p.add_argument("report", help="a report saved with --json (or json.dump(report.to_dict()))")
    p.add_argument("--as", dest="kind", default="text", choices=names(), help="renderer (default: text)")
    p.add_argument("-o", "--output", default=None, metavar="OUT",
                   help="write to OUT instead of stdout (required for a binary format: memory_viz, tensorboard); "
                        "its folder is created when missing")
    p.add_argument("--html", default=None, metavar="OUT", help="shortcut for --as page -o OUT")
    args = p.parse_args(argv)
    if args.html:
        args.kind, args.output = "page", args.html
    if renderer(args.kind).binary and not args.output:
        p.error(f"--as {args.kind} writes a binary file: give -o OUT (e.g. -o snapshot{renderer(args.kind).suffix})")
    _check_output(p, "-o/--html", args.output, make=True)
    try:
        report = load_report(loads(read_bounded(args.report)))
    except OSError as exc:
        p.error(f"cannot read {args.report}: {exc.strerror or exc}")
    except (ValueError, UnicodeDecodeError) as exc:  # not a regular file, too big, not JSON, not a report
        p.error(f"{args.report} is not a saved backward_doctor report: {str(exc).splitlines()[0][:300]}")
    try:
        out = renderer(args.kind).render(report)
    except RuntimeError as exc:  # a renderer that needs a package not installed here (tensorboard)
        p.error(str(exc))
    except (ReportError, ArithmeticError) as exc:  # a value no file of this format holds (a crafted snapshot,
        # a number past its range): refused in one line, nothing written
        p.error(f"{args.report} cannot be rendered --as {args.kind}: {_one_line(exc)}")
    if not args.output:
        print(out)
        return 0
    try:  # (the folder made only now: a render that failed leaves none behind)
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        write_atomic(args.output, out)
    except OSError as exc:
        p.error(f"cannot write {args.output}: {exc.strerror or exc}")
    return 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]
