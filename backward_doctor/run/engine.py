"""How a step is seen: once, every op screened; a replay only where that cannot be afforded.

On the CPU the one run screens every op's output for NaN/Inf as it goes
(``detail=True``; the native recorder in C++, skipping ops that keep finite values
finite), so the op that made a NaN is known without running the cell's code a second
time. On CUDA a per-op screen would synchronise the device after every op: there the
first run screens only scalar outputs (the loss) and, when NaN/Inf shows, the step is
replayed from the training state saved before it (the rollback snapshot), with every
op screened; the report then says that the cell's code ran twice.

>>> import torch
>>> ns = {"w": torch.nn.Parameter(torch.ones(2))}
>>> snap = snapshot_for("loss = (w / 0).sum()", ns)
>>> snap is not None
True
"""
from __future__ import annotations

import logging
import contextlib
import io
import warnings
from typing import Any

from ..trace.records import Trace

log = logging.getLogger(__name__)


def snapshot_for(source: str, namespace: dict[str, Any]) -> Any:
    """The rollback snapshot of what ``source`` may change (None when it cannot or should not be taken)."""
    from ..util.cell import Cell, stored_names
    from .snapshot import take_if_it_fits

    try:
        rebinds = stored_names(Cell(source).stmts)
    except Exception:  # a cell we cannot parse: the run will report the SyntaxError
        log.debug("no snapshot: the cell does not parse", exc_info=True)
        return None
    snapshot, why_not = take_if_it_fits(namespace, rebinds, source)
    if snapshot is None:
        warnings.warn(f"backward_doctor: no rollback snapshot ({why_not}); a NaN/Inf origin cannot be replayed "
                      "in detail", RuntimeWarning, stacklevel=3)
    return snapshot


ENGINES = ("auto", "native", "python")


