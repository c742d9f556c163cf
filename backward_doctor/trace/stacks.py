"""Stacks the main process did not run itself: other threads' (a hang's), and the DataLoader worker processes' with
what each was loading, for the loaders whose workers went wrong or delivered each other's batches
(``capture/workers/main_side.py``).

>>> LoaderRecord("DataLoader(DS, num_workers=2)", workers=[WorkerRecord(0, state="raised")]).workers[0].state
'raised'
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FrameInfo:
    file: str
    line: int
    function: str
    in_cell: bool = False
    user: bool = False
    code: str = ""


@dataclass
class ThreadStack:
    name: str
    ident: int
    is_main: bool
    frames: list[FrameInfo] = field(default_factory=list)


@dataclass
class WorkerRecord:
    """One DataLoader worker process as the main process saw it when something went wrong
    (``capture/workers/main_side.py``): what it was doing, its stack, its error."""

    worker: int                    # the worker's id in its DataLoader (0 .. num_workers-1)
    pid: int = 0
    state: str = ""                # "fetching", "idle", "raised", "could not send", "exited", "crashed", "no answer"
    task: str = ""                 # what it was loading: "dataset[5]", "batch [4, 5, 6, 7]"
    frames: list[FrameInfo] = field(default_factory=list)  # its stack (outermost first): photographed or at its error
    error: str = ""                # its own error, "ValueError: bad sample 5"
    exitcode: int | None = None    # how it ended, for a worker that is gone (negative: killed by that signal)
    made_at: list[FrameInfo] = field(default_factory=list)  # where a tensor requiring grad it held was made
    waited_on: bool = False        # the main process was waiting for this worker's batch


@dataclass
class LoaderRecord:
    """A DataLoader whose workers were started during the run and did not simply deliver their batches."""

    loader: str                    # "DataLoader(Tokens, batch_size=4, num_workers=2, persistent_workers=True)"
    dataset: str = ""              # the dataset's class (``Tokens``)
    num_workers: int = 0
    context: str = ""              # how workers start: "fork", "spawn", "forkserver"
    workers: list[WorkerRecord] = field(default_factory=list)
    photographed: bool = False     # the workers' stacks were taken (a hang: on the timeout or Ctrl-C)
    #: an IterableDataset's loader with 2+ workers (``capture/workers/batches.py``): its first batches fingerprinted,
    #: and how many were equal to a batch another worker had delivered (every worker iterating the whole stream)
    batches_checked: int = 0
    duplicated: int = 0
    iter_file: str | None = None   # where the dataset's class defines ``__iter__`` (None: in the cell, or unknown)
    iter_line: int | None = None
    reads_worker_info: bool | None = None  # that code reads ``get_worker_info()`` (None: its source not readable)
    loop_line: int | None = None   # the cell's line that iterates the loader


__all__ = ["FrameInfo", "LoaderRecord", "ThreadStack", "WorkerRecord"]
