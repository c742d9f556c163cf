"""What the report calls things, in plain words: a finding's kind ("Gradients never zeroed", not
``stale_grad``), a fix that did not work and what to try next, which recorder ran, a frame of a stack.
Plain data for every renderer (text, HTML page, panel).

>>> kind_words("stale_grad")
'Gradients never zeroed'
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..analysis.findings import Finding
from ..trace.queries import recorded_nothing

if TYPE_CHECKING:
    from ..report.fix_result import FixResult
    from ..report.report import Report
    from ..trace.records import Trace
    from ..trace.stacks import FrameInfo

#: Each kind of finding in plain words, for badges and headlines (the kind itself stays in the JSON).
KIND_WORDS = {
    "amp_skipped": "AMP step skipped", "backward_twice": "Backward run twice", "broadcast": "Silent broadcast",
    "detached": "Graph cut", "device_mismatch": "Different devices", "dtype_mismatch": "Different dtypes",
    "exception": "Error", "graph_leak": "Graphs kept alive", "hang": "Hang", "index_out_of_range":
    "Index out of range", "inf": "Inf", "inplace": "In-place write", "no_grad_path": "No gradient path",
    "nonfinite": "NaN / Inf", "nonleaf_param": "Parameters not leaves", "oom": "Out of memory",
    "orphan_params": "Parameters the optimizer misses", "shape_mismatch": "Shapes do not fit",
    "stale_grad": "Gradients never zeroed", "grad_accumulation": "Gradient accumulation", "amp_misuse":
    "Mixed precision misused", "timeout": "Time limit reached", "dataloader_worker": "DataLoader worker",
    "compile_divergence": "Compiled differs from eager", "loss_on_probabilities": "Loss fed the wrong scores",
    "train_eval_mode": "train() / eval() mode", "scheduler_misuse": "Learning-rate scheduler out of step",
    "label_misalignment": "Labels misaligned",
    "frozen_params_updated": "Frozen parameters updated", "untied_weights": "Tied weights trained apart",
    "loss_spike": "Loss spike",
}


def kind_words(kind: str) -> str:
    """A finding's kind in plain words.

    >>> kind_words("stale_grad"), kind_words("something_new")
    ('Gradients never zeroed', 'Something new')
    """
    return KIND_WORDS.get(kind) or kind.replace("_", " ").capitalize()


def finding_title(f: Finding) -> str:
    """What a finding is called: its title, else its kind in plain words.

    >>> finding_title(Finding("stale_grad", "")), finding_title(Finding("oom", "", title="Out of memory"))
    ('Gradients never zeroed', 'Out of memory')
    """
    return f.title or kind_words(f.kind)


def line_role(f: Finding) -> str:
    """What a finding's line is, over its source: the root cause, or for NaN/Inf no op was named as the origin of
    (a replay that did not make it again: transient) only where the run saw it.

    >>> line_role(Finding("nonfinite", "", evidence={"located": False})), line_role(Finding("oom", ""))
    ('where NaN/Inf was seen (not its origin)', 'root cause')
    """
    if f.kind == "nonfinite" and f.evidence.get("located") is False:
        return "where NaN/Inf was seen (not its origin)"
    return "root cause"


def fix_code_lines(f: Finding) -> list[str]:
    """The lines of a finding's fix as code (``evidence["fix_code"]``), blank lines at its ends dropped and
    trailing spaces cut; ``[]`` when it has none, so no renderer shows a ``fix:`` label over nothing.

    >>> fix_code_lines(Finding("amp_misuse", "", evidence={"fix_code": "\\nscaler.unscale_(opt)  \\nclip()\\n"}))
    ['scaler.unscale_(opt)', 'clip()']
    >>> fix_code_lines(Finding("amp_misuse", "", evidence={"fix_code": " \\n  "})), fix_code_lines(Finding("oom", ""))
    ([], [])
    """
    code = f.evidence.get("fix_code")
    if not code:
        return []
    lines = [ln.rstrip() for ln in str(code).splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


# --------------------------------------------------------------------------- fixes
def fix_failed(result: "FixResult") -> bool:
    """True when the fix was applied and its re-run did not complete (ran out of memory, raised, hung).

    >>> from backward_doctor.report.fix_result import FixResult
    >>> fix_failed(FixResult("amp", applied=True, fits=False)), fix_failed(FixResult("amp", applied=True, fits=True))
    (True, False)
    """
    return bool(result.applied and not result.cancelled and result.fits is False)


def fix_next_step(result: "FixResult") -> str:
    """What to try after a fix that did not work: a bigger k, or two fixes together ('' when it worked).

    >>> from backward_doctor.report.fix_result import FixResult
    >>> fix_next_step(FixResult("accumulate:4", applied=True, fits=False))
    'Try `accumulate:8` (twice as many, smaller micro-batches), or `amp` and accumulation together (16-bit activations in each micro-batch).'
    """
    if not fix_failed(result):
        return ""
    kind, _, arg = result.name.partition(":")
    if kind == "accumulate":
        k = int(arg) if arg.isdigit() else 2
        return (f"Try `accumulate:{2 * k}` (twice as many, smaller micro-batches), or `amp` and accumulation "
                "together (16-bit activations in each micro-batch).")
    if kind == "checkpoint":
        return ("Try `accumulate:2` (smaller micro-batches), or checkpointing and accumulation together: keep this "
                "code and split the batch as `accumulate` does.")
    if kind == "amp":
        return "Try `accumulate:2` (smaller micro-batches), or keep `amp` and add accumulation on top of it."
    return "The findings above say what to change by hand."


def what_ran(trace: "Trace") -> str:
    """What a clean report says ran: "the step", or for a loop "the cell (60 optimizer steps)".

    >>> from backward_doctor.trace.records import Trace
    >>> what_ran(Trace())
    'the step'
    >>> t = Trace(); t.iterations.steps = 60
    >>> what_ran(t)
    'the cell (60 optimizer steps)'
    """
    steps = trace.iterations.steps
    return f"the cell ({steps} optimizer steps)" if steps > 1 else "the step"


def unrecorded(trace: "Trace") -> bool:
    """Steps ran but no op was recorded: always on watched them with the recorder asleep (``capture/loop/choosing.py``),
    so "no op ran" would be wrong.

    >>> from backward_doctor.trace.records import Trace
    >>> unrecorded(Trace())
    False
    """
    return bool(trace.iterations.steps) and recorded_nothing(trace)


def ok_headline(trace: "Trace") -> str:
    """A clean report's headline: what ran, and how much of it was looked at (always on may have watched the
    step without recording its ops: then the checks that read ops did not run, and "nothing looks wrong"
    would claim more than was seen).

    >>> from backward_doctor.trace.records import Trace
    >>> ok_headline(Trace())
    'the step ran and nothing looks wrong'
    >>> t = Trace(engine="native"); t.iterations.steps = 1
    >>> ok_headline(t)
    'the step ran and nothing went wrong (watched, not recorded op by op: the silent checks did not run)'
    """
    if unrecorded(trace):
        return (f"{what_ran(trace)} ran and nothing went wrong (watched, not recorded op by op: the silent checks "
                "did not run)")
    return f"{what_ran(trace)} ran and nothing looks wrong"


def original_verdict(result: "FixResult") -> str:
    """What was wrong with the step before the fix ('' when it was fine or is not known): a fixed
    report must not read as if nothing had ever been wrong.

    >>> from backward_doctor.report.fix_result import FixResult
    >>> original_verdict(FixResult("amp", original={"findings": [{"kind": "oom", "message": "", "line": 4}]}))
    'Out of memory at cell line 4'
    """
    original = result.original or {}
    findings = original.get("findings") or []
    if findings:
        f = Finding.from_dict(findings[0])
        return f"{finding_title(f)} at {f.location()}"
    exc = original.get("exception")
    return exc.split("\n")[0][:200] if exc else ""


def next_fix_arg(result: "FixResult") -> str | None:
    """The one fix a button can run next after ``result`` did not work (``accumulate:8`` after
    ``accumulate:4``; ``accumulate:2`` after checkpointing or amp), None when it worked.

    >>> from backward_doctor.report.fix_result import FixResult
    >>> next_fix_arg(FixResult("accumulate:4", applied=True, fits=False))
    'accumulate:8'
    """
    if not fix_failed(result):
        return None
    kind, _, arg = result.name.partition(":")
    if kind == "accumulate":
        return f"accumulate:{2 * int(arg) if arg.isdigit() else 4}"
    if kind in ("checkpoint", "amp"):
        return "accumulate:2"
    return None



def recorder_words(report: "Report") -> str:
    """Which tier recorded the ops, for a report's footer, with why when it was not the one wanted.

    >>> from backward_doctor.report import Report
    >>> recorder_words(Report())
    'the Python recorder'
    """
    if report.trace.engine == "native":
        return "the native recorder"
    return "the Python recorder" + (f" ({report.engine_note})" if report.engine_note else "")



def frame_label(fi: "FrameInfo", places: dict[str, str] | None = None) -> str:
    """A frame of a thread's stack: ``Cell In[2], line 4`` when the frontend named it, else ``cell:4`` /
    ``threading.py:320``.

    >>> from backward_doctor.trace.stacks import FrameInfo
    >>> frame_label(FrameInfo("<cell>", 4, "<module>", in_cell=True)), frame_label(FrameInfo("/a/b.py", 3, "f"))
    ('cell:4', 'b.py:3')
    """
    named = (places or {}).get("" if fi.in_cell else fi.file)
    if named:
        return f"{named}, line {fi.line}"
    return f"cell:{fi.line}" if fi.in_cell else f"{os.path.basename(fi.file)}:{fi.line}"
