"""``amp_misuse``: ``optimizer.step()`` where ``scaler.step(optimizer)`` belongs (issue 48's precision items).

torch raises at the ``scaler.update()`` after it ("No inf checks were recorded prior to update"); the
doctor names the optimizer step's line, with the line rewritten, on both engines; the documented recipe
stays silent, and an ``update()`` with no ``scale()`` at all keeps torch's own words.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.analysis.rules.amp_steps import NO_INF_CHECKS

ENGINES = ["native", "python"]


def _ns() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return {"torch": torch, "F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "scaler": torch.amp.GradScaler("cpu"),
            "data": [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(4)]}


LOOP = """\
for x, y in data:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    opt.step()
    scaler.update()
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_the_optimizer_step_beside_the_scaler_is_named_not_the_update_that_raised(engine):
    report = bd.diagnose(LOOP, _ns(), engine=engine)
    assert NO_INF_CHECKS in report.exception
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["problem"]) == ("amp_misuse", 6, 0, "step_without_scaler")
    assert f.evidence["fix_code"] == "scaler.step(opt)" and f.evidence["update_line"] == 7
    assert "65,536" in f.message and "`scaler.update()` at line 7" in f.message


@pytest.mark.parametrize("engine", ENGINES)
def test_a_single_step_is_named_with_its_line_rewritten(engine):
    src = ("x, y = data[0]\nwith torch.autocast('cpu', dtype=torch.bfloat16):\n    loss = F.cross_entropy(model(x), y)\n"
           "scaler.scale(loss).backward()\nopt.step(); opt.zero_grad()\nscaler.update()\n")
    f = bd.diagnose(src, _ns(), engine=engine).root_cause
    assert (f.kind, f.line, f.iteration) == ("amp_misuse", 5, None)
    assert f.evidence["fix_code"] == "scaler.step(opt); opt.zero_grad()"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_documented_recipe_is_silent_and_an_update_without_scale_keeps_torchs_words(engine):
    report = bd.diagnose(LOOP.replace("opt.step()", "scaler.step(opt)"), _ns(), engine=engine)
    assert report.ok and not report.findings, report.findings
    f = bd.diagnose("scaler.update()\n", _ns(), engine=engine).root_cause
    assert f.kind == "exception" and "scale" in f.message
