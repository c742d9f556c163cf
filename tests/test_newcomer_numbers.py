"""Numbers a newcomer reads (issue 47, item 7): each tensor whose statistics a NaN/Inf finding shows is named,
and a fix's before column shows the parameters the original run had when the cell built the model itself."""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.fixes import run_fix
from backward_doctor.render.sections import comparison_html

NAN_TARGET = """
pred = model(xb)
loss = F.mse_loss(pred, yb)
loss.backward()
opt.step()
"""


def _nan_target_ns() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    yb = torch.randn(8, 1)
    yb[3, 0] = float("nan")  # one bad label from the data pipeline
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "xb": torch.randn(8, 4),
            "yb": yb, "F": F, "torch": torch}


def test_nan_in_the_target_names_both_tensors_whose_statistics_it_shows(engine):
    report = bd.diagnose(NAN_TARGET, _nan_target_ns(), engine=engine)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.evidence["variable"] == "yb"
    # Two tensors' statistics, each after its own name (the prediction first, as mse_loss takes them).
    assert f.evidence["input_names"] == ["pred", "yb"]
    shown = re.findall(r"`(\w+)`: float32\[8, 1\] min=[^;)]*", f.message)
    assert shown == ["pred", "yb"], f.message
    assert "1 NaN" in f.message.split("`yb`: ")[1].split(")")[0]  # the NaN is yb's, not the prediction's
    assert "1 NaN" not in f.message.split("`pred`: ")[1].split(";")[0]
    assert all(s.startswith(("`pred`: ", "`yb`: ")) for s in f.evidence["inputs"])
    assert "`pred`: float32[8, 1]" in str(report)


def test_names_come_from_the_op_s_roles_when_the_line_does_not_say(engine):
    # `*pair` says nothing of which tensor went where: the prediction is named by its role in mse_loss, the
    # target by the variable the capture saw holding the NaN.
    src = "pair = (model(xb), yb)\nloss = F.mse_loss(*pair)\nloss.backward()\nopt.step()\n"
    f = bd.diagnose(src, _nan_target_ns(), engine=engine).findings[0]
    assert f.kind == "nonfinite" and f.evidence["input_names"] == ["the prediction", "yb"]
    assert "(the prediction: float32[8, 1] min=" in f.message and "; `yb`: float32[8, 1] min=" in f.message


BUILT_IN_CELL = """
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters())
xb = torch.randn(32, 64)
yb = torch.randint(0, 10, (32,))
loss = F.cross_entropy(model(xb), yb)
loss.backward()
opt.step()
"""


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_before_column_counts_the_parameters_of_a_model_built_in_the_cell(engine):
    torch.manual_seed(0)
    ns = {"nn": nn, "torch": torch, "F": F}
    original = bd.diagnose(BUILT_IN_CELL, ns, engine=engine)  # as the panel has it, from the magic's run
    nbytes = _param_bytes(ns["model"])
    assert original.trace.memory.peak_by_category["parameters"] == nbytes
    fr = run_fix(BUILT_IN_CELL, ns, "accumulate:2", original=original).fix_result
    assert fr.applied and fr.fits
    before = fr.comparison["before"]["peak_by_category"]
    assert before["parameters"] == nbytes
    row = re.search(r"<td>  parameters</td><td class='num'>([^<]*)</td>", comparison_html(fr))
    assert row is not None and row.group(1) != "0 B"


def test_fix_from_scratch_counts_the_cell_s_model_in_both_columns():
    torch.manual_seed(0)
    ns = {"nn": nn, "torch": torch, "F": F}
    fr = bd.diagnose(BUILT_IN_CELL, ns, fix="accumulate:2").fix_result
    nbytes = _param_bytes(ns["model"])
    cmp = fr.comparison
    assert cmp["before"]["peak_by_category"]["parameters"] == nbytes
    assert cmp["after"]["peak_by_category"]["parameters"] == nbytes
    # The parameters moved out of "other", not counted twice: each column still adds up to its peak.
    for side in ("before", "after"):
        assert sum(cmp[side]["peak_by_category"].values()) == cmp[side]["peak_bytes"]


def test_the_loop_position_is_the_training_loops_not_a_setup_loops(engine):
    """A setup loop before the training loop (`for m in model: ...`) is over when training runs: its variable's
    last value is no position. Before, the place read "(m = Linear(...), step = 2)" (seen with FSDP2's
    `for layer in model: fully_shard(layer)`)."""
    cell = ("model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))\n"
            "for m in model:\n"
            "    if isinstance(m, nn.Linear):\n"
            "        nn.init.zeros_(m.bias)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for step in range(3):\n"
            "    x = torch.randn(8, 4)\n"
            "    if step == 2:\n"
            "        x[0, 0] = float('nan')\n"
            "    loss = model(x).pow(2).mean()\n"
            "    loss.backward()\n"
            "    opt.step(); opt.zero_grad()\n")
    report = bd.diagnose(cell, {"torch": torch, "nn": nn}, engine=engine)
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 9, 2), f
    assert report.trace.iterations.values["2"] == "step = 2" and "m = " not in str(report)
