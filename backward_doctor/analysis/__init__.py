"""Analysis: pure functions over a :class:`~backward_doctor.trace.Trace` that name the root cause.

``rules/`` holds the rules (``fn(trace) -> list[Finding]``, ordered, most specific first), ``findings``
the :class:`Finding` they return, ``fix_plan`` the memory model behind the OOM predictions and the
checkpoint plan. Nothing here runs torch code or keeps state.

>>> from backward_doctor.trace import Trace
>>> analyze(Trace())
[]
"""
from __future__ import annotations

from .findings import Finding
from .rules import analyze

__all__ = ["Finding", "analyze"]
