"""Out of memory: what filled the device, and what each fix is predicted to need.

Predictions come from the categories live when memory ran out. Parameters,
gradients and optimizer state do not depend on the batch; activations do:

- ``accumulate:k``: fixed + activations / k
- ``amp``: fixed + activations / 2 (16-bit activations; fp32 master weights stay)
- ``checkpoint``: fixed + activations kept only at module boundaries plus one
  module's activations recomputed at a time

They describe the step up to the failing op, so they are lower bounds when the
step failed early; the fixes issue re-runs the step to measure them.

>>> predict({"parameters": 100, "gradients": 0, "optimizer": 0, "activations": 800, "other": 0}, {}, 0)["accumulate:4"]
300
"""
from __future__ import annotations

from typing import Any

from ..findings import Finding, at, forward_where
from ..trace import Trace
from ..units import format_bytes

_FIXED = ("parameters", "gradients", "optimizer")


def predict(by_category: dict[str, int], by_module: dict[str, int], requested: int) -> dict[str, int]:
    # Gradients being computed in backward have the parameters' size, not the batch's.
    in_backward = by_module.get("(gradients in backward)", 0)
    fixed = sum(by_category.get(c, 0) for c in _FIXED) + in_backward
    # ``requested`` is already live: the failing op's output exists when the limit trips.
    act = max(0, sum(v for c, v in by_category.items() if c not in _FIXED) - in_backward)
    out = {f"accumulate:{k}": fixed + act // k for k in (2, 4, 8)}
    out["amp"] = fixed + act // 2
    module_bytes = [v for k, v in by_module.items() if not k.startswith("(")]
    if module_bytes:
        biggest = max(module_bytes)
        # Boundaries keep ~one input per module; the biggest module is recomputed at a time.
        out["checkpoint"] = fixed + (act - sum(module_bytes)) + biggest + act // max(8, len(module_bytes) * 4)
    return out


def oom(trace: Trace) -> list[Finding]:
    """The line during which memory ran out, the breakdown, and predicted peaks."""
    exc = trace.exception
    if exc is None or not (exc.type == "OutOfMemoryError" or "out of memory" in exc.message.lower()):
        return []
    info: dict[str, Any] = exc.oom or {}
    rec = trace.op(info.get("index"))
    where = rec.where if rec is not None else exc.where
    if rec is not None and rec.phase == "backward":
        fwd = forward_where(trace, rec)
        where = type(where)(line=where.line, file=where.file, cell_line=where.cell_line, module=fwd.module)
    cats = info.get("by_category", {})
    by_module = info.get("by_module", {})
    requested = info.get("requested") or 0
    limit = trace.memory.limit_bytes or trace.memory.device_total_bytes
    preds = predict(cats, by_module, requested)
    fixed = sum(cats.get(c, 0) for c in _FIXED)
    live = info.get("live", sum(cats.values()))
    phase = rec.phase if rec is not None else "the step"
    breakdown = ", ".join(f"{c} {format_bytes(v)}" for c, v in cats.items() if v)
    msg = (f"Memory ran out during {phase} at line {where.line}"
           f"{' in ' + where.module if where.module else ''}{' (' + rec.op + ')' if rec else ''}: "
           f"{format_bytes(live)} live tensors{' on a ' + format_bytes(limit) + ' device' if limit else ''} "
           f"({breakdown}).")
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
        msg += (" Activations saved for backward grow with the batch and dominate: keep the batch and split "
                "it into micro-batches (gradient accumulation)"
                f"{f', k={k} is predicted to fit' if k else ''}, or use AMP or activation checkpointing. "
                "Deleting outputs or emptying the cache does not reduce what backward needs.")
        fixes = ["accumulate", "amp", "checkpoint"]
    preds_text = {name: format_bytes(v) for name, v in preds.items()}
    return [at("oom", where, msg, op=rec.op if rec else None, fixes=fixes, title="Out of memory",
               evidence={"by_category": cats, "by_module": by_module, "requested": requested,
                         "limit": limit, "predicted_peak": preds, "predicted_peak_text": preds_text,
                         "simulated": bool(info.get("simulated")), "lower_bound": True})]
