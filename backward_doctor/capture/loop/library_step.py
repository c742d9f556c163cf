"""A library's own training step, run again for the replay of the iteration that went wrong: its arguments (the
batch) kept as it runs, and where the library's loop was then (its step counters) kept once, so that the replay
after the run sees the loop where the iteration saw it (a ``compute_loss`` that reads ``self.state.global_step``, a
``training_step`` that reads ``self.global_step``, compute what they computed then, not at the loop's end).

>>> library_step({}, "x = 1") is None
True
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Iterator

from ...util.process import doctors_own
from .trainers import find_library_loop

_LIGHTNING_LOOPS = ("pytorch_lightning.loops", "lightning.pytorch.loops")


class LoopPosition:
    """Where a library's loop is: the objects that count its steps (``transformers``: the ``Trainer``'s ``state``;
    Lightning: the progress trackers of the trainer's ``fit_loop``), copied when made (the moment an iteration went
    wrong). :meth:`restored` puts the copies in place while the iteration is replayed, and what was there back
    after: nothing else is touched (no ``load_state_dict``, which marks a loop as restarting).

    >>> class T:
    ...     state = None
    >>> LoopPosition(T()).kept
    0
    """

    def __init__(self, trainer: Any) -> None:
        self._kept: list[tuple[Any, str, Any]] = []
        try:
            for owner, name in _position_slots(trainer):
                self._kept.append((owner, name, copy.deepcopy(getattr(owner, name))))
        except Exception as exc:  # a version laid out otherwise: the replay runs where the loop is now
            if not doctors_own(exc):
                raise
            self._kept = []

    @property
    def kept(self) -> int:
        return len(self._kept)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        now = [(owner, name, getattr(owner, name)) for owner, name, _ in self._kept]
        try:
            for owner, name, value in self._kept:
                setattr(owner, name, copy.deepcopy(value))
            yield
        finally:
            for owner, name, value in now:
                setattr(owner, name, value)


def _position_slots(trainer: Any) -> Iterator[tuple[Any, str]]:
    """(object, attribute) of each of the loop's step counters."""
    state = getattr(trainer, "state", None)
    if type(state).__name__ == "TrainerState" and type(state).__module__.startswith("transformers."):
        yield trainer, "state"
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is None or not type(fit_loop).__module__.startswith(_LIGHTNING_LOOPS):
        return
    seen, todo = set(), [fit_loop]
    while todo:
        loop = todo.pop()
        if id(loop) in seen:
            continue
        seen.add(id(loop))
        for name, value in vars(loop).items():
            if not type(value).__module__.startswith(_LIGHTNING_LOOPS):
                continue
            if type(value).__name__.endswith("Progress"):
                yield loop, name
            else:  # a child loop (the epoch loop, its optimization loops)
                todo.append(value)


def in_position(position: LoopPosition | None, body: Callable[[], Any]) -> Any:
    """``body()`` with the library's loop where it was when ``position`` was kept (the replay's step)."""
    with position.restored() if position is not None else contextlib.nullcontext():
        return body()


def replayable(body: Callable[[], Any] | None, trainer: Any) -> Callable[[], Any] | None:
    """``body`` (the library's step, its batch bound in) to run later where the loop is now."""
    return functools.partial(in_position, LoopPosition(trainer), body) if body is not None and trainer is not None \
        else body


