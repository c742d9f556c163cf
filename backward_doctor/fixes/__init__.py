"""Fixes: re-run a failing step with gradient accumulation, AMP, activation checkpointing or sync checks.

Each fix rewrites the cell into plain code a person keeps (an explicit micro-batch
loop, a ``torch.autocast`` block, ``torch.utils.checkpoint`` around chosen modules,
explicit index checks) and runs *that* code under the same capture as any cell,
with the training state rolled back in between, so the report compares the
original run with the fixed one on real numbers.

>>> from backward_doctor.fixes import parse_fix
>>> parse_fix("accumulate:8").arg
8
"""
from __future__ import annotations

from typing import Any, Callable

from ..report.fix_result import FixResult
from .spec import KNOWN_FIXES, FixSpec, parse_fix

__all__ = ["FixResult", "FixSpec", "KNOWN_FIXES", "parse_fix", "run_fix"]


def run_fix(source: str, namespace: dict[str, Any] | None, fix: str, *, original: Any = None,
            timeout: float | None = None, memory_limit: int | str | None = None, rollback: bool = True,
            progress: Callable[[float, str], None] | None = None, cancel: Callable[[], bool] | None = None):
    """Apply ``fix`` to the cell and run it; returns the fixed run's ``Report`` with ``fix_result``.

    Full description: :func:`backward_doctor.fixes.apply.run_fix` (imported lazily: it pulls in the capture).
    """
    from .apply import run_fix as _run_fix

    return _run_fix(source, namespace, fix, original=original, timeout=timeout, memory_limit=memory_limit,
                    rollback=rollback, progress=progress, cancel=cancel)
