"""The measured equivalence check of gradient accumulation and what the accumulation watch counts, on both
engines: exact factors where the arithmetic says what they must be, a gradient changed between the
micro-batches, the check refused when the gradients would not fit, backward() calls that are not
micro-batches (a reentrant checkpoint's, a second loss's), and the counts per optimizer step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.capture.watches import accumulation as accum_watch





def _ns() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    data = [(torch.randn(5, 6), torch.randint(0, 3, (5,))) for _ in range(6)]
    return {"torch": torch, "F": F, "model": model, "loader": data,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


LOOP = """\
k = 3
for i, (xb, yb) in enumerate(loader):
    loss = F.cross_entropy(model(xb), yb){scale}
    loss.backward(){clip}
    if (i + 1) % k == 0:
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.parametrize("scale, factor", [(" / k", 1.0), ("", 3.0), (" / 2", 1.5)])
def test_the_measured_factor_is_what_the_scaling_makes_it(engine, scale, factor):
    report = bd.diagnose(LOOP.format(scale=scale, clip=""), _ns(), engine=engine)
    check = report.trace.accumulation.check
    assert check is not None and check.micro_batches == 3 and check.why_not == "", check
    assert abs(check.factor - factor) < 1e-6 and check.sum_rel_diff < 1e-6, check
    assert report.trace.accumulation.per_step[3] == 2
    kinds = [f.kind for f in report.findings]
    assert kinds == ([] if factor == 1.0 else ["grad_accumulation"]), kinds
    if factor != 1.0:
        assert report.findings[0].evidence["divisor"] == (2.0 if "2" in scale else 1.0)


def test_a_gradient_changed_between_micro_batches_is_measured(engine):
    """Clipping after every micro-batch clips partial sums: the step's gradient is not what the micro-batches
    added up to. Named at the clip line (``rules/clipping.py``), with the measurement that says the clips bit."""
    clip = "\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)"
    cell = LOOP.format(scale=" / k", clip=clip)
    report = bd.diagnose(cell, _ns(), engine=engine)
    f = report.findings[0]
    at_clip = cell.splitlines().index("    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)") + 1
    assert (f.kind, f.evidence["problem"], f.line, f.severity) == ("grad_accumulation", "clip_per_micro_batch",
                                                                   at_clip, "error"), f.message
    assert f.evidence["check"]["sum_rel_diff"] > 0.1 and "Measured in iteration" in f.message


def test_the_check_is_refused_when_the_gradients_would_not_fit(engine, monkeypatch):
    monkeypatch.setattr(accum_watch, "available_ram", lambda: 4096)
    report = bd.diagnose(LOOP.format(scale="", clip=""), _ns(), engine=engine)
    check = report.trace.accumulation.check
    assert check.factor is None and "copies the gradients twice" in check.why_not, check
    f = report.findings[0]  # the structural finding stands without the measurement
    assert f.evidence["problem"] == "loss_not_divided" and "Measured" not in f.message


def test_reentrant_checkpointing_backward_is_not_a_micro_batch(engine):
    ns = _ns()
    ns["checkpoint"] = torch.utils.checkpoint.checkpoint
    cell = """\
for xb, yb in loader[:3]:
    optimizer.zero_grad()
    h = checkpoint(model[0], xb.requires_grad_(), use_reentrant=True)
    loss = F.cross_entropy(model[2](model[1](h)), yb)
    loss.backward()
    optimizer.step()
"""
    report = bd.diagnose(cell, ns, engine=engine)
    assert report.findings == [] and report.trace.accumulation.per_step == [0, 3], report.trace.accumulation
    # nor for the loop watch: one backward() an iteration, the loss its own (not the recomputed segment's)
    its = report.trace.iterations
    assert its.backwards == [1, 1, 1] and None not in its.loss, (its.backwards, its.loss)


