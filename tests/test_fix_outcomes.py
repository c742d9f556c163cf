"""A fix that fits but costs much more time says so (point 2 of issue 30): in its message, its headline
in the panel and the text report, the fixed verdict, and on its button from then on."""
from __future__ import annotations

import html
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.fixes.apply import slowdown
from backward_doctor.report.fix_result import FixResult


@torch.library.custom_op("bd_test::slow_in_bf16", mutates_args=())
def slow_in_bf16(x: torch.Tensor) -> torch.Tensor:
    """A kernel that is slow in bfloat16, as matmuls are on a CPU without bf16 units (the case a newcomer met:
    amp took a step from 0.58 s to 11.5 s); identity otherwise."""
    if x.dtype == torch.bfloat16:
        time.sleep(0.4)
    return x.clone()


@slow_in_bf16.register_fake
def _(x):
    return torch.empty_like(x)


torch.library.register_autograd("bd_test::slow_in_bf16", lambda ctx, grad: grad)


class SlowInBf16(nn.Module):
    def forward(self, x):
        return slow_in_bf16(x)


class Pause(nn.Module):
    """Costs a fixed 0.3 s per call, outside any op: k micro-batches pay it k times."""

    def forward(self, x):
        time.sleep(0.3)
        return x


def _ns(*extra: nn.Module) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), *extra, nn.ReLU(), nn.Linear(512, 10))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "F": F,
            "xb": torch.randn(1024, 64), "yb": torch.randint(0, 10, (1024,))}


STEP = "opt.zero_grad()\nloss = F.cross_entropy(model(xb), yb)\nloss.backward()\nopt.step()\n"


def test_slowdown_is_said_only_when_an_op_that_does_the_work_is_much_slower_per_call():
    mm = {"aten::mm": [10, 5e4]}
    assert slowdown({"op_time": mm}, {"op_time": {"aten::mm": [10, 1e6], "aten::add": [5, 1e3]}}) == (20.0, "aten::mm")
    # More calls of the same op (8 micro-batches, a recomputed forward) are more work, not a slower op.
    assert slowdown({"op_time": mm}, {"op_time": {"aten::mm": [80, 4e5]}}) is None
    # A slower op that is a small part of the time, or a few milliseconds in all, is no reason to warn.
    assert slowdown({"op_time": mm}, {"op_time": {"aten::mm": [10, 5e4], "aten::add": [5, 1e6], "aten::x": [1, 9e6]}}) \
        is None
    assert slowdown({"op_time": {"aten::mm": [10, 100.0]}}, {"op_time": {"aten::mm": [10, 5000.0]}}) is None


@pytest.mark.parametrize("limit", ["5MB", None], ids=["original-ran-out", "original-ran"])
def test_a_fix_that_fits_but_whose_ops_are_much_slower_says_so_everywhere(limit):
    """amp where the bfloat16 kernel is slow: the step fits the device (float32 needs 6.7 MB, bfloat16 3.7),
    and its ops take far longer each than the original run's, whether that one ran out or ran."""
    ns = _ns(SlowInBf16())
    report = bd.diagnose(STEP, ns, memory_limit=limit, fix="amp")
    fr = report.fix_result
    assert fr.applied and fr.fits and report.ok, fr.message
    assert fr.comparison["before"]["completed"] is (limit is None)
    assert fr.slowdown is not None and fr.slowdown >= 3, fr.comparison
    assert f"It is much slower: each call of `bd_test::slow_in_bf16` took {fr.slowdown:g}x as long" in fr.message
    assert "bfloat16 autocast on a CPU runs without the fast kernels" in fr.message
    text = str(report)
    if limit:  # a FIXED line only where the original step failed
        assert text.startswith(f"backward_doctor: FIXED - the step ran with amp (ops up to {fr.slowdown:g}x slower "
                               "with it)")
        assert f"With it ops run up to {fr.slowdown:g}x slower." in html.unescape(report.to_html())
    assert f"applied, the step ran, but ops ran up to {fr.slowdown:g}x slower than in the original" in text
    page = html.unescape(report.to_html())
    assert "fits, but slow" in page and f"amp: the step ran, ops up to {fr.slowdown:g}x slower" in page


def test_more_work_is_not_called_slow():
    """accumulate:8 calls the model 8 times (8 x 0.3 s outside the ops): the step takes longer, which the
    before/after table says, but no op is slower, so the fix is not flagged."""
    report = bd.diagnose(STEP, _ns(Pause()), fix="accumulate:8")
    fr = report.fix_result
    assert fr.fits and fr.comparison["after"]["step_s"] > 2 * fr.comparison["before"]["step_s"]
    assert fr.slowdown is None and "much slower" not in fr.message, fr.comparison


def test_the_panel_button_of_a_slow_fix_says_so_after_it_ran():
    pytest.importorskip("ipywidgets")
    from backward_doctor.frontends.panel import Panel

    ns = _ns()
    report = bd.diagnose(STEP, ns, memory_limit="5MB")
    panel = Panel(report, STEP, ns)
    fast = FixResult("amp", applied=True, fits=True, message="ran", comparison={"before": {}, "after": {}})
    slow = FixResult("amp", applied=True, fits=True, message="ran", slowdown=19.8, code="x = 1\n",
                     comparison={"before": {"step_s": 0.58}, "after": {"step_s": 11.5}})
    assert "amp" in panel.fix_buttons
    panel.show_result(bd.Report(fix_result=fast))
    assert panel.fix_buttons["amp"].description == "Try amp"
    panel.show_result(bd.Report(fix_result=slow))
    assert panel.fix_buttons["amp"].description == "Try amp (ops up to 19.8x slower here)"
    assert "fits, but slow" in panel.after.value and "x = 1" in panel.keep.value  # it works: the code is kept
