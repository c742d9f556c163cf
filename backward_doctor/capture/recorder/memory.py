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
from array import array
from typing import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ...trace.parts import STORAGE_EVENTS_CAP, StorageEvents
from ...trace.records import CATEGORIES
from ...util.process import doctors_own

_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s memory in this process: ``t`` itself, or for a wrapper subclass
    with one inner tensor its inner tensor (a ``DTensor``'s local shard: FSDP2's parameters). A wrapper's own
    storage is empty bookkeeping whose data pointer PyTorch refuses to read, and its size is the global one.

    >>> t = torch.zeros(2)
    >>> local_tensor(t) is t
    True
    """
    while type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        inner = [x for x in (getattr(t, n, None) for n in t.__tensor_flatten__()[0]) if isinstance(x, torch.Tensor)]
        if len(inner) != 1:  # (several inner tensors: counted as the wrapper says. DTensor's mesh is no tensor)
            break
        t = inner[0]
    return t


def storage_key(t: torch.Tensor) -> int | None:
    """A stable identity for ``t``'s storage while it is alive (None if it has none)."""
    try:
        return local_tensor(t).untyped_storage()._cdata
    except Exception as exc:  # sparse/nested/subclass tensors without a plain storage
        if not doctors_own(exc):  # (a signal handler's exception: the user's, it goes on)
            raise
        return None


def shape_of(t: torch.Tensor) -> torch.Size:
    """``t.shape``, or an empty size for tensors that have none (a strided nested tensor's is per item).

    >>> list(shape_of(torch.zeros(2, 3)))
    [2, 3]
    """
    try:
        return t.shape
    except RuntimeError as exc:
        if not doctors_own(exc):
            raise
        return torch.Size([])


def grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad``, read without PyTorch's "The .grad attribute of a Tensor that is not a leaf Tensor is being
    accessed" warning: a parameter an in-place update turned into a non-leaf has no ``.grad`` (unless it
    retains one), and a plain run that never reads it prints nothing, so the doctor's reads must not either.

    >>> w = torch.ones(2, requires_grad=True)
    >>> grad_of(w * 2) is None, grad_of(w) is None
    (True, True)
    """
    return t.grad if t.is_leaf or t.retains_grad else None


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (0 for sparse/nested tensors, which have no plain one)."""
    try:
        return local_tensor(t).untyped_storage().nbytes()
    except Exception as exc:
        if not doctors_own(exc):
            raise
        return 0


