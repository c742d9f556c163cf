"""The :class:`Report` users get back: findings first, the trace behind them.

>>> import backward_doctor as bd
>>> r = bd.diagnose("import torch\\nx = torch.ones(2, requires_grad=True)\\n(x * 2).sum().backward()")
>>> r.ok, r.findings
(True, [])
>>> bd.Report.from_dict(r.to_dict()).to_dict() == r.to_dict()
True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..analysis.findings import Finding
from .fix_result import FixResult
from .renderers import renderer, write
from .schema import FORMAT, VERSION, check_report
from ..trace.records import Trace


@dataclass
class Report:
    """Findings (most important first), the cell's exception as text, and the trace."""

    findings: list[Finding] = field(default_factory=list)
    exception: str | None = None
    trace: Trace = field(default_factory=Trace)
    fix: str | None = None
    #: set when the report is of a run with ``fix=...`` (see ``backward_doctor.fixes``)
    fix_result: FixResult | None = None
    #: raw file ('' for the cell) -> the name the frontend gives it (``Cell In[2]``; see ``places.py``)
    places: dict[str, str] = field(default_factory=dict)
    #: why the ops were recorded by the Python recorder when the native one was wanted (None: no reason to say)
    engine_note: str | None = None
    #: fix name -> '' when it can be applied to the cell, else why not (None: not checked; see ``fixes/offers.py``)
    fix_offers: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        """True when the step ran to the end and nothing was found."""
        return self.exception is None and not self.trace.timed_out and not self.findings

    @property
    def root_cause(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: ``format``, ``version`` and the fields ``schema.json`` describes
        (``docs/report-format.md``)."""
        return {"format": FORMAT, "version": VERSION, "ok": self.ok, "exception": self.exception, "fix": self.fix,
                "findings": [f.to_dict() for f in self.findings], "trace": self.trace.to_dict(),
                "fix_result": self.fix_result.to_dict() if self.fix_result is not None else None,
                "places": dict(self.places), "engine_note": self.engine_note,
                "fix_offers": dict(self.fix_offers) if self.fix_offers is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        """A report from :meth:`to_dict` output, of this version or an older one. The data is checked against
        ``schema.json`` first: ``ReportError`` (a ``ValueError``, one line naming the field) when it does not
        fit, so nothing below ever reads a value of the wrong type or size."""
        check_report(data)
        return cls(findings=[Finding.from_dict(f) for f in data.get("findings", [])],
                   exception=data.get("exception"), fix=data.get("fix"),
                   trace=Trace.from_dict(data.get("trace", {})),
                   fix_result=FixResult.from_dict(data["fix_result"]) if data.get("fix_result") else None,
                   places=dict(data.get("places") or {}), engine_note=data.get("engine_note"),
                   fix_offers=dict(data["fix_offers"]) if data.get("fix_offers") is not None else None)

    def __str__(self) -> str:
        return renderer("text").render(self)

    def __repr__(self) -> str:
        kinds = ", ".join(f.kind for f in self.findings) or "no findings"
        return f"<backward_doctor.Report {'ok' if self.ok else 'problem'}: {kinds}>"

    def to_html(self) -> str:
        """The report as a self-contained HTML fragment: plots embedded, no script, user text escaped."""
        return renderer("html").render(self)

    def save_html(self, path: str) -> str:
        """Write the report as one self-contained HTML page to ``path`` (whole or not at all, never through a link
        at ``path``: ``renderers.write``); returns the path."""
        return write(self, "page", path)

    def save_memory_snapshot(self, path: str) -> str:
        """Write the memory snapshot PyTorch's viewers read (drop it on pytorch.org/memory_viz) to ``path``:
        the allocator's own history on CUDA, else made from the doctor's ledger; returns the path.

        >>> import os, pickle, tempfile
        >>> path = Report().save_memory_snapshot(os.path.join(tempfile.mkdtemp(), "step.pickle"))
        >>> with open(path, "rb") as fh:
        ...     sorted(pickle.load(fh))
        ['device_traces', 'segments']
        """
        return write(self, "memory_viz", path)

    def save_trace(self, path: str) -> str:
        """Write the run as a Chrome/Perfetto trace (open it in ui.perfetto.dev) to ``path``; returns the path.

        >>> import json, os, tempfile
        >>> with open(Report().save_trace(os.path.join(tempfile.mkdtemp(), "step.json"))) as fh:
        ...     sorted(json.load(fh))
        ['displayTimeUnit', 'otherData', 'traceEvents']
        """
        return write(self, "perfetto", path)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": str(self), "text/html": self.to_html()}
