"""The one orchestration of a run: every frontend (``diagnose()``, the magic, the CLI) and the fixes
call :func:`run_step`.

It picks the engine (``engine.py``), makes the capture, runs the cell under it (by ``exec``, or by a
frontend's own ``execute``: the magic hands over IPython's ``run_cell``), replays a NaN/Inf from the
rollback snapshot where the first run could not locate it (CUDA; ``snapshot.py``), applies the rules
and keeps the report as the process's last one. The arguments every frontend accepts are checked here,
once, before anything runs.

>>> report = run_step("x = 1", {})
>>> report.ok, last_report() is report
(True, True)
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..analysis import analyze
from ..capture.end.excerpts import keep_excerpts
from ..capture.history import history_for
from ..capture.runner import cell_filename, make_capture, run_source, run_under_capture
from ..capture.loop.choosing import nothing_recorded
from ..capture.loop.library_step import library_step
from ..report import Report
from ..report.places import Namer, name_places
from ..trace import Trace
from . import compile_replay
from .plan import iteration_replay, replayed, rollback_for
from .engine import choose_engine, python_tier_reason, replay_in_detail, screens_every_op, snapshot_for, wants_replay

_last: list[Report | None] = [None]
_MAX_TIMEOUT = 1e6


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


def check_flag(name: str, value: Any) -> bool:
    """``value`` must be a bool (``"no"`` is truthy: refuse it rather than guess).

    >>> check_flag("every_iteration", True)
    True
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, not {value!r}")
    return value


def check_rollback(rollback: Any) -> bool:
    """``rollback`` must be a bool (see :func:`check_flag`)."""
    return check_flag("rollback", rollback)


def build_report(trace: Trace, fix: str | None = None) -> Report:
    """Run the rules over ``trace`` and remember the result as the last report."""
    exc = trace.exception.summary() if trace.exception else None
    findings = analyze(trace)
    keep_excerpts(trace, [(f.file, f.line) for f in findings])  # (those the trace's own places left out)
    return remember(Report(findings=findings, exception=exc, trace=trace, fix=fix))


def finished_report(trace: Trace, namespace: dict[str, Any], *, places: Namer | None = None,
                    engine_asked: str = "auto", fix: str | None = None) -> Report:
    """The report of a run that ended (``build_report``), its places named as the frontend names them, and why
    the Python tier ran when the engine was left to choose."""
    report = build_report(trace, fix)
    name_places(report, namespace, places)
    if engine_asked == "auto" and trace.engine == "python":
        report.engine_note = python_tier_reason()
    return report


def remember(report: Report) -> Report:
    """Make ``report`` what :func:`last_report` returns (one item assignment: atomic, no lock a Ctrl-C
    could leave held)."""
    _last[0] = report
    return report


def last_report() -> Report | None:
    """The latest report made in this process (by ``diagnose``, the magic, the CLI or a fix)."""
    return _last[0]