class MemoryLedger:
    """Running live bytes per category, plus who made each storage.

    Per storage it keeps plain ints in three dicts and one weak reference: the
    ledger runs for every op, and objects the garbage collector tracks (lists,
    tuples, closures) would make Python collect far more often during the step
    (a full collection of a process with torch loaded takes ~0.2 s).
    """

    def __init__(self) -> None:
        self._totals = [0] * len(CATEGORIES)
        self._total = 0
        self._live: dict[int, int] = {}      # storage key -> nbytes
        self._cat: dict[int, int] = {}       # storage key -> category index
        self._producer: dict[int, int] = {}  # storage key -> op index that made it (absent: before the step)
        self._refs: dict[int, weakref.ref] = {}
        self._ref_keys: dict[int, int] = {}  # id(weakref) -> storage key
        # The weak references' callback is a C function: a dead storage's reference is only noted, and
        # counted out at the next read (:meth:`drain`). A Python callback would run Python code wherever a
        # storage dies, and an exception raised there (a cell's own SIGALRM time limit) would be swallowed
        # by CPython ("Exception ignored in ..."): the user's step would run on.
        self._dead: list[weakref.ref] = []
        self._callback = self._dead.append
        self.on_free: Callable[[int], None] | None = None
        self.active = True
        #: every count, free and move in order, 5 ints each (see ``StorageEvents``); None: not kept here
        self.log: array | None = array("q")
        self.dropped = 0
        #: how many ops have started (the capture sets it): when a storage was freed or moved
        self.clock: Callable[[], int] = lambda: 0

    def _note(self, action: int, key: int, nbytes: int, cat: int, op: int) -> None:
        log = self.log
        if log is None:
            return
        if len(log) < STORAGE_EVENTS_CAP * 5:
            log.extend((action, key, nbytes, cat, op))
        else:
            self.dropped += 1

    @property
    def total(self) -> int:
        """Live bytes now."""
        if self._dead:
            self.drain()
        return self._total

    @total.setter
    def total(self, value: int) -> None:
        self._total = value

    @property
    def totals(self) -> list[int]:
        """Live bytes now, by category (``CATEGORIES`` order)."""
        if self._dead:
            self.drain()
        return self._totals

    @totals.setter
    def totals(self, value: list[int]) -> None:
        self._totals = value

    def drain(self) -> None:
        """Count out the storages that died since the last read (see ``__init__``)."""
        dead, keys = self._dead, self._ref_keys
        while dead:
            key = keys.pop(id(dead.pop()), None)
            if key is not None:
                self._freed(key)

    def _freed(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is None or not self.active:
            return
        cat = self._cat.pop(key, None)
        if cat is None:  # (counted only halfway: an exception landed in track())
            return
        self._producer.pop(key, None)
        self._refs.pop(key, None)
        self._totals[cat] -= nbytes
        self._total -= nbytes
        self._note(0, key, nbytes, cat, self.clock())
        if self.on_free is not None:
            self.on_free(key)

    def track(self, t: torch.Tensor, category: str, producer: int | None = None) -> bool:
        """Count ``t``'s storage under ``category`` unless already counted; True if new."""
        if self._dead:
            self.drain()
        try:
            st = local_tensor(t).untyped_storage()
        except Exception as exc:
            if not doctors_own(exc):
                raise
            return False
        key = st._cdata
        if key in self._live:
            return False
        try:
            ref = weakref.ref(st, self._callback)
        except TypeError:
            return False
        nbytes = st.nbytes()
        cat = _CAT_INDEX[category]
        self._live[key] = nbytes
        self._cat[key] = cat
        if producer is not None:
            self._producer[key] = producer
        self._refs[key] = ref
        self._ref_keys[id(ref)] = key
        self._totals[cat] += nbytes
        self._total += nbytes
        self._note(1, key, nbytes, cat, -1 if producer is None else producer)
        return True

    def known(self, key: int) -> bool:
        if self._dead:
            self.drain()
        return key in self._live

    def producer(self, key: int) -> int | None:
        if self._dead:
            self.drain()
        return self._producer.get(key)

    def category(self, key: int) -> str | None:
        if self._dead:
            self.drain()
        cat = self._cat.get(key)
        return None if cat is None else CATEGORIES[cat]

    def reclassify(self, t: torch.Tensor, category: str) -> None:
        """Move ``t``'s storage to ``category`` (tracking it first if needed)."""
        key = storage_key(t)
        if key is None:
            return
        if self._dead:
            self.drain()
        if key not in self._live:
            self.track(t, category)
            return
        old, new = self._cat[key], _CAT_INDEX[category]
        if old != new:
            nbytes = self._live[key]
            self._totals[old] -= nbytes
            self._totals[new] += nbytes
            self._cat[key] = new
            self._note(2, key, nbytes, new, self.clock())

    def snapshot(self) -> dict[str, int]:
        return {c: self.totals[i] for i, c in enumerate(CATEGORIES)}

    def bytes_by_producer(self) -> dict[int | None, int]:
        """Live bytes grouped by the op index that produced them (for module breakdowns)."""
        if self._dead:
            self.drain()
        out: dict[int | None, int] = {}
        producers = self._producer
        for key, nbytes in self._live.items():
            producer = producers.get(key)
            out[producer] = out.get(producer, 0) + nbytes
        return out

    def close(self) -> None:
        """Stop counting and drop every weak reference (their callbacks go with them)."""
        self.active = False
        self._dead.clear()
        for d in (self._live, self._cat, self._producer, self._refs, self._ref_keys):
            d.clear()


def storage_events(flat: array | bytes, dropped: int = 0) -> StorageEvents:
    """A ledger's log (storage keys: addresses) as the trace keeps it: each storage numbered in the order it
    was counted, a new number each time (an address is reused once its storage is freed); the frees and
    moves of storages counted before the log began are left out.

    >>> storage_events(array("q", [1, 9000, 8, 0, 3, 2, 9000, 8, 1, 4, 0, 9000, 8, 1, 5, 1, 9000, 4, 0, 6])).flat
    [1, 0, 8, 0, 3, 2, 0, 8, 1, 4, 0, 0, 8, 1, 5, 1, 1, 4, 0, 6]
    """
    if isinstance(flat, bytes):
        ints = array("q")
        ints.frombytes(flat)
    else:
        ints = flat
    out: list[int] = []
    numbers: dict[int, int] = {}  # storage key -> the number of the storage counted under it now
    counted = 0
    for i in range(0, len(ints) - 4, 5):
        action, key, nbytes, cat, op = ints[i:i + 5]
        if action == 1:
            number = numbers[key] = counted
            counted += 1
        elif key in numbers:
            number = numbers[key]
        else:
            continue
        out.extend((action, number, nbytes, cat, op))
        if action == 0:
            del numbers[key]
    return StorageEvents(flat=out, dropped=dropped)


class Timeline:
    """Live bytes by category after each op, in bounded memory.

    Up to ``capacity`` samples are kept; when full, neighbouring samples are merged
    (the one with the larger total survives, so peaks are never lost) and each
    sample from then on stands for twice as many ops. Samples live in flat
    ``array`` buffers (no Python object per op, see :class:`MemoryLedger`).

    >>> tl = Timeline(capacity=4)
    >>> for i in range(10):
    ...     tl.add(i, [i, 0], i)
    >>> tl.samples()[0], tl.stride
    ([3, 7, 9], 4)
    """

    def __init__(self, capacity: int = 20_000) -> None:
        self.capacity = capacity
        self.stride = 1
        self.index = array("q")
        self._flat = array("q")   # category totals of every sample, one after the other
        self._width = 0
        self._pending: tuple[int, list[int], int] | None = None  # best sample of the open bucket
        self._in_bucket = 0

    def add(self, index: int, totals: list[int], total: int) -> None:
        if self.stride == 1 and len(self.index) < self.capacity - 1:  # the common case: keep every op
            # The width is set before the rows it describes: an exception from a signal handler (a cell's own
            # SIGALRM) may land between any two statements here, and samples() reads only whole rows.
            self._width = len(totals)
            n, k = len(self._flat), len(self.index)
            try:  # both or neither, so later rows stay paired with their ops
                self._flat.extend(totals)
                self.index.append(index)
            except BaseException:  # (a handler may run just after append returned, still inside this try)
                del self._flat[n:]
                del self.index[k:]
                raise
            return
        pending = self._pending
        if pending is None or total >= pending[2]:
            self._pending = (index, list(totals), total)
        self._in_bucket += 1
        if self._in_bucket >= self.stride:
            self._close_bucket()

    def extend(self, index: array, flat: array, width: int = 5) -> None:
        """:meth:`add` for many samples (``width`` totals each, one after the other in ``flat``); the
        total of each is the sum of its totals."""
        if self.stride == 1 and len(self.index) + len(index) < self.capacity:
            if len(index):
                self._width = width
            self._flat.extend(flat)
            self.index.extend(index)
            return
        for i, at in enumerate(index):
            totals = list(flat[i * width:(i + 1) * width])
            self.add(at, totals, sum(totals))

    def _row(self, i: int) -> list[int]:
        w = self._width
        return list(self._flat[i * w:(i + 1) * w])

    def _close_bucket(self) -> None:
        if self._pending is None:
            return
        index, totals, _ = self._pending
        self._width = len(totals)
        self._flat.extend(totals)
        self.index.append(index)
        self._pending, self._in_bucket = None, 0
        if len(self.index) >= self.capacity:
            n = len(self.index)
            keep = [max(i, i + 1, key=lambda j: sum(self._row(j))) if i + 1 < n else i for i in range(0, n, 2)]
            flat = array("q")
            for i in keep:
                flat.extend(self._row(i))
            self.index = array("q", (self.index[i] for i in keep))
            self._flat = flat
            self.stride *= 2

    def samples(self) -> tuple[list[int], list[list[int]]]:
        """(op indices, totals per sample), including the open bucket."""
        # Only rows whose index and totals were both written (see add): an interrupted add leaves one of them.
        rows = min(len(self.index), len(self._flat) // self._width) if self._width else 0
        index = list(self.index[:rows])
        totals = [self._row(i) for i in range(rows)]
        if self._pending is not None:
            index.append(self._pending[0])
            totals.append(list(self._pending[1]))
        return index, totals
