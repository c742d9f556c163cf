"""Which fixes a report offers: only those that can be applied to the cell that ran.

A finding names the fixes that would help its kind of failure (``accumulate``, ``amp``, ``checkpoint``); whether
one can be applied depends on the cell: a step with one ``backward()`` is rewritten, a library's loop gets its
own knob where the cell builds its arguments, and some cells allow neither. Each named fix is rewritten once
here, text only (nothing runs), and the report keeps the answer in ``Report.fix_offers``: the panel shows a
button only for a fix that can be applied, and says why the others cannot, so no button refuses when clicked.

>>> from backward_doctor.report import Report
>>> check_offers(Report(), "x = 1", {})
{}
"""
from __future__ import annotations

import logging
from typing import Any

from ..util.cell import NotApplicable
from .spec import parse_fix

log = logging.getLogger(__name__)


def check_offers(report: Any, source: str, namespace: dict[str, Any]) -> dict[str, str]:
    """Fix name -> '' (it can be applied) or why not, for each fix the findings name; kept in
    ``report.fix_offers``. Run right after the cell, on the namespace it left (as a fix would be)."""
    from .apply import rewrite_for

    offers: dict[str, str] = {}
    for name in dict.fromkeys(n for f in report.findings for n in f.fixes):
        try:
            rewrite_for(parse_fix(name), source, namespace, report)
            offers[name] = ""
        except NotApplicable as exc:
            offers[name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - a rewrite that breaks is not offered, and says so
            log.debug("checking the fix %s failed", name, exc_info=True)
            offers[name] = f"it could not be prepared for this cell ({type(exc).__name__}: {exc})"
    report.fix_offers = offers
    return offers
