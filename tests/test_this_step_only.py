"""Verdicts depend only on what this step did, never on what earlier cells left behind.

Each test is a situation a notebook user reaches by running cells in some order: another model
with NaN gradients in the namespace, a parameter an earlier update turned into a non-leaf, a hang
in a namespace that also holds NaN. On both engines.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
import torch.nn.functional as F

import backward_doctor as bd


def _ns():
    torch.manual_seed(0)
    model_a, model_b = nn.Linear(4, 1), nn.Linear(4, 1)
    return {"F": F, "torch": torch, "model_a": model_a, "model_b": model_b,
            "opt_b": torch.optim.SGD(model_b.parameters(), lr=0.1), "x": torch.randn(8, 4), "y": torch.randn(8, 1)}


STEP_B_NO_ZERO_GRAD = "loss = F.mse_loss(model_b(x), y)\nloss.backward()\nopt_b.step()\n"


def test_nan_left_on_another_model_changes_nothing(engine):
    ns = _ns()
    bd.diagnose("loss_a = (model_a(x) * float('nan')).sum()\nloss_a.backward()", ns, engine=engine)
    assert torch.isnan(ns["model_a"].weight.grad).all()  # the earlier cell's doing, left in the namespace
    for _ in range(3):
        report = bd.diagnose(STEP_B_NO_ZERO_GRAD, ns, engine=engine)
    assert report.trace.engine == engine  # not replayed: model_a's NaN is not this step's
    assert not any("replayed" in n for n in report.trace.notes)
    assert [f.kind for f in report.findings] == ["stale_grad"]


def test_a_clean_step_beside_a_nan_model_is_ok(engine):
    ns = _ns()
    bd.diagnose("loss_a = (model_a(x) * float('nan')).sum()\nloss_a.backward()", ns, engine=engine)
    report = bd.diagnose("opt_b.zero_grad()\n" + STEP_B_NO_ZERO_GRAD, ns, engine=engine)
    assert report.ok, report.findings
    assert report.trace.engine == engine


def test_a_hang_is_never_run_twice(engine):
    ns = _ns()
    bd.diagnose("loss_a = (model_a(x) * float('nan')).sum()\nloss_a.backward()", ns, engine=engine)
    ns["runs"] = []
    src = "runs.append(1)\nloss = (model_a(x)).sum()\nloss.backward()\nimport time\nwhile True:\n    time.sleep(0.01)\n"
    report = bd.diagnose(src, ns, timeout=1.0, engine=engine)
    assert report.findings[0].kind == "hang"
    assert ns["runs"] == [1]


def _ema_ns():
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return {"F": F, "torch": torch, "student": student, "teacher": teacher,
            "opt": torch.optim.SGD(student.parameters(), lr=0.1), "x": torch.randn(8, 4), "y": torch.randn(8, 1)}


EMA_STEP = """\
opt.zero_grad()
loss = F.mse_loss(student(x), teacher(x))
loss.backward()
opt.step()
for t, s in zip(teacher.parameters(), student.parameters()):
    t.mul_(0.99).add_(0.01 * s)
"""


def test_ema_update_outside_no_grad_is_named_where_it_happens(engine):
    ns = _ema_ns()
    report = bd.diagnose(EMA_STEP, ns, engine=engine)
    assert report.exception is None
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("nonleaf_param", 6, "aten::add_")
    assert "teacher.0.weight" in f.evidence["parameters"] and f.evidence["in_this_step"]


def test_a_non_leaf_parameter_is_a_finding_not_a_crash(engine):
    ns = _ema_ns()
    exec(EMA_STEP, ns)  # an earlier run, without the doctor, made the teacher's parameters non-leaves
    assert not ns["teacher"][0].weight.is_leaf
    report = bd.diagnose(EMA_STEP, ns, engine=engine)
    assert report.exception is None  # the doctor's own hooks never fail on it
    assert report.findings[0].kind == "nonleaf_param"
    assert report.findings[0].line == 6


def test_ema_under_no_grad_is_silent(engine):
    ns = _ema_ns()
    src = EMA_STEP.replace("for t, s", "with torch.no_grad():\n  for t, s").replace("    t.mul_", "      t.mul_")
    report = bd.diagnose(src, ns, engine=engine)
    assert report.ok, report.findings
