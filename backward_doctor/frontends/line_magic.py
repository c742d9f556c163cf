"""``%backward_doctor on|off|status``: the line magic that turns always on (``always_on.py``) on and off.

>>> AlwaysOnMagics.backward_doctor_line.__name__
'backward_doctor_line'
"""
from __future__ import annotations

from typing import Any

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from ..api import check_options
from ..run.engine import choose_engine
from .always_on import Options, current, turn_off, turn_on


@magics_class
class AlwaysOnMagics(Magics):
    """``%backward_doctor on|off|status`` (the line magic; ``%%backward_doctor`` is the cell magic)."""

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("action", nargs="?", default="status", choices=("on", "off", "status"),
                              help="on: watch every later cell that trains; off: stop; status: say which")
    @magic_arguments.argument("--timeout", type=float, default=None, metavar="S",
                              help="seconds without a completed optimizer step before a cell counts as hung "
                                   "and is interrupted")
    @magic_arguments.argument("--memory-limit", default=None, metavar="SIZE",
                              help="simulated device capacity for every watched cell, e.g. 300MB or 2GiB")
    @magic_arguments.argument("--quiet", action="store_true",
                              help="no line for silent findings of a cell that ran to its end (failures still show)")
    @magic_arguments.argument("--every-iteration", action="store_true",
                              help="record every iteration of a loop (default: 0, 1, 2 and powers of two)")
    @magic_arguments.argument("--engine", default="auto", metavar="NAME",
                              help="what records the ops: auto, native or python")
    @line_magic("backward_doctor")
    def backward_doctor_line(self, line: str) -> None:
        """Watch every later cell that trains, and show the diagnosis the first time one fails.

        Example::

            %load_ext backward_doctor
            %backward_doctor on --timeout 120

        A cell that trains (a backward, an optimizer step, ``trainer.train()``...) runs as with
        ``%%backward_doctor``; when it fails (an exception, NaN/Inf, a hang past ``--timeout``
        seconds without an optimizer step, Ctrl-C, an OOM) the report appears above the traceback. When it
        succeeds nothing is shown, or one line when something silent was found. Other cells run as they are.
        ``%%backward_doctor`` on a cell still works and wins. ``%backward_doctor off`` puts everything back.
        """
        args = magic_arguments.parse_argstring(self.backward_doctor_line, line)
        shell = self.shell
        given = args.timeout is not None or args.memory_limit is not None or args.quiet or args.every_iteration \
            or args.engine != "auto"
        if given and args.action != "on":
            raise UsageError(f"options go with `on` (`%backward_doctor on {line.strip()}`), not with {args.action}")
        if args.action == "off":
            print("backward_doctor: always on is off" if turn_off(shell) else "backward_doctor: always on was not on")
            return
        if args.action == "status":
            on = current(shell)
            print(on.status() if on is not None else "backward_doctor: always on is off "
                  "(`%backward_doctor on` watches every later cell that trains)")
            return
        try:
            opts = check_options(timeout=args.timeout, memory_limit=args.memory_limit, engine=args.engine,
                                 every_iteration=args.every_iteration)
            options = Options(timeout=opts.timeout, memory_limit=opts.memory_limit, quiet=args.quiet, engine=opts.engine,
                              every_iteration=opts.every_iteration)
            choose_engine(options.engine, memory_limit=options.memory_limit, build=False)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(turn_on(shell, options).status())


def register(ipython: Any) -> None:
    """Register the line magic (``%load_ext backward_doctor``)."""
    ipython.register_magics(AlwaysOnMagics)


__all__ = ["AlwaysOnMagics", "register"]
