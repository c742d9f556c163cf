"""What a training loop did between two optimizer steps: how many ``backward()`` calls fed each step,
where gradients were zeroed, how each loss was scaled, and the measured equivalence of the accumulated
gradient with one full batch. The capture writes them (``capture/watches/accumulation.py``); the
``grad_accumulation`` rule reads them (``analysis/rules/accumulation.py``).

Counted from ``torch.autograd.backward`` and the optimizer step hooks, not from the phase of the ops:
a step of a library loop (Lightning runs ``backward`` inside ``optimizer.step(closure)``) counts the
same as a step written in a cell.

>>> from backward_doctor.util.serde import from_dict, to_dict
>>> w = StepWindow(iteration=0, backward=4, calls=[BackwardCall(line=3, divisor=4.0)])
>>> from_dict(StepWindow, to_dict(w)) == w
True
>>> Accumulation(per_step=[0, 9, 0, 3]).steps_with(3)
3
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BackwardCall:
    """One ``backward()`` call (the first windows of a run only): where the user called it, the loss it
    started from and how that loss was scaled just before (a division by a constant at its root), and how much of
    that a library did."""

    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None
    site: int = 0                  # the call site (code object and offset) hashed: the same line run again
    loss: float | None = None      # the value backward() started from, when readable in place (CPU)
    divisor: float = 1.0           # the loss reached backward() divided by this (``loss / 4``: 4.0; none: 1.0)
    root: str = ""                 # the autograd node it started at (``DivBackward0``)
    #: the library whose code called backward() and divided the loss on its way there (``accelerator.backward``,
    #: the Trainer's ``training_step``, Lightning's automatic optimization): "accelerate", "transformers",
    #: "lightning"; '' none did
    library: str = ""
    library_divisor: float = 1.0   # what those libraries divided it by (part of ``divisor``)


@dataclass
class ZeroGradCall:
    """A ``zero_grad()`` between two ``backward()`` calls that fed the same optimizer step."""

    after: int                     # backward() calls of its window before it
    target: str = "optimizer"      # "optimizer" (``optimizer.zero_grad()``) or "module" (``model.zero_grad()``)
    type: str = ""                 # the class of what it was called on (``SGD``, ``Sequential``)
    stepped: bool = True           # it cleared gradients of the parameters the step then used
    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None


@dataclass
class StepWindow:
    """One optimizer step and what led to it since the previous step (the first windows of a run, and
    the first that zeroed gradients between its ``backward()`` calls or stepped off a library's sync)."""

    iteration: int
    backward: int = 0                                      # backward() calls since the previous step
    calls: list[BackwardCall] = field(default_factory=list)  # the first few of them
    zero_grads: list[ZeroGradCall] = field(default_factory=list)
    zeroed_first: bool = False     # gradients were zeroed (or None) before its first backward()
    optimizer: str = ""            # the class of the optimizer that stepped
    line: int | None = None        # where the step was called
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None
    accumulate: int = 0            # a library's accumulation steps in force then (Accelerate's ``num_steps``; 0: none)
    sync: bool | None = None       # Accelerate's gradient state said this was a step to take (None: not in use)


@dataclass
class AccumulationCheck:
    """The measured equivalence check: in the first window that accumulated ``micro_batches`` backward()
    calls (gradients zeroed before it), the gradient the step used against the gradient one full batch
    of the same micro-batches gives: each micro-batch's own gradient (what its backward() added to
    ``.grad``), rescaled to a 1/k share of its loss, summed. Measured right after the last backward()
    (before clipping and unscaling); ``factor``: the step's gradient along the full batch's, as a multiple
    of it (4.0: four times too large); ``rel_diff``: |step - full| / |full|."""

    iteration: int
    micro_batches: int
    divisor: float = 1.0           # what each micro-batch's loss was divided by
    factor: float | None = None
    rel_diff: float | None = None
    norm_step: float | None = None
    norm_full: float | None = None
    #: |step - sum| / |sum| against the plain sum of what the backward() calls added, whatever their scaling:
    #: not zero when something changed the gradients between the micro-batches (a zero_grad, a clip, a hook)
    sum_rel_diff: float | None = None
    why_not: str = ""              # the check did not run, and why


@dataclass
class Accumulation:
    """Every optimizer step of the run in counts, a few of them in detail, and the measured check."""

    per_step: list[int] = field(default_factory=list)  # [n]: steps fed by n backward() calls (last: n or more)
    windows: list[StepWindow] = field(default_factory=list)
    trailing: int = 0              # backward() calls after the last step (no step used them)
    check: AccumulationCheck | None = None
    #: accumulation a library was configured for: "Trainer.gradient_accumulation_steps=4", ...
    settings: list[str] = field(default_factory=list)

    def steps_with(self, n: int) -> int:
        """Optimizer steps fed by exactly ``n`` backward() calls."""
        return self.per_step[n] if 0 <= n < len(self.per_step) else 0


__all__ = ["Accumulation", "AccumulationCheck", "BackwardCall", "StepWindow", "ZeroGradCall"]
