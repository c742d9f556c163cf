"""``grad_accumulation``: ``clip_grad_norm_`` after every micro-batch instead of once before the step
(issue 48's precision items: placed at the clip line, not at ``step()``), on both engines, beside the correct
twins: one clip before the step, two parameter groups clipped apart, a loop without accumulation, and the
libraries that clip for you (a Trainer's ``max_grad_norm``, Lightning's ``gradient_clip_val``) while they
accumulate.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
import library_loops as ll

ENGINES = ["native", "python"]


def _ns() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return {"torch": torch, "F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "data": [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(8)]}


PER_MICRO_BATCH = """\
k = 4
for i, (x, y) in enumerate(data):
    loss = F.cross_entropy(model(x), y) / k
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    if (i + 1) % k == 0:
        opt.step()
        opt.zero_grad()
"""
ONCE = """\
k = 4
for i, (x, y) in enumerate(data):
    loss = F.cross_entropy(model(x), y) / k
    loss.backward()
    if (i + 1) % k == 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
"""
TWO_GROUPS = """\
for x, y in data:
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model[0].parameters(), 0.5)
    torch.nn.utils.clip_grad_norm_(model[2].parameters(), 0.5)
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_a_clip_after_every_micro_batch_is_named_at_the_clip(engine):
    report = bd.diagnose(PER_MICRO_BATCH, _ns(), engine=engine)
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["problem"]) == ("grad_accumulation", 5, 0, "clip_per_micro_batch")
    assert (f.evidence["clips"], f.evidence["micro_batches"], f.evidence["step_line"]) == (4, 4, 7)
    assert f.evidence["fix_code"].splitlines() == [
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # once per optimizer step, on the whole sum",
        "opt.step()"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("src", [ONCE, TWO_GROUPS], ids=["once_before_the_step", "two_groups_apart"])
def test_clipping_once_per_step_stays_silent(engine, src):
    report = bd.diagnose(src, _ns(), engine=engine)
    assert report.ok and not report.findings, report.findings


@pytest.mark.parametrize("engine", ENGINES)
def test_libraries_that_clip_while_they_accumulate_stay_silent(engine):
    report = bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(task="lm", steps=2, accum=2, max_grad_norm=0.01), engine=engine)
    assert report.trace.precision.clips and not [f for f in report.findings if f.kind == "grad_accumulation"], \
        report.findings
    ns = ll.lit_fit(steps=2, trainer_kwargs={"accumulate_grad_batches": 2, "gradient_clip_val": 0.01})
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    assert report.trace.precision.clips and not [f for f in report.findings if f.kind == "grad_accumulation"], \
        report.findings