def check_engine(engine: Any) -> str:
    """``ValueError`` for an unknown engine name (before anything runs)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return engine


def choose_engine(engine: str, *, memory_limit: int | None = None, build: bool = True) -> str:
    """The engine the run records on: ``"native"`` or ``"python"``.

    ``auto`` takes the native recorder when it is built (building it the first time,
    once per torch version, cached after) and torch has no CUDA (its CUDA path has not run on a GPU yet).
    A simulated ``memory_limit`` runs on either: the native recorder fails the allocation
    that would overflow the device, inside the op, as a real device does. ``native``
    insists (ValueError, saying why, if it cannot be had); ``python`` never uses it.
    ``build=False``: do not wait for a build (the magic starts one in the background when
    the extension is loaded).

    >>> choose_engine("python")
    'python'
    """
    if engine == "python":
        return "python"
    from .. import native
    from ..capture.native_capture import native_available

    why = None
    if not native_available(build=build or engine == "native"):
        status = native.status()
        why = status["reason"] or ("the native recorder is still being built" if status["building"]
                                   else "the native recorder is not available here")
    if why is None:
        return "native"
    if engine == "native":
        raise ValueError(f"engine='native' cannot be used: {why}")
    return "python"


def python_tier_reason() -> str | None:
    """Why ``auto`` recorded with the Python tier just now, in words for a report's footer (None: switched
    off on purpose, nothing to say).

    >>> python_tier_reason() is None or isinstance(python_tier_reason(), str)
    True
    """
    from .. import native

    status = native.status()
    if not status["enabled"]:
        return None
    if status["building"]:
        return "the native recorder was still being built (it is used from the next run on)"
    if status["reason"]:
        return f"the native recorder could not be built: {status['reason']}"
    import torch

    if torch.cuda.is_available():
        return None  # auto keeps the Python tier on a machine with a GPU by design (native_capture.native_available)
    return "the native recorder is not built yet"


def screens_every_op() -> bool:
    """True where the one run screens every op for NaN/Inf (the CPU); False once the process uses CUDA, where a
    screen per op would synchronise the device after every op and the first run screens only scalars (see module
    doc). A machine with a GPU the process has not touched runs CPU steps as the CPU does.

    >>> isinstance(screens_every_op(), bool)
    True
    """
    from ..capture.state import cuda_in_use

    return not cuda_in_use()


def wants_replay(trace: Trace, snapshot: Any) -> bool:
    """The first tier asks for the detailed run, and one can be had: a snapshot to replay from, and a
    step that ended by itself (a hang or a Ctrl-C is never run a second time).

    >>> wants_replay(Trace(needs_detail="nonfinite"), snapshot=None)
    False
    """
    if not trace.needs_detail or snapshot is None or trace.timed_out:
        return False
    return trace.exception is None or trace.exception.type != "KeyboardInterrupt"


def replay_in_detail(first: Trace, source: str, namespace: dict[str, Any], snapshot: Any, *,
                     timeout: float | None, memory_limit: int | None) -> Trace:
    """Restore ``snapshot`` and run the step again with every op checked, on the engine of the first
    run (the native recorder screens outputs in C++; the Python tier in its dispatch mode).

    The replay is silent (its prints are swallowed: the user saw them once). What
    only the first run could judge, comparisons with earlier runs of the cell, is
    carried over from ``first``. The state the run left (weights, optimizer state, RNG, the objects its names
    were bound to) is put back after the replay where a copy fits: a NaN/Inf the replay does not make again
    (transient) would otherwise leave the replay's finite weights where the run left NaN. (What the cell did
    to other objects, a list it appends to, happened twice: the note says so.)
    """
    from ..capture.native_capture import native_available
    from ..capture.runner import run_source
    from ..trace.queries import made_nonfinite_again
    from .snapshot import Bindings, take_if_it_fits

    engine = "native" if first.engine == "native" and native_available() else "python"
    end, why_not = take_if_it_fits(namespace, source=source)
    left = Bindings(namespace, contents=False)
    snapshot.restore(namespace)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            detailed = run_source(source, namespace, timeout=timeout, memory_limit=memory_limit,
                                  filename=first.cell_file, detail=True, engine=engine)
    finally:
        if end is not None:
            end.restore(namespace)
            left.restore(namespace)
    if end is None:  # (into both: one of them is the report's)
        for t in (first, detailed):
            t.notes.append(f"The state the run left could not be kept to put back after the replay ({why_not}): "
                           "the namespace holds the replay's")
    # (a NaN/Inf that reached nothing, a mask's -inf, is not the one the run saw, unless that one reached nothing)
    loose = first.iterations.first_nonfinite is None and not any(first.nonfinite_reached.values())
    if not made_nonfinite_again(detailed, loose=loose):
        # Replayed, the step stayed finite (or did other work: a library's trainer that had reached its last step
        # returns at once): the first run's report stands, with what it could not locate.
        steps = ("" if detailed.iterations.steps == first.iterations.steps else
                 f" (the replay ran {detailed.iterations.steps} optimizer steps, the run {first.iterations.steps}: "
                 "state outside the model and the optimizer, such as a trainer's step count, was not rolled back)")
        first.notes.append("NaN/Inf appeared in this step; replayed from the state saved before it with every op's "
                           f"output checked, it did not appear again{steps}, so where it was born is not known. The "
                           "cell's code ran twice")
        first.needs_detail = "nonfinite:not_reproduced"  # (the rule says so rather than ask for a replay)
        # transient: the same state did not make it again (unknown where the replay did other work than the run)
        first.nonfinite_reproduced = False if not steps else None
        return first
    detailed.nonfinite_reproduced = True
    detailed.stale_steps = first.stale_steps
    detailed.graph_holders = first.graph_holders
    detailed.history = first.history
    detailed.run_id = first.run_id
    detailed.notes.append("NaN/Inf appeared in this step: it was replayed from the state saved before it, with "
                          "every op's output checked, to find the op that made it. The cell's code ran twice: what "
                          "it did outside the model, the optimizer and the names it assigns (the next batch of an "
                          "iterator, appends to a list, files, printed output, which was hidden) happened twice")
    return detailed
