"""Two tiers: a cheap capture on every run, a detailed replay only when it is needed.

The first tier (``Capture(detail=False)``) records ops, memory and the loss's
finiteness; when it sees NaN/Inf it cannot yet say which op made it. Then the
step is replayed from the training state saved before it (the rollback
snapshot), with every op's output screened: the same step, seen in detail.

>>> import torch
>>> ns = {"w": torch.nn.Parameter(torch.ones(2))}
>>> snap = snapshot_for("loss = (w / 0).sum()", ns)
>>> snap is not None
True
"""
from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

from .trace import Trace


def snapshot_for(source: str, namespace: dict[str, Any]) -> Any:
    """The rollback snapshot of what ``source`` may change (None when it cannot or should not be taken)."""
    from .fixes.cell import Cell, stored_names
    from .fixes.snapshot import Snapshot, available_ram, estimate_bytes

    try:
        cell = Cell(source)
        rebinds = stored_names(cell.stmts)
    except Exception:  # a cell we cannot parse: the run will report the SyntaxError
        return None
    need, avail = estimate_bytes(namespace, rebinds), available_ram()
    if avail is not None and need > 0.8 * avail:
        warnings.warn(f"backward_doctor: no rollback snapshot ({need} bytes needed, {avail} available); "
                      "a NaN/Inf origin cannot be replayed in detail", RuntimeWarning, stacklevel=3)
        return None
    try:
        return Snapshot.take(namespace, rebinds)
    except Exception as exc:  # never lose the diagnosis to the snapshot
        warnings.warn(f"backward_doctor: no rollback snapshot ({type(exc).__name__}: {exc})", RuntimeWarning,
                      stacklevel=3)
        return None


def replay_in_detail(first: Trace, source: str, namespace: dict[str, Any], snapshot: Any, *,
                     timeout: float | None, memory_limit: int | None) -> Trace:
    """Restore ``snapshot`` and run the step again with every op checked; returns the detailed trace.

    The replay is silent (its prints are swallowed: the user saw them once). What
    only the first run could judge, comparisons with earlier runs of the cell, is
    carried over from ``first``.
    """
    from .runner import run_source

    snapshot.restore(namespace)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        detailed = run_source(source, namespace, timeout=timeout, memory_limit=memory_limit,
                              filename=first.cell_file, detail=True)
    detailed.stale_steps = first.stale_steps
    detailed.graph_holders = first.graph_holders
    detailed.history = first.history
    detailed.run_id = first.run_id
    detailed.notes.append("NaN/Inf appeared in this step: it was replayed from the state saved before it, "
                          "with every op's output checked, to find the op that made it")
    return detailed
