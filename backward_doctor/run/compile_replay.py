"""torch.compile vs eager: a compiled step that went NaN/Inf or raised, run again eagerly from the same
state (torch's accuracy minifier and compiler bisector are the model; nothing is shelled out).

Before a cell that uses ``torch.compile`` (a compiled module or function in the namespace, ``compile(`` in
the cell, or a ``Trainer`` told ``torch_compile=True``), :func:`plan` takes the rollback snapshot. After the
run, when the compiled step went NaN/Inf (its loss, a gradient, a weight), diverged or raised,
:meth:`CompilePlan.check`:

1. keeps the state the run ended with, restores the snapshot and runs the same cell again under
   ``torch.compiler.set_stance("force_eager")`` (every compiled region runs its original Python: the
   same step, eagerly), recording the inputs and weights each compiled module got at its first call;
2. puts the end state back: the namespace ends as the compiled run left it (its names bound to the compiled
   run's objects, the lists and dicts they hold with the compiled run's contents);
3. if eager does the same (NaN too, or the same error), the report is built from the eager replay: its
   op-by-op record places the NaN's origin (or the failing op) at the user's line, where the compiled
   run could only show the region's edge;
4. if eager does not, each compiled module's call is compared op by op (``run/compile_graphs.py``):
   the first op whose result differs, its line and its region go into ``trace.compile_check`` and the
   ``compile_divergence`` rule says what it means.

>>> plan("x = 1", {}, rollback=True) is None  # nothing compiled: nothing taken, nothing to check
True
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import types
from typing import Any, Callable

import torch

from ..analysis.rules.amp import collapsed
from .compile_backward import first_in_backward
from .compile_graphs import backend_of, compare_module
from ..capture.frames import UserFrames
from ..capture.loop.trainers import library_of
from ..trace.parts import CompileCheck
from ..trace.records import Trace
from .compile_verdict import agrees, scaler_words, unwrapped
from .snapshot import Bindings, Snapshot, take_if_it_fits

_replaying = [False]  # the eager replay itself is not checked again


def _is_compiled(value: Any, compiled_module: type) -> bool:
    """A module or function ``torch.compile`` returned (checked without attribute lookups that raise: this
    runs before every step)."""
    return isinstance(value, compiled_module) or \
        isinstance(value, types.FunctionType) and "_torchdynamo_orig_callable" in value.__dict__


def compiled_in(namespace: dict[str, Any]) -> list[tuple[str, Any]]:
    """``torch.compile``'d modules and functions bound in the namespace, or held by one of its modules as
    a direct child (``model.encoder = torch.compile(...)``).

    >>> compiled_in({"f": torch.compile(lambda x: x)})[0][0]
    'f'
    """
    from torch._dynamo.eval_frame import OptimizedModule

    found = []
    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        if _is_compiled(value, OptimizedModule):
            found.append((name, value))
        elif isinstance(value, torch.nn.Module):
            found.extend((f"{name}.{child}", m) for child, m in value._modules.items()
                         if _is_compiled(m, OptimizedModule))
        elif _trainer_args(value) is not None:  # the model a Trainer compiled in train() (after its first run)
            wrapped = vars(value).get("model_wrapped")
            if _is_compiled(wrapped, OptimizedModule):
                found.append((f"{name}.model_wrapped", wrapped))
    return found


def _trainer_args(value: Any) -> Any:
    """The ``TrainingArguments`` of a ``transformers.Trainer`` or a subclass (read from the instance's own dict: no
    property of an arbitrary object runs), else None."""
    if library_of(value) != "transformers" or not hasattr(value, "__dict__"):
        return None
    return vars(value).get("args")


def compiles_inside(namespace: dict[str, Any]) -> list[str]:
    """Names of library objects that compile the model inside the step: a ``Trainer`` given
    ``TrainingArguments(torch_compile=True)`` (its ``train()`` compiles the model through accelerate).

    >>> compiles_inside({"x": 1})
    []
    """
    return [name for name, value in list(namespace.items())
            if not name.startswith("_") and getattr(_trainer_args(value), "torch_compile", False) is True]


def plan(source: str, namespace: dict[str, Any], rollback: bool, snapshot: Snapshot | None = None
         ) -> "CompilePlan | None":
    """A plan to check the step against eager (with the snapshot it needs), or None: nothing compiled, no
    rollback allowed, or this run is itself the eager replay."""
    if _replaying[0] or not rollback:
        return None
    if not compiled_in(namespace) and "compile(" not in source and not compiles_inside(namespace):
        return None
    if snapshot is None:
        from .engine import snapshot_for

        snapshot = snapshot_for(source, namespace)
    return CompilePlan(namespace, snapshot, source) if snapshot is not None else None


#: What a ``Trainer`` makes in ``train()`` and reuses in the next call (the snapshot does not cover an object's
#: attributes): the eager replay starts from what it had before the step, as the compiled run did.
_TRAINER_MADE = ("optimizer", "lr_scheduler", "model_wrapped")


def _trainer_fields(namespace: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    return [(namespace[name], {a: vars(namespace[name]).get(a) for a in _TRAINER_MADE if a in vars(namespace[name])})
            for name in compiles_inside(namespace)]


def _put(fields: list[tuple[Any, dict[str, Any]]]) -> None:
    for trainer, values in fields:
        for attr, value in values.items():
            setattr(trainer, attr, value)


def trouble(trace: Trace) -> str | None:
    """What makes a compiled step worth replaying eagerly: ``"nonfinite"`` (NaN/Inf reached the loss, a
    gradient or a weight), ``"exception"``, ``"skipping"`` (a GradScaler that skipped step after step: inf/NaN
    gradients every time behind a finite loss, gradients the loop cleared before the run's end) or
    ``"diverged"`` (a loop whose loss ended over 10x both its first and its lowest value); None for a step that
    ran fine, hung or was interrupted.

    >>> from backward_doctor.trace.parts import Iterations
    >>> trouble(Trace(iterations=Iterations(steps=6, loss=[1.0, 0.8, 0.9, 3.0, 20.0, 90.0])))
    'diverged'
    """
    if trace.timed_out or (trace.exception is not None and trace.exception.type == "KeyboardInterrupt"):
        return None
    if trace.exception is not None:
        return "exception"
    if trace.iterations.first_nonfinite is not None or any(trace.nonfinite_reached.values()) \
            or any(e.reached for e in trace.nonfinite) or trace.nonfinite_hint is not None:
        return "nonfinite"
    if collapsed(trace):  # (the amp rule's test: one or two skips while the scale settles are dynamic scaling)
        return "skipping"
    losses = [v for v in trace.iterations.loss if v is not None]
    if len(losses) >= 5 and losses[-1] > 10 * max(losses[0], min(losses), 1e-12):
        return "diverged"
    return None


def _ending(trace: Trace, trigger: str) -> str:
    """How a run ended, in a few words (``trigger``: what is being compared)."""
    if trace.exception is not None:
        inner = unwrapped(trace.exception)
        if inner is not None:  # (dynamo's wrapper says only that the backend raised: what it raised matters)
            return f"raised {trace.exception.type} while compiling ({inner[0]}: {inner[1][:160]})"
        return f"raised {trace.exception.type}: {trace.exception.message.splitlines()[0][:160]}"
    if trigger == "skipping" or trouble(trace) == "skipping":
        return scaler_words(trace, trouble(trace) == "skipping")
    its = trace.iterations
    if trouble(trace) == "nonfinite":
        where = f" in iteration {its.first_nonfinite}'s {its.first_nonfinite_in}" if its.first_nonfinite is not None \
            else ""
        return f"went NaN/Inf{where}"
    losses = [v for v in its.loss if v is not None]
    if trouble(trace) == "diverged":
        return f"diverged (loss {losses[0]:.4g} at first, {losses[-1]:.4g} at the end)"
    last = losses[-1] if losses else None
    if trace.precision.scaler.calls:  # (the loss backward() saw was the scaled one: its steps say more)
        return {"nonfinite": "stayed finite", "diverged": "did not diverge"}.get(trigger, "ran without an error") + \
            f" ({scaler_words(trace, False).split(': ', 1)[1]})"
    return {"nonfinite": "stayed finite", "diverged": "did not diverge"}.get(trigger, "ran without an error") + \
        (f" (last loss {last:.6g})" if last is not None else "")


class _FirstCalls:
    """Forward pre-hooks on each compiled module's original module during the eager replay: the inputs and
    weights of its first call (copies), for the op-by-op comparison. Removed on exit."""

    def __init__(self, compiled: list[tuple[str, Any]]) -> None:
        self.modules = [(name, m) for name, m in compiled if isinstance(m, torch.nn.Module)]
        self.calls: dict[str, tuple[tuple, dict, dict[str, torch.Tensor]]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "_FirstCalls":
        for name, m in self.modules:
            self._handles.append(m._orig_mod.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, name: str) -> Callable[..., None]:
        def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if name in self.calls:
                return
            with torch.no_grad():
                copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
                state = {k: copy(v) for k, v in [*module.named_parameters(), *module.named_buffers()]}
                self.calls[name] = (tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}, state)
        return keep


class CompilePlan:
    """See the module doc: the snapshot taken before the compiled step, and the check after it."""

    def __init__(self, namespace: dict[str, Any], snapshot: Snapshot, source: str = "") -> None:
        self.namespace = namespace
        self.snapshot = snapshot
        self.source = source  # (what another thread's training leaves alone: ``capture/elsewhere.py``)
        self.trainers = _trainer_fields(namespace)  # (a Trainer's own optimizer would carry the NaN into the replay)

    def check(self, first: Trace, rerun: Callable[[], Trace]) -> Trace:
        """``rerun``: runs the cell again as the first run did (``run_step``), returning its trace."""
        why = trouble(first)
        compiled = compiled_in(self.namespace)
        if why is None or not (compiled or first.compiles or any(op.where.compiled for op in first.ops)):
            return first
        end, why_not = take_if_it_fits(self.namespace, source=self.source)
        if end is None:
            first.notes.append(f"torch.compile: the step was not replayed eagerly to compare: {why_not}")
            return first
        left = Bindings(self.namespace)  # (the compiled run's objects in its names: the replay binds its own)
        self.snapshot.restore(self.namespace)
        ended = _trainer_fields(self.namespace)
        _put(self.trainers)
        _replaying[0] = True
        try:
            with _FirstCalls(compiled) as calls, torch.compiler.set_stance("force_eager"), \
                    contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                eager = rerun()
        finally:
            _replaying[0] = False
            end.restore(self.namespace)
            left.restore(self.namespace)
            _put(ended)
        if eager.timed_out or (eager.exception is not None and eager.exception.type == "KeyboardInterrupt"):
            first.notes.append("torch.compile: the eager replay (to compare with the compiled step) was interrupted "
                               "or timed out: no verdict on compiled vs eager")
            return first
        if why != "exception" and eager.exception is None and eager.iterations.steps < first.iterations.steps:
            first.notes.append(f"torch.compile: the step was replayed eagerly to compare, but the replay ran "
                               f"{eager.iterations.steps} optimizer steps where the compiled run ran "
                               f"{first.iterations.steps} (a trainer that keeps its progress between calls?): "
                               "no verdict on compiled vs eager")
            return first
        agreed = agrees(first, eager, why, trouble(eager))
        check = CompileCheck(trigger=why, eager_agrees=agreed, compiled=_ending(first, why), eager=_ending(eager, why))
        if agreed:
            return _from_eager(first, eager, check)
        if why != "exception":  # (an error only the compiled step raises is its own answer: nothing to bisect)
            _bisect(check, compiled, calls.calls, first.cell_file)
        first.compile_check = check
        first.notes.append("torch.compile: the step was replayed eagerly from the state saved before it (the same "
                           f"cell, every compiled region running its Python code): compiled it {check.compiled}, "
                           f"eagerly it {check.eager}. The cell's code ran twice (what it did outside the model "
                           "and the optimizer too); the ops shown are the compiled run's")
        return first


def _from_eager(first: Trace, eager: Trace, check: CompileCheck) -> Trace:
    """Eager does the same: the report is the eager replay's (ops seen one by one), with what only the
    compiled run knew carried over."""
    for name in ("stale_steps", "graph_holders", "history", "run_id", "compiles"):
        setattr(eager, name, getattr(first, name))
    eager.compile_check = check
    eager.notes = list(first.notes) + [
        f"torch.compile: the step {check.compiled} compiled; replayed eagerly from the state saved before it (the "
        f"same cell, every compiled region running its Python code) it {check.eager} too, so the compiler is not "
        "the cause. The ops shown are the eager replay's: inside a compiled region the compiled run could only "
        "be seen at the region's edge. The cell's code ran twice (what it did outside the model and the "
        "optimizer too)"]
    inner = unwrapped(first.exception) if first.exception is not None else None
    if inner is not None:
        why = (" (AOTAutograd runs the backward once while it traces the region, so a saved tensor written in place "
               "fails there, before the step runs)") if "inplace operation" in inner[1] else ""
        eager.notes.append(
            f"torch.compile: compiled, the error surfaced while compiling, as {first.exception.type} at the call of the "
            f"compiled code{why}; eagerly it surfaced where PyTorch runs it, and the ops of the replay name the line "
            "that caused it")
    return eager


def _bisect(check: CompileCheck, compiled: list[tuple[str, Any]], calls: dict[str, tuple], cell_file: str) -> None:
    """The first op that differs, in the first compiled module (by name) where one does."""
    frames = UserFrames(cell_file=cell_file)
    reasons = []
    for name, module in compiled:
        if name not in calls:
            continue
        args, kwargs, state = calls[name]
        backend = backend_of(module)
        if backend is None:
            reasons.append(f"`{name}`: its backend could not be found")
            continue
        result = compare_module(module._orig_mod, args, kwargs, backend, state=state, frames=frames)
        if result["stage"] == "backward" and not result["op"]:  # (inf gradients behind a forward that agrees)
            result.update(first_in_backward(module._orig_mod, args, kwargs, backend, state=state, frames=frames) or {})
        label = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__)
        check.region = f"`{name}` ({type(module._orig_mod).__name__}.forward, compiled with {label})"
        check.ops_compared = result["ops_compared"]
        if result["op"] or result["stage"]:
            fields = {f.name for f in dataclasses.fields(CompileCheck)}
            for key, value in result.items():
                if key in fields and key != "ops_compared":
                    setattr(check, key, value)
            if check.file == cell_file:
                check.file = None
            return
        reasons.append(f"`{name}`: {result['why_not']}")
    if not calls:
        reasons.append("no compiled module was called (a compiled function is compared as a whole only)")
    check.why_not = "; ".join(reasons)


__all__ = ["CompilePlan", "compiled_in", "compiles_inside", "plan", "trouble"]
