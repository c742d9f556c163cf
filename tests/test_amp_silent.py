"""``amp_misuse`` where a GradScaler's steps and updates do not pair (issue 48's precision items), on both engines,
each bug beside its correct twin.

What torch 2.13 does (:func:`test_what_torch_does`, plainly, before the doctor is asked): a ``scaler.update()``
skipped after a ``scaler.step(opt)`` that ran makes the *next* ``scaler.step(opt)`` raise "step() has already
been called since the last update()" (the scaler's stage for that optimizer stays STEPPED until an update); a
``break`` before the update leaves the scaler waiting, and the next cell's step raises. ``opt.step()`` called
directly after ``scaler.scale(loss).backward()`` raises nothing while ``scaler.update()`` is never called: every
update applies gradients times the scale.

The doctor names the ``continue``/``if``/``break`` that skips the update (with the iteration whose step went
without it) and the ``opt.step()`` line ahead of the NaN/Inf its huge steps lead to, with the fix as code; the
documented recipe, accumulation with a scaler, a disabled scaler, bf16 autocast without one, a step skipped for
an overflow, ``unscale_`` + clipping, two optimizers under one scaler, and Lightning/Accelerate/Trainer driving
the scaler themselves stay silent.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
import library_loops as ll
from report_check import describe, fits_the_schema, silent

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _ns(scale: float = 2.0 ** 8, enabled: bool = True, lr: float = 0.1, n: int = 8, poison: int | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(n)]
    if poison is not None:  # one batch whose loss overflows: the scaler skips that step (normal dynamic scaling)
        data[poison] = (torch.full((4, 8), 1e38), data[poison][1])
    return {"torch": torch, "F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=lr),
            "scaler": torch.amp.GradScaler("cpu", init_scale=scale, enabled=enabled), "data": data}


_HEAD = """\
for i, (x, y) in enumerate(data):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
"""
#: the documented recipe
RECIPE = _HEAD + "    scaler.step(opt)\n    scaler.update()\n"
#: a logging shortcut placed before the update: iterations 1, 2, 3 step without it
CONTINUE = _HEAD + "    scaler.step(opt)\n    if i % 4:\n        continue\n    scaler.update()\n"
#: the update under an if
UPDATE_UNDER_IF = _HEAD + "    scaler.step(opt)\n    if i % 2 == 0:\n        scaler.update()\n"
#: the update once, after the loop
UPDATE_AFTER_LOOP = _HEAD + "    scaler.step(opt)\nscaler.update()\n"
#: an early exit between the step and the update: the cell ends with the scaler waiting
BREAK = _HEAD + "    scaler.step(opt)\n    if i == 2:\n        break\n    scaler.update()\n"
#: the optimizer stepped directly on the scaled gradients, no update: nothing raises
DIRECT = _HEAD + "    opt.step()\n"


def test_what_torch_does():
    """Plainly, without the doctor: the skipped update raises at the next step; the direct step raises nothing and
    its weights move scale times as far as the recipe's."""
    ns = _ns()
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        exec(CONTINUE, ns)
    assert ns["i"] == 2  # (iteration 1 stepped without its update; iteration 2's step raised)
    ns = _ns()
    exec(BREAK, ns)  # nothing raised, the scaler left waiting ...
    with pytest.raises(RuntimeError, match="already been called"):
        exec(RECIPE, ns)  # ... until the next cell's step
    moved = {}
    for name, cell in (("recipe", RECIPE), ("direct", DIRECT)):
        ns = _ns(n=1)
        before = ns["model"][0].weight.detach().clone()
        exec(cell, ns)
        moved[name] = (ns["model"][0].weight.detach() - before).abs().max().item()
    assert moved["direct"] == pytest.approx(256 * moved["recipe"], rel=1e-3)


@pytest.mark.parametrize("cell, line, how, update_line, iteration", [
    (CONTINUE, 8, "continue", 9, 1), (UPDATE_UNDER_IF, 7, "if", 8, 1), (UPDATE_AFTER_LOOP, 7, "after_loop", 7, 0)],
    ids=["continue", "update_under_if", "update_after_loop"])
