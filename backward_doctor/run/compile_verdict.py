"""Whether the eager replay of a compiled step did what the compiled step did (``run/compile_replay.py``), and
how to say what a GradScaler did.

Two ways the same failure looks different compiled and eager:

* **An error found while compiling.** AOTAutograd traces the backward of a compiled region once, ahead of
  the step, so a tensor autograd saved and the region then wrote in place fails there: dynamo wraps it as
  ``BackendCompilerFailed`` ("backend='inductor' raised: RuntimeError: one of the variables ...") at the call
  of the compiled code, where eager raises the ``RuntimeError`` itself at ``loss.backward()``. The same error
  (its type, its first words) is agreement: the compiler is not the cause, and the eager replay's ops name
  the line that wrote in place.
* **Inf/NaN gradients.** Where the loop clears its gradients after the step, the only trace of them is a
  GradScaler that skipped step after step (``"skipping"``); a run that kept them shows them as NaN/Inf
  (``"nonfinite"``). Either in eager agrees with either compiled.

>>> from backward_doctor.trace.records import ExceptionInfo
>>> unwrapped(ExceptionInfo("BackendCompilerFailed", "backend='inductor' raised:\\nRuntimeError: one of the x"))
('RuntimeError', 'one of the x')
>>> unwrapped(ExceptionInfo("RuntimeError", "one of the x")) is None
True
"""
from __future__ import annotations

import re

from ..trace.records import ExceptionInfo, Trace

#: dynamo's wrapper of an error its backend raised (``torch._dynamo.exc.BackendCompilerFailed``'s message)
_BACKEND = re.compile(r"backend=(?:'[^']*'|\S+) raised:\n([A-Za-z_][\w.]*): (.*)", re.S)
#: what the compiled step and the eager replay may each show of inf/NaN gradients
_GRADIENTS = ("nonfinite", "skipping")
_HEAD = 60  # characters of the first line compared: the rest names versions, hints and torch's advice


def unwrapped(exc: ExceptionInfo) -> tuple[str, str] | None:
    """The type and first line of the error a compiler backend raised, from dynamo's wrapper around it; None
    for an error that is not such a wrapper."""
    m = _BACKEND.match(exc.message or "")
    if m is None:
        return None
    return m.group(1).rsplit(".", 1)[-1], m.group(2).strip().splitlines()[0] if m.group(2).strip() else ""


def _head(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0][:_HEAD] if lines else ""


def agrees(first: Trace, eager: Trace, why: str, eager_why: str | None) -> bool:
    """Eager did what the compiled step did: the same error (a compile-time wrapper's own error counts as it),
    inf/NaN gradients either way, or the same divergence.

    >>> agrees(Trace(), Trace(), "skipping", "nonfinite"), agrees(Trace(), Trace(), "skipping", None)
    (True, False)
    """
    if why == "exception":
        exc, other = first.exception, eager.exception
        if exc is None or other is None:
            return False
        inner = unwrapped(exc)
        if inner is None:
            return other.type == exc.type
        return other.type == inner[0] and _head(other.message) == _head(inner[1])
    if why in _GRADIENTS:
        return eager_why in _GRADIENTS
    return eager_why == why


def scaler_words(trace: Trace, skipping: bool) -> str:
    """What a run's GradScaler did, in a few words (``skipping``: it kept skipping).

    >>> from backward_doctor.trace.precision import Precision, ScalerSteps
    >>> scaler_words(Trace(precision=Precision(scaler=ScalerSteps(calls=8, skipped=8, longest_skipped=8))), True)
    'kept skipping the optimizer step: its GradScaler skipped 8 of 8 steps (inf/NaN gradients each time)'
    """
    s = trace.precision.scaler
    if skipping:
        return (f"kept skipping the optimizer step: its GradScaler skipped {s.skipped} of {s.calls} steps "
                "(inf/NaN gradients each time)")
    return f"trained: its GradScaler skipped {s.skipped} of {s.calls} steps"


__all__ = ["agrees", "scaler_words", "unwrapped"]