def run_step(source: str, namespace: dict[str, Any], *, timeout: float | None = None,
             memory_limit: int | None = None, engine: str = "auto", rollback: bool = True,
             cell_file: str | None = None, execute: Callable[[], BaseException | None] | None = None,
             build: bool = True, history: bool = True, detail: bool | None = None,
             fix: str | None = None, every_iteration: bool = False, places: Namer | None = None,
             stall: bool = False, budget: bool = False) -> Report:
    """Run the cell ``source`` in ``namespace`` under a capture and diagnose it (arguments already
    checked). ``execute``: runs the cell and returns its exception (default: ``exec`` of ``source``
    compiled as ``cell_file``). ``build``: whether the native recorder may be built now (the magic
    says no: a first cell must not wait for a 1-2 min build). ``history``: compare with the cell's earlier runs (stale
    gradients, growing memory; a fix's rewritten cell has none). ``detail``: screen every op for
    NaN/Inf in this run (default: where that is cheap, see ``engine.screens_every_op``). ``fix``: the name the report is labelled
    with. ``every_iteration``: record every iteration of a loop (the native recorder samples them). ``places``:
    the frontend's names for the cell and files (``Cell In[2]``; ``report/places.py``). ``stall``: the timeout
    counts from the latest optimizer step, not from the start (a long loop that keeps stepping is not hung).
    ``budget``: always on's cost budget (``capture/loop/choosing.py``): iterations are recorded op by op only while
    that stays cheap, and the one that fails is replayed in detail (on the native recorder; not for a compiled
    step, whose replay compares compiled and eager runs op by op). Where the run screens only scalars (CUDA), no
    state is copied before the cell: the iteration whose loss goes NaN/Inf keeps its own and is replayed alone."""
    chosen = choose_engine(engine, memory_limit=memory_limit, build=build)
    if detail is None:  # one run, every op screened where that is cheap: no replay, no snapshot (engine.py)
        detail = screens_every_op()
    # Which iteration replay (``plan.py``): a sampled loop (native, CPU) replays the iteration where NaN/Inf first
    # shows unrecorded; with scalars screened only (CUDA) always on copies no state before every cell, and a
    # library's loop is not replayed whole (the library does not start again from the same state): the iteration
    # whose loss goes NaN/Inf keeps its own and is replayed alone with every op screened (a library's loop:
    # through its own step, ``capture/library_step.library_step``).
    kind = iteration_replay(chosen, detail=detail, every_iteration=every_iteration, memory_limit=memory_limit,
                            wanted=rollback)
    lib_step = library_step(namespace, source) if kind is not None else None
    try:
        if kind == "scalars" and not (budget or lib_step is not None):
            kind = None  # (a cell the doctor runs whole: the rollback snapshot replays it)
        sampled, scalars_only = kind == "sampled", kind == "scalars"
        snapshot = snapshot_for(source, namespace) if rollback and not detail and not scalars_only else None
        # torch.compile: a compiled step that goes NaN/Inf or raises is replayed eagerly from this state
        # (compile_replay.py)
        compile_plan = compile_replay.plan(source, namespace, rollback, snapshot)
        past = history_for(source, namespace) if history else None
        iteration_rollback = rollback_for(kind, source, namespace, lib_step[0] if lib_step is not None else None)
        budget = budget and (sampled or scalars_only) and compile_plan is None
        if execute is None:
            trace = run_source(source, namespace, timeout=timeout, memory_limit=memory_limit, filename=cell_file,
                               history=past, detail=detail, engine=chosen, every_iteration=every_iteration,
                               rollback=iteration_rollback, stall=stall, budget=budget)
        else:
            capture = make_capture(chosen, namespace, cell_file=cell_file or cell_filename(), source=source,
                                   memory_limit=memory_limit, history=past, detail=detail,
                                   every_iteration=every_iteration, budget=budget)
            capture.rollback = iteration_rollback
            trace = run_under_capture(execute, capture, timeout, stall)
    finally:
        if lib_step is not None:
            lib_step[1]()  # (the trainer's training_step as it was: the replay runs the one it wrapped)
    trace = replayed(trace, iteration_rollback, namespace, timeout=timeout, engine=chosen, probe=rollback)
    if compile_plan is not None:
        trace = compile_plan.check(trace, lambda: run_step(
            source, namespace, timeout=timeout, memory_limit=memory_limit, engine=chosen, cell_file=trace.cell_file,
            build=False, history=False, detail=True, every_iteration=every_iteration).trace)
        del compile_plan
    if trace.compile_check is None and wants_replay(trace, snapshot):  # (the eager replay screened every op)
        # NaN/Inf seen: replay the step from the saved state with every op checked. The namespace
        # ends as a plain run leaves it (the replay recomputes the same step).
        trace = replay_in_detail(trace, source, namespace, snapshot, timeout=timeout, memory_limit=memory_limit)
    del snapshot
    if budget:
        note = nothing_recorded(trace)
        if note:
            trace.notes.append(note)
    return finished_report(trace, namespace, places=places, engine_asked=engine, fix=fix)
