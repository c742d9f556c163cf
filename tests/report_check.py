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
