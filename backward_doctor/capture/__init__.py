"""Capture: running the user's code while recording it, and giving every global back afterwards.

Layer 2 of capture -> trace -> analysis -> report -> render -> frontends. The only layer that touches
torch's runtime (dispatch modes, hooks, the native recorder in ``backward_doctor.native``); what leaves
it is an inert :class:`~backward_doctor.trace.Trace`.

The rooms, bottom to top (a room imports only those below it and the shared modules here):
``recorder/`` (every aten op, live memory, statistics, collectives, torch.compile's compiling),
``workers/`` (DataLoader workers, both sides), ``watches/`` (the training watches' registry and its
members), ``loop/`` (iterations, which are recorded, optimizer steps, library loops), ``end/`` (the
run turned into a trace). Shared: ``state.py`` (:class:`CaptureState`), ``guard.py``, ``frames.py``,
``namespace.py``, ``elsewhere.py``, ``history.py``, ``janitor.py``. The assembly, which nothing in a
room imports: ``context.py`` (:class:`Capture`), ``native_capture.py``, ``python_sampling.py``,
``runner.py`` (a cell's source under a capture, with the hang watchdog), ``open_run.py``.

>>> import torch
>>> with Capture() as cap:
...     (torch.ones(2, requires_grad=True) * 2).sum().backward()
>>> len(cap.finish().ops) > 0
True
"""
from __future__ import annotations

from .context import Capture

__all__ = ["Capture"]
