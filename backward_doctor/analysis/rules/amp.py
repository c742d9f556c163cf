"""``amp_misuse``: mixed precision used in a way that trains wrong or fails.

* clipping before unscaling: ``clip_grad_norm_`` on gradients that still carry the GradScaler's loss
  scale (the scaler's state at the clip, ``trace.precision.clips``);
* a tensor made under ``torch.autocast`` used after its ``with`` block by a float32 layer: the dtype
  error names both lines (an exception rule, before the generic dtype mismatch);
* updates below the weights' precision: bf16/fp16 weights stepped directly, and a sampled fraction of
  their values with a non-zero gradient left unchanged by the step (``trace.precision.updates``);
* a GradScaler whose scale keeps falling: steps skipped in a row (``trace.precision.scaler``), with the
  first op that overflowed; one or two skips stay ``amp_skipped`` (informational).

Silent on the documented recipe (``scaler.scale(loss).backward()``, ``scaler.unscale_(opt)``, clip,
``scaler.step(opt)``, ``scaler.update()``), on fp32 master weights under autocast, and on autocast
outputs cast back (``.float()``) or consumed inside the block.

>>> from backward_doctor.trace import Trace
>>> amp_misuse(Trace()) + amp_crossing(Trace())
[]
"""
from __future__ import annotations

import ast
import functools
import linecache
import re

from ..findings import Finding, at, code_at, looped, placed, same_exception
from ...trace.records import OpRecord, Trace, Where
from .amp_cast import cast_parts
from .failures import _DTYPE

_TITLE = "Mixed precision misused"
_LOW = ("bfloat16", "float16")
COLLAPSE = 5              # skipped in a row: the scale keeps falling, not settling
_STUCK = 0.2              # of the sampled values with a gradient, this many unchanged: updates round away


def _names(trace: Trace) -> tuple[str, str]:
    """The cell's scaler and optimizer variables, as it calls them (``scaler.step(optimizer)``)."""
    m = re.search(r"(\w+)\.step\((\w+)\)", trace.source)
    return (m.group(1), m.group(2)) if m else ("scaler", "optimizer")


# ---------------------------------------------------------------- clip before unscale
def _clip_before_unscale(trace: Trace) -> list[Finding]:
    clip = next((c for c in trace.precision.clips if c.scaled), None)
    if clip is None:
        return []
    scaler, opt = _names(trace)
    code = code_at(trace, clip.line, clip.file) or "clip_grad_norm_(...)"
    # On CUDA the scale is not read (a read would synchronise the device): the sentence says so rather than a number.
    known = clip.scale is not None
    scale = f"{clip.scale:g}" if known else "not read on CUDA, 65536 unless the scaler was built otherwise"
    times = f"{scale}x the true one" if known else "the scale times the true one"
    fraction = f"1/{scale}" if known else "1/scale"
    limit = f"max_norm={clip.max_norm:g}" if clip.max_norm is not None else "its max_norm"
    # Accelerate's clip only when Accelerate's own backward scaled these gradients in this run: an Accelerator
    # elsewhere in the namespace (or the word in the cell) says nothing about which scaler this step used.
    if clip.scaled_by == "accelerate":
        fix = f"accelerator.clip_grad_norm_(model.parameters(), {clip.max_norm:g})" if clip.max_norm is not None \
            else "accelerator.clip_grad_norm_(...)"
        how = f"`{fix}` (it unscales first)"
    else:
        fix = f"{scaler}.unscale_({opt})\n{code}"
        how = f"`{scaler}.unscale_({opt})` right before it: `{scaler}.unscale_({opt}); {code}`"
    msg = (f"`{code}` clipped gradients that still carried the GradScaler's loss scale ({scale}): the scaler "
           f"had not unscaled them yet (stage {clip.stage or 'READY'}), so their norm is {times} and "
           f"{limit} cuts them to about {fraction} of the limit you meant; once `{scaler}.step` unscales them the "
           f"update is that much too small (with a large scale, almost nothing trains). Unscale first: {how}.")
    where = placed(clip)
    return [at("amp_misuse", where, msg, title=_TITLE, iteration=looped(trace, clip.iteration),
               evidence={"problem": "clip_before_unscale", "scale": clip.scale, "stage": clip.stage,
                         "max_norm": clip.max_norm, "fix_code": fix})]


