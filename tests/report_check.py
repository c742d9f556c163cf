"""One check the scenario suites run on every report they make: its JSON fits
``backward_doctor/report/schema.json`` exactly (strict: a field the schema does not describe fails, named)."""
from __future__ import annotations

import json
from typing import Any

from backward_doctor.report.schema import check_report


def fits_the_schema(report: Any) -> Any:
    """``report`` itself, once its ``to_dict()`` (through JSON, as saved) fits the schema exactly."""
    check_report(json.loads(json.dumps(report.to_dict())), strict=True)
    return report


def describe(report: Any) -> str:
    """The report's exception and findings, one line each: what a failed assertion on it shows."""
    return "\n".join([f"exception={report.exception!r}"] + [
        f"  {f.kind} {f.location()} file={f.file} evidence={f.evidence.get('problem')}: {f.message}"
        for f in report.findings])


def only(report: Any, kind: str) -> Any:
    """The report's one finding, of ``kind``, in a run that raised nothing."""
    assert report.exception is None, describe(report)
    assert [f.kind for f in report.findings] == [kind], describe(report)
    return report.findings[0]


def silent(report: Any) -> None:
    """Nothing raised, nothing found: the correct twin of a bug."""
    assert report.exception is None and report.findings == [], describe(report)
