"""An ``IterableDataset`` that every DataLoader worker iterates in full (``trace.loaders``' fingerprinted batches,
``capture/workers/batches.py``): each of the ``num_workers`` processes gets a copy of the dataset, and an
``__iter__`` that does not split its stream by ``torch.utils.data.get_worker_info()`` makes every sample come
``num_workers`` times an epoch. Nothing raises; the model trains on duplicated data and an "epoch" is several.
Named at the dataset's ``__iter__``, the code to change, with the fix as code.

>>> from backward_doctor.trace import Trace
>>> duplicated_stream(Trace())
[]
"""
from __future__ import annotations

from ..findings import Finding, at, looped
from ...trace.records import Trace, Where
from ...trace.stacks import LoaderRecord

FIX = ("info = torch.utils.data.get_worker_info()\n"
       "worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)\n"
       "for i, sample in enumerate(stream):  # your __iter__'s own stream\n"
       "    if i % workers == worker:  # each worker its share\n"
       "        yield sample")


def duplicated_stream(trace: Trace) -> list[Finding]:
    """The first loader whose workers delivered each other's batches (see the module doc)."""
    rec = next((r for r in trace.loaders if r.duplicated), None)
    return [_finding(trace, rec)] if rec is not None else []


def _finding(trace: Trace, rec: LoaderRecord) -> Finding:
    name = rec.dataset or "the dataset"
    if rec.iter_line is not None:
        where = Where(line=rec.iter_line, file=rec.iter_file, cell_line=rec.loop_line, function=f"{name}.__iter__")
        def_at = f"line {rec.iter_line}" if rec.iter_file is None else \
            f"`{rec.iter_file.rsplit('/', 1)[-1]}:{rec.iter_line}`"
    else:
        where, def_at = Where(line=rec.loop_line, cell_line=rec.loop_line), "its definition"
    if rec.reads_worker_info:
        split = (f"`{name}.__iter__` ({def_at}) reads `get_worker_info()`, but its workers still deliver the same "
                 "batches: check that each worker keeps only its share of the stream (a shard, or every "
                 "`num_workers`-th sample from its `id`).")
    else:
        split = (f"`{name}.__iter__` ({def_at}) does not split the stream between them"
                 + (" (it never reads `torch.utils.data.get_worker_info()`)" if rec.reads_worker_info is False
                    else "") + ".")
    n = rec.num_workers
    msg = (f"Every DataLoader worker iterates the whole `{name}`: of the first {rec.batches_checked} batches, "
           f"{rec.duplicated} were equal to a batch another worker had already delivered. A DataLoader gives each "
           f"of its `num_workers={n}` processes its own copy of an `IterableDataset`, and {split} Each sample comes "
           f"{n} times an epoch: the model trains on duplicated data, and each epoch makes {n} passes over it. Give "
           "each worker its share in `__iter__` (as below), or use a map-style `Dataset` with a sampler.")
    return at("dataloader_worker", where, msg, severity="warning", title="Every worker iterates the whole dataset",
              iteration=looped(trace, 0),
              evidence={"worker": None, "task": "", "state": "duplicated", "dataset": rec.dataset,
                        "num_workers": n, "batches_checked": rec.batches_checked, "duplicated": rec.duplicated,
                        "reads_worker_info": rec.reads_worker_info, "loop_line": rec.loop_line,
                        "fix_code": FIX})


__all__ = ["duplicated_stream"]
