"""An exception the user's own code raised because of a problem the doctor located is that problem's
consequence: the problem is the root cause (the headline, first), the exception comes right after it, with
its line, as what it is.

A training script's guard (``if not torch.isfinite(loss): raise SystemExit("training diverged")``, ``assert
loss.isfinite()``, ``raise RuntimeError("loss is nan")``) stops the run after NaN/Inf showed; headlining its
``SystemExit`` would send the user to the guard, not to the NaN in the data at iteration 200. Only an
exception that

* no exception rule explained (the generic ``exception`` finding: an autograd in-place error, an OOM, shapes
  that do not fit keep their own findings and stay first),
* came from a ``raise`` statement (``ExceptionInfo.raised``: torch's C++ errors surface at a call, never at
  a ``raise``) in the user's code (the traceback's innermost frame is the user's: a library's own
  ``raise ValueError`` is the library's error, not a guard),

is moved, and only behind a problem a guard reacts to: NaN/Inf (``nonfinite``, the learning rate that made
it included) or a GradScaler whose scale collapsed because every step overflowed. A run ends at its
exception, so whatever the doctor found happened before it.

>>> from backward_doctor.trace import Trace
>>> cause_first(Trace(), [])
[]
"""
from __future__ import annotations

from .findings import Finding, sentence
from ..trace.records import Trace


def _guard_raised(trace: Trace) -> bool:
    """The cell's exception came from a ``raise`` statement (or an ``assert``) in the user's own code.

    >>> from backward_doctor.trace.records import ExceptionInfo
    >>> from backward_doctor.trace.stacks import FrameInfo
    >>> t = Trace(exception=ExceptionInfo("SystemExit", "diverged", raised=True,
    ...                                   frames=[FrameInfo("<cell>", 7, "<module>", in_cell=True, user=True)]))
    >>> _guard_raised(t), _guard_raised(Trace(exception=ExceptionInfo("RuntimeError", "boom")))
    (True, False)
    """
    exc = trace.exception
    # (a KeyboardInterrupt is Ctrl-C's or the hang rule's, never a guard of the user's)
    if exc is None or not exc.raised or not exc.frames or exc.type == "KeyboardInterrupt":
        return False
    return exc.frames[-1].user


def _cause(f: Finding) -> bool:
    """A problem a training guard reacts to (what makes a loss NaN/Inf or a scaler give up)."""
    return f.kind == "nonfinite" or (f.kind == "amp_misuse" and f.evidence.get("problem") in (
        "scale_collapse", "step_without_scaler"))


def cause_first(trace: Trace, findings: list[Finding]) -> list[Finding]:
    """``findings`` with the problem first and the user's guard that raised because of it right after it, as
    its consequence (see the module docstring); otherwise ``findings`` as they are. The guard's finding keeps
    its place in the code (line, iteration) and says what it raised.

    >>> cause_first(Trace(), [Finding("exception", "The cell raised SystemExit.")])[0].kind
    'exception'
    """
    if not findings or findings[0].kind != "exception" or not _guard_raised(trace):
        return findings
    cause = next((f for f in findings[1:] if _cause(f)), None)
    if cause is None:
        return findings
    exc = trace.exception
    assert exc is not None  # (_guard_raised)
    guard = findings[0]
    first = exc.message.splitlines()[0].strip() if exc.message else ""
    raised = f"{exc.type}: {first}" if first else exc.type
    about = ", ".join(filter(None, [cause.title, cause.when()]))
    guard.message = sentence(f"A consequence of the finding above{f' ({about})' if about else ''}: your code "
                             f"raised {raised} here, after it") + \
        " The check did its job; the cause is the finding above, not this line."
    guard.title = f"{exc.type} raised by your code (a consequence)"
    guard.severity = "warning"
    guard.evidence["consequence_of"] = cause.kind
    rest = [f for f in findings[1:] if f is not cause]
    return [cause, guard, *rest]


__all__ = ["cause_first"]