# ---------------------------------------------------------------- updates below the weights' precision
def _stuck(trace: Trace) -> list[Finding]:
    u = next((x for x in trace.precision.updates if x.sampled and x.unchanged / x.sampled >= _STUCK), None)
    if u is None:
        return []
    frac = u.unchanged / u.sampled
    names = {p.key: p.name for p in trace.params}
    worst = sorted((p for p in u.params if p.sampled), key=lambda p: -p.unchanged / p.sampled)
    frozen = [names.get(p.key, "?") for p in worst if p.unchanged == p.sampled]
    shown = ", ".join(f"{names.get(p.key, '?')} {100 * p.unchanged / p.sampled:.0f}%" for p in worst[:4])
    lr = f" at lr={u.lr:g}" if u.lr is not None else ""
    # (the library whose loop this run ran, or the cell's call of it: never a trainer elsewhere in the namespace)
    library = trace.iterations.library
    if library == "transformers" or "trainer.train" in trace.source:
        fix = "load the model in float32 and pass `bf16=True` to `TrainingArguments` (autocast, float32 weights)"
    elif library == "lightning" or "trainer.fit" in trace.source:
        fix = "`precision=\"bf16-mixed\"` instead of `\"bf16-true\"` in `pl.Trainer` (float32 weights, bf16 compute)"
    else:
        fix = ("keep the weights in float32 and run the forward under `torch.autocast(device_type, "
               "dtype=torch.bfloat16)` (fp32 master weights)")
    step = code_at(trace, u.line, u.file) or "optimizer.step()"
    step = f"`{step}`" if "step(" in step else f"the optimizer step inside `{step}`"
    # (the line that made the weights bf16, often an earlier cell's, is the cause: the finding goes there)
    cast = cast_parts(trace, u, "transformers" if "bf16=True" in fix else "lightning" if "bf16-mixed" in fix else "")
    fix = cast.fix or fix
    msg = (f"{100 * frac:.0f}% of the sampled {u.dtype} weight values whose gradient was not zero came out of "
           f"{step} unchanged ({u.optimizer}{lr}): each update "
           f"is smaller than half the spacing of {u.dtype} numbers around the weight ({u.dtype} keeps "
           f"{8 if u.dtype == 'bfloat16' else 11} bits of mantissa: a weight of 1.0 can only move in steps of "
           f"{2 ** -7 if u.dtype == 'bfloat16' else 2 ** -10:g}), so it rounds back to the same value and those "
           f"weights never train ({shown}"
           f"{'; not one value of ' + ', '.join(frozen[:3]) + ' moved' if frozen else ''}).{cast.sentence} Fix: {fix}; or a "
           "larger learning rate, or an optimizer that keeps the rounding error (Kahan summation / stochastic "
           "rounding).")
    evidence = {"problem": "update_below_precision", "dtype": u.dtype, "lr": u.lr, "optimizer": u.optimizer,
                "sampled": u.sampled, "unchanged": u.unchanged, "fraction": frac, "frozen": frozen[:8]}
    if cast.where is not None:  # (the step's own line stays in the evidence: where the updates vanished)
        evidence.update(fix_code=cast.fix_code, step_line=u.line, step_file=u.file)
    return [at("amp_misuse", cast.where or placed(u), msg, title=_TITLE, severity="warning",
               iteration=None if cast.where is not None else looped(trace, u.iteration), evidence=evidence)]


