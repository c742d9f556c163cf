"""backward_doctor: find the root cause of a failing PyTorch training step.

>>> import backward_doctor as bd
>>> report = bd.diagnose("import torch\\nw = torch.ones(3, requires_grad=True)\\nw += 1")
>>> report.findings[0].kind, report.findings[0].line
('inplace', 3)

In IPython/Jupyter: ``%load_ext backward_doctor`` then ``%%backward_doctor`` on a cell, or
``%backward_doctor on`` to watch every later cell that trains.
Importing this package imports neither IPython nor matplotlib.
"""
from __future__ import annotations

import logging

from . import render  # noqa: F401  (registers the renderers the report looks up by name)
from .analysis import Finding
from .api import diagnose, last_report
from .capture import Capture
from .report import Report
from .trace import Trace

__all__ = ["diagnose", "last_report", "Capture", "Finding", "Report", "Trace", "load_ipython_extension"]
__version__ = "0.1.0"
# A library logs, an application decides where that goes (errors the doctor swallows to keep the
# user's step running are logged under "backward_doctor.*": `logging.basicConfig(level="DEBUG")`).
logging.getLogger(__name__).addHandler(logging.NullHandler())


def load_ipython_extension(ipython) -> None:  # noqa: ANN001 - IPython's API
    """Called by ``%load_ext backward_doctor``: registers ``%%backward_doctor`` and ``%backward_doctor on|off``."""
    from .frontends.line_magic import register
    from .frontends.magic import load_ipython_extension as _load

    _load(ipython)
    register(ipython)


def unload_ipython_extension(ipython) -> None:  # noqa: ANN001
    from .frontends.always_on import turn_off
    from .frontends.magic import unload_ipython_extension as _unload

    turn_off(ipython)
    _unload(ipython)
