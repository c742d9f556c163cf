"""A fix that fits but costs much more time says so (point 2 of issue 30): in its message, its headline
in the panel and the text report, the fixed verdict, and on its button from then on."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.fixes.apply import slowdown
from backward_doctor.report.fix_result import FixResult


class Pause(nn.Module):
    """Costs a fixed 0.3 s per call, as a slow kernel would: k micro-batches pay it k times."""

    def forward(self, x):
        time.sleep(0.3)
        return x


def _ns():
    torch.manual_seed(0)
    model = nn.Sequential(Pause(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "F": F,
            "xb": torch.randn(1024, 64), "yb": torch.randint(0, 10, (1024,))}


STEP = "opt.zero_grad()\nloss = F.cross_entropy(model(xb), yb)\nloss.backward()\nopt.step()\n"


def test_slowdown_is_said_only_when_it_is_large():
    assert slowdown(0.58, 11.5) == 19.8                      # the case a newcomer met: amp (bf16) on a CPU
    assert slowdown(0.58, 1.2) is None and slowdown(0.01, 0.2) is None and slowdown(None, 3.0) is None


def test_a_fix_that_fits_but_is_much_slower_says_so_everywhere():
    """accumulate:8 runs the model 8 times: 8 x 0.3 s against the original's one 0.3 s before it ran out."""
    ns = _ns()
    report = bd.diagnose(STEP, ns, memory_limit="2.2MB", fix="accumulate:8")
    fr = report.fix_result
    assert fr.applied and fr.fits and report.ok, fr.message
    assert fr.slowdown is not None and fr.slowdown >= 3, fr.comparison
    assert "It is much slower: " in fr.message and f"{fr.slowdown:g}x the original step's" in fr.message
    assert "until it ran out of memory" in fr.message
    text = str(report)
    assert text.startswith(f"backward_doctor: FIXED - the step ran with accumulate:8 ({fr.slowdown:g}x slower "
                           "with it)")
    assert f"applied, the step ran, but {fr.slowdown:g}x slower than the original" in text
    html = report.to_html()
    assert "fits, but slow" in html and f"accumulate:8: the step ran, {fr.slowdown:g}x slower" in html
    assert f"With it the step is {fr.slowdown:g}x slower." in html


def test_the_panel_button_of_a_slow_fix_says_so_after_it_ran():
    pytest.importorskip("ipywidgets")
    from backward_doctor.frontends.panel import Panel

    ns = _ns()
    report = bd.diagnose(STEP, ns, memory_limit="2.2MB")
    panel = Panel(report, STEP, ns)
    fast = FixResult("amp", applied=True, fits=True, message="ran", comparison={"before": {}, "after": {}})
    slow = FixResult("amp", applied=True, fits=True, message="ran", slowdown=19.8, code="x = 1\n",
                     comparison={"before": {"step_s": 0.58}, "after": {"step_s": 11.5}})
    assert "amp" in panel.fix_buttons
    panel.show_result(bd.Report(fix_result=fast))
    assert panel.fix_buttons["amp"].description == "Try amp"
    panel.show_result(bd.Report(fix_result=slow))
    assert panel.fix_buttons["amp"].description == "Try amp (19.8x slower here)"
    assert "fits, but slow" in panel.after.value and "x = 1" in panel.keep.value  # it works: the code is kept