def test_the_windows_say_where_each_call_was_made(engine):
    report = bd.diagnose(LOOP.format(scale=" / k", clip=""), _ns(), engine=engine)
    acc = report.trace.accumulation
    w = acc.windows[0]
    assert (w.iteration, w.backward, w.zeroed_first, w.optimizer, w.line) == (0, 3, True, "SGD", 6)
    assert [c.line for c in w.calls] == [4, 4, 4] and {c.divisor for c in w.calls} == {3.0}
    assert len({c.site for c in w.calls}) == 1 and all(c.loss is not None for c in w.calls)
    assert acc.trailing == 0 and acc.settings == []


def test_the_wrappers_are_put_back():
    from torch.amp.grad_scaler import GradScaler
    from torch.nn.utils import clip_grad

    before = (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad, GradScaler.step, clip_grad._clip_grads_with_norm_,
              torch.autograd.backward)
    bd.diagnose(LOOP.format(scale=" / k", clip=""), _ns())
    after = (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad, GradScaler.step, clip_grad._clip_grads_with_norm_,
             torch.autograd.backward)
    assert before == after


def test_a_long_loop_counts_every_step_past_the_detailed_windows(engine):
    """Past the windows kept in detail, a one-backward() step is only counted (the watch's fast path): every
    step still in ``per_step``, the detailed windows still the first ones, and an odd window later on (two
    backward() calls with a zero_grad() between them, in iteration 30) still kept."""
    ns = _ns()
    ns["loader"] = ns["loader"] * 8  # 48 batches
    cell = """\
for i, (xb, yb) in enumerate(loader):
    optimizer.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    if i == 30:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
    optimizer.step()
"""
    acc = bd.diagnose(cell, ns, engine=engine).trace.accumulation
    assert acc.per_step[:3] == [0, 47, 1], acc.per_step
    assert len(acc.windows) == accum_watch._DETAILED + 1, [w.iteration for w in acc.windows]
    assert [w.iteration for w in acc.windows[:3]] == [0, 1, 2]
    late = acc.windows[-1]
    assert (late.iteration, late.backward, len(late.zero_grads)) == (30, 2, 1), late


def test_the_counting_only_path_keeps_what_the_general_path_keeps(engine, monkeypatch):
    """The fast path past the detailed windows (one backward(), nothing else in the window) writes exactly what
    the general path writes for the same loop: with it switched off (``_counting`` never set), the same
    record, field for field, on a loop of single steps, accumulation of two, and odd windows late on."""
    cell = """\
for i, (xb, yb) in enumerate(loader):
    optimizer.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    if i % 7 == 3:
        F.cross_entropy(model(xb), yb).backward()
    if i in (25, 33):
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
    optimizer.step()
"""

    def accumulation() -> dict:
        ns = _ns()
        ns["loader"] = ns["loader"] * 7  # 42 batches
        return dataclasses.asdict(bd.diagnose(cell, ns, engine=engine).trace.accumulation)

    fast = accumulation()
    never = property(lambda self: False, lambda self, value: None)  # (set by the watch, read as False)
    monkeypatch.setattr(accum_watch.AccumulationWatch, "_counting", never, raising=False)
    general = accumulation()
    assert fast == general
    assert fast["per_step"][1] > accum_watch._DETAILED, fast["per_step"]  # (the fast path had steps to count)


ADVERSARIAL = """\
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(16, 8); y = torch.randint(0, 3, (16,))
    x.requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    x_adv = (x + 0.1 * x.grad.sign()).detach()
    opt.zero_grad()
    loss = F.cross_entropy(model(x_adv), y)
    loss.backward()
    opt.step()
"""


def test_an_adversarial_step_is_not_accumulation(engine):
    """FGSM adversarial training: a backward() for the input's gradient, zero_grad() to drop what it left in
    the parameters, then the step's own backward(). Two backward() calls from two lines feed one step, but they
    are not micro-batches: before, the measured check called it "gradient accumulation written wrong" (1.04x
    the full batch's gradient)."""
    report = bd.diagnose(ADVERSARIAL, {"torch": torch, "nn": nn, "F": F}, engine=engine)
    assert report.findings == [], [(f.kind, f.evidence.get("problem"), f.line) for f in report.findings]
