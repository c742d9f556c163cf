"""Live-tensor accounting on any device: each storage counted once, by category.

The ledger holds only weak references to storages: a callback subtracts a
storage's bytes the moment PyTorch frees it, so the ledger never keeps memory
alive. Views and in-place outputs share their base's storage and are not
counted again.

>>> import torch
>>> ledger = MemoryLedger()
>>> t = torch.zeros(256)
>>> ledger.track(t, "other")
True
>>> ledger.total
1024
>>> del t; ledger.total
0
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from .trace import CATEGORIES

_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


def storage_key(t: torch.Tensor) -> int | None:
    """A stable identity for ``t``'s storage while it is alive (None if it has none)."""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # sparse/nested/subclass tensors without a plain storage
        return None


class MemoryLedger:
    """Running live bytes per category, plus who made each storage."""

    def __init__(self) -> None:
        self.totals = [0] * len(CATEGORIES)
        self.total = 0
        # key -> [nbytes, category index, producer op index, weakref]
        self._live: dict[int, list] = {}
        self.on_free: Callable[[int], None] | None = None
        self.active = True

    def _freed(self, key: int, _ref: object = None) -> None:
        entry = self._live.pop(key, None)
        if entry is None or not self.active:
            return
        self.totals[entry[1]] -= entry[0]
        self.total -= entry[0]
        if self.on_free is not None:
            self.on_free(key)

    def track(self, t: torch.Tensor, category: str, producer: int | None = None) -> bool:
        """Count ``t``'s storage under ``category`` unless already counted; True if new."""
        try:
            st = t.untyped_storage()
        except Exception:
            return False
        key = st._cdata
        if key in self._live:
            return False
        nbytes = st.nbytes()
        try:
            ref = weakref.ref(st, lambda r, k=key: self._freed(k))
        except TypeError:
            return False
        cat = _CAT_INDEX[category]
        self._live[key] = [nbytes, cat, producer, ref]
        self.totals[cat] += nbytes
        self.total += nbytes
        return True

    def known(self, key: int) -> bool:
        return key in self._live

    def producer(self, key: int) -> int | None:
        entry = self._live.get(key)
        return entry[2] if entry else None

    def category(self, key: int) -> str | None:
        entry = self._live.get(key)
        return CATEGORIES[entry[1]] if entry else None

    def reclassify(self, t: torch.Tensor, category: str) -> None:
        """Move ``t``'s storage to ``category`` (tracking it first if needed)."""
        key = storage_key(t)
        if key is None:
            return
        if key not in self._live:
            self.track(t, category)
            return
        entry = self._live[key]
        new = _CAT_INDEX[category]
        if entry[1] != new:
            self.totals[entry[1]] -= entry[0]
            self.totals[new] += entry[0]
            entry[1] = new

    def snapshot(self) -> dict[str, int]:
        return {c: self.totals[i] for i, c in enumerate(CATEGORIES)}

    def bytes_by_producer(self) -> dict[int | None, int]:
        """Live bytes grouped by the op index that produced them (for module breakdowns)."""
        out: dict[int | None, int] = {}
        for nbytes, _cat, producer, _ref in self._live.values():
            out[producer] = out.get(producer, 0) + nbytes
        return out

    def close(self) -> None:
        """Stop counting and drop every weak reference (their callbacks go with them)."""
        self.active = False
        self._live.clear()


class Timeline:
    """Live bytes by category after each op, in bounded memory.

    Up to ``capacity`` samples are kept; when full, neighbouring samples are merged
    (the one with the larger total survives, so peaks are never lost) and each
    sample from then on stands for twice as many ops.

    >>> tl = Timeline(capacity=4)
    >>> for i in range(10):
    ...     tl.add(i, [i, 0], i)
    >>> tl.samples()[0], tl.stride
    ([3, 7, 9], 4)
    """

    def __init__(self, capacity: int = 20_000) -> None:
        self.capacity = capacity
        self.stride = 1
        self.index: list[int] = []
        self.totals: list[list[int]] = []   # one list of category totals per sample
        self._pending: tuple[int, list[int], int] | None = None  # best sample of the open bucket
        self._in_bucket = 0

    def add(self, index: int, totals: list[int], total: int) -> None:
        if self.stride == 1 and len(self.index) < self.capacity - 1:  # the common case: keep every op
            self.index.append(index)
            self.totals.append(totals.copy())
            return
        pending = self._pending
        if pending is None or total >= pending[2]:
            self._pending = (index, list(totals), total)
        self._in_bucket += 1
        if self._in_bucket >= self.stride:
            self._close_bucket()

    def _close_bucket(self) -> None:
        if self._pending is None:
            return
        index, totals, _ = self._pending
        self.index.append(index)
        self.totals.append(totals)
        self._pending, self._in_bucket = None, 0
        if len(self.index) >= self.capacity:
            keep = [max(i, i + 1, key=lambda j: sum(self.totals[j])) if i + 1 < len(self.index) else i
                    for i in range(0, len(self.index), 2)]
            self.index = [self.index[i] for i in keep]
            self.totals = [self.totals[i] for i in keep]
            self.stride *= 2

    def samples(self) -> tuple[list[int], list[list[int]]]:
        """(op indices, totals per sample), including the open bucket."""
        if self._pending is not None:
            index, totals, _ = self._pending
            return self.index + [index], self.totals + [totals]
        return list(self.index), list(self.totals)
