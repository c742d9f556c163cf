"""What one rank of a distributed run left behind: its collectives, parameters without a gradient, how
it ended, and (when it got that far) the trace of its run.

Like the rest of ``trace/``, these are inert records: strings, shapes and small numbers taken at record
time, never a tensor, a module or a frame. Each rank writes its :class:`RankRecord` as JSON; the parent
(``frontends/launch.py``) fills in how the process ended and the rules in ``analysis/distributed.py``
compare the ranks.

>>> c = Collective(index=0, op="all_gather", seq=3, count=1, sizes=[[17, 4]], line=9, loop={"step": 2})
>>> c.label()
'all_gather [17, 4] at line 9 (step = 2)'
>>> r = RankRecord(rank=1, world_size=2, collectives=[c])
>>> RankRecord.from_dict(r.to_dict()) == r
True
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..util.serde import from_dict, to_dict
from .records import Trace
from .stacks import ThreadStack

#: How a DDP gradient all-reduce appears in a rank's log: issued by the reducer (C++) during backward,
#: so it is recorded around ``backward()`` and counted by the process group's sequence number.
DDP_BACKWARD = "backward (DDP gradient all-reduce)"
DDP_FORWARD = "DDP forward (buffer/bucket sync)"


def place(line: int | None, file: str | None) -> str:
    """``line 9`` for the script itself (``file`` None), ``util.py:12`` for another file.

    >>> place(9, None), place(12, "/a/util.py"), place(None, None)
    ('line 9', 'util.py:12', 'an unknown line')
    """
    if line is None:
        return "an unknown line"
    return f"line {line}" if file is None else f"{os.path.basename(file)}:{line}"


def loop_text(loop: dict[str, int]) -> str:
    """``step = 3`` (the loop variables when the call was made).

    >>> loop_text({"epoch": 0, "step": 3})
    'epoch = 0, step = 3'
    """
    return ", ".join(f"{k} = {v}" for k, v in sorted(loop.items()))


@dataclass
class Collective:
    """One call that issued collectives on this rank, in the order made.

    ``seq``: the process group's sequence number before the call (ranks that agree issue collective
    ``seq`` for the same reason); ``count``: how many collectives it issued (None: it never returned,
    the rank was still inside it); ``sizes``: the shapes of its tensors (input first); ``line``/``file``:
    the user's call (``file`` None: the script); ``loop``: the script's integer loop variables then.
    """

    index: int
    op: str
    seq: int | None = None
    count: int | None = None
    sizes: list[list[int]] = field(default_factory=list)
    dtype: str = ""
    line: int | None = None
    file: str | None = None
    loop: dict[str, int] = field(default_factory=dict)
    group: str = ""
    error: str = ""
    #: when the call began and returned, seconds since the epoch (0 / None: not known, or still inside it)
    start_s: float = 0.0
    end_s: float | None = None

    @property
    def pending(self) -> bool:
        """Still inside the call when the rank stopped (it is waiting there)."""
        return self.count is None

    def label(self) -> str:
        """``all_gather [17, 4] at line 9 (step = 2)``."""
        sizes = " " + ", ".join(str(list(s)) for s in self.sizes[:3]) if self.sizes else ""
        more = f" (+{len(self.sizes) - 3} more)" if len(self.sizes) > 3 else ""
        loop = f" ({loop_text(self.loop)})" if self.loop else ""
        return f"{self.op}{sizes}{more} at {place(self.line, self.file)}{loop}"


@dataclass
class UnusedParams:
    """Parameters of a DDP module that got no gradient in one ``backward()`` (DDP then waits for them
    forever, or fails at the next forward). ``forward_line``: the line that called the DDP module.

    >>> UnusedParams(names=["extra.bias"], forward_line=14).names
    ['extra.bias']
    """

    names: list[str]
    module: str = ""
    backward_index: int = 0
    forward_line: int | None = None
    forward_file: str | None = None
    backward_line: int | None = None
    loop: dict[str, int] = field(default_factory=dict)
    total: int = 0  # parameters of the module that require a gradient


@dataclass
class RankRecord:
    """Everything known about one rank. ``exitcode``: the process's status (negative: killed by a
    signal, named in ``signal``); ``stopped``: why the launcher ended it ('' when it exited by itself:
    "timeout", or "after rank N failed"); ``wrote_report``: the rank's run finished and its record (with
    ``trace``) was written; else the record is rebuilt from its collective log and its fault output."""

    rank: int
    world_size: int
    script: str = ""
    exitcode: int | None = None
    signal: str | None = None
    stopped: str = ""
    wrote_report: bool = False
    collectives: list[Collective] = field(default_factory=list)
    unused: list[UnusedParams] = field(default_factory=list)
    stacks: list[ThreadStack] = field(default_factory=list)
    fault: str = ""
    output_tail: str = ""
    duration_s: float = 0.0
    trace: Trace | None = None
    #: which run of the script wrote the rank's files (a folder reused by a later run holds older files too)
    run: str = ""
    #: when the rank started (seconds since the epoch, its machine's clock)
    started: float = 0.0
    #: optimizer steps the rank logged as it went (its iterations)
    steps: int = 0
    #: seconds between the rank's last sign of progress (a collective or an iteration logged) and the
    #: moment the launcher stopped it; None when it was not stopped or that is unknown
    progress_s: float | None = None
    #: where it ran under torchrun: its node (``GROUP_RANK``), its rank on that node (``LOCAL_RANK``), the
    #: machine's name; None/'' when not known (a record from before these were kept)
    node: int | None = None
    local_rank: int | None = None
    host: str = ""

    def where_ran(self) -> str:
        """``node 1, local rank 0, on gpu-7``: where torchrun placed the rank ('' when unknown).

        >>> RankRecord(3, 4, node=1, local_rank=1, host="b").where_ran()
        'node 1, local rank 1, on b'
        """
        parts = [f"node {self.node}" if self.node is not None else "",
                 f"local rank {self.local_rank}" if self.local_rank is not None else "",
                 f"on {self.host}" if self.host else ""]
        return ", ".join(p for p in parts if p)

    @property
    def waiting_in(self) -> Collective | None:
        """The collective call this rank was still inside when it stopped, if any."""
        pending = [c for c in self.collectives if c.pending]
        return pending[-1] if pending else None

    def ended(self) -> str:
        """How the process ended, in words.

        >>> RankRecord(1, 2, exitcode=-6, signal="SIGABRT").ended(), RankRecord(0, 2, stopped="timeout").ended()
        ('killed by SIGABRT', 'stopped by the launcher (timeout)')
        """
        if self.stopped:
            return f"stopped by the launcher ({self.stopped})"
        if self.signal:
            return f"killed by {self.signal}"
        if self.exitcode is None:  # combined from files (torchrun): how the process ended is not known
            return "ran to the end (exit status unknown)" if self.wrote_report else \
                "did not finish its run (exit status unknown)"
        return f"exited {self.exitcode}"

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankRecord":
        return from_dict(cls, data)
