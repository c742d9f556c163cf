"""Updates rounding away on bf16/fp16 weights, placed at the line that made the weights low precision.

``optimizer.step()`` is where the updates vanish, but the cause is the statement that made the weights bf16
(``model.to(torch.bfloat16)``, ``.half()``, ``from_pretrained(..., torch_dtype=torch.bfloat16)``, Lightning's
``precision="bf16-true"``), often in an earlier cell: ``Precision.cast``, read from the user's sources by the
capture (``capture/end/weight_casts.py``). The finding goes there, with that statement keeping float32 weights and
bf16 compute (autocast, ``bf16=True``, ``"bf16-mixed"``) as the fix. Where the sources do not tell, the finding
stays at the step and says so: the weights were already low precision when the step first ran.

>>> from backward_doctor.trace import Trace, LowPrecisionUpdate, WeightsCast
>>> t = Trace(); u = LowPrecisionUpdate(iteration=0, optimizer="AdamW", dtype="bfloat16")
>>> cast_parts(t, u, "").where is None
True
>>> t.precision.cast = WeightsCast(dtype="bfloat16", line=2, code="model = model.to(torch.bfloat16)")
>>> parts = cast_parts(t, u, "")
>>> parts.where.line, parts.fix_code.splitlines()[0]
(2, '# model = model.to(torch.bfloat16)   <- removed: the weights stay float32')
"""
from __future__ import annotations

from dataclasses import dataclass

from ...trace.precision import LowPrecisionUpdate
from ...trace.records import Trace, Where


@dataclass
class CastParts:
    """What the ``update_below_precision`` finding says of where the weights were made low precision."""

    where: Where | None   # the cast's line; None: not found, the finding stays at the step
    sentence: str         # said before the fix
    fix: str              # the fix, in words with code
    fix_code: str         # the fix as code ('' when not found)


def _compute(trace: Trace, library: str, dtype: str) -> str:
    """The low-precision compute that keeps float32 weights, as code for this loop."""
    torch_dtype = f"torch.{dtype}"
    if library == "transformers":
        return f"args = TrainingArguments(..., {'bf16' if dtype == 'bfloat16' else 'fp16'}=True)"
    if library == "lightning":
        return f"trainer = pl.Trainer(..., precision=\"{'bf16' if dtype == 'bfloat16' else '16'}-mixed\")"
    device = next((o.device for o in trace.optimizers if o.device), "cpu").split(":")[0]
    return (f"with torch.autocast(device_type=\"{device}\", dtype={torch_dtype}):\n"
            "    loss = ...  # the forward and the loss, as before")


def cast_parts(trace: Trace, u: LowPrecisionUpdate, library: str) -> CastParts:
    """Where the weights of ``u`` were made ``u.dtype`` (``trace.precision.cast``), what to say of it and the
    fix as code; ``library``: the loop's ("transformers", "lightning", '' for the cell's own)."""
    cast = trace.precision.cast
    if cast is None or cast.line is None or cast.dtype != u.dtype:
        sentence = (f" The weights were already {u.dtype} when this step first ran (iteration {u.iteration}); the "
                    f"line that made them {u.dtype} was not found in this cell or the cells run before it.")
        return CastParts(None, sentence, "", "")
    where = Where(line=cast.line, file=cast.file, cell_line=cast.line if cast.file is None else None,
                  function=cast.function)
    lightning = "precision=" in cast.code
    sentence = (f" `{cast.code}` is what made these weights {u.dtype}: every update the optimizer makes is rounded "
                f"to {u.dtype} as it is written into them.")
    compute = "" if lightning else _compute(trace, library, u.dtype)
    if cast.fix:
        kept = f"{cast.fix}   # float32 weights"
        words = f"`{cast.fix}` instead of `{cast.code}`"
    else:
        kept = f"# {cast.code}   <- removed: the weights stay float32"
        words = f"drop `{cast.code}`"
    fix_code = kept + (f"\n{compute}" if compute else "")
    fix = (f"keep float32 master weights and compute in {u.dtype}: {words}"
           + (f", then `{compute.splitlines()[0]}`" if compute else ""))
    return CastParts(where, sentence, fix, fix_code)


__all__ = ["CastParts", "cast_parts"]
