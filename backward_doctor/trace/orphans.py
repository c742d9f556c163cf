"""What the optimizer-membership watch (``capture/watches/orphans.py``) leaves in a trace: the parts of a model an
optimizer trains whose parameters no optimizer holds (``Trace.unoptimized``), such as a head or an adapter put on
the model after the optimizer was built.

>>> from backward_doctor.util.serde import from_dict, to_dict
>>> u = UnoptimizedModule(model="model", module="model.head", cls="Linear", params=["model.head.weight"],
...                       keys=[7], numel=32, optimizer="opt", optimizer_cls="AdamW", optimizer_id=3, held=144)
>>> from_dict(UnoptimizedModule, to_dict(u)) == u
True
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UnoptimizedModule:
    """A module (or a parameter held directly by a module) of a model that an optimizer trains, none of whose
    parameters is in any optimizer's param groups, read at the end of the run. Recorded whether or not they got a
    gradient: the rule reads their part in the step from ``Trace.params``, by name."""

    model: str                 # the variable that holds the model (``model``)
    module: str                # the module (``model.head``), or the parameter itself when its module's others are held
    cls: str                   # the module's class (``Linear``; ``Parameter`` for a parameter alone)
    params: list[str] = field(default_factory=list)   # its parameters that require grad, by name (``ParamInfo.name``)
    keys: list[int] = field(default_factory=list)     # their storage keys, in the same order
    numel: int = 0             # their values, all together
    #: the optimizer that holds the rest of the model (the most of its values): its variable (``opt``,
    #: ``trainer.optimizer``) or, for one the namespace does not name, '' with its class only
    optimizer: str = ""
    optimizer_cls: str = ""
    optimizer_id: int = 0      # its ``id()`` (``OptimizerStep.id``)
    held: int = 0              # the model's values that optimizer holds
    #: parameters that optimizer holds which no module of the namespace holds any more (replaced since it was built)
    replaced: int = 0
    #: of ``params``, those holding a ``.grad`` at the end of the run (what a parameter the capture never hooked says:
    #: one put directly on a module it had registered already, ``model.scale = nn.Parameter(...)``)
    grads: int = 0


__all__ = ["UnoptimizedModule"]
