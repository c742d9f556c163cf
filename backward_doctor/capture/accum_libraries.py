"""What the libraries that accumulate gradients for the user say about it (read by the accumulation watch,
``accum_watch.py``): Accelerate's process-wide gradient state at each ``backward()`` and step, and the accumulation
the namespace's Trainer, Lightning trainer or Accelerator is configured for.

>>> list(settings({"steps": 4}))
[]
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from .process import doctors_own


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


__all__ = ["accelerate_state", "settings"]