def test_a_skipped_update_is_named_where_it_is_skipped_not_at_the_step_that_raised(engine, cell, line, how,
                                                                                     update_line, iteration):
    report = fits_the_schema(bd.diagnose(cell, _ns(), engine=engine))
    assert "step() has already been called since the last update()" in report.exception
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["problem"], f.evidence["how"]) == \
        ("amp_misuse", line, iteration, "update_skipped", how), describe(report)
    assert (f.evidence["step_line"], f.evidence["update_line"]) == (6, update_line)
    assert f.evidence["fix_code"] == "scaler.step(opt)\nscaler.update()"
    assert f"`scaler.step(opt)` (line 6) stepped the SGD optimizer at iteration {iteration}" in f.message
    assert "the loss scale never adapts" in f.message
    [u] = report.trace.precision.scaler.unpaired
    assert (u.iteration, u.line, u.direct, u.at_end) == (iteration, 6, False, False)


def test_a_skipped_update_before_unscale_and_clipping_is_named_too(engine):
    """With ``scaler.unscale_(opt)`` before the clip, torch raises at the next ``unscale_`` ("unscale_() is being
    called after step()"), before any step: the same ``continue`` is named."""
    cell = CONTINUE.replace("    scaler.step(opt)\n", "    scaler.unscale_(opt)\n"
                            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    scaler.step(opt)\n")
    report = bd.diagnose(cell, _ns(), engine=engine)
    assert "unscale_() is being called after step()" in report.exception
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["how"], f.evidence["step_line"]) == \
        ("amp_misuse", 10, 1, "continue", 8), describe(report)


def test_a_break_before_the_update_is_a_warning_at_the_break(engine):
    """Nothing raises in this cell: the scaler is left waiting, and the next cell's first step would raise."""
    report = fits_the_schema(bd.diagnose(BREAK, _ns(), engine=engine))
    assert report.exception is None
    [f] = report.findings
    assert (f.kind, f.line, f.iteration, f.severity, f.evidence["how"]) == ("amp_misuse", 8, 2, "warning", "break"), \
        describe(report)
    assert "leaves the loop before `scaler.update()` at line 9" in f.message and "next cell's" in f.message
    assert f.evidence["fix_code"] == "scaler.step(opt)\nscaler.update()"


def test_the_optimizer_stepped_directly_on_scaled_gradients_is_named(engine):
    report = fits_the_schema(bd.diagnose(DIRECT, _ns(), engine=engine))
    assert report.exception is None
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["problem"], f.evidence["raised"]) == \
        ("amp_misuse", 6, 0, "step_without_scaler", False), describe(report)
    assert (f.evidence["scale"], f.evidence["steps"], f.evidence["iterations"]) == (256.0, 8, list(range(8)))
    assert f.evidence["fix_code"] == "scaler.step(opt)\nscaler.update()"
    assert "every update is 256 times too large" in f.message and "Nothing raised" in f.message


def test_the_direct_step_comes_before_the_nan_it_causes(engine):
    """The default scale (65,536) and a large learning rate: the weights blow up to NaN a few steps in; the NaN is
    what the run shows, the direct step is what made it."""
    ns = _ns(scale=2.0 ** 16, lr=1.0, n=12)
    report = fits_the_schema(bd.diagnose(DIRECT, ns, engine=engine))
    kinds = [f.kind for f in report.findings]
    assert "nonfinite" in kinds, describe(report)
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["problem"]) == ("amp_misuse", 6, 0, "step_without_scaler"), \
        describe(report)
    assert kinds.index("amp_misuse") < kinds.index("nonfinite")


