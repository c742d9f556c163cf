"""The :class:`Finding` record and helpers the rules share.

>>> f = Finding(kind="inplace", message="...", line=3)
>>> Finding.from_dict(f.to_dict()) == f
True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..util.serde import from_dict, to_dict
from ..trace.queries import line_text
from ..trace.records import OpRecord, Trace, Where

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    """One diagnosis: what happened, where (the root cause), and what to do.

    ``line``/``file``: the root-cause line (``file`` None means a line of the cell);
    ``op``: aten op name (``aten::add_``); ``module``: dotted path from the user's
    variable (``model.body.2``); ``fixes``: names of one-click fixes that apply.
    """

    kind: str
    message: str
    line: int | None = None
    file: str | None = None
    op: str | None = None
    module: str | None = None
    fixes: list[str] = field(default_factory=list)
    severity: str = "error"
    title: str = ""
    cell_line: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    #: 0-based iteration of the cell's loop (the outermost ``for``/``while`` holding the root-cause line) in
    #: which the root cause happened; None outside a loop or when unknown (``analysis/loops.py``)
    iteration: int | None = None
    #: the function the root-cause line is in (``Block.forward``; None at a cell's top level)
    function: str | None = None
    #: ``file`` (or the cell) as the frontend that ran it names it: ``Cell In[2]`` in IPython; '' unnamed
    place: str = ""
    #: the class of ``module`` (``BatchNorm2d``), when the namespace could tell
    module_type: str = ""
    #: the rank (process) of a distributed run the finding is about; None: one process, or all ranks
    rank: int | None = None

    def location(self) -> str:
        """Where, as the user knows the place: ``Cell In[2], line 12, in Block.forward`` (a frontend named
        the cell) or ``cell line 4`` / ``models.py:12``; then the module with its type and the loop's
        iteration; ``rank 1, ...`` first for a rank of a distributed run.

        >>> Finding("nonfinite", "", line=3, iteration=20, evidence={"loop_line": 1}).location()
        'cell line 3, in iteration 20 of the loop at line 1'
        >>> Finding("oom", "", line=12, file="/tmp/ipykernel_1/167147110.py", function="Block.forward",
        ...         place="Cell In[2]", module="net.blocks.1.bn2", module_type="BatchNorm2d").location()
        'Cell In[2], line 12, in Block.forward, module net.blocks.1.bn2 (BatchNorm2d)'
        >>> Finding("desync", "", line=9, rank=1).location()
        'rank 1, cell line 9'
        """
        loc = self._place()
        return loc if self.rank is None else f"rank {self.rank}, {loc}"

    def _place(self) -> str:
        if self.line is None:
            loc = "unknown line"
        elif self.place:
            loc = f"{self.place}, line {self.line}"
        elif self.file is None:
            loc = f"cell line {self.line}"
        else:
            import os

            loc = f"{os.path.basename(self.file)}:{self.line}"
        if self.function and not self.function.startswith("<") and self.line is not None:
            loc += f", in {self.function}"
        if self.module:
            loc += f", module {self.module} ({self.module_type})" if self.module_type else f" ({self.module})"
        return f"{loc}, {self.when()}" if self.iteration is not None else loc

    def when(self) -> str:
        """``in iteration 20 of the loop at line 1``, ``in iteration 3 of `trainer.train()` (epoch 0)`` for a
        library's loop ('' outside a loop).

        >>> Finding("inplace", "", iteration=3, evidence={"loop_call": "trainer.train()", "loop_value": "epoch 0"}).when()
        'in iteration 3 of `trainer.train()` (epoch 0)'
        """
        if self.iteration is None:
            return ""
        loop = self.evidence.get("loop_line")
        call = self.evidence.get("loop_call")
        value = self.evidence.get("loop_value")
        of = f" of `{call}`" if call else " of the loop" + (f" at line {loop}" if loop is not None else "")
        return f"in iteration {self.iteration}{of}" + (f" ({value})" if value else "")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finding":
        return from_dict(cls, data)


def forward_where(trace: Trace, rec: OpRecord | None) -> Where:
    """Where the user wrote the code behind ``rec``: for a backward op, its forward op."""
    if rec is None:
        return Where()
    if rec.phase == "backward":
        fwd = trace.op(rec.fwd_index)
        if fwd is not None:
            return fwd.where
    return rec.where


def sentence(text: str) -> str:
    """``text`` ending in one full stop: PyTorch's messages often end in their own ("... worker process 0.").

    >>> sentence("Caught ValueError in DataLoader worker process 0."), sentence("shapes differ")
    ('Caught ValueError in DataLoader worker process 0.', 'shapes differ.')
    """
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."


def at(kind: str, where: Where, message: str, **kw: Any) -> Finding:
    """A finding located at ``where``."""
    kw.setdefault("function", where.function)
    return Finding(kind=kind, message=message, line=where.line, file=where.file,
                   cell_line=where.cell_line, module=where.module, **kw)


def placed(rec: Any) -> Where:
    """The ``Where`` of a record that keeps its own place (``line``, ``file``, ``cell_line``, ``function``:
    a step window, a zero_grad or clip call).

    >>> from backward_doctor.trace.precision import ClipCall
    >>> placed(ClipCall(iteration=0, line=7)).line
    7
    """
    return Where(line=rec.line, file=rec.file, cell_line=rec.cell_line, function=rec.function)


def looped(trace: Trace, iteration: int | None) -> int | None:
    """``iteration`` for a finding, when the run was a loop (more than one optimizer step, in the cell or in a
    library's loop, or a library's loop at all: stopped at its first step, it is still iteration 0); None for a
    single step, where an iteration says nothing.

    >>> looped(Trace(), 0) is None
    True
    """
    its = trace.iterations
    return iteration if its.steps > 1 or its.library or trace.precision.scaler.calls > 1 else None


def code_at(trace: Trace, line: int | None, file: str | None = None) -> str:
    """A source line for a message, without its trailing comment ('' when unknown)."""
    return source_line(trace, line, file).split("  #")[0].split(" # ")[0].strip()


def source_line(trace: Trace, line: int | None, file: str | None = None) -> str:
    """The text of a cell line (or of a file line the trace copied when it was recorded), stripped; ''
    when unknown. Nothing is read from disk: a saved report is analysed as it was recorded."""
    return line_text(trace, line, file)


def same_exception(trace: Trace) -> bool:
    """True when the recorded failed op is what raised the cell's exception."""
    exc, failed = trace.exception, trace.failed_op
    if exc is None or failed is None:
        return False
    first = exc.summary().split("\n")[0][:200]
    return failed.error[:200] == first or failed.error.split(": ", 1)[-1][:120] in exc.message
