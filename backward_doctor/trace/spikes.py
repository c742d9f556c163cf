"""A loss that jumped far above its recent trend and stayed finite (``Trace.loss_spike``): where the loop watch's
loss series (``Iterations.loss``) says it did, and what the probe after the run (``run/spike_replay.py``) found
when it ran that iteration's batch again beside the one before it.

The decision is made after the run from the series the loop watch records anyway (no cost in any iteration): a
point is a spike when it is far above the median of the points before it in robust units (median absolute
deviations) **and** many times that median **and** several times the two points just before it **and** above
where training began (or very many times the median) **and** the loss comes back near that trend in the points
after it.
Healthy noise, a warm-up, a schedule, the first iterations and a loss that is high throughout are none of these.

>>> flat = [1.0, 0.9, 0.95, 0.92, 0.88, 0.9, 0.85, 0.87, 0.86, 0.84]
>>> spike_points(flat + [9.0] + flat)
[10]
>>> spike_points(flat + [2.0] + flat), spike_points([50.0 + (i % 3) for i in range(30)])
([], [])
>>> spike_points(flat + [9.0, 8.0, 7.5, 7.0, 6.2, 5.0])  # (a new loop starting high: it does not come back down)
[]
>>> from backward_doctor.util.serde import from_dict, to_dict
>>> s = LossSpike(iteration=10, loss=9.0, median=0.88, ratio=10.2, mads=80.0)
>>> from_dict(LossSpike, to_dict(s)) == s
True
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import ge, is_not, mul

#: points before a candidate that its trend is read from, at most and at least (the first iterations are no trend)
WINDOW, HISTORY = 20, 8
#: how far above the trend: median absolute deviations (scaled to a normal's sigma) and times the median
MADS, RATIO = 10.0, 5.0
#: a spike jumps from the iteration before it: this many times the larger of the two points before it
JUMP = 3.0
#: points after a candidate that must be back near the trend (at most, at least): a spike comes back down
AFTER, AFTER_MIN = 5, 3
#: a spike below where training began counts only this many times the median (a late, small loss's noise does not)
RATIO_ALONE = 50.0


def spike_points(loss: list[float | None]) -> list[int]:
    """The indexes of ``loss`` (a loop watch's series; None: not read or non-finite) that are spikes (see the
    module docstring). A loss that can be negative (a log-likelihood) has no ratio to read: no spike. A jump the
    loss does not come back down from (over the next 5 points) is no spike: a new model's loop later in the same run
    starts high, and a loss that diverged stays up."""
    # (the points kept and the jump test are C-level maps: this runs after every loop, over every iteration, and most
    # points end at the jump test; the loop below sees only the few that jumped)
    kept = list(map(is_not, loss, repeat(None)))
    index, vals = list(compress(range(len(loss)), kept)), list(compress(loss, kept))
    if len(vals) <= HISTORY:
        return []
    start = max(vals[:5])  # (where training began: the first losses)
    out = []
    before = map(mul, repeat(JUMP), map(max, vals[HISTORY - 1:-1], vals[HISTORY - 2:-2]))
    for n in compress(range(HISTORY, len(vals)), map(ge, vals[HISTORY:], before)):
        i, v = index[n], vals[n]  # (a jump from the iterations just before it: not a level reached earlier)
        prev = vals[max(0, n - WINDOW):n]
        med = statistics.median(prev)
        if med <= 0 or v < RATIO * med:
            continue  # (not far above the trend)
        mad = statistics.median(abs(u - med) for u in prev)
        scale = max(1.4826 * mad, 0.01 * med)  # (a loss flat to the digit: 1% of its level is its noise)
        if (v - med) / scale < MADS:
            continue
        if v <= start and v < RATIO_ALONE * med:
            continue
        # back to the trend after it: a spike, not a level that moved (a new model's loop in the same run, a loss
        # that diverged and stays up)
        after = vals[n + 1:n + 1 + AFTER]
        if len(after) < AFTER_MIN or statistics.median(after) > min(med + 0.25 * (v - med), 1.5 * med):
            continue
        out.append(i)
    return out


def trend(loss: list[float | None], index: int) -> tuple[float, float]:
    """(median, median absolute deviation) of the points before ``index`` that its spike was measured against.

    >>> trend([1.0, 2.0, 3.0, 10.0], 3)
    (2.0, 1.0)
    """
    prev = [u for u in loss[:index] if u is not None][-WINDOW:]
    med = statistics.median(prev)
    return med, statistics.median(abs(u - med) for u in prev)


@dataclass
class LayerJump:
    """One module's activations or gradients in the spiking batch against the batch before it (the probe's)."""

    module: str                 # ``model.0``
    cls: str = ""               # ``Linear``
    activation: float = 0.0     # L2 norm of its output in the spiking batch (summed over its calls)
    activation_before: float = 0.0
    grad: float = 0.0           # L2 norm of its parameters' gradients in the spiking batch (0: none)
    grad_before: float = 0.0
    line: int | None = None     # the cell line that called it (None: no cell frame on the stack)


@dataclass
class LossSpike:
    """The first point of the loss series far above its recent trend, in a run that stayed finite, and what the
    probe after the run found (``run/spike_replay.py``)."""

    iteration: int                      # the loop's iteration (optimizer step) whose loss jumped
    loss: float                         # its loss
    median: float                       # the median of the points before it (up to ``WINDOW``)
    ratio: float                        # loss / median
    mads: float                         # (loss - median) in median absolute deviations (scaled to a sigma)
    spikes: int = 1                     # points of the series that are spikes, this one included
    #: the probe: that iteration's batch and the one before it run again through the loop's body, from the weights
    #: the run ended with (the state before the spike is not kept: keeping it would cost every iteration); '' when
    #: it ran, else why it could not (a shuffling DataLoader, a library's loop, gradient accumulation, ...)
    why_not: str = ""
    batch: int | None = None            # the spiking batch's index in what the loop iterates
    baseline: int | None = None         # the batch it was compared with (the one before it)
    loop_line: int | None = None        # the cell's ``for`` line the batches come from
    source: str = ""                    # what the loop iterates (``enumerate(batches)``)
    #: code that gives the spiking batch back (``batches[25]``; ``next(itertools.islice(loader, 25, None))``)
    fetch: str = ""
    #: the loss of the spiking batch and of the baseline batch in the probe (None: no loss reached ``backward()``)
    replay_loss: float | None = None
    baseline_loss: float | None = None
    #: the spiking batch's values against the other batches the probe read (``xb`` up to 2.9e+03, the others 4.1)
    described: str = ""
    out_of_range: str = ""              # the loop variable whose values were out of the others' range ('' none)
    #: the module whose activations (``jumped`` = "activations") or gradients ("gradients") grew most against the
    #: baseline batch (the first in forward order near the largest jump); None: none grew
    jump: LayerJump | None = None
    jumped: str = ""
    layers: list[LayerJump] = field(default_factory=list)  # every leaf module measured, in forward order (<= 64)

    @property
    def reproduced(self) -> bool | None:
        """The spiking batch makes the loss jump again over its neighbour (None: not probed, or no loss read)."""
        if self.replay_loss is None or self.baseline_loss is None or self.baseline_loss <= 0:
            return None
        return self.replay_loss >= 3.0 * self.baseline_loss


__all__ = ["LayerJump", "LossSpike", "spike_points", "trend", "HISTORY", "MADS", "RATIO", "WINDOW"]
