"""No offered fix refuses (issue 45): over the scenario suites, every fix a report offers (a panel button) is
applied when clicked, and every fix a finding names is either offered or said to be not applicable, with why.

Each scenario is diagnosed as the findings tests do; then each offered fix is run as the panel's button runs
it (``run_fix`` with the report as the original), from the namespace the diagnosis left.
"""
from __future__ import annotations

import pytest

import backward_doctor as bd
import scenarios as S
from backward_doctor.fixes import run_fix
from backward_doctor.render.view import applicable_fixes
from scenarios import silent as SS

pytestmark = pytest.mark.slow

#: Every scenario that ends (a hang only ends at its timeout, and names no fix).
SCENARIOS = [sc for sc in S.FAILING + SS.FAILING if sc.kind != "hang"]


def _diagnose(sc, engine: str):
    ns = sc.setup()
    report = None
    for _ in range(sc.runs):
        report = bd.diagnose(sc.source, ns, engine=engine, **sc.kwargs)
    return report, ns


def test_every_offered_fix_on_the_scenario_suites_is_applied(engine):
    offered: list[str] = []
    for sc in SCENARIOS:
        report, ns = _diagnose(sc, engine)
        named = {n for f in report.findings for n in f.fixes}
        offers = report.fix_offers or {}
        assert set(offers) == named, sc.name                                  # each named fix was checked
        assert all(why for name, why in offers.items() if name not in [o.name for o in applicable_fixes(report)])
        text = str(report)
        for name, why in offers.items():                                      # refused: advice text with the reason
            if why:
                assert why.split(":")[0][:40] in text.replace("\n    ", " "), (sc.name, name)
        for opt in applicable_fixes(report):                                  # what the panel makes buttons of
            fixed = run_fix(sc.source, ns, opt.arg, original=report, memory_limit=sc.kwargs.get("memory_limit"))
            fr = fixed.fix_result
            assert fr.applied and "cannot be applied" not in fr.message, (sc.name, opt.arg, fr.message)
            offered.append(f"{sc.name}:{opt.arg}")
    # The suites do offer fixes (out of memory: accumulation and mixed precision), so the check above ran.
    assert {"batch_size_raised_to_4096:amp", "attention_scores_at_long_context:amp"} <= set(offered), offered
