"""What the doctor remembers about one cell across its runs (bounded; no tensors held).

Silent bugs show only from one run to the next: memory that grows, gradients that
were never cleared before the next ``optimizer.step()``. Each cell (by its source
and namespace) gets a :class:`CellHistory`: a short list of run summaries (numbers
and strings) and a weak map from gradient tensors to the step that used them.

>>> h = history_for("loss.backward()", {})
>>> list(h.runs)
[]
"""
from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

from ..util.process import interrupts_deferred

_MAX_RUNS = 20
_MAX_CELLS = 64


@dataclass
class RunSummary:
    """One run of the cell, in numbers."""

    run_id: int
    live_bytes_end: int
    stepped: bool
    seq_start: int = 0  # autograd sequence numbers of the nodes this run created: [start, end)
    seq_end: int = 0
    amp_skipped: int = 0
    exception: str | None = None


@dataclass
class CellHistory:
    """Runs of one cell, most recent last (at most 20)."""

    key: str
    runs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_MAX_RUNS))
    #: gradient tensor -> (run id, step line) of the optimizer step that consumed it, weakly keyed:
    #: a gradient still here at the next step was never cleared in between.
    stepped_grads: Any = field(default_factory=WeakIdKeyDictionary)

    def add(self, summary: RunSummary) -> None:
        self.runs.append(summary)

    def live_bytes(self) -> list[int]:
        return [r.live_bytes_end for r in self.runs]


_cells: "collections.OrderedDict[str, CellHistory]" = collections.OrderedDict()
_lock = threading.Lock()


def cell_key(source: str, namespace: dict[str, Any]) -> str:
    """Same source in the same namespace = the same cell."""
    digest = hashlib.sha1(source.strip().encode("utf-8", "replace")).hexdigest()[:16]
    return f"{id(namespace):x}:{digest}"


def history_for(source: str, namespace: dict[str, Any]) -> CellHistory:
    """The history of this cell, created on first use (least recently used cells forgotten)."""
    key = cell_key(source, namespace)
    with interrupts_deferred(), _lock:  # a Ctrl-C must not leave the lock held
        hist = _cells.get(key)
        if hist is None:
            hist = _cells[key] = CellHistory(key=key)
            while len(_cells) > _MAX_CELLS:
                _cells.popitem(last=False)
        else:
            _cells.move_to_end(key)
        return hist


def forget_all() -> None:
    """Drop every cell's history (tests, or a user starting over)."""
    with interrupts_deferred(), _lock:  # a Ctrl-C must not leave the lock held
        _cells.clear()
