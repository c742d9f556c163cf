"""torch.compile vs eager (``trace.compile_check``, from ``run/compile_replay.py``): a compiled step that
went NaN/Inf or raised where the same step run eagerly from the same state did not.

Where eager does the same, there is nothing to say here: the report is the eager replay's, and the usual
rules place the NaN's origin or the failing op at the user's line. Where eager does not, the compiled
code makes the difference, and the finding names the first op whose result differs, its line and its
compiled region, or says why none could be isolated.

>>> from backward_doctor.trace import Trace
>>> compile_divergence(Trace()), compile_failure(Trace())
([], [])
"""
from __future__ import annotations

from ..findings import Finding, at
from ...trace.records import Trace, Where

#: AOTAutograd's backward cannot itself be differentiated: said directly, or (with donated buffers, the default
#: where the graph has some) as a backward that requires create_graph=False
_DOUBLE_BACKWARD = ("does not currently support double backward", "requires create_graph=False")


def _fix(check, error: str) -> str:
    """What to do about it, from what was found."""
    if check.dropped:
        return (f" Just before it the custom op `{check.dropped}` returns nothing and declares no argument it "
                "writes to (`mutates_args=()`): a compiler takes it for a pure function whose result nobody uses "
                "and removes it, with its in-place writes. Declare what it mutates, e.g. "
                "`@torch.library.custom_op(..., mutates_args={\"x\"})` (torch's docs: `mutates_args` must be "
                "accurate, otherwise the behaviour is undefined).")
    if any(words in error for words in _DOUBLE_BACKWARD):
        return (" AOTAutograd compiles one backward and cannot differentiate it again: a gradient penalty (or any "
                "`create_graph=True` gradient that is itself backpropagated) through a compiled module fails. "
                "Run that part through the original module, e.g. `model._orig_mod(x_penalty)` for the penalty's "
                "forward, or keep the compiled module for the plain loss only.")
    return (" Keep that code out of the compiled region (`@torch.compiler.disable` on the function holding it, or "
            "compile a smaller module), check with `torch.compile(..., backend=\"aot_eager\")` whether the backend's "
            "code generation is the cause, and report it to PyTorch with the minifier "
            "(`TORCHDYNAMO_REPRO_AFTER=\"aot\" TORCHDYNAMO_REPRO_LEVEL=4`).")


def compile_divergence(trace: Trace) -> list[Finding]:
    """The compiled step went NaN/Inf (or diverged) where eager from the same state did not: where, and what
    to do."""
    check = trace.compile_check
    if check is None or check.eager_agrees or check.trigger == "exception":
        return []
    return [_finding(trace, check)]


def compile_failure(trace: Trace) -> list[Finding]:
    """The compiled step raised where eager from the same state did not (an exception rule)."""
    check = trace.compile_check
    if check is None or check.eager_agrees or check.trigger != "exception":
        return []
    return [_finding(trace, check)]


def _finding(trace: Trace, check) -> Finding:
    exc = trace.exception
    error = f"{exc.type}: {exc.message.splitlines()[0]}" if exc is not None else ""
    msg = (f"Compiled, the step {check.compiled}; replayed eagerly from the same state (the same cell, the "
           f"compiled code switched off with `torch.compiler.set_stance(\"force_eager\")`) it {check.eager}. "
           "The compiled code, not the model's math, makes the difference.")
    if check.trigger == "skipping":  # (a finite loss: nothing looked wrong but the weights never moved)
        msg += (" A GradScaler skips `optimizer.step()` whenever a gradient is inf/NaN, so compiled the model never "
                "trained, though its loss stayed finite.")
    if check.op:
        msg += (f" The first op whose {'gradient' if check.stage == 'backward' else 'result'} differs is `{check.op}`"
                + (f" at line {check.line} (`{check.code}`)" if check.line is not None else "")
                + f", in the compiled region {check.region} ({check.ops_compared} ops compared): {check.detail}.")
        where = Where(line=check.line, file=check.file, function=check.function or None)
    elif check.stage == "backward":
        msg += (f" The forward of {check.region} agrees with eager op for op; its backward (compiled by "
                "AOTAutograd) gives other gradients.")
        where = exc.where if exc is not None else Where()
    else:
        msg += f" No single op was isolated: {check.why_not}." if check.why_not and check.trigger != "exception" else ""
        where = exc.where if exc is not None else Where()
        if any(words in error for words in _DOUBLE_BACKWARD):  # the root cause: the gradient differentiated again
            line = next((k for k, text in enumerate(trace.source.splitlines(), 1) if "create_graph=True" in text), None)
            where = Where(line=line, cell_line=line) if line is not None else where
    msg += _fix(check, error)
    title = "Fails only when compiled" if check.trigger == "exception" else "Compiled code differs from eager"
    return at("compile_divergence", where, msg, op=check.op or None, title=title,
              evidence={"eager_agrees": False, "compiled": check.compiled, "eager": check.eager,
                        "region": check.region, "op": check.op, "stage": check.stage, "dropped": check.dropped})


def compiled_first(findings: list[Finding]) -> list[Finding]:
    """When the compiled step differs from eager, that comes first, and what the compiled run alone showed
    (NaN/Inf seemingly born at a region's edge, or in the data) is its consequence, not a second cause.

    >>> compiled_first([Finding("nonfinite", "x"), Finding("compile_divergence", "y")])[1].severity
    'warning'
    """
    top = next((f for f in findings if f.kind == "compile_divergence"), None)
    if top is None:
        return findings
    for f in findings:
        if f.kind == "nonfinite" or f.kind == "amp_misuse" and f.evidence.get("problem") == "scale_collapse":
            f.severity = "warning"
            f.message = ("Seen in the compiled run only (the eager replay stays finite; see above): " + f.message)
    return [top] + [f for f in findings if f is not top]


__all__ = ["compile_divergence", "compile_failure", "compiled_first"]
