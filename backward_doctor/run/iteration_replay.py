"""One iteration of a training loop replayed in detail: the one where NaN/Inf first showed while the
recorder was off (a long loop is sampled: ``capture/native_capture.py``).

During the run, :class:`IterationRollback` keeps the RNG states at the start of each iteration (a few KB,
replaced every iteration) and, once, when the loop watch sees NaN/Inf in an iteration's loss or
gradients *before its optimizer step*, a copy of the training state (the weights and optimizer state the
step has not touched yet) and references to that iteration's loop variables (its batch). After the run,
:func:`replay_iteration` saves the state the run ended with, restores the iteration's, runs the loop's
body once with every op screened, in a shallow copy of the namespace (the names it assigns and the
lists it appends to are the copy's), and puts the end state back: the namespace ends as the plain run
left it, and only one iteration ran twice, not the whole loop.

>>> rb = IterationRollback("for i in range(3):\\n    opt.step()\\n", {})
>>> rb.iteration is None
True
"""
from __future__ import annotations

import ast
import contextlib
import copy
import ctypes
import dataclasses
import io
import random
import sys
from typing import Any, Callable

import torch

from ..trace.queries import made_nonfinite_again
from ..trace.records import SampledRun, Trace
from ..util.loops import loop_names, one_iteration, training_loop
from ..capture.state import cuda_in_use
from .snapshot import Bindings, Snapshot, take_if_it_fits

_CONTAINERS = (list, dict, set)


def _rng(source: str, native: Any = None) -> dict[str, Any]:
    """The RNG states a loop body draws from: torch's (dropout, ``randn``), and Python's or NumPy's only
    when the cell names them (10-35 us each, every iteration). (The batch itself is not drawn again: the
    replay reuses the iteration's loop variables.) With the native recorder torch's state is copied in
    C++ (``native`` keeps it: no tensor allocated, a fraction of a microsecond)."""
    state: dict[str, Any] = {}
    if native is not None:
        native.mark_rng()
    else:  # read in place (``.numpy()`` would dispatch a ``detach``), the state tensor freed at once
        t = torch.get_rng_state()
        state["torch"] = ctypes.string_at(t.data_ptr(), t.numel())
    if cuda_in_use():  # (the CUDA generator's seed and offset: read on the host, no synchronisation)
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "random" in source:
        state["python"] = random.getstate()
        if "numpy" in sys.modules and ("np." in source or "numpy" in source):
            state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


class IterationRollback:
    """What one unrecorded iteration is replayed from (see the module docstring); the capture calls
    :meth:`iteration_began` and :meth:`went_nonfinite` (``capture.rollback``). ``scalars_only``: the iterations
    are recorded, but their ops were screened for NaN/Inf only where they made a scalar (CUDA: a screen of every
    op would synchronise the device after each); the first NaN/Inf scalar of a forward keeps the state."""

    def __init__(self, source: str, namespace: dict[str, Any], native: Any = None,
                 find_body: Callable[[], Callable[[], Any] | None] | None = None, scalars_only: bool = False) -> None:
        self.source = source
        self.scalars_only = scalars_only
        #: a library's loop (no loop in ``source``): asked, when the iteration goes wrong, for a function that
        #: runs that iteration's forward and backward again (its batch bound in)
        self._find_body = find_body
        self.body: Callable[[], Any] | None = None
        self.namespace = namespace
        self._native = native  # the native recorder's module: it keeps torch's RNG state in C++
        self._rng = _rng(source, native)  # iteration 0 starts with the run
        self._torch_rng_only = native is not None and "random" not in source  # (see _rng)
        self.state: Snapshot | None = None
        self.iteration: int | None = None
        self.values: dict[str, Any] = {}
        self.locals: dict[str, Any] = {}  # the locals of the function running the loop, when one does
        self.why_not = ""
        self.failed = False  # kept for an exception, not for NaN/Inf
        self.seen_in_scalar = False
        self.torch_rng: bytes | None = None  # torch's state at the iteration's start (native: kept in C++)

    def iteration_began(self, iteration: int) -> None:
        if self.iteration is None:
            if self._torch_rng_only:  # (every iteration of a long loop: one call into C++, nothing allocated)
                self._native.mark_rng()
            else:
                self._rng = _rng(self.source, self._native)

    def went_nonfinite(self, iteration: int, what: str) -> None:
        """The first NaN/Inf, in an iteration the recorder did not record: keep its state (once)."""
        if self.iteration is not None:
            return
        self.iteration = iteration
        self.seen_in_scalar = what == "scalar"  # (the recorder was on, screening scalars only; else asleep)
        names = loop_names(self.source)
        values = {n: self.namespace[n] for n in names if n in self.namespace}
        # the loop runs inside a function (a script's main()): its locals (its model and optimizer saved too)
        local = _loop_locals(self.source, self.namespace) if len(values) < len(names) else {}
        state, self.why_not = take_if_it_fits({**self.namespace, **local} if local else self.namespace,
                                              source=self.source)
        if state is None:
            return
        # the draws of the iteration's own start, not of now
        state.rng = {**state.rng, **self._rng}
        if self._native is not None:
            self.torch_rng = self._native.marked_rng()
        else:
            state.rng["torch"] = torch.frombuffer(bytearray(self._rng["torch"]), dtype=torch.uint8)
        self.state = state
        self.values, self.locals = values, local
        self.values.update({n: local[n] for n in names if n in local})
        if self._find_body is not None:
            try:
                self.body = self._find_body()
            except Exception:  # noqa: BLE001 - no replay then (the report says so), never a failed step
                self.body = None

    def went_wrong(self, iteration: int, exc: BaseException | None = None, trace: Trace | None = None) -> None:
        """The cell raised in an iteration the recorder did not record: keep its state (after the run). Not when
        ``exc`` was raised outside the training loop (before it began, after it ended: no iteration was running,
        and a replay of the last one would do its work again)."""
        if exc is not None and trace is not None and not raised_in_loop(exc, self.source, trace):
            return
        self.failed = True
        self.went_nonfinite(iteration, "exception")

    def restore(self, namespace: dict[str, Any]) -> None:
        """Put the kept state back: weights and optimizer state, the RNG of the iteration's start (torch's
        from the native recorder when it kept it), and the gradients that iteration began with (zeroed,
        when the cell zeroes them)."""
        self.state.restore(namespace)
        if self.torch_rng is not None:
            self._native.restore_rng(self.torch_rng)
        if "zero_grad(" in self.source:  # the iteration began with zeroed gradients, not with its own
            for t, *_ in self.state.tensors:
                t.grad = None

    def release(self) -> None:
        """Drop the copy and the batch (after the replay, or when none is run)."""
        self.state, self.values, self.locals, self.body = None, {}, {}, None


