"""What every way of running a diagnosis decides the same way: whether the iteration where a loop first goes
NaN/Inf (or raises) while the recorder did not record it is replayed alone, with what state kept for it, and that
replay once the run ended. :func:`~backward_doctor.run.step.run_step` (a cell the doctor runs) and
:class:`~backward_doctor.run.open_diagnosis.OpenDiagnosis` (code already running: always on's trigger, the library
callbacks) both ask here; the report at the end is ``step.finished_report``.

>>> iteration_replay("native", detail=True, every_iteration=False, memory_limit=None)
'sampled'
>>> iteration_replay("python", detail=False, every_iteration=False, memory_limit=None)
'scalars'
>>> iteration_replay("native", detail=True, every_iteration=True, memory_limit=None) is None
True
"""
from __future__ import annotations

from typing import Any, Callable

from .. import native
from ..trace import Trace
from .iteration_replay import IterationRollback, replay_iteration
from .spike_replay import probe_spike


def iteration_replay(engine: str, *, detail: bool, every_iteration: bool, memory_limit: int | None,
                     wanted: bool = True) -> str | None:
    """How an unrecorded iteration that went wrong is replayed alone: ``"sampled"`` (the native recorder on the
    CPU samples a loop's iterations: the first one to go NaN/Inf or raise unrecorded is replayed with every op
    screened, from the state kept as it began), ``"scalars"`` (the Python recorder screening scalar outputs only,
    as on CUDA: the iteration whose loss goes NaN/Inf keeps its own state and is replayed alone), None (every
    iteration recorded, or a simulated memory limit: the run itself is the record). ``wanted``: the caller has
    something to replay (rollback asked for; a loop or a library's step to run again)."""
    if not wanted or memory_limit is not None:
        return None
    if detail and engine == "native" and not every_iteration:
        return "sampled"
    if not detail and engine == "python":
        return "scalars"
    return None


def rollback_for(kind: str | None, source: str, namespace: dict[str, Any],
                 find_body: Callable[[], Any] | None = None) -> IterationRollback | None:
    """The run-level rollback the capture tells each iteration's start (None: ``kind`` is None). ``find_body``: a
    library's loop, whose step is run again rather than the cell's loop body."""
    if kind == "sampled":
        return IterationRollback(source, namespace, native.load(build=False), find_body=find_body)
    if kind == "scalars":
        return IterationRollback(source, namespace, find_body=find_body, scalars_only=True)
    return None


def replayed(trace: Trace, rollback: IterationRollback | None, namespace: dict[str, Any], *,
             timeout: float | None, engine: str, probe: bool = True) -> Trace:
    """``trace`` with the iteration the rollback kept state for replayed in detail (itself when none was), and a
    loss that spiked without NaN/Inf probed (``spike_replay.py``: decided from the loss series after the run; not
    with ``probe=False``, a run that asked for no replay: a rank's, whose collectives would have no peers)."""
    if rollback is not None and rollback.iteration is not None:
        return replay_iteration(trace, rollback, namespace, timeout=timeout, engine=engine)
    return probe_spike(trace, namespace, run_again=probe)


__all__ = ["iteration_replay", "replayed", "rollback_for"]
