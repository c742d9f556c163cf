"""The public entry point: :func:`diagnose` a cell's source, :func:`last_report`.

>>> import backward_doctor as bd
>>> bd.diagnose("import torch\\ntorch.ones(2) + torch.ones(3)").findings[0].kind
'shape_mismatch'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .util.process import one_run_at_a_time
from .fixes.apply import run_fix
from .fixes.offers import check_offers
from .fixes.spec import parse_fix
from .report import Report
from .run.engine import check_engine
from .run.step import build_report, check_cell, check_flag, check_rollback, check_timeout, last_report, run_step
from .util.units import parse_size

__all__ = ["RunOptions", "build_report", "check_cell", "check_engine", "check_fix", "check_nproc", "check_options", "check_rollback",
           "check_timeout", "diagnose",
           "last_report"]


def check_fix(fix: str | None) -> None:
    """Raise ``ValueError`` for an unknown or malformed fix name (before anything runs)."""
    if fix is not None:
        parse_fix(fix)


_MAX_NPROC = 64


def check_nproc(nproc: Any) -> int:
    """``nproc`` as an int; ``ValueError`` unless it is a whole number from 1 to 64.

    >>> check_nproc(2)
    2
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= _MAX_NPROC:
        raise ValueError(f"--nproc must be a whole number of ranks from 1 to {_MAX_NPROC}, not {nproc!r}")
    return nproc


@dataclass(frozen=True)
class RunOptions:
    """How a run is recorded, as :func:`check_options` returns it: checked once where a user hands them in
    (``diagnose()``, the magics, the CLI, ``run``, the callbacks), the same rules and words everywhere."""

    timeout: float | None = None      # seconds (None: no limit)
    memory_limit: int | None = None   # bytes of a simulated device (None: none)
    engine: str = "auto"
    rollback: bool = True
    every_iteration: bool = False
    fix: str | None = None
    nproc: int | None = None          # ranks (None: one process)


def check_options(*, timeout: Any = None, memory_limit: Any = None, engine: Any = "auto", rollback: Any = True,
                  every_iteration: Any = False, fix: Any = None, nproc: Any = None) -> RunOptions:
    """The options checked, before anything runs: ``ValueError`` naming the first bad one.

    >>> check_options(timeout=60, memory_limit="2GiB").memory_limit
    2147483648
    >>> check_options(every_iteration="no")
    Traceback (most recent call last):
    ValueError: every_iteration must be True or False, not 'no'
    >>> check_options(nproc=2, fix="amp")
    Traceback (most recent call last):
    ValueError: --nproc runs the code as it is: --fix applies to one process
    """
    timeout = check_timeout(timeout)
    limit = parse_size(memory_limit)
    check_fix(fix)
    check_engine(engine)
    check_rollback(rollback)
    check_flag("every_iteration", every_iteration)
    if nproc is not None:
        check_nproc(nproc)
        if fix is not None:
            raise ValueError("--nproc runs the code as it is: --fix applies to one process")
    return RunOptions(timeout, limit, engine, rollback, every_iteration, fix, nproc)


def diagnose(source: str, namespace: dict[str, Any] | None = None, *, timeout: float | None = None,
             memory_limit: int | str | None = None, fix: str | None = None, rollback: bool = True,
             engine: str = "auto", every_iteration: bool = False) -> Report:
    """Run ``source`` (one cell: a training step) in ``namespace`` and diagnose it.

    The namespace is mutated exactly as ``exec`` would; the cell's exception is
    recorded in the report, never raised. ``timeout`` (s) turns a stuck run into a
    ``hang`` finding; ``memory_limit`` (bytes or ``"300MB"``) simulates a device
    of that size. Bad arguments raise ``ValueError`` before anything runs, and so
    does nothing run when another thread is diagnosing a step (``RuntimeError``: the
    doctor's hooks are process-wide, one diagnosis at a time).

    ``fix`` (``"accumulate"``, ``"accumulate:4"``, ``"amp"``, ``"checkpoint"``, ``"sync"``)
    runs the cell, restores the training state (``rollback=True``), runs the
    rewritten cell and returns that run's report with ``report.fix_result``: the
    code to keep, a diff and before/after numbers. See ``backward_doctor.fixes``.

    ``engine`` records the ops: ``"auto"`` (the native C++ recorder where it can
    be used, else the Python dispatch mode), ``"native"`` or ``"python"``; see
    ``backward_doctor.run.engine.choose_engine``. On the CPU the cell runs once, every op's
    output checked for NaN/Inf; on CUDA a run that shows NaN/Inf is replayed from the
    rollback snapshot (``rollback=True``), every op checked, to find its origin.

    A training loop in the cell is sampled by the native recorder: iterations 0, 1, 2 and each
    power of two are recorded op by op, the others run with the recorder off, so a loop of
    thousands of steps costs ~1.1-1.2x. ``every_iteration=True`` records them all (2-4x).

    >>> import backward_doctor as bd
    >>> bd.diagnose("x = 1").ok
    True
    """
    check_cell(source, namespace)
    opts = check_options(timeout=timeout, memory_limit=memory_limit, fix=fix, engine=engine, rollback=rollback,
                         every_iteration=every_iteration)
    timeout, limit = opts.timeout, opts.memory_limit
    ns = {} if namespace is None else namespace
    ns.setdefault("__builtins__", __builtins__)
    with one_run_at_a_time():
        if fix is not None:
            return run_fix(source, ns, fix, timeout=timeout, memory_limit=limit, rollback=rollback)
        report = run_step(source, ns, timeout=timeout, memory_limit=limit, engine=engine, rollback=rollback,
                          every_iteration=every_iteration)
    check_offers(report, source, ns)  # only the fixes that can be applied to this cell are offered
    return report