def raised_in_loop(exc: BaseException, source: str, trace: Trace) -> bool:
    """Whether ``exc`` was raised while the cell's training loop ran (or the library's loop the cell calls, at
    ``trace.iterations.library_line``): a line of the cell its traceback passes through lies in the loop's body
    (a function the cell defines included). True where it cannot be told: no such loop in the cell's text, no
    frame of the cell in the traceback.

    >>> cell = "for b in []:\\n    opt.step()\\nraise ValueError('after the loop')\\n"
    >>> try:
    ...     exec(compile(cell, "<c>", "exec"), {})
    ... except ValueError as e:
    ...     raised_in_loop(e, cell, Trace(cell_file="<c>"))
    False
    """
    lines, tb = [], exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == trace.cell_file and tb.tb_lineno is not None:
            lines.append(tb.tb_lineno)
        tb = tb.tb_next
    span = _loop_span(source, trace.iterations.library_line)
    return not lines or span is None or any(span[0] <= line <= span[1] for line in lines)


def _loop_span(source: str, library_line: int | None) -> tuple[int, int] | None:
    """The lines an iteration of the cell's training loop runs (its header and body, not its ``else``), or those
    of the statement calling a library's loop; None: neither is in the cell's text."""
    loop = training_loop(source)
    if loop is not None:
        return loop.lineno, max(s.end_lineno or s.lineno for s in loop.body)
    if library_line is None:
        return None
    try:
        stmts = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)
                 and n.lineno <= library_line <= (n.end_lineno or n.lineno)]
    except SyntaxError:
        return None
    inner = min(stmts, key=lambda n: (n.end_lineno or n.lineno) - n.lineno, default=None)
    return None if inner is None else (inner.lineno, inner.end_lineno or inner.lineno)


