"""What the frozen-parameter watch (``capture/watches/frozen.py``) leaves in a trace: the parameters with
``requires_grad=False`` that an optimizer step still changed (``Trace.frozen_updates``).

>>> from backward_doctor.util.serde import from_dict, to_dict
>>> u = FrozenUpdate(index=3, optimizer="AdamW", id=1, line=8, iteration=2, key=7, sampled=16, moved=16)
>>> from_dict(FrozenUpdate, to_dict(u)) == u
True
"""
from __future__ import annotations

from dataclasses import dataclass

from .parts import OptimizerStep


@dataclass
class FrozenUpdate(OptimizerStep):
    """A parameter with ``requires_grad=False`` that an optimizer step still changed: values sampled in place
    before and after the step (``capture/watches/frozen.py``), recorded only where some of them moved."""

    iteration: int = 0        # the loop's iteration the step ended
    key: int = 0              # the parameter's storage key (``ParamInfo.key``: its name)
    numel: int = 0
    sampled: int = 0          # values compared
    moved: int = 0            # of those, how many the step changed
    max_change: float = 0.0   # the largest absolute change among them
    max_abs: float = 0.0      # the largest absolute value among them before the step (the scale of the change)
    grad_zero: bool = False   # its ``.grad`` was zero where sampled (``zero_grad(set_to_none=False)`` left it)


__all__ = ["FrozenUpdate"]
