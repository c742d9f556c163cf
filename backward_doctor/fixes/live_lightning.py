"""Lightning's knobs set on the live objects, for a ``trainer.fit(model, loader)`` whose ``Trainer`` and
``DataLoader`` an earlier cell built (``live_knobs.py`` is the same for transformers).

The rewritten cell sets them for the run and runs the cell as it is: ``accumulate`` sets the Trainer's
``accumulate_grad_batches`` and the loader's batch size (its ``BatchSampler``'s: a ``DataLoader`` refuses a new
``batch_size`` once built), ``amp`` gives the Trainer's strategy a bf16 ``MixedPrecision`` plugin. After the run
the Trainer, its strategy and state, the loader's sampler and the module are put back (their attributes, and
the fit loop's progress through its own ``state_dict``), so nothing changes unless the user keeps the fix.

>>> _root(type("T", (), {"__module__": "lightning.pytorch.trainer.trainer"}))
'lightning.pytorch'
"""
from __future__ import annotations

import ast
from typing import Any

from ..util.cell import Cell, NotApplicable
from .accumulate import Rewrite, split_batch
from .live_knobs import comment_lines, elsewhere, settings
from .spec import FixSpec


def _root(cls: type) -> str:
    """The package Lightning was imported as (``pytorch_lightning`` or ``lightning.pytorch``)."""
    return cls.__module__.split(".trainer")[0]


def _arg(call: ast.Call, position: int, name: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == name), None)


def rewrite(spec: FixSpec, cell: Cell, namespace: dict[str, Any], original: Any, loop: Any) -> Rewrite | None:
    """``spec`` set on the live Lightning ``Trainer`` (and ``DataLoader``) of ``loop``, or None where the live
    objects do not decide it (checkpointing wraps the cell's ``fit`` whatever built the Trainer)."""
    if spec.kind not in ("accumulate", "amp"):
        return None
    trainer, func = loop.runner, loop.call.func
    model_node, loader_node = _arg(loop.call, 0, "model"), _arg(loop.call, 1, "train_dataloaders")
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and isinstance(model_node, ast.Name)):
        raise NotApplicable("the Trainer or the module is not a name in this cell, so the doctor cannot set the "
                            "knobs for the run: set them where the Trainer is built")
    var, model = func.value.id, namespace.get(model_node.id)
    objects, pairs = [trainer, trainer.strategy, trainer.state, model], []
    if spec.kind == "accumulate":
        if getattr(model, "automatic_optimization", True) is False:
            raise NotApplicable("the LightningModule optimizes by hand (`automatic_optimization = False`), which "
                                "Lightning's accumulate_grad_batches does not support: accumulate in its "
                                "training_step (step every k batches)")
        if loop.loader is not None:  # (a batch size set on the live loader would be built over by the cell)
            raise NotApplicable("the cell builds the DataLoader but not the Trainer: build both in one cell, or "
                                "neither, and the doctor can try it")
        loader = namespace.get(loader_node.id) if isinstance(loader_node, ast.Name) else None
        sampler = getattr(loader, "batch_sampler", None)
        batch = getattr(sampler, "batch_size", None)
        if not isinstance(batch, int):
            raise NotApplicable("the DataLoader `fit` is given is not a name in this cell with a batch size, so the "
                                "doctor cannot split its batches: set `batch_size` where it is built")
        accum = trainer.accumulate_grad_batches
        k = split_batch(spec.arg if isinstance(spec.arg, int) else None, original, batch)
        lines = [f"{var}.accumulate_grad_batches = {accum * k}\n",
                 f"{loader_node.id}.batch_sampler.batch_size = {batch // k}  # (a DataLoader's own is fixed)\n"]
        pairs = [(type(loader), {"batch_size": batch // k}), (type(trainer), {"accumulate_grad_batches": accum * k})]
        what = (f"batch_size {batch} -> {batch // k} and accumulate_grad_batches {accum} -> {accum * k}: the same "
                f"{batch * accum} examples per optimizer step, in micro-batches of {batch // k}")
        objects.append(sampler)
        details: dict[str, Any] = {"k": k, "batch_size": batch}
        kind = "gradient accumulation"
    else:
        device = getattr(getattr(trainer.strategy, "root_device", None), "type", "cpu")
        lines = [f"from {_root(type(trainer))}.plugins.precision import MixedPrecision\n",
                 f"{var}.strategy.precision_plugin = MixedPrecision('bf16-mixed', {device!r})\n"]
        pairs = [(type(trainer), {"precision": "bf16-mixed"})]
        what = ("the forward pass in bfloat16 autocast (activations saved in 16 bits), weights kept in float32; the "
                "loss is close to, not equal to, the float32 loss")
        details, kind = {}, "mixed precision"
    where = elsewhere(namespace, pairs, "".join(lines).strip())
    at = f"where they are built, {where['place']}" if where["place"] else \
        "where they are built (not in this kernel's input history)"
    setting = where["setting"]
    comment = comment_lines(f"backward_doctor fix {spec.name} - {what}. Set on the live `{var}` for this run; to "
                            f"keep it, set `{setting}` {at}, or run this cell.", where["place"])
    code = comment + "".join(lines) + cell.source + ("" if cell.source.endswith("\n") else "\n")
    msg = (f"Lightning's own {kind}, set on the live `{var}` for the run: {what}. Where they are built: "
           + (f"{where['place']}." if where["place"] else "not found in this kernel's input history."))
    return Rewrite(code=code, message=msg, details={
        **details, "live_var": var, "elsewhere": where, "live_what": "its settings, its state, the loader's batch size",
        "live_objects": (objects, [trainer.fit_loop])})
