"""Out of memory: what filled the device, and what each fix is predicted to need.

Predictions start from what was live when memory ran out. What existed before
the step (parameters, optimizer state, old gradients, the batch itself: micro-batches
are views of it) stays whatever the fix; parameter gradients have the parameters'
size; everything else the step made (activations, gradients of activations in
flight, temporaries) scales with the batch:

- ``accumulate:k``: fixed + every parameter's gradient (they exist from the second
  micro-batch on) + the rest / k
- ``amp``: fixed + a 16-bit copy of the weights + the rest, its float32 part halved
- ``checkpoint``: fixed + the rest, with the chosen modules' saved activations
  replaced by their inputs plus one module recomputed at a time (see ``fixes/plan.py``)

When the step ran out during the forward pass the rest of the step is unknown, so
the predictions are lower bounds (``evidence["lower_bound"]``); running out in
backward they are close (within 20% on the models in ``tests/test_fixes_predict.py``).
The fixes re-run the step and measure (``report.fix_result.comparison``).

>>> cats = {"parameters": 100, "gradients": 0, "optimizer": 0, "activations": 800, "other": 0}
>>> predict(cats, {}, 0)["accumulate:4"]  # 100 parameters + 100 gradients + 800 / 4
400
"""
from __future__ import annotations

from typing import Any

from ..findings import Finding, at, forward_where
from ...trace.parts import OomInfo
from ...trace.records import Trace
from ...util.units import format_bytes

_FIXED = ("parameters", "gradients", "optimizer")


