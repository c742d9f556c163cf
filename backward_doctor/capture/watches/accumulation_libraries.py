"""What the libraries that accumulate gradients for the user say about it (read by the accumulation watch,
``watches/accumulation.py``): Accelerate's process-wide gradient state at each ``backward()`` and step, the accumulation
the namespace's Trainer, Lightning trainer or Accelerator is configured for, and what a library that called
``backward()`` divided the loss by on its way there (``library_division``).

>>> list(settings({"steps": 4}))
[]
"""
from __future__ import annotations

import types
from typing import Any, Callable, Iterator

import torch

from ...util.process import doctors_own


def accelerate_state(mod: Any) -> tuple[bool | None, int]:
    """Accelerate's gradient state (a process-wide singleton in ``accelerate.state``, ``mod``): whether this
    is a step to take (``sync_gradients``) and its accumulation steps."""
    try:
        state = mod.GradientState._shared_state
        num = int((state.get("plugin_kwargs") or {}).get("num_steps", 0) or 0)
        sync = state.get("sync_gradients")
    except Exception as exc:  # another version's layout: not worth failing the step for
        if not doctors_own(exc):
            raise
        return None, 0
    return (bool(sync) if num > 1 and sync is not None else None), num


def settings(namespace: dict[str, Any]) -> Iterator[str]:
    """Accumulation the namespace's library objects are configured for (more than one micro-batch)."""
    for name, value in list(namespace.items()):
        if name.startswith("_") or isinstance(value, (type, torch.Tensor, torch.nn.Module)):
            continue
        try:
            kind = type(value).__name__
            if kind.endswith("Trainer") and hasattr(value, "accumulate_grad_batches"):
                n, what = value.accumulate_grad_batches, "accumulate_grad_batches"
            elif hasattr(value, "args") and hasattr(value.args, "gradient_accumulation_steps"):
                n, what = value.args.gradient_accumulation_steps, "args.gradient_accumulation_steps"
            elif kind == "Accelerator":
                n, what = value.gradient_accumulation_steps, "gradient_accumulation_steps"
            else:
                continue
        except Exception:  # a property that raises: nothing to say about it
            continue
        if isinstance(n, int) and n > 1:
            yield f"{name}.{what}={n}"


def _accelerate(frame: types.FrameType) -> float | None:
    """``Accelerator.backward``: ``loss / self.gradient_accumulation_steps`` before it calls backward() (not under
    DeepSpeed, whose engine scales the loss itself)."""
    acc = frame.f_locals.get("self")
    if "DEEPSPEED" in str(getattr(acc, "distributed_type", "")):
        return None
    return float(acc.gradient_accumulation_steps)


def _trainer(frame: types.FrameType) -> float | None:
    """``Trainer.training_step``: ``loss / self.current_gradient_accumulation_steps`` unless it decided the loss was
    already scaled for accumulation (its local ``loss_is_scaled_for_ga``, computed before backward())."""
    scaled = frame.f_locals.get("loss_is_scaled_for_ga")
    if scaled is None:  # (another version's training_step: it says nothing the doctor can read)
        return None
    return 1.0 if scaled else float(frame.f_locals["self"].current_gradient_accumulation_steps)


def _lightning(frame: types.FrameType) -> float | None:
    """``LightningModule.backward`` under automatic optimization: the loss ``training_step`` returned was divided
    by ``trainer.accumulate_grad_batches`` (``ClosureResult.from_training_step_output``); manual: not divided."""
    module = frame.f_locals.get("self")
    if not getattr(module, "automatic_optimization", False) or getattr(module, "_fabric", None) is not None:
        return 1.0
    return float(module.trainer.accumulate_grad_batches)


#: (module, function) of the library functions that divide a loss before it reaches backward()
_DIVIDERS: dict[tuple[str, str], tuple[str, Callable[[types.FrameType], float | None]]] = {
    ("accelerate.accelerator", "Accelerator.backward"): ("accelerate", _accelerate),
    ("transformers.trainer", "Trainer.training_step"): ("transformers", _trainer),
    ("pytorch_lightning.core.module", "LightningModule.backward"): ("lightning", _lightning),
    ("lightning.pytorch.core.module", "LightningModule.backward"): ("lightning", _lightning),
}


def library_division(frame: types.FrameType | None, depth: int = 16) -> tuple[str, float]:
    """What the libraries on the stack of a ``backward()`` call (``frame`` and those that called it) divided its
    loss by: (the library that divided by more than 1, '' if none; the product of their divisions). Read by the
    accumulation watch for the first windows' calls only.

    >>> library_division(None)
    ('', 1.0)
    """
    name, total = "", 1.0
    while frame is not None and depth > 0:
        code = frame.f_code
        found = _DIVIDERS.get((frame.f_globals.get("__name__", ""), getattr(code, "co_qualname", code.co_name)))
        if found is not None:
            try:
                d = found[1](frame)
            except Exception as exc:  # another version's layout: nothing said about it
                if not doctors_own(exc):
                    raise
                d = None
            if d is not None and d > 0:
                total *= d
                name = found[0] if d > 1 else name
        frame, depth = frame.f_back, depth - 1
    return name, total


__all__ = ["accelerate_state", "library_division", "settings"]
