"""Learning-rate schedulers as they were stepped during a run: which ``scheduler.step()`` calls came before the
first ``optimizer.step()`` of their optimizer, how many came per optimizer step, and the learning rate each one
moved. The capture writes them (``capture/watches/schedules.py``); the ``scheduler_misuse`` rule reads them.

>>> rec = SchedulerRecord(type="StepLR", optimizer="SGD", calls=1, steps=[SchedulerCall(iteration=0)])
>>> rec.steps[0].iteration, rec.calls
(0, 1)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerCall:
    """One ``scheduler.step()`` the cell's run made (not the one its constructor makes)."""

    iteration: int                   # the loop's iteration: optimizer steps completed before it
    backwards: int = 0               # ``backward()`` calls in the run before it (micro-batches between two calls)
    first: bool = False              # the scheduler's first step since it was made (its ``_step_count`` was 1)
    #: torch's own flag on the scheduler's optimizer: its ``step()`` ran since the scheduler was made (None: no flag)
    optimizer_stepped: bool | None = None
    scaler_skipped: int = 0          # GradScaler steps skipped (inf/NaN gradients) in the run before this call
    lr_before: float | None = None   # the first param group's learning rate before and after the call
    lr_after: float | None = None
    library: str = ""                # the library whose code made this call ('' the user's)
    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None


@dataclass
class SchedulerRecord:
    """One scheduler stepped during the run: its class, its optimizer's class, and its calls."""

    type: str                        # the scheduler's class name (``StepLR``)
    optimizer: str = ""              # its optimizer's class name
    #: the library whose own code stepped it first (``transformers``, ``lightning``, ``accelerate``), '' the user's
    library: str = ""
    calls: int = 0                   # all its steps in the run
    steps: list[SchedulerCall] = field(default_factory=list)  # the first 64
    last: SchedulerCall | None = None  # a step past the first 64 (every 256th: the latest such)


__all__ = ["SchedulerCall", "SchedulerRecord"]
