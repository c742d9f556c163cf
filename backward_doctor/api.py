"""The public entry point: :func:`diagnose` a cell's source, :func:`last_report`.

>>> import backward_doctor as bd
>>> bd.diagnose("import torch\\ntorch.ones(2) + torch.ones(3)").findings[0].kind
'shape_mismatch'
"""
from __future__ import annotations

import math
from typing import Any

from .capture.process import one_run_at_a_time
from .capture.history import history_for
from .report.report import Report
from .run.engine import check_engine, choose_engine, replay_in_detail, screens_every_op, snapshot_for, wants_replay
from .analysis.rules import analyze
from .trace.records import Trace
from .util.units import parse_size

#: Fixes backward_doctor applies with ``fix=`` (see ``backward_doctor.fixes``).
KNOWN_FIXES = ("accumulate", "amp", "sync", "checkpoint")
_last: list[Report | None] = [None]
_MAX_TIMEOUT = 1e6


def check_fix(fix: str | None) -> None:
    """Raise ``ValueError`` for an unknown or malformed fix name (before anything runs)."""
    if fix is None:
        return
    from .fixes.spec import parse_fix

    parse_fix(fix)


def check_cell(source: Any, namespace: Any) -> None:
    """``ValueError`` unless ``source`` is a cell's code and ``namespace`` a dict (or None)."""
    if not isinstance(source, str):
        raise ValueError(f"source must be the code of a cell as a string, not {type(source).__name__}")
    if namespace is not None and not isinstance(namespace, dict):
        raise ValueError(f"namespace must be a dict of globals, not {type(namespace).__name__}")


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds (None: no limit); ``ValueError`` for anything but a finite positive number.

    >>> check_timeout(2)
    2.0
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive finite number of seconds (or None for no limit), "
                         f"not {timeout!r}")
    if timeout > _MAX_TIMEOUT:  # threading's waits overflow past this
        raise ValueError(f"timeout must be at most {_MAX_TIMEOUT:.0f} s (about 11 days), not {timeout!r}; "
                         "None means no limit")
    return float(timeout)


def build_report(trace: Trace, fix: str | None = None) -> Report:
    """Run the rules over ``trace`` and remember the result as the last report."""
    exc = trace.exception.summary() if trace.exception else None
    report = Report(findings=analyze(trace), exception=exc, trace=trace, fix=fix)
    _last[0] = report  # (one item assignment: atomic, no lock a Ctrl-C could leave held)
    return report


def diagnose(source: str, namespace: dict[str, Any] | None = None, *, timeout: float | None = None,
             memory_limit: int | str | None = None, fix: str | None = None, rollback: bool = True,
             engine: str = "auto") -> Report:
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

    >>> import backward_doctor as bd
    >>> bd.diagnose("x = 1").ok
    True
    """
    from .capture.runner import run_source

    check_cell(source, namespace)
    timeout = check_timeout(timeout)
    limit = parse_size(memory_limit)
    check_fix(fix)
    check_engine(engine)
    if not isinstance(rollback, bool):
        raise ValueError(f"rollback must be True or False, not {rollback!r}")
    ns = {} if namespace is None else namespace
    ns.setdefault("__builtins__", __builtins__)
    with one_run_at_a_time():
        if fix is not None:
            from .fixes.apply import run_fix

            return run_fix(source, ns, fix, timeout=timeout, memory_limit=limit, rollback=rollback)
        return _diagnose(source, ns, timeout, limit, rollback, engine)


def _diagnose(source: str, ns: dict[str, Any], timeout: float | None, limit: int | None, rollback: bool,
              engine: str) -> Report:
    from .capture.runner import run_source

    chosen = choose_engine(engine, memory_limit=limit)
    detail = screens_every_op()  # one run, every op screened: no replay, no snapshot (see tiers)
    snapshot = snapshot_for(source, ns) if rollback and not detail else None
    trace = run_source(source, ns, timeout=timeout, memory_limit=limit, history=history_for(source, ns),
                       detail=detail, engine=chosen)
    if wants_replay(trace, snapshot):
        trace = replay_in_detail(trace, source, ns, snapshot, timeout=timeout, memory_limit=limit)
    return build_report(trace)


def last_report() -> Report | None:
    """The latest report made in this process (by ``diagnose``, the magic or the CLI)."""
    return _last[0]
