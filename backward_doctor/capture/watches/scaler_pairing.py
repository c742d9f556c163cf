"""Optimizer steps beside a GradScaler that its ``update()`` did not follow (``ScalerSteps.unpaired``): the
precision watch's part that pairs each step with the scaler's update, kept apart by meaning.

* ``scaler.step(optimizer)`` with no ``scaler.update()`` before that optimizer's next ``scaler.step`` (a
  ``continue`` before the update, an update under an ``if``): torch raises "step() has already been called since
  the last update()" at the next step, which is not where the mistake is; or before the run ended (a ``break``
  before the update: the next cell's first ``scaler.step`` raises). Read from the scaler's own stage for that
  optimizer (``STEPPED`` until ``update()``), which is what torch checks.
* ``optimizer.step()`` called directly while a scaler had scaled a loss it did not unscale for that optimizer,
  with no ``scaler.step`` inside it: the update applies gradients multiplied by the scale. Nothing raises while
  the cell never calls ``scaler.update()`` (``rules/amp_steps.py`` reads it).

Only a run that scales a loss pays for it: the precision watch swaps its step methods in at the first
``scaler.scale`` of an enabled scaler (a loop with no GradScaler runs none of this).

>>> from backward_doctor.trace.precision import ScalerSteps
>>> p = Pairing(ScalerSteps())
>>> p.direct_began("SGD", 3, 256.0, {"line": 6}); p.direct_ended()
>>> p.record.unpaired[0].direct, p.record.unpaired[0].iteration, p.record.unpaired[0].line
(True, 3, 6)
"""
from __future__ import annotations

import weakref
from typing import Any

from ...trace.precision import ScalerSteps, UnpairedStep

_KEPT = 16  # unpaired steps kept in detail (every one counted)


def stage(scaler: Any, opt: Any) -> str:
    """The scaler's stage for ``opt`` ("READY", "UNSCALED", "STEPPED"; '' when it has none: torch's own
    ``_per_optimizer_states``, read without creating an entry)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    st = states.get(id(opt)) if isinstance(states, dict) else None
    return getattr(st.get("stage"), "name", "") if isinstance(st, dict) else ""


class Pairing:
    """Writes ``record.unpaired`` (see the module docstring); told by the precision watch's wrappers."""

    def __init__(self, record: ScalerSteps) -> None:
        self.record = record
        self.inside = 0   # scaler.step calls running (an optimizer step inside one is not a direct step)
        #: scaler id -> (weakref, {optimizer id -> (iteration, optimizer weakref, class name, place)}) of the
        #: optimizers it stepped since its last update()
        self._stepped: dict[int, tuple[Any, dict[int, tuple[int, Any, str, dict[str, Any]]]]] = {}
        self._candidate: tuple[str, int, float | None, dict[str, Any]] | None = None

    def wants_place(self) -> bool:
        """Whether another unpaired step would be kept in detail (its place is worth a walk of the stack)."""
        return len(self.record.unpaired) < _KEPT

    def _add(self, step: UnpairedStep) -> None:
        self.record.unpaired_count += 1
        if len(self.record.unpaired) < _KEPT:
            self.record.unpaired.append(step)

    # ---------------------------------------------------------------- scaler.step / update
    def step_starting(self, scaler: Any, opt: Any, place: Any) -> None:
        """``scaler.step(opt)`` is about to run (``place()``: where it was called). An optimizer this scaler
        stepped since its last update: torch is about to raise, and the step before had no update."""
        self.inside += 1
        self._candidate = None  # (the outermost optimizer step goes through the scaler after all)
        if stage(scaler, opt) != "STEPPED":
            return
        entry = self._stepped.get(id(scaler))
        earlier = entry[1].pop(id(opt), None) if entry is not None else None
        where = earlier[3] if earlier is not None and earlier[3] else (place() if self.wants_place() else {})
        self._add(UnpairedStep(iteration=earlier[0] if earlier is not None else -1, optimizer=type(opt).__name__,
                               **where))

    def step_done(self, scaler: Any, opt: Any, iteration: int, place: dict[str, Any]) -> None:
        """``scaler.step(opt)`` returned (it stepped at ``iteration``, or skipped a step whose gradients overflowed:
        either way torch now waits for ``update()``)."""
        if stage(scaler, opt) != "STEPPED":
            return
        entry = self._stepped.get(id(scaler))
        if entry is None or entry[0]() is not scaler:
            entry = self._stepped[id(scaler)] = (weakref.ref(scaler), {})
        entry[1][id(opt)] = (iteration, weakref.ref(opt), type(opt).__name__, place)

    def step_left(self) -> None:
        """``scaler.step`` returned or raised."""
        self.inside = max(0, self.inside - 1)

    def updated(self, scaler: Any) -> None:
        """``scaler.update()`` returned: every optimizer it stepped is paired."""
        self._stepped.pop(id(scaler), None)

    # ---------------------------------------------------------------- optimizer.step() directly
    def direct_began(self, optimizer: str, iteration: int, scale: float | None, place: dict[str, Any]) -> None:
        """The outermost ``optimizer.step()`` began on scaled gradients, outside any ``scaler.step``."""
        self._candidate = (optimizer, iteration, scale, place)

    def direct_ended(self) -> None:
        """The outermost step returned: no ``scaler.step`` ran inside it (a library's optimizer wrapper calls the
        scaler from its own ``step``) -> a direct step."""
        if self._candidate is None:
            return
        optimizer, iteration, scale, place = self._candidate
        self._candidate = None
        self._add(UnpairedStep(iteration=iteration, optimizer=optimizer, direct=True, scale=scale, **place))

    # ---------------------------------------------------------------- the run's end
    def finish(self) -> None:
        """The run ended: the optimizers still waiting for their scaler's update (the next ``scaler.step`` of
        them raises)."""
        for ref, opts in list(self._stepped.values()):
            scaler = ref()
            for iteration, opt_ref, name, place in list(opts.values()):
                opt = opt_ref()
                if scaler is not None and opt is not None and stage(scaler, opt) == "STEPPED":
                    self._add(UnpairedStep(iteration=iteration, optimizer=name, at_end=True, **place))
        self._stepped.clear()


__all__ = ["Pairing", "stage"]
