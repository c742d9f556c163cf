"""A new capability lands by registering a watch (``capture/watches/registry.py``): no edit of the capture, the loop hooks or
the optimizer hooks. The watch below is defined here and only registered; a real ``diagnose()`` of a training loop
tells it the loop's events, on both engines, asleep iterations included, and what it writes is in the report's
trace. A registered watch whose bookkeeping fails is switched off alone, said in a note, and the run stays
bit-identical."""
from __future__ import annotations

import pytest

import backward_doctor as bd
from backward_doctor.capture import guard
from backward_doctor.capture.watches.registry import EVENTS, Watch, register, registered, unregister
from test_watch_faults import LOOP, assert_identical, loop_namespace, plain, state_of


class StepCounter(Watch):
    """Counts what it is told, and writes one note into the trace at the end: what a new watch would record."""

    events = ("backward_began", "saw_backward", "backward_ended", "step_began", "before_step", "iteration_ended",
              "finish")

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.told = {e: 0 for e in self.events}
        self.order: list[str] = []

    def backward_began(self, loss) -> bool:
        self.told["backward_began"] += 1
        return False  # (it does not count the loss: the accumulation watch does)

    def saw_backward(self, loss) -> None:
        self.told["saw_backward"] += 1
        self.order.append(f"loss@{self.ctx.backwards()}")

    def backward_ended(self, counted) -> None:
        self.told["backward_ended"] += 1

    def step_began(self, opt, args, kwargs) -> None:
        self.told["step_began"] += 1

    def before_step(self, opt) -> None:
        self.told["before_step"] += 1

    def iteration_ended(self) -> None:
        self.told["iteration_ended"] += 1
        self.order.append(f"end@{self.ctx.iteration()}")

    def finish(self, namespace) -> None:
        self.told["finish"] += 1
        self.ctx.trace.notes.append(f"step counter: {self.told['iteration_ended']} iterations, "
                                    f"{self.told['saw_backward']} losses")


@pytest.fixture
def counter_watch():
    made: list[StepCounter] = []
    register("step_counter", lambda ctx: made.append(StepCounter(ctx)) or made[-1],
             what="the step counter (a test's watch)", lost="its counts stop there")
    try:
        yield made
    finally:
        unregister("step_counter")
    assert "step_counter" not in registered() and "step_counter" not in guard.GUARDED


def test_a_registered_watch_is_told_every_event_of_a_real_loop(counter_watch, engine):
    ns = loop_namespace()
    report = bd.diagnose(LOOP, ns, engine=engine)
    assert report.trace.exception is None
    [w] = counter_watch
    steps = report.trace.iterations.steps
    assert steps == 12
    # every iteration, recorded or slept through (the native recorder samples them)
    assert w.told["step_began"] == w.told["before_step"] == w.told["iteration_ended"] == steps, w.told
    assert w.told["backward_began"] == w.told["backward_ended"] == w.told["saw_backward"] == steps, w.told
    assert w.told["finish"] == 1
    # told in the loop's order: each iteration's loss, then its end (counted from 0, before it is counted); the
    # loop's series, first in the registry, has counted the loss when this watch is told it
    assert w.order[:4] == ["loss@1", "end@0", "loss@2", "end@1"], w.order
    assert "step counter: 12 iterations, 12 losses" in report.trace.notes
    # the doctor's own watches still ran beside it
    assert report.trace.precision.scaler.steps and report.trace.accumulation.windows


def test_a_watch_registered_before_another_is_told_first(engine):
    told: list[str] = []

    class Spy(Watch):
        events = ("iteration_ended",)

        def __init__(self, name: str) -> None:
            self.name = name

        def iteration_ended(self) -> None:
            told.append(self.name)

    register("spy_first", lambda ctx: Spy("first"), before="accumulation")
    register("spy_last", lambda ctx: Spy("last"))
    try:
        assert registered().index("spy_first") < registered().index("accumulation") < registered().index("spy_last")
        bd.diagnose(LOOP, loop_namespace(), engine=engine)
    finally:
        unregister("spy_first")
        unregister("spy_last")
    assert told[:4] == ["first", "last", "first", "last"], told


def test_a_registered_watch_that_fails_is_switched_off_and_the_run_is_bit_identical(engine):
    expected = plain()
    calls = []

    class Broken(Watch):
        events = ("before_step",)

        def before_step(self, opt) -> None:
            calls.append(1)
            raise RuntimeError("injected fault")

        def off(self) -> None:
            self.before_step = lambda opt: calls.append("after off")  # type: ignore[method-assign]

    register("broken_test_watch", lambda ctx: Broken(), what="the broken test watch", lost="nothing it counts")
    try:
        ns = loop_namespace()
        report = bd.diagnose(LOOP, ns, engine=engine)
    finally:
        unregister("broken_test_watch")
    assert report.trace.exception is None
    assert_identical(state_of(ns), expected)
    assert calls[0] == 1 and set(calls[1:]) == {"after off"} and len(calls) == 12, calls
    [note] = [n for n in report.trace.notes if n.startswith("the broken test watch stopped")]
    assert "RuntimeError: injected fault" in note and "nothing it counts" in note
    # the doctor's own watches were not switched off with it
    assert not [n for n in report.trace.notes if "watch" in n and "stopped" in n and "broken" not in n]


def test_registering_a_name_twice_is_refused_and_events_are_the_documented_ones():
    with pytest.raises(ValueError, match="registered already"):
        register("accumulation", lambda ctx: None)
    assert {"backward_began", "step_began", "before_step", "iteration_ended", "finish"} <= set(EVENTS)
    assert registered()[:5] == ["loop", "precision", "accumulation", "schedule", "frozen"]


def test_no_registered_watch_no_training_watch_in_the_report(engine):
    """The registry emptied of the doctor's watches but the loop's series: the run still diagnoses (its series and
    ops), the training records stay empty: the capture calls no watch by name."""
    from backward_doctor.capture.watches import registry as watches

    saved = list(watches._REGISTRY)
    watches._REGISTRY[:] = [(n, f) for n, f in saved if n == "loop"]
    try:
        ns = loop_namespace()
        report = bd.diagnose(LOOP, ns, engine=engine)
    finally:
        watches._REGISTRY[:] = saved
    assert report.trace.exception is None and report.trace.iterations.steps == 12
    assert not report.trace.accumulation.windows and not report.trace.precision.scaler.steps
    assert not [n for n in report.trace.notes if "stopped" in n], report.trace.notes
    # (no watch counts the loss without the accumulation watch: the series has no loss, and says so with None)
    assert all(v is None for v in report.trace.iterations.loss), report.trace.iterations.loss