# ---------------------------------------------------------------- the correct twins
ACCUMULATION = """\
k = 4
for i, (x, y) in enumerate(data):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y) / k
    scaler.scale(loss).backward()
    if (i + 1) % k == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""
UNSCALE_CLIP = _HEAD + """\
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
"""
DISABLED = _HEAD + "    opt.step()\n"  # (run with enabled=False: scale() and the rest pass through)
BF16_NO_SCALER = RECIPE.replace("scaler.scale(loss).backward()", "loss.backward()") \
    .replace("    scaler.step(opt)\n    scaler.update()\n", "    opt.step()\n")
TWO_OPTIMIZERS = """\
opt2 = torch.optim.SGD(model[2].parameters(), lr=0.1)
opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
for x, y in data:
    opt.zero_grad(); opt2.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.step(opt2)
    scaler.update()
"""


@pytest.mark.parametrize("cell, kwargs", [
    (RECIPE, {}), (ACCUMULATION, {}), (UNSCALE_CLIP, {}), (DISABLED, {"enabled": False}), (BF16_NO_SCALER, {}),
    (TWO_OPTIMIZERS, {}), (RECIPE, {"poison": 3})],
    ids=["recipe", "accumulation", "unscale_clip", "disabled_scaler", "bf16_without_scaler", "two_optimizers",
         "a_step_skipped_for_an_overflow"])
def test_steps_paired_with_updates_stay_silent(engine, cell, kwargs):
    report = bd.diagnose(cell, _ns(**kwargs), engine=engine)
    assert not report.trace.precision.scaler.unpaired, report.trace.precision.scaler.unpaired
    if "poison" in kwargs:  # (the overflowing batch is NaN/Inf the nonfinite rule reports; the scaler skipped it)
        s = report.trace.precision.scaler
        assert s.skipped == 1 and not [f for f in report.findings if f.kind == "amp_misuse"], describe(report)
        return
    silent(report)


# ---------------------------------------------------------------- library loops
def _accelerate(prepare_optimizer: bool = True) -> dict:
    """An Accelerate loop whose accelerator scales with a CPU GradScaler (what it builds for fp16 on a GPU)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=1)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepare_optimizer:
        model, opt, loader = acc.prepare(model, opt, ll.xy_loader(n=32))
    else:  # (the optimizer left out of prepare: a plain torch one, stepped on the gradients the scaler scaled)
        model, loader = acc.prepare(model, ll.xy_loader(n=32))
    return {"torch": torch, "accelerator": acc, "model": model, "optimizer": opt, "loader": loader}


def test_accelerate_with_an_optimizer_left_out_of_prepare_steps_on_scaled_gradients(engine):
    report = bd.diagnose(ll.ACCEL_LOOP, _accelerate(prepare_optimizer=False), engine=engine)
    f = report.root_cause
    assert (f.kind, f.line, f.iteration, f.evidence["problem"]) == ("amp_misuse", 5, 0, "step_without_scaler"), \
        describe(report)
    assert f.evidence["steps"] == 4 and f.evidence["scale"] == 256.0


def test_library_loops_that_drive_the_scaler_stay_silent(engine):
    report = bd.diagnose(ll.ACCEL_LOOP, _accelerate(), engine=engine)
    assert report.trace.precision.scaler.calls == 4
    silent(report)
    pl = pytest.importorskip("pytorch_lightning")
    plugin = pl.plugins.precision.MixedPrecision("16-mixed", "cpu",
                                                 scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    report = bd.diagnose(ll.LIT_FIT, ll.lit_fit(steps=4, trainer_kwargs={"plugins": [plugin]}), engine=engine)
    assert report.trace.precision.scaler.calls == 4
    silent(report)
    # A Trainer's accelerator given a CPU scaler (fp16's, on this CPU): it scales, steps and updates through it. (Its
    # clip does not unscale first, as a CPU accelerator not built for fp16 does not: clip_before_unscale says so,
    # rightly for this setup; the pairing of steps and updates is what is checked here.)
    ns = ll.hf_trainer(steps=4)
    ns["trainer"].accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    s = report.trace.precision.scaler
    assert s.calls == 4 and not s.unpaired and report.exception is None
    assert not [f for f in report.findings if f.evidence.get("problem") in ("update_skipped", "step_without_scaler")], \
        describe(report)
