"""The doctor's training watches in the registry (``watches/registry.py``), in the order they are told each event: the
loop's series first (what the others read: the ``backward()`` count), the precision watch before the accumulation
watch (a GradScaler's skipped step ends the accumulation window before it closes), then the schedulers, the
frozen parameters and the optimizers' membership (read at the end: parts of a model no optimizer holds). A new capability is one more watch module and one more ``register`` line here.

>>> from backward_doctor.capture.watches.registry import registered
>>> registered()
['loop', 'precision', 'accumulation', 'schedule', 'frozen', 'orphans']
"""
from __future__ import annotations

from typing import Any

from .accumulation import AccumulationWatch
from .frozen import FrozenWatch
from .orphans import OrphanWatch
from .precision import PrecisionWatch
from .schedules import ScheduleWatch
from .registry import WatchContext, register


def _loop(ctx: WatchContext) -> Any:
    """The per-iteration series: made by the capture (each tier reads live bytes and gradients its own way)."""
    return ctx.loop


def _precision(ctx: WatchContext) -> PrecisionWatch:
    return PrecisionWatch(ctx.trace.precision, frames=ctx.frames, on_skipped=lambda: ctx.tell("skipped_step"),
                          iteration=ctx.iteration, guards=ctx.guards, backwards=ctx.backwards)


def _accumulation(ctx: WatchContext) -> AccumulationWatch:
    return AccumulationWatch(ctx.trace.accumulation, frames=ctx.frames, params=ctx.params, iteration=ctx.iteration,
                             quiet=ctx.quiet, scalar=ctx.scalar, counter=ctx.counter, guards=ctx.guards)


def _schedule(ctx: WatchContext) -> ScheduleWatch:
    return ScheduleWatch(ctx.trace.schedules, frames=ctx.frames, guards=ctx.guards, iteration=ctx.iteration,
                         backwards=ctx.backwards, scaler_skipped=lambda: ctx.trace.precision.scaler.skipped)


def _frozen(ctx: WatchContext) -> FrozenWatch:
    return FrozenWatch(ctx.trace.frozen_updates, quiet=ctx.quiet)


def _orphans(ctx: WatchContext) -> OrphanWatch:
    return OrphanWatch(ctx.trace.unoptimized, left_alone=ctx.left_alone)


register("loop", _loop)
register("precision", _precision)
register("accumulation", _accumulation)
register("schedule", _schedule)
register("frozen", _frozen)
register("orphans", _orphans)

__all__: list[str] = []
