"""Accelerate's knobs set on the live objects, for a loop over ``accelerator.accumulate(model)`` whose
``Accelerator`` and prepared ``DataLoader`` an earlier cell built (``live_knobs.py`` is the same for transformers).

``accumulate`` sets the Accelerator's ``gradient_accumulation_steps`` (its own setter) and the prepared loader's
batch size (its ``BatchSampler``'s: a ``DataLoader`` refuses a new ``batch_size`` once built), then runs the cell as
it is; ``accelerator.backward`` divides each micro-batch's loss and the prepared optimizer steps once per window.
After the run the Accelerator, its shared state and the sampler are put back. Mixed precision is not set live:
Accelerate fixes it once per process.

>>> _loader_names(ast.parse("for i, (x, y) in enumerate(loader):\\n    pass").body[0])
['enumerate', 'loader']
"""
from __future__ import annotations

import ast
from typing import Any

from ..util.cell import Cell, NotApplicable
from .accumulate import Rewrite, split_batch
from .live_knobs import comment_lines, elsewhere
from .spec import FixSpec


def _loader_names(stmt: ast.stmt) -> list[str]:
    """The names the loop statement iterates over (``for ... in enumerate(loader)``: ``enumerate``, ``loader``)."""
    it = getattr(stmt, "iter", None)
    return [n.id for n in ast.walk(it) if isinstance(n, ast.Name)] if it is not None else []


def rewrite(spec: FixSpec, cell: Cell, namespace: dict[str, Any], original: Any, loop: Any) -> Rewrite | None:
    """``accumulate`` set on the live Accelerator and loader of ``loop``; None for the other fixes (mixed
    precision is refused as without the live objects, checkpointing wraps the loop whatever built them)."""
    if spec.kind != "accumulate":
        return None
    accelerator, func = loop.runner, loop.call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        raise NotApplicable("the Accelerator is not a name in this cell, so the doctor cannot set its "
                            "gradient_accumulation_steps for the run: set them where it is built")
    var = func.value.id
    if loop.loader is not None:  # (a batch size set on the live loader would be built over by the cell)
        raise NotApplicable("the cell builds the DataLoader but not the Accelerator: build both in one cell, or "
                            "neither, and the doctor can try it")
    names = [n for n in _loader_names(cell.stmts[loop.index])
             if isinstance(getattr(getattr(namespace.get(n), "batch_sampler", None), "batch_size", None), int)]
    if len(names) != 1:
        raise NotApplicable("the loop does not iterate over one DataLoader named in this cell, so the doctor cannot "
                            "split its batches: set `batch_size` where it is built")
    loader = namespace[names[0]]
    sampler, batch = loader.batch_sampler, loader.batch_sampler.batch_size
    accum = accelerator.gradient_accumulation_steps
    k = split_batch(spec.arg if isinstance(spec.arg, int) else None, original, batch)
    lines = [f"{var}.gradient_accumulation_steps = {accum * k}\n",
             f"{names[0]}.batch_sampler.batch_size = {batch // k}  # (a DataLoader's own is fixed)\n"]
    # The DataLoader the user built is the one the cell that built the Accelerator prepared (or an earlier one).
    base = type(getattr(loader, "base_dataloader", loader))  # (a prepared loader wraps the one the user built)
    where = elsewhere(namespace, [(base, {"batch_size": batch // k}),
                                  (type(accelerator), {"gradient_accumulation_steps": accum * k})],
                      "".join(lines).strip())
    what = (f"batch_size {batch} -> {batch // k} and gradient_accumulation_steps {accum} -> {accum * k}: the same "
            f"{batch * accum} examples per optimizer step, in micro-batches of {batch // k}")
    at = f"where they are built, {where['place']}" if where["place"] else \
        "where they are built (not in this kernel's input history)"
    comment = comment_lines(f"backward_doctor fix {spec.name} - {what}. Set on the live `{var}` for this run; to "
                            f"keep it, set `{where['setting']}` {at}, or run this cell.", where["place"])
    code = comment + "".join(lines) + cell.source + ("" if cell.source.endswith("\n") else "\n")
    msg = (f"Accelerate's own gradient accumulation, set on the live `{var}` for the run: {what}. Where they are "
           "built: " + (f"{where['place']}." if where["place"] else "not found in this kernel's input history."))
    return Rewrite(code=code, message=msg, details={
        "k": k, "batch_size": batch, "live_var": var, "elsewhere": where,
        "live_what": "its accumulation steps, its state, the loader's batch size",
        "live_objects": ([accelerator, sampler], [], [accelerator.gradient_state.plugin_kwargs])})
