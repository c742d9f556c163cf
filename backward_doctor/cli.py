"""Command line: ``python -m backward_doctor FILE.py`` diagnoses a file as one cell.

Exit status: 0 when the step ran and nothing was found, 1 when a problem was
found, 2 for bad arguments (nothing is run then). With ``--fix NAME`` the report
(and the status) is that of the fixed run, with the code to keep.

>>> main(["--help"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
SystemExit: 0
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .api import check_fix, check_timeout, diagnose
from .units import parse_size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backward_doctor",
                                description="Run a training-step script as one cell and diagnose it.")
    p.add_argument("file", help="Python file with the training step")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds before it counts as a hang")
    p.add_argument("--memory-limit", default=None, metavar="SIZE", help="simulated device capacity, e.g. 2GiB")
    p.add_argument("--fix", default=None, metavar="NAME", help="re-run with a fix (accumulate[:k], amp, sync, checkpoint)")
    p.add_argument("--no-rollback", action="store_true",
                   help="with --fix: do not restore the training state between the original and the fixed run")
    p.add_argument("--engine", default="auto", choices=("auto", "native", "python"),
                   help="what records the ops (default auto: the native recorder where it can be used)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON to OUT")
    p.add_argument("--html", default=None, metavar="OUT",
                   help="also write the report as one self-contained HTML page to OUT")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_timeout(args.timeout)
        limit = parse_size(args.memory_limit)
        check_fix(args.fix)
    except ValueError as exc:
        parser.error(str(exc))
    if not os.path.isfile(args.file):
        parser.error(f"no such file: {args.file}")
    with open(args.file, encoding="utf-8") as fh:
        source = fh.read()
    path = os.path.abspath(args.file)
    namespace = {"__name__": "__main__", "__file__": path}
    sys.path.insert(0, os.path.dirname(path))  # imports next to the script work, as with `python FILE`
    try:
        report = diagnose(source, namespace, timeout=args.timeout, memory_limit=limit, fix=args.fix,
                          engine=args.engine,
                          rollback=not args.no_rollback)
    finally:
        sys.path.remove(os.path.dirname(path))
    print(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh)
    if args.html:
        report.save_html(args.html)
    return 0 if report.ok else 1
