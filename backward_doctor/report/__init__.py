"""The report: findings, the cell's exception and the trace, plus a fix's result; renderers
registered in ``backward_doctor.render`` turn it into text, HTML or a panel.

>>> Report().ok
True
"""
from __future__ import annotations

from .fix_result import FixResult
from .report import Report

__all__ = ["FixResult", "Report"]
