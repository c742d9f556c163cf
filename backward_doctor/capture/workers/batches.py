"""The batches an ``IterableDataset``'s workers deliver, fingerprinted in the main process (the worker watch's part,
``workers/main_side.py``): a DataLoader copies the dataset into each of its ``num_workers`` processes, and an
``IterableDataset`` whose ``__iter__`` does not split its stream by ``torch.utils.data.get_worker_info()`` is
iterated in full by every one of them: each sample comes ``num_workers`` times an epoch, and nothing raises.

Only loaders of an ``IterableDataset`` with two workers or more are looked at, and only their first batches: a few
hundred bytes of each batch's first tensors are hashed (read in place: no op dispatched, nothing kept but the hash).
The sign is a batch equal to one *another* worker delivered, again and again, while no worker repeats its own (a
dataset that yields one constant batch is not a duplicated stream).

>>> import torch
>>> prints = BatchPrints()
>>> for k in range(4):
...     for worker in (0, 1):  # (two workers, each iterating the whole stream)
...         prints.saw(worker, torch.full((2,), float(k)))
>>> prints.checked, prints.duplicated, prints.repeated
(8, 4, 0)
"""
from __future__ import annotations

import ctypes
import inspect
import zlib
from typing import Any, Iterator

import torch

_CHECKED = 32  # batches fingerprinted per iterator (its first ones)
_BYTES = 256   # bytes hashed of each tensor
_TENSORS = 4   # tensors of a batch looked at


def duplicates_possible(loader: Any) -> bool:
    """A loader whose workers may each deliver the whole stream: an ``IterableDataset`` with two workers or more.

    >>> duplicates_possible(torch.utils.data.DataLoader(list(range(4)), num_workers=2))
    False
    """
    return isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset) and \
        int(getattr(loader, "num_workers", 0) or 0) >= 2


class BatchPrints:
    """Fingerprints of an iterator's first batches, by the worker that delivered them (see the module doc)."""

    def __init__(self) -> None:
        self._seen: dict[int, set[int]] = {}  # fingerprint -> the workers that delivered it
        self.checked = 0     # batches fingerprinted
        self.duplicated = 0  # batches equal to one another worker delivered before
        self.repeated = 0    # batches equal to one the same worker delivered before

    def saw(self, worker: int | None, data: Any) -> None:
        """Worker ``worker`` delivered batch ``data`` (None: which worker is not known, nothing counted)."""
        if worker is None or self.checked >= _CHECKED:
            return
        print_ = fingerprint(data)
        if print_ is None:
            return
        self.checked += 1
        workers = self._seen.setdefault(print_, set())
        if worker in workers:
            self.repeated += 1
        elif workers:
            self.duplicated += 1
        workers.add(worker)

    def duplicates_stream(self) -> bool:
        """Batches came again from other workers (two or more), and no worker repeated its own."""
        return self.duplicated >= 2 and self.repeated == 0


def fingerprint(data: Any) -> int | None:
    """A hash of a batch's first tensors (their shapes, dtypes and first bytes; None: no plain CPU tensor in it).

    >>> fingerprint({"x": torch.ones(3)}) == fingerprint([torch.ones(3)]), fingerprint("text")
    (True, None)
    """
    h, found = 0, False
    for t in _tensors(data):
        # (plain, dense, contiguous CPU tensors read in place: ``data_ptr`` dispatches no op)
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided or \
                not t.is_contiguous():
            continue
        found = True
        h = zlib.crc32(f"{tuple(t.shape)}{t.dtype}".encode(), h)
        n = min(t.numel() * t.element_size(), _BYTES)
        if n:
            h = zlib.crc32(ctypes.string_at(t.data_ptr(), n), h)
    return h if found else None


def _tensors(data: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The first tensors of a batch: itself, or in its lists, tuples and dicts (values in order), a few levels."""
    if isinstance(data, torch.Tensor):
        yield data
        return
    if depth > 3:
        return
    items = data.values() if isinstance(data, dict) else data if isinstance(data, (list, tuple)) else ()
    count = 0
    for item in items:
        for t in _tensors(item, depth + 1):
            yield t
            count += 1
            if count >= _TENSORS:
                return


def iter_source(dataset: Any) -> tuple[str | None, int | None, bool | None]:
    """Where the dataset's class defines ``__iter__`` (file, first line) and whether that code reads
    ``get_worker_info`` (None: its source cannot be read).

    >>> iter_source(object())
    (None, None, None)
    """
    fn = getattr(type(dataset), "__iter__", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None, None, None
    try:
        reads = "get_worker_info" in inspect.getsource(fn)
    except (OSError, TypeError):
        reads = None
    return code.co_filename, code.co_firstlineno, reads


__all__ = ["BatchPrints", "duplicates_possible", "fingerprint", "iter_source"]
