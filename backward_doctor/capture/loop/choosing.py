"""Which iterations of a training loop the native recorder records op by op; the others run with it asleep
(nothing observed: the loop watch still reads every iteration's loss, gradient norm and memory).

- :class:`PowersOfTwo` (``%%backward_doctor``, ``diagnose()``): iterations 0, 1, 2 and each power of two, so
  a single step is always recorded and a loop of 2,000 iterations records 13.
- :class:`CostBudget` (``%backward_doctor on``): the cell starts asleep, and a candidate iteration (1, 2, then
  the powers of two) is recorded only while recording stays within a share of the cell's own time. A
  single step, or a short loop of expensive steps, is not recorded at all: when it fails, the iteration that
  failed is replayed in detail from the state kept when it failed (``run/iteration_replay.py``), and when it
  succeeds the report says which checks did not run. Always on is meant to be left on; a step recorded op
  by op costs 2-5x a plain one (``benchmarks/RESULTS.md``), which a cell that trains fine must not pay.

The capture asks :meth:`Sampling.records` at the start of each candidate iteration (and of the one after a
recorded iteration) with what the iterations since it last asked cost (seconds, and the ops recorded).

>>> b = CostBudget(start=0.0)
>>> b.records_first()
False
>>> b.records(1, now=0.001, last_s=0.0005)                 # a cheap iteration: within the budget
True
>>> b.records(2, now=0.050, last_s=0.040, last_ops=5000)   # recording it cost far more than its share
False
"""
from __future__ import annotations

import time

from ...trace.queries import recorded_nothing
from ...trace.records import Trace

#: what turning one recorded op into the trace costs after the run (``_convert`` and ``_build_ops``: ~3-4 and
#: ~2.5 us an op on the 2-core CPU machine, benchmarks/RESULTS.md): counted against the budget with the run
_CONVERT_S_PER_OP = 6e-6
#: before any iteration was recorded, what recording one is taken to cost: this many times its plain time
#: (recorder, NaN/Inf screen, module hooks and conversion together: 2.8-3.6x measured on the transformer,
#: GPT-2 and T5 steps of the whole-path benchmark)
_PRIOR_EXTRA = 3.5


class Sampling:
    """Every iteration recorded (``--every-iteration``); the base of the other policies."""

    name = "every iteration"

    def records_first(self) -> bool:
        """Whether the cell's first iteration (and what runs before its loop) is recorded."""
        return True

    def candidate(self, iteration: int) -> bool:
        """Whether ``iteration`` may be recorded at all (a cheap test: asleep, the others are not asked)."""
        return True

    def next_candidate(self, iteration: int) -> int:
        """The first candidate after ``iteration`` (asleep, the iterations before it are not asked about)."""
        k = iteration + 1
        while not self.candidate(k):
            k += 1
        return k

    def records(self, iteration: int, *, now: float, last_s: float, last_n: int = 1,
                last_ops: int | None = None) -> bool:
        """Whether ``iteration`` (>= 1, a candidate) is recorded. ``now``: ``perf_counter()``; ``last_s``: how
        long the ``last_n`` iterations since the policy was last asked took; ``last_ops``: the ops recorded in
        them (None: they ran asleep; a recorded iteration is always followed by a question)."""
        return self.candidate(iteration)


class PowersOfTwo(Sampling):
    """Iterations 0, 1, 2 and each power of two.

    >>> [k for k in range(1, 20) if PowersOfTwo().candidate(k)]
    [1, 2, 4, 8, 16]
    >>> [PowersOfTwo().next_candidate(k) for k in (0, 1, 2, 3, 4, 5, 1000)]
    [1, 2, 4, 4, 8, 8, 1024]
    """

    name = "iterations 0, 1, 2 and powers of two"

    def candidate(self, iteration: int) -> bool:
        return iteration < 3 or iteration & (iteration - 1) == 0

    def next_candidate(self, iteration: int) -> int:
        k = iteration + 1
        return k if k < 3 else 1 << (k - 1).bit_length()


class CostBudget(PowersOfTwo):
    """The candidates of :class:`PowersOfTwo` after the first, each recorded only while the recording spent so
    far plus this one's estimate stays within ``share`` of the cell's plain time plus ``slack_s`` (the rest of
    always-on's budget, 1.15x + 10 ms, goes to its fixed costs: set-up, the per-iteration watch, the report;
    the watch alone is ~15% of a loop of 0.2 ms steps on a CPU, benchmarks/RESULTS.md). The estimate is measured: a
    recorded iteration's time beyond an asleep one's, plus converting its ops."""

    name = "within always-on's cost budget"

    def __init__(self, share: float = 0.05, slack_s: float = 0.003, start: float | None = None) -> None:
        self.share, self.slack_s = share, slack_s
        self.start = time.perf_counter() if start is None else start
        self.spent = 0.0            # seconds recording has cost so far (estimated as described above)
        self._asleep_s: float | None = None  # an asleep iteration's time (a running mean)
        self._extra_s: float | None = None   # what recording one iteration cost beyond that, when measured

    def records_first(self) -> bool:
        return False

    def records(self, iteration: int, *, now: float, last_s: float, last_n: int = 1,
                last_ops: int | None = None) -> bool:
        if last_ops is None:
            each = last_s / max(1, last_n)
            self._asleep_s = each if self._asleep_s is None else 0.5 * (self._asleep_s + each)
        else:
            extra = max(0.0, last_s - (self._asleep_s or 0.0)) + last_ops * _CONVERT_S_PER_OP
            self.spent += extra
            self._extra_s = extra
        if not self.candidate(iteration):
            return False
        estimate = self._extra_s if self._extra_s is not None else _PRIOR_EXTRA * (self._asleep_s or last_s)
        plain = max(0.0, now - self.start - self.spent)
        return self.spent + estimate <= self.share * plain + self.slack_s


def nothing_recorded(trace: Trace) -> str | None:
    """The note for a run always on kept asleep from start to end (None when some of it was recorded or
    replayed): what was watched all the same, and which checks did not run.

    >>> nothing_recorded(Trace(engine="native", op_count=3)) is None
    True
    """
    if not recorded_nothing(trace):
        return None
    steps = trace.iterations.steps
    what = "the step" if steps <= 1 else f"its {steps} steps"
    return (f"always on recorded nothing op by op ({what} ran with the recorder asleep: recording costs 2-5x a "
            "plain step, more than always on's budget allows). The loss, gradient norm and memory were watched "
            "(a failure inside the loop is replayed in detail); the checks that read the ops (silent broadcasting, detached "
            "outputs, in-place writes to saved tensors, unused parameters) did not run. `%%backward_doctor` on "
            "the cell records it op by op.")


__all__ = ["Sampling", "PowersOfTwo", "CostBudget", "nothing_recorded"]
