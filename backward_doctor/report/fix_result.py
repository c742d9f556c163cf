"""The outcome of one fix attempt, as plain data (JSON round trip like the rest of the report).

>>> r = FixResult(name="accumulate:4", applied=False, message="no backward() call in the cell")
>>> FixResult.from_dict(r.to_dict()) == r
True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..util.serde import from_dict, to_dict


@dataclass
class FixResult:
    """What a fix did.

    ``name``: the fix as run (``"accumulate:4"``); ``applied``: False when it could not
    be applied (``message`` says why) or the run was cancelled; ``code``: the rewritten
    cell (what ran, and what to keep); ``diff``: unified diff original -> rewritten;
    ``comparison``: ``{"before": {...}, "after": {...}, "grad_max_rel_err": float | None}``
    with ``peak_bytes``, ``peak_by_category``, ``step_s`` and ``loss`` for each run;
    ``original``: the original run's report as a dict (None when it never ran).
    """

    name: str
    applied: bool = False
    message: str = ""
    code: str = ""
    diff: str = ""
    comparison: dict[str, Any] = field(default_factory=dict)
    original: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    fits: bool | None = None          # the fixed run completed (None: it did not run)
    cancelled: bool = False
    rolled_back: bool = False         # the state was restored from the snapshot at some point
    #: the op the fix made slowest took this many times as long per call as in the original run (set only when
    #: much slower: it fits, at a price; ``fixes.apply.slowdown``)
    slowdown: float | None = None
    #: a library's knobs built in an earlier cell and set on the live objects for the run: where they are built
    #: (``place``: ``Cell In[3], line 5``, None when not found), ``setting``, that cell's number, ``code`` and
    #: ``diff`` edited, and ``live`` (the assignment on the live object); ``fixes.live_knobs.elsewhere``
    elsewhere: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FixResult":
        return from_dict(cls, data)