# ---------------------------------------------------------------- the scale keeps falling
def collapsed(trace: Trace) -> bool:
    """The GradScaler skipped so many steps in a row that its scale is collapsing, not settling."""
    s = trace.precision.scaler
    return s.longest_skipped >= COLLAPSE or (s.calls >= 3 and s.skipped == s.calls)


def _first_overflow(trace: Trace) -> OpRecord | None:
    ev = next((e for e in trace.nonfinite if e.is_origin and e.reached), None) or \
        next((e for e in trace.nonfinite if e.is_origin), None)
    return trace.op(ev.index) if ev is not None else None


def _scale_collapse(trace: Trace) -> list[Finding]:
    if not collapsed(trace):
        return []
    s = trace.precision.scaler
    start, end = s.run_start, s.run_end
    first = start.scale if start is not None else None
    last = s.scale_last
    op = _first_overflow(trace)
    overflow_line = None
    if op is not None:
        w, name = op.where, f"`{op.op}`"
        fwd = trace.op(op.fwd_index) if op.phase == "backward" and op.fwd_index is not None else None
        if fwd is not None:  # (a backward op's own line is the backward() call: its forward op's is the user's)
            w, name = fwd.where, f"`{op.op}` in the backward of `{fwd.op}`"
        at_line = f"line {w.line}" if w.file is None else f"{w.file}:{w.line}"
        overflow_line = w.line
        origin = (f"The first op that overflowed: {name} at {at_line}"
                  f" (`{code_at(trace, w.line, w.file)}`){' in ' + w.module if w.module else ''}: fix that value "
                  "(see the NaN/Inf finding), not the scale.")
    else:
        origin = "The step's gradients were inf/NaN at every scale: look for the op that makes them (run with "\
                 "`every_iteration=True` to record every iteration)."
    scales = f" ({first:g} -> {last:g})" if first is not None and last is not None else ""
    msg = (f"GradScaler skipped {s.longest_skipped} optimizer steps in a row ({s.skipped} of {s.calls} "
           f"`scaler.step` calls this run) and halved its scale each time{scales}: the gradients overflow whatever "
           f"the scale, so nothing trains and the scale heads for zero. A few skips while the scale settles are "
           f"normal; this many mean inf/NaN in the model or the loss. {origin} Compute the loss (and softmax/log) "
           "in float32, outside autocast, and clamp what can overflow.")
    where = placed(start) \
        if start is not None else Where()
    return [at("amp_misuse", where, msg, title=_TITLE, severity="warning",
               iteration=looped(trace, start.iteration if start is not None else None),
               evidence={"problem": "scale_collapse", "skipped_in_a_row": s.longest_skipped, "skipped": s.skipped,
                         "calls": s.calls, "scale_first": first, "scale_last": last,
                         "first_overflow": op.op if op is not None else None,
                         "first_overflow_line": overflow_line,
                         "last_call": end.call if end is not None else None})]


def amp_misuse(trace: Trace) -> list[Finding]:
    """Mixed precision misused, from what the run recorded (see the module docstring)."""
    out: list[Finding] = []
    for check in (_clip_before_unscale, _stuck, _scale_collapse):
        out.extend(check(trace))
    return out[:1] + [f for f in out[1:] if f.line != out[0].line]


