"""The panel and the static HTML draw every kind of report in the scenario suite.

One or two scenarios of each kind (tests/scenarios/) are diagnosed as the findings
tests do; then every tab of the panel is opened and the static HTML is rendered. No
section may fail to draw, and the verdict names the root-cause location.
"""
from __future__ import annotations

import pytest

import backward_doctor as bd
import scenarios as S

pytest.importorskip("ipywidgets")
from backward_doctor.frontends.panel import Panel  # noqa: E402

GROUPS = [S.NONFINITE, S.INPLACE, S.DEVICE, S.DTYPE, S.SHAPE, S.INDEX, S.BACKWARD_TWICE, S.NO_GRAD, S.OOM,
          S.HANG, S.CORRECT]
PICKED = [sc for group in GROUPS for sc in group[:2]]


def _diagnose(sc):
    ns = sc.setup()
    report = None
    for _ in range(sc.runs):
        report = bd.diagnose(sc.source, ns, **sc.kwargs)
    return report, ns


@pytest.mark.parametrize("sc", PICKED, ids=[sc.name for sc in PICKED])
def test_every_section_draws(sc):
    report, ns = _diagnose(sc)
    p = Panel(report, sc.source, ns)
    for i in range(4):
        p.tabs.selected_index = i
    p.memory_toggle.value = "by module"
    shown = [w.value for w in (p.summary, p.memory_note, p.findings, p.graph_html, p.ops_html)]
    assert all("could not be drawn" not in v for v in shown), sc.name
    assert 'class="bd-plot"' in p.memory_plot.value
    html = report.to_html()
    assert "could not be drawn" not in html and "<script" not in html
    if report.findings:
        assert report.findings[0].location().split(" (")[0] in p.summary.value
