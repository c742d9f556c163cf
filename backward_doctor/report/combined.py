"""The one report of a distributed run: findings over all ranks (root cause first, each with its rank)
and every rank's record (how it ended, its collectives, its own trace).

>>> from backward_doctor.trace import Trace
>>> from backward_doctor.trace.distributed import RankRecord
>>> r = CombinedReport(ranks=[RankRecord(k, 2, exitcode=0, wrote_report=True, trace=Trace()) for k in range(2)],
...                    nproc=2)
>>> r.ok, CombinedReport.from_dict(r.to_dict()).to_dict() == r.to_dict()
(True, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..analysis.findings import Finding
from ..trace.distributed import RankRecord
from .renderers import renderer, write
from .schema import FORMAT, VERSION, check_report


@dataclass
class CombinedReport:
    """Findings of all ranks (most important first) and the ranks' records; ``script`` the file run,
    ``nproc`` how many ranks, ``timeout_s`` the launcher's limit, ``notes`` what the launcher saw."""

    findings: list[Finding] = field(default_factory=list)
    ranks: list[RankRecord] = field(default_factory=list)
    script: str = ""
    #: the script's (or the cell's) text: its lines are shown beside the findings
    source: str = ""
    nproc: int = 0
    timeout_s: float | None = None
    duration_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every rank ran its script to the end without an exception, and nothing was found."""
        return not self.findings and all(r.wrote_report and not r.stopped and r.trace is not None
                                         and r.trace.exception is None for r in self.ranks)

    @property
    def root_cause(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def exception(self) -> str | None:
        """The first rank's exception that is not a consequence, else the first one (text)."""
        from ..analysis.distributed import is_consequence, rank_error

        errors = [(is_consequence(r), rank_error(r)) for r in self.ranks if rank_error(r)]
        errors.sort(key=lambda e: e[0])
        return errors[0][1] if errors else None

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "kind": "distributed", "ok": self.ok, "script": self.script, "source": self.source,
                "nproc": self.nproc,
                "timeout_s": self.timeout_s, "duration_s": self.duration_s, "notes": list(self.notes),
                "findings": [f.to_dict() for f in self.findings], "ranks": [r.to_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CombinedReport":
        """A combined report from :meth:`to_dict` output, checked against ``schema.json`` first (``ReportError``)."""
        check_report({**data, "kind": "distributed"} if isinstance(data, dict) else data)
        return cls(findings=[Finding.from_dict(f) for f in data.get("findings", [])],
                   ranks=[RankRecord.from_dict(r) for r in data.get("ranks", [])], script=data.get("script", ""),
                   source=data.get("source", ""), nproc=data.get("nproc", 0), timeout_s=data.get("timeout_s"),
                   duration_s=data.get("duration_s", 0.0), notes=list(data.get("notes", [])))

    def __str__(self) -> str:
        return renderer("text").render(self)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{f.kind}@rank{f.rank}" if f.rank is not None else f.kind for f in self.findings)
        return f"<backward_doctor.CombinedReport {self.nproc} ranks, {'ok' if self.ok else 'problem'}: " \
               f"{kinds or 'no findings'}>"

    def to_html(self) -> str:
        return renderer("html").render(self)

    def save_html(self, path: str) -> str:
        return write(self, "page", path)

    def save_memory_snapshot(self, path: str) -> str:
        """The memory snapshot (one device per rank) to ``path``; see ``Report.save_memory_snapshot``."""
        return write(self, "memory_viz", path)

    def save_trace(self, path: str) -> str:
        """The ranks on one timeline (one process each, with their collectives) as a Perfetto trace."""
        return write(self, "perfetto", path)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": str(self), "text/html": self.to_html()}


def load_report(data: dict[str, Any]) -> Any:
    """A saved report of either kind (``--json``): a :class:`CombinedReport` or a ``Report``; ``ReportError``
    (one line naming the field) when it does not fit ``schema.json``.

    >>> type(load_report({"kind": "distributed"})).__name__, type(load_report({})).__name__
    ('CombinedReport', 'Report')
    >>> load_report({"kind": "distributed", "ranks": [{"rank": "<script>", "world_size": 2}]})
    Traceback (most recent call last):
    backward_doctor.report.schema.ReportError: ranks[0].rank: "<script>" is not an integer
    """
    if isinstance(data, dict) and data.get("kind") == "distributed":
        return CombinedReport.from_dict(data)
    from .report import Report

    return Report.from_dict(data)