# ---------------------------------------------------------------- autocast outputs outside their block
@functools.lru_cache(maxsize=64)
def _autocast_blocks(source: str) -> tuple[tuple[int, int, int], ...]:
    """(with line, first body line, last body line) of every ``with ...autocast(...)`` block."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                call = item.context_expr
                func = call.func if isinstance(call, ast.Call) else call
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "autocast":
                    out.append((node.lineno, node.body[0].lineno, node.end_lineno or node.lineno))
                    break
    return tuple(out)


def _block(trace: Trace, line: int | None, file: str | None) -> tuple[int, int, int] | None:
    if line is None:
        return None
    source = trace.source if file is None else "".join(linecache.getlines(file))
    return next((b for b in _autocast_blocks(source) if b[1] <= line <= b[2]), None)


def amp_crossing(trace: Trace) -> list[Finding]:
    """A dtype error from a bf16/fp16 tensor autocast made, used after its ``with`` block (both lines)."""
    exc, failed = trace.exception, trace.failed_op
    if exc is None or failed is None or not _DTYPE.search(exc.message) or not same_exception(trace):
        return []
    low = [m for m in failed.inputs if m.dtype in _LOW]
    # (not backward: a library's training_step may run inside ``optimizer.step(closure)``, phase "optimizer")
    if not low or not any(m.dtype == "float32" for m in failed.inputs) or failed.phase == "backward":
        return []
    use = failed.where
    if _block(trace, use.line, use.file) is not None:
        return []  # inside autocast itself: not this boundary
    made = None
    for op in reversed(trace.ops):
        if op.index >= failed.index or op.phase == "backward":
            continue
        if any(m.dtype == low[0].dtype for m in op.outputs) and _block(trace, op.where.line, op.where.file):
            made = op
            break
    if made is None:
        return []
    w = made.where
    block = _block(trace, w.line, w.file)
    made_code, use_code = code_at(trace, w.line, w.file), code_at(trace, use.line, use.file)
    var = made_code.split("=")[0].strip() if "=" in made_code and "==" not in made_code else "the output"
    cast = f"{var} = {var}.float()" if var != "the output" else ".float()"
    at_made = f"line {w.line}" if w.file == use.file else f"{w.file}:{w.line}"
    msg = (f"`{use_code}` (line {use.line}) got a {low[0].dtype} tensor that `torch.autocast` made at {at_made} "
           f"(`{made_code}`, inside the `with` block at line {block[0]}), next to float32 weights: autocast's "
           f"outputs keep their dtype after the block ends, and outside it nothing casts them for `{failed.op}`. "
           f"Cast back where the block ends (`{cast}`), or run line {use.line} inside the `with` block.")
    return [at("amp_misuse", use, msg, op=failed.op, title=_TITLE,
               evidence={"problem": "autocast_output_outside", "made_line": w.line, "made_file": w.file,
                         "made_op": made.op, "with_line": block[0], "dtype": low[0].dtype,
                         "inputs": [m.short() for m in failed.inputs], "fix_code": cast})]


def low_precision(dtypes: list[str]) -> str | None:
    """The first of ``dtypes`` that is float16 or bfloat16, if any.

    >>> low_precision(["float32", "bfloat16"]), low_precision(["float32"])
    ('bfloat16', None)
    """
    return next((d for d in dtypes if d in _LOW), None)


def low_precision_origin(low: str, phase: str) -> str:
    """What the NaN/Inf rule adds when the op that made the first NaN/Inf ran in ``low`` (float16 or bfloat16, see
    :func:`low_precision`): that precision may be the cause. Said as a condition: the recorded statistics are
    those of the low-precision values, not what float32 would have computed.

    >>> low_precision_origin("bfloat16", "forward").split(":")[0]
    'It ran in bfloat16'
    """
    limits = ("float16 overflows to inf above 65,504 and rounds to 0 below ~6e-8" if low == "float16" else
              "bfloat16 keeps 8 significant bits (1 + 2**-10 is 1 there, so their difference is 0)")
    text = (f"It ran in {low}: {limits}, so values finite and distinct in float32 can be inf or equal here. If "
            "this op is finite in float32, keep it there: `.float()` its inputs (under `torch.autocast`, wrap it "
            "in `with torch.autocast(device_type, enabled=False):`)")
    if phase == "backward" and low == "float16":
        text += "; gradients that overflow float16 need the loss scaled (`torch.amp.GradScaler`)"
    return text + "."


__all__ = ["COLLAPSE", "amp_crossing", "amp_misuse", "collapsed", "low_precision", "low_precision_origin"]
