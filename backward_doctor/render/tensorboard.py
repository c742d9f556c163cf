"""The ``tensorboard`` renderer (only where ``tensorboard`` is installed): a training loop's per-iteration
loss, gradient norm, learning rate and live memory as TensorBoard scalars, and the verdict as text, in one
event file (bytes).

The series are the loop watch's (``trace.iterations``: every iteration, recorded or not, one point per
``stride`` iterations), so the curves are the run's own; a step without a loop gets its peak memory and
the verdict. Write it into a log folder under a name TensorBoard looks for, then ``tensorboard --logdir
runs``::

    python -m backward_doctor render report.json --as tensorboard -o runs/step/events.out.tfevents.bd

A distributed report writes each rank's series under ``rank<k>/``.
"""
from __future__ import annotations

import glob
import os
import tempfile
from typing import Any

from ..report.renderers import Renderer, register, renderer
from ..report.schema import ReportError
from ..trace.records import Trace


#: the last step a TensorBoard event holds (an int64)
MAX_STEP = 2 ** 63 - 1


def _scalars(writer: Any, trace: Trace, prefix: str) -> None:
    its = trace.iterations
    longest = max(len(its.loss), len(its.grad_norm), len(its.lr), len(its.live_bytes), 1)
    if not 0 <= (longest - 1) * its.stride <= MAX_STEP:
        raise ReportError(f"trace.iterations.stride: {its.stride:,} iterations a point makes steps past the "
                          f"{MAX_STEP:,} an event holds")
    series = (("loss", its.loss), ("grad_norm", its.grad_norm), ("learning_rate", its.lr),
              ("live_bytes", its.live_bytes))
    for name, values in series:
        for k, value in enumerate(values):
            if value is not None:
                writer.add_scalar(f"{prefix}iterations/{name}", float(value), k * its.stride)
    writer.add_scalar(f"{prefix}memory/peak_bytes", float(trace.memory.peak_bytes), 0)


@register
class TensorBoardRenderer(Renderer):
    """One TensorBoard event file (bytes); ``RuntimeError`` saying what to install when tensorboard is not."""

    name, suffix, binary = "tensorboard", ".tfevents", True

    def render(self, report: Any) -> bytes:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("the tensorboard export needs the tensorboard package: pip install tensorboard") \
                from None
        with tempfile.TemporaryDirectory(prefix="backward_doctor_tb_") as folder:
            writer = SummaryWriter(folder)
            try:
                ranks = getattr(report, "ranks", None)
                runs = [(r.trace, f"rank{r.rank}/") for r in ranks if r.trace is not None] if ranks is not None \
                    else [(report.trace, "")]
                for trace, prefix in runs:
                    _scalars(writer, trace, prefix)
                text = renderer("text").render(report)
                writer.add_text("backward_doctor/verdict", "\n".join("    " + line for line in text.splitlines()), 0)
            finally:
                writer.close()
            (path,) = glob.glob(os.path.join(folder, "events.out.tfevents.*"))
            with open(path, "rb") as fh:
                return fh.read()


__all__ = ["TensorBoardRenderer"]