def predict(by_category: dict[str, int], by_module: dict[str, int], requested: int, *,
            grads_at_start: int = 0, grads_full: int | None = None,
            checkpoint: tuple[int, int] | None = None, amp_factor: float = 0.5,
            step_extra: int = 0) -> dict[str, int]:
    """Predicted peak bytes per fix (see the module docstring).

    ``grads_at_start``: gradient bytes live when the step began; ``grads_full``: bytes of
    all trainable parameters' gradients (default: the parameters' bytes); ``checkpoint``:
    (activation bytes saved in modules at the OOM, bytes kept with the planned checkpointing);
    ``amp_factor``: what AMP leaves of the batch-sized part (0.5 when it is all float32);
    ``step_extra``: what the optimizer step adds to what existed before the step (state it
    creates on its first step, its temporaries): every fix's peak is at least the step's.
    """
    # ``requested`` is already live: the failing op's output exists when the limit trips.
    live = sum(by_category.values())
    params = by_category.get("parameters", 0)
    grads = by_category.get("gradients", 0)
    existing = by_module.get("(existing before the step)")
    if existing is None:
        existing = params + by_category.get("optimizer", 0) + min(grads, grads_at_start)
    new_grads = max(0, grads - grads_at_start)      # parameter gradients made by this backward
    fixed = existing + new_grads
    scaled = max(0, live - fixed)
    full = params if grads_full is None else grads_full
    acc_grads = max(0, full - min(grads, grads_at_start) - new_grads)
    out = {f"accumulate:{k}": fixed + acc_grads + scaled // k for k in (2, 4, 8)}
    out["amp"] = fixed + params // 2 + int(scaled * amp_factor)
    if checkpoint is not None:
        saved, kept = checkpoint
        out["checkpoint"] = fixed + max(0, scaled - saved) + kept
    if step_extra:
        step = existing - min(grads, grads_at_start) + full + step_extra
        out = {name: max(v, step) for name, v in out.items()}
    return out


def _step_facts(trace: Trace, by_module: dict[str, int]) -> dict[str, Any]:
    """What the trace adds to the live breakdown: gradients at the start, all gradients' size, a checkpoint plan."""
    grads = trace.memory.by_category.get("gradients") or [0]
    facts: dict[str, Any] = {"grads_at_start": grads[0]}
    params = getattr(trace, "params", None) or []
    numel = sum(p.numel for p in params)
    if numel and trace.parameters.bytes:
        facts["grads_full"] = trace.parameters.bytes * sum(p.numel for p in params if p.requires_grad) // numel
    from ..fix_plan import amp_factor, checkpoint_estimate, optimizer_step_extra

    facts["checkpoint"] = checkpoint_estimate(trace, by_module)
    facts["amp_factor"] = amp_factor(trace)
    if "step(" in trace.source:  # the cell steps an optimizer (its own state and temporaries count)
        facts["step_extra"] = sum(optimizer_step_extra(o) for o in trace.optimizers)
    return facts


def oom(trace: Trace) -> list[Finding]:
    """The line during which memory ran out, the breakdown, and predicted peaks."""
    exc = trace.exception
    if exc is None or not (exc.type == "OutOfMemoryError" or "out of memory" in exc.message.lower()):
        return []
    info = exc.oom or OomInfo()  # none: memory ran out outside the capture's ledger
    rec = trace.op(info.index)
    where = rec.where if rec is not None else exc.where
    if rec is not None and rec.phase == "backward":
        fwd = forward_where(trace, rec)
        where = type(where)(line=where.line, file=where.file, cell_line=where.cell_line, module=fwd.module)
    cats = info.by_category
    by_module = info.by_module
    requested = info.requested or 0
    limit = trace.memory.limit_bytes or trace.memory.device_total_bytes
    preds = predict(cats, by_module, requested, **_step_facts(trace, by_module))
    fixed = sum(cats.get(c, 0) for c in _FIXED)
    live = info.live
    phase = rec.phase if rec is not None else "the step"
    breakdown = ", ".join(f"{c} {format_bytes(v)}" for c, v in cats.items() if v)
    msg = (f"Memory ran out during {phase} at line {where.line}"
           f"{' in ' + where.module if where.module else ''}{' (' + rec.op + ')' if rec else ''}: "
           + (f"{format_bytes(live - requested)} already live and {format_bytes(requested)} asked for, "
              f"{format_bytes(live)} in all" if info.simulated and 0 < requested <= live
              else f"{format_bytes(live)} live tensors")  # a simulated device counts the request in `live`
           + f"{' on a ' + format_bytes(limit) + ' device' if limit else ''} ({breakdown}).")
    fixes: list[str] = []
    activations = cats.get("activations", 0)
    if rec is not None and rec.phase == "backward" and requested > activations:
        fwd = trace.op(rec.fwd_index)
        of = f" of `{fwd.op}`" if fwd else ""
        msg += (f" The tensor being allocated, a gradient{of} of {format_bytes(requested)}, is larger than all "
                f"saved activations ({format_bytes(activations)}): the parameter's gradient itself does not "
                "fit, so smaller batches or checkpointing will not help. For a large embedding table use "
                "`nn.Embedding(..., sparse=True)` with a sparse-capable optimizer, or freeze the table; "
                "otherwise the model needs a bigger device.")
        fixes = []
    elif limit and fixed >= 0.8 * limit:
        msg += (" Parameters, gradients and optimizer state alone nearly fill the device, so a smaller batch "
                "will not help: use a lighter optimizer state (SGD, or Adam with bf16 states), AMP, or a "
                "smaller model.")
        fixes = ["amp"]
    else:
        k = next((k for k in (2, 4, 8) if limit and preds[f"accumulate:{k}"] <= 0.9 * limit), None)
        early = rec is None or rec.phase == "forward"  # the rest of the step never ran: predictions are floors
        hint = (f", k={k} at least is needed (the step failed early, so this is a floor)" if early
                else f", k={k} is predicted to fit") if k else ""
        if limit and requested > 0.9 * limit:  # (CUDA's allocator says what it was asked for; a simulated limit too)
            k_min = -(-requested // int(0.9 * limit))
            msg += (f" The one tensor being allocated, {format_bytes(requested)}, is larger than "
                    f"{'the whole device' if requested > limit else 'nine tenths of the device'} by itself. If it "
                    f"grows with the batch, only a split into {k_min} micro-batches or more can fit it (gradient "
                    "accumulation; AMP halves it at most); if it does not (a size taken from the wrong dimension, an "
                    "outer product or a broadcast made real, a `.repeat` or `.contiguous()` of a large expanded "
                    "view), no split helps: check the shape this line asks for.")
        else:
            msg += (" Activations saved for backward grow with the batch and dominate: keep the batch and split "
                    f"it into micro-batches (gradient accumulation){hint}, or use AMP or activation checkpointing. "
                    "Deleting outputs or emptying the cache does not reduce what backward needs.")
        fixes = ["accumulate", "amp", "checkpoint"]
    preds_text = {name: format_bytes(v) for name, v in preds.items()}
    return [at("oom", where, msg, op=rec.op if rec else None, fixes=fixes, title="Out of memory",
               evidence={"by_category": cats, "by_module": by_module, "requested": requested,
                         "limit": limit, "predicted_peak": preds, "predicted_peak_text": preds_text,
                         "simulated": info.simulated,
                         "lower_bound": rec is None or rec.phase == "forward"})]
