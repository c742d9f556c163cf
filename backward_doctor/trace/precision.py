"""What mixed precision did during a run: gradient clipping and the GradScaler's state at that moment,
the scaler's steps (taken or skipped, and its scale), and whether updates to low-precision weights
survived rounding. The capture writes them (``capture/watches/precision.py``); the ``amp_misuse`` rule
reads them (``analysis/rules/amp.py``).

>>> from backward_doctor.util.serde import from_dict, to_dict
>>> p = Precision(clips=[ClipCall(iteration=0, scaled=True, scale=65536.0)])
>>> from_dict(Precision, to_dict(p)) == p
True
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClipCall:
    """A ``clip_grad_norm_`` call, and whether the gradients it clipped still carried a GradScaler's
    loss scale (the scaler had scaled a loss and not yet unscaled this optimizer's gradients)."""

    iteration: int
    scaled: bool = False
    scale: float | None = None       # the scale they carried (CPU scalers; None: not read)
    stage: str = ""                  # the scaler's stage for its optimizers then ("READY", "UNSCALED")
    max_norm: float | None = None
    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None
    #: the library whose own code scaled the loss these gradients came from (``"accelerate"``: its
    #: ``accelerator.backward``), '' when the user's code called ``scaler.scale``: the advice follows what ran
    scaled_by: str = ""
    #: ``backward()`` calls of the run before this clip (-1: not counted): two clips of one optimizer step with
    #: backward() calls between them clip each micro-batch's running sum (``rules/accumulation.py``)
    backward: int = -1


@dataclass
class ScalerStep:
    """One ``scaler.step(optimizer)``: whether the optimizer step ran, and the scale it was taken with."""

    call: int                        # 0-based count of scaler.step calls in the run
    iteration: int                   # the loop's iteration (optimizer steps taken before it)
    skipped: bool = False
    scale: float | None = None       # the scale the gradients carried (CPU scalers; None: not read)
    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None


@dataclass
class UnpairedStep:
    """An optimizer step beside a GradScaler that the scaler's ``update()`` did not follow as it should: a
    ``scaler.step(optimizer)`` with no ``scaler.update()`` before that optimizer's next ``scaler.step`` (torch then
    raises "step() has already been called since the last update()") or before the run ended (the next cell's
    ``scaler.step`` raises), or an ``optimizer.step()`` called directly on gradients the scaler had scaled and not
    unscaled (``direct``: no ``scaler.step`` ran inside it; nothing raises while ``update()`` is never called)."""

    iteration: int                   # the loop's iteration of that step (-1: in an earlier run)
    optimizer: str                   # its class name
    direct: bool = False             # optimizer.step() itself, not scaler.step(optimizer)
    at_end: bool = False             # still without its update when the run ended
    scale: float | None = None       # the scale its gradients carried (CPU scalers; None: not read)
    line: int | None = None          # where the step was called
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None


@dataclass
class ScalerSteps:
    """Every ``scaler.step`` of the run in counts, the first ones and the longest run of skips in detail."""

    calls: int = 0
    skipped: int = 0
    longest_skipped: int = 0           # the most skipped in a row
    steps: list[ScalerStep] = field(default_factory=list)  # the first 64 calls
    run_start: ScalerStep | None = None  # the first call of the longest run of skips
    run_end: ScalerStep | None = None    # its last call
    scale_last: float | None = None      # the scale after the run's last update
    #: steps beside the scaler without their ``update()`` (the first 16; ``UnpairedStep``), and how many in all
    unpaired: list[UnpairedStep] = field(default_factory=list)
    unpaired_count: int = 0


@dataclass
class ParamUpdate:
    """One low-precision parameter in an optimizer step: sampled values with a non-zero gradient, and
    how many of them the step left exactly as they were (the update rounded away)."""

    key: int                         # its storage key (``ParamInfo.key`` names it)
    numel: int
    sampled: int
    unchanged: int


@dataclass
class LowPrecisionUpdate:
    """An optimizer step on weights stored in bf16/fp16: how much of it survived rounding."""

    iteration: int
    optimizer: str
    dtype: str
    lr: float | None = None
    sampled: int = 0                 # sampled values (of the low-precision parameters) with a non-zero gradient
    unchanged: int = 0               # of them, exactly equal after the step
    params: list[ParamUpdate] = field(default_factory=list)
    line: int | None = None          # where the step was called
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None


@dataclass
class WeightsCast:
    """The statement of the user's sources that made a model's weights low precision (``model.to(torch.bfloat16)``,
    ``.half()``, ``from_pretrained(..., torch_dtype=torch.bfloat16)``, Lightning's ``precision="bf16-true"``), as far
    as they tell: looked for only when a step on such weights was sampled (``LowPrecisionUpdate``)."""

    dtype: str                  # "bfloat16" or "float16", as the weights were seen
    file: str | None = None     # None: the cell that ran; else an earlier cell's or a user's file
    line: int | None = None
    code: str = ""              # the statement, on one line
    fix: str = ""               # that statement keeping float32 weights ('' where the line is better deleted)
    function: str | None = None


@dataclass
class Precision:
    """Mixed precision in one run (empty when the run used none of it)."""

    clips: list[ClipCall] = field(default_factory=list)        # the first 16
    scaler: ScalerSteps = field(default_factory=ScalerSteps)
    updates: list[LowPrecisionUpdate] = field(default_factory=list)  # the first steps on low-precision weights
    cast: WeightsCast | None = None  # where the weights of ``updates`` were made low precision, when found


__all__ = ["ClipCall", "LowPrecisionUpdate", "ParamUpdate", "Precision", "ScalerStep", "ScalerSteps", "UnpairedStep",
           "WeightsCast"]
