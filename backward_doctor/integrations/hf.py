"""``transformers.Trainer``: a ``TrainerCallback`` that keeps the doctor's watch across ``trainer.train()``.

>>> from transformers import Trainer                                          # doctest: +SKIP
>>> from backward_doctor.integrations import DoctorCallback                   # doctest: +SKIP
>>> trainer = Trainer(model=model, args=args, train_dataset=ds,
...                   callbacks=[DoctorCallback(on_nonfinite="stop")])        # doctest: +SKIP
>>> trainer.train()                                                           # doctest: +SKIP

Training runs as usual, watched in the sampled mode (``python -m backward_doctor``'s cost on a long
loop); when it raises, hangs past ``timeout`` seconds without an optimizer step, or its loss or gradients
go NaN/Inf, the report is written to the ``TrainingArguments.output_dir`` (``backward_doctor-report.json``
and ``.html``) and shown (on stderr in a script, displayed in a notebook). ``on_nonfinite="stop"`` (the
default) ends training after the optimizer step whose loss or gradients were first NaN/Inf, as
``--debug underflow_overflow`` would, but naming the op, line, iteration and fix.

The ``Trainer`` says nothing to its callbacks when training raises. Given to ``Trainer(callbacks=[...])``,
the callback hears the trainer's construction (``on_init_end``) and wraps that trainer's ``train`` (an
attribute of the instance) so the report comes before the exception propagates; added later
(``trainer.add_callback``) it falls back on the ends ``watching.py`` lists.

Importing this module imports ``transformers``; ``backward_doctor.integrations`` imports it only when
``DoctorCallback`` is asked for.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from transformers import Trainer, TrainerCallback

from ..capture.loop.library_step import StepArguments
from .watching import LoopDoctor


class DoctorCallback(TrainerCallback):
    """Watch ``trainer.train()`` (see the module docstring). Arguments as :class:`LoopDoctor`:
    ``output_dir`` (default: the trainer's), ``on_nonfinite`` (``"stop"``/``"continue"``), ``timeout``,
    ``memory_limit``, ``engine``, ``every_iteration``, ``quiet``. ``doctor.report`` is the latest report."""

    def __init__(self, output_dir: Any = None, **options: Any) -> None:
        self.doctor = LoopDoctor(output_dir, **options)

    # ---------------------------------------------------------------- the trainer's events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is not None and not getattr(vars(trainer).get("train"), "__backward_doctor__", False):
            trainer.train = _ending_on_exception(trainer, self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        namespace = {k: kwargs[k] for k in ("model", "optimizer", "lr_scheduler") if kwargs.get(k) is not None}
        trainer = _calling_trainer()
        if trainer is not None:  # the advice names the TrainingArguments to set, and where they are built
            self.doctor.advise = functools.partial(_advice, weakref.ref(trainer))
        steps = StepArguments(trainer, keep_last=True) if trainer is not None else None
        self.doctor.begin(namespace, output_dir=getattr(args, "output_dir", None),
                          find_body=steps.body if steps is not None else None,
                          cleanup=steps.remove if steps is not None else None, library="transformers")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.doctor.should_stop():
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.doctor.end(None)

    @property
    def report(self) -> Any:
        """The latest training run's report (None before one ended, or when the callback stood aside)."""
        return self.doctor.report


def _advice(trainer_ref: Any, report: Any) -> dict[str, str]:
    """The fixes' advice for a Trainer's run: its arguments' knobs, where the script or a cell builds them."""
    from ..fixes.live_knobs import advice, built_at
    from .watching import _main_file

    trainer = trainer_ref()
    if trainer is None:
        return {}
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    where = built_at(type(trainer.args), getattr(shell, "user_ns", None), _main_file())
    return advice(report, trainer, where)


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` calling back (from its ``__init__`` or its training loop): a few frames up the stack."""
    frame = sys._getframe(2)
    try:
        for _ in range(8):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def _ending_on_exception(trainer: Trainer, callback: DoctorCallback) -> Any:
    """``trainer.train``, ending the watch with the exception training raised (the report before it
    propagates). A callback no longer in the trainer's list is passed by."""
    train = trainer.train

    @functools.wraps(train)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the traceback
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            if callback in trainer.callback_handler.callbacks:
                callback.doctor.end(exc)
            raise

    wrapped.__backward_doctor__ = True  # type: ignore[attr-defined]
    return wrapped


__all__ = ["DoctorCallback"]