def _loop_locals(source: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """The locals of the function frame now running a line of the cell's training loop (a function the cell
    defines: its globals are the namespace), so its body can run again with the names it reads."""
    loop = training_loop(source)
    frame = sys._getframe(2)
    try:
        while loop is not None and frame is not None:
            if frame.f_globals is namespace and frame.f_code.co_name != "<module>" \
                    and loop.lineno <= frame.f_lineno <= (loop.end_lineno or loop.lineno):
                return dict(frame.f_locals)
            frame = frame.f_back
        return {}
    finally:
        del frame


def replay_iteration(first: Trace, rollback: IterationRollback, namespace: dict[str, Any], *,
                     timeout: float | None, engine: str) -> Trace:
    """Run iteration ``rollback.iteration`` of the cell's training loop again from its saved state with
    every op checked; returns the detailed trace (what only the whole run knew carried over), or
    ``first`` with a note saying why no replay was possible or it did not show NaN/Inf again."""
    from ..capture.runner import make_capture, run_under_capture

    from ..capture.namespace import loop_values

    k = rollback.iteration
    rollback_failed, rollback_scalar = rollback.failed, rollback.seen_in_scalar
    ran = _how_it_ran(rollback.scalars_only and rollback.seen_in_scalar)
    values = loop_values(rollback.values, list(rollback.values)) if rollback.values else ""
    try:
        found = (rollback.body, []) if rollback.body is not None else one_iteration(rollback.source, first.cell_file)
        whole = found is None and _whole_cell(first, rollback, namespace)
        if whole:  # (no loop in the cell, nothing stepped before it failed: the cell is the iteration)
            found = compile(rollback.source, first.cell_file, "exec"), []
        why = rollback.why_not or ("" if found is not None else _why_no_body(
            rollback.source, rollback._find_body is not None, first.iterations.library))
        end = None
        if not why and rollback.state is not None:
            # (names: the replay assigns only its copy's; the locals of a function running the loop: theirs too)
            end, why = take_if_it_fits({**namespace, **rollback.locals} if rollback.locals else namespace,
                                        source=rollback.source)
        if not why and end is not None and found is not None and not callable(found[0]):  # (a library's step: no update)
            why = _out_of_reach(first, end)
        if why or end is None or found is None or rollback.state is None:
            what = "The cell raised" if rollback_failed else "NaN/Inf first appeared"
            first.notes.append(f"{what} in iteration {k}, {ran}; it "
                               f"could not be replayed in detail: {why or 'no state was kept'}")
            return first
        code, _ = found
        left = Bindings(namespace)  # (the replay runs in a copy: the lists and dicts nested in it are shared)
        try:
            detailed = _run_once(first, rollback, code, namespace, timeout, engine, make_capture,
                                 run_under_capture)
        finally:
            end.restore(namespace)
            left.restore(namespace)
    finally:
        rollback.release()
    if rollback_failed:
        if detailed.exception is None or first.exception is None or detailed.exception.type != first.exception.type:
            first.notes.append(f"The cell raised in iteration {k}, {ran}; replayed from "
                               "its saved state that iteration did not raise the same error, so the report is "
                               "built from the run itself")
            return first
        return _merged(first, detailed, k, values, failed=True, whole=whole, ran=ran)
    if not made_nonfinite_again(detailed, loose=rollback_scalar):
        first.nonfinite_reproduced = False  # (transient: the rules name no op, the replay saw none make it)
        first.notes.append(f"NaN/Inf first appeared in iteration {k}, {ran}; replayed "
                           "from its saved state (weights, optimizer state, RNG and its loop variables) it stayed "
                           "finite: it came from something the replay did not repeat (the hardware, a "
                           "nondeterministic kernel, a race, or state outside the model, the optimizer and the loop "
                           "variables)")
        return first
    merged = _merged(first, detailed, k, values, whole=whole, ran=ran)
    merged.nonfinite_reproduced = True  # (deterministic: the same state made it again)
    return merged


def _out_of_reach(first: Trace, end: Snapshot) -> str:
    """Why the replay would leave an optimizer changed: the run stepped one the snapshot does not hold (held deeper
    than an attribute of an object a name holds, or by a callable), which the replay's step would move a step
    ahead with no copy to put back; "" when every optimizer the run stepped is saved."""
    saved = {id(opt) for opt, *_ in end.optimizers}
    missed = sorted({s.optimizer for s in first.optimizer_steps if s.id not in saved})
    if not missed:
        return ""
    return (f"the loop steps an optimizer ({', '.join(missed)}) that no name of the notebook holds, nor an object "
            "bound to one as an attribute: its state could not be saved, and a replay would leave it a step ahead")


def _how_it_ran(scalars_only: bool) -> str:
    """How the iteration ran the first time, for the report's notes."""
    if scalars_only:
        return ("which ran with its ops screened for NaN/Inf only where they made a scalar (on CUDA a screen of "
                "every op would synchronise the device after each)")
    return "which ran with the recorder off"


def _why_no_body(source: str, library: bool = False, loop: str = "") -> str:
    """Why no code was found to replay the iteration with (for the report's note); ``library``: a library's step
    was looked for (``find_body``); ``loop``: the library whose loop the cell runs, when no step could be followed.

    >>> _why_no_body("trainer.train()", library=True)
    "the library's training step of that iteration could not be found (it had not run yet, or ran elsewhere)"
    """
    from ..util.loops import training_loop

    if not source or library:
        return "the library's training step of that iteration could not be found (it had not run yet, or ran elsewhere)"
    if loop == "lightning":
        return ("the LightningModule's `training_step` could not be followed: `fit()` is given the module by a name "
                "of the notebook in automatic optimization (`model = MyModule()`, then `trainer.fit(model, ...)`); "
                "with an expression (`trainer.fit(MyModule(), ...)`), or under manual optimization, the step is not "
                "run again")
    if loop:
        return f"the {loop} loop's training step could not be followed"
    if training_loop(source) is not None:
        return "the cell's training loop fetches its own batch (`next(...)`): a replay would take the next one"
    return ("the cell has no training loop of its own (the steps ran inside a function it calls), or running it "
            "again would take the next item of an iterator it reads (`next(...)`)")


def _whole_cell(first: Trace, rollback: IterationRollback, namespace: dict[str, Any]) -> bool:
    """The cell has no loop of its own and no library's, and at most one optimizer step ran in it: replaying
    the cell replays the step (a loop inside a function the cell calls would run again whole: not that). Not
    when it takes its batch from an iterator the user holds (``next(it)``): the replay would take the next."""
    from ..util.loops import draws_from_iterators, training_loop

    return (rollback.iteration == 0 and bool(rollback.source) and rollback._find_body is None
            and first.iterations.steps <= 1 and training_loop(rollback.source) is None
            and not draws_from_iterators(rollback.source, namespace))


def _run_once(first: Trace, rollback: IterationRollback, code: Any, namespace: dict[str, Any],
              timeout: float | None, engine: str, make_capture: Any, run_under_capture: Any) -> Trace:
    rollback.restore(namespace)
    ns = {name: (copy.copy(v) if type(v) in _CONTAINERS else v) for name, v in namespace.items()}
    ns.update(rollback.locals)
    ns.update(rollback.values)
    capture = make_capture(engine, ns, cell_file=first.cell_file, source=rollback.source, detail=True,
                           every_iteration=True)

    def run() -> BaseException | None:
        if callable(code):  # a library's step (its batch bound in)
            code()
        else:
            exec(code, ns)
        return None

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return run_under_capture(run, capture, timeout)


def _merged(first: Trace, detailed: Trace, k: int, values: str, failed: bool = False, whole: bool = False,
            ran: str = "which ran with the recorder off") -> Trace:
    """The replay's ops (and NaN/Inf origin, or failing op); the whole run's loop series, graphs, history and
    exception (the replay's, the same error, when it is the error being explained: its op is recorded)."""
    detailed.iterations = dataclasses.replace(first.iterations, replayed=k)
    if values:
        detailed.iterations.values = {**first.iterations.values, str(k): values}
    kept = ("stale_steps", "graph_holders", "history", "run_id", "duration_s", "timed_out", "threads",
            "timeout_s", "timeout_stall", "completed", "accumulation", "precision", "loaders", "schedules",
            "frozen_updates", "untied_weights", "unoptimized") + (
                () if failed else ("exception",))  # (the watches saw every iteration of the run: theirs stand)
    for name in kept:
        setattr(detailed, name, getattr(first, name))
    if not whole and first.ops:  # (the loop's own recorded iterations, for the exports: not only the replay)
        detailed.sampled = SampledRun(ops=first.ops, started_at=first.started_at)
    if whole:
        first_run = ("with the recorder asleep (always on records only what fits its cost budget)"
                     if "recorder off" in ran else ran.replace("which ran ", ""))
        detailed.notes = list(first.notes) + [
            f"The step {'raised' if failed else 'went NaN/Inf'} {first_run}: the cell was run again from the state saved "
            f"{'when it raised' if failed else 'when NaN/Inf first showed, before the optimizer step'} (weights, "
            "optimizer state, RNG), with every op recorded, in a copy of the notebook's names. Its ops are the "
            "ones shown; what the cell did outside the model and the optimizer (printing, which was hidden, the "
            "next batch of an iterator, files) happened twice"]
        return detailed
    what = ("The cell raised in iteration" if failed else "NaN/Inf first appeared in iteration")
    detailed.notes = list(first.notes) + [
        f"{what} {k}, {ran}: that iteration alone was replayed from the state "
        f"saved {'when it raised' if failed else 'when NaN/Inf first showed, before its optimizer step'} (weights, optimizer state, RNG and its "
        "loop variables), with every op recorded. Its ops are the ones shown; what the body did outside the "
        "model and the optimizer (printing, which was hidden, files) happened twice"]
    return detailed


__all__ = ["IterationRollback", "replay_iteration"]