class StepArguments:
    """A ``transformers.Trainer``'s ``training_step`` (or a LightningModule's) wrapped (an attribute of the
    instance, removed when the watch ends) to know the current call's arguments: the batch an iteration that goes
    NaN/Inf is replayed with. They are referenced during the call only, or with ``keep_last`` until the next call
    or :meth:`remove` (NaN/Inf gradients from a finite loss show at the optimizer step, after ``training_step``
    returned; a LightningModule's loss reaches ``backward()`` after it returned; the library's loop holds that
    batch until its next one anyway), and kept once, by the replay, until it has run. (The callback's,
    ``integrations/hf.py``, and a cell's that calls ``trainer.train()`` or ``trainer.fit(model, ...)``:
    :func:`library_step`.)"""

    def __init__(self, trainer: Any, keep_last: bool = False) -> None:
        self.trainer = trainer
        self._had = "training_step" in vars(trainer)
        self._saved = vars(trainer).get("training_step")
        step = self._step = trainer.training_step
        self._current: tuple[tuple, dict] | None = None

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the traceback
            self._current = (args, kwargs)
            try:
                return step(*args, **kwargs)
            finally:
                if not keep_last:
                    self._current = None

        trainer.training_step = training_step

    def body(self) -> Any:
        """The current step again, its arguments bound in, to run later where the loop is now (None outside a
        step)."""
        return replayable(self.step(), self.trainer)

    def step(self) -> Any:
        """The current step, its arguments bound in (None outside a step)."""
        if self._current is None:
            return None
        args, kwargs = self._current
        return functools.partial(self._step, *args, **kwargs)

    def remove(self) -> None:
        self._current = None
        if self._had:
            self.trainer.training_step = self._saved
        else:
            vars(self.trainer).pop("training_step", None)


def step_and_backward(step: Callable[[], Any], context: Callable[[], Any] | None = None) -> None:
    """A LightningModule's ``training_step`` (``step``, its batch bound in) and the backward of the loss it
    returns, as Lightning's automatic optimization runs them (the replay of a batch that went NaN/Inf): the step
    inside ``context()``, the trainer's precision context (autocast under ``precision="16-mixed"`` or
    ``"bf16-mixed"``: a NaN/Inf only low precision makes would not show again without it), the backward after
    it, as Lightning runs it."""
    with context() if context is not None else contextlib.nullcontext():
        out = step()
    loss = out.get("loss") if isinstance(out, dict) else out
    if loss is not None and getattr(loss, "requires_grad", False):
        loss.backward()


def precision_context(trainer: Any) -> Callable[[], Any] | None:
    """The context a Lightning ``trainer`` runs each ``training_step`` in (its precision plugin's
    ``train_step_context``: autocast for mixed precision), or None where this Lightning has none.

    >>> precision_context(object()) is None
    True
    """
    try:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
        context = getattr(plugin, "train_step_context", None)
    except Exception as exc:  # another version's layout: the step replays without it (and says so if finite)
        if not doctors_own(exc):
            raise
        return None
    return context if callable(context) else None


def library_step(namespace: dict[str, Any], source: str) -> tuple[Callable[[], Any], Callable[[], None]] | None:
    """``(find_body, remove)`` for the library loop ``source`` calls, the step it runs each iteration wrapped
    (:class:`StepArguments`; ``remove`` takes the wrapper out: call it when the run ends, whatever happened): a
    ``transformers`` trainer's ``training_step``, or the ``training_step`` of the LightningModule a Lightning
    ``fit(model, ...)`` is given by name, with its backward (automatic optimization only: under manual
    optimization the step also steps the optimizers); None for anything else. So that the iteration that goes
    NaN/Inf in a cell's ``trainer.train()`` or ``trainer.fit()`` is replayed alone, through the library's own
    step, rather than the whole cell (the library does not start again from the same state: a trainer at its
    last step returns at once).
    """
    loop = find_library_loop(namespace, source)
    if loop is None:
        return None
    if loop.library == "transformers":
        trainer = loop.ref()
        if trainer is None:
            return None
        steps = StepArguments(trainer, keep_last=True)
        return steps.body, steps.remove
    module = namespace.get(loop.model) if loop.model else None
    if (module is None or not callable(getattr(module, "training_step", None))
            or getattr(module, "automatic_optimization", None) is not True):
        return None
    held = StepArguments(module, keep_last=True)
    trainer = loop.ref

    def find_body() -> Callable[[], None] | None:
        body = held.step()
        step = functools.partial(step_and_backward, body, precision_context(trainer())) if body is not None else None
        return replayable(step, trainer())
    return find_body, held.remove


__all__ = ["LoopPosition", "StepArguments", "in_position", "library_step", "precision_context", "replayable",
           "step_and_backward"]
