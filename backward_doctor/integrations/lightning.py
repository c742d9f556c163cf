"""Lightning: a ``Callback`` that keeps the doctor's watch across ``trainer.fit()``.

>>> import pytorch_lightning as pl                                               # doctest: +SKIP
>>> from backward_doctor.integrations import DoctorLightningCallback              # doctest: +SKIP
>>> trainer = pl.Trainer(max_epochs=3, callbacks=[DoctorLightningCallback()])    # doctest: +SKIP
>>> trainer.fit(model, loader)                                                   # doctest: +SKIP

The training part of ``fit()`` (``on_train_start`` to ``on_train_end``, or ``on_exception``) is watched in
the sampled mode; when it raises, hangs past ``timeout`` seconds without an optimizer step, or its loss or
gradients go NaN/Inf, the report is written to the trainer's ``default_root_dir``
(``backward_doctor-report.json`` and ``.html``) and shown. ``on_nonfinite="stop"`` (the default) ends
training (``trainer.should_stop``) after the batch whose loss or gradients were first NaN/Inf, as
``detect_anomaly=True`` would stop it, but naming the op, line, iteration and fix.

Works with ``pytorch_lightning`` and with ``lightning`` (``lightning.pytorch``): the callback subclasses
whichever is installed (``pytorch_lightning`` first); importing this module imports it.
"""
from __future__ import annotations

import functools
from typing import Any

try:
    from pytorch_lightning import Callback
except ImportError:  # the unified package
    from lightning.pytorch import Callback  # type: ignore[no-redef]

from ..capture.loop.library_step import precision_context, replayable, step_and_backward
from .watching import LoopDoctor


class DoctorLightningCallback(Callback):
    """Watch ``trainer.fit()`` (see the module docstring). Arguments as :class:`LoopDoctor`:
    ``output_dir`` (default: the trainer's ``default_root_dir``), ``on_nonfinite``, ``timeout``,
    ``memory_limit``, ``engine``, ``every_iteration``, ``quiet``. ``report`` is the latest report."""

    def __init__(self, output_dir: Any = None, **options: Any) -> None:
        super().__init__()
        self.doctor = LoopDoctor(output_dir, **options)
        self._batch: tuple[Any, Any, int] | None = None  # (module, batch, index) during a batch only
        self._trainer: Any = None  # (during fit only)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        namespace: dict[str, Any] = {"model": pl_module}
        for i, opt in enumerate(getattr(trainer, "optimizers", None) or []):
            namespace["optimizer" if i == 0 else f"optimizer_{i}"] = opt
        self.doctor.begin(namespace, output_dir=getattr(trainer, "default_root_dir", None), find_body=self._step,
                          library="lightning")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch, self._trainer = (pl_module, batch, batch_idx), trainer

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch = None
        if self.doctor.should_stop():
            trainer.should_stop = True

    def _step(self) -> Any:
        """The current batch's ``training_step`` and its backward, to run again (the replay of the iteration
        that first went NaN/Inf), or None outside a batch or under manual optimization."""
        if self._batch is None:
            return None
        module, batch, index = self._batch
        if not getattr(module, "automatic_optimization", True):
            return None  # (its training_step steps the optimizers itself: not run twice)

        return replayable(functools.partial(step_and_backward, functools.partial(module.training_step, batch, index),
                                            precision_context(self._trainer)), self._trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._batch = self._trainer = None
        self.doctor.end(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._batch = self._trainer = None
        self.doctor.end(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.doctor.watching:  # (fit ended without on_train_end: nothing else says how)
            self.doctor.end(None, unannounced="when the trainer tore down")

    @property
    def report(self) -> Any:
        """The latest training run's report (None before one ended, or when the callback stood aside)."""
        return self.doctor.report


__all__ = ["DoctorLightningCallback"]
