"""Capture: running the user's code while recording it, and giving every global back afterwards.

Layer 2 of capture -> trace -> analysis -> report -> render -> frontends. The only layer that touches
torch's runtime (dispatch modes, hooks, the native recorder in ``backward_doctor.native``); what leaves
it is an inert :class:`~backward_doctor.trace.Trace`.

- ``context.py``: :class:`Capture`, the context manager (lifecycle, hooks); ``record.py``: the per-op
  hot path; ``mode.py``: the private dispatch mode; ``finish.py`` + ``step_state.py``: turning the
  run into a trace; ``native_capture.py`` + ``native_records.py``: the C++ recorder's tier.
- ``memory.py`` (live-tensor ledger), ``stats.py``, ``checks.py``, ``frames.py``, ``namespace.py``,
  ``stores.py``, ``cuda.py``, ``compile_watch.py``: what the recorders use.
- ``runner.py``: running a cell's source under a capture with the hang watchdog; ``history.py``: what
  is remembered about a cell across runs; ``process.py``: the undo stack, the Ctrl-C hold, one
  diagnosis at a time.

>>> import torch
>>> with Capture() as cap:
...     (torch.ones(2, requires_grad=True) * 2).sum().backward()
>>> len(cap.finish().ops) > 0
True
"""
from __future__ import annotations

from .context import Capture

__all__ = ["Capture"]
