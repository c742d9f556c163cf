"""Issue 48, ``frozen_params_updated``: parameters with ``requires_grad=False`` that ``optimizer.step()`` still
changes, named at the line that froze them with the iteration, how much they moved and the fix as code, and
silent on the correct twins. Both engines; a Lightning ``fit()`` and a Hugging Face ``Trainer.train()``.

What torch 2.13 really does (checked plainly in :func:`test_what_torch_does`, before the doctor is asked): an
optimizer skips a parameter whose ``.grad`` is None, so a layer frozen mid-training moves on only while its
gradient is kept as zeros (``zero_grad(set_to_none=False)``): AdamW's weight decay and Adam's moments, and SGD's
momentum, keep moving it; plain SGD on a zero gradient leaves it as it was.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from report_check import describe as _describe, only as _only, silent as _silent
import library_loops as ll

os.environ.setdefault("HF_HUB_OFFLINE", "1")


ADAMW = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
SGD_MOMENTUM = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
SGD_PLAIN = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731


def _ns(make_opt=ADAMW, batchnorm: bool = False, trainable_only: bool = False) -> dict:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if batchnorm else []) + [nn.ReLU(), nn.Linear(16, 4)]
    model = nn.Sequential(*layers)
    params = [p for p in model.parameters() if p.requires_grad] if trainable_only else model.parameters()
    return {"torch": torch, "nn": nn, "F": F, "model": model, "x": torch.randn(6, 8),
            "y": torch.randint(0, 4, (6,)), "opt": make_opt(params)}


#: the first layer frozen at iteration 2 of 5 (a fine-tune that freezes the encoder after a warm-up)
FREEZE_MID = """\
for step in range(5):
    if step == 2:
        for p in model[0].parameters():
            p.requires_grad_(False)
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""
FREEZE_MID_NONE = FREEZE_MID.replace("opt.zero_grad(set_to_none=False)", "opt.zero_grad()")


def _moved(ns: dict, cell: str) -> float:
    """How far the first layer's weight moved after the freeze, running ``cell`` plainly (no doctor)."""
    frozen = {}
    real_step = ns["opt"].step

    def step(*a, **kw):  # the weight as the freeze left it: read at the first step after it
        if not ns["model"][0].weight.requires_grad and "w" not in frozen:
            frozen["w"] = ns["model"][0].weight.detach().clone()
        return real_step(*a, **kw)
    ns["opt"].step = step
    exec(cell, ns)
    del ns["opt"].step
    return float((ns["model"][0].weight.detach() - frozen["w"]).abs().max())


def test_what_torch_does():
    assert _moved(_ns(ADAMW), FREEZE_MID) > 1e-3          # weight decay and Adam's moments: it drifts
    assert _moved(_ns(SGD_MOMENTUM), FREEZE_MID) > 1e-3   # momentum from before the freeze: it drifts
    assert _moved(_ns(SGD_PLAIN), FREEZE_MID) == 0.0      # plain SGD on a zero gradient: it stays
    for make in (ADAMW, SGD_MOMENTUM):
        assert _moved(_ns(make), FREEZE_MID_NONE) == 0.0  # .grad None: torch skips it


# ----------------------------------------------------------------------------- the bugs
def test_adamw_weight_decay_on_zero_filled_gradients_of_a_layer_frozen_mid_training(engine):
    report = bd.diagnose(FREEZE_MID, _ns(ADAMW), engine=engine)
    f = _only(report, "frozen_params_updated")
    assert (f.line, f.file, f.iteration, f.severity) == (4, None, 2, "warning"), _describe(report)
    assert f.location() == "cell line 4, module model.0 (Linear), in iteration 2 of the loop at line 1 (step = 2)"
    ev = f.evidence
    assert ev["parameters"] == ["model.0.weight", "model.0.bias"] and ev["optimizer"] == "AdamW"
    assert (ev["step_line"], ev["zero_grad_line"], ev["freeze_line"], ev["grad_zero"]) == (8, 5, 4, True)
    assert ev["moved"] == ev["sampled"] == 16 * 8 + 16 and 1e-4 < ev["max_change"] < 1e-1
    assert ev["iterations"][0] == 2 and (ev["iterations"] == [2, 3, 4] if engine == "python" else True)
    assert ev["fix_code"] == ("opt.zero_grad()  # set_to_none=True: frozen parameters keep .grad None and the "
                              "optimizer skips them")
    assert "since line 4 (`p.requires_grad_(False)`) froze them" in f.message
    assert "`opt.step()` (line 8, AdamW) still changed them at iteration 2" in f.message
    assert "`opt.zero_grad(set_to_none=False)` (line 5) keeps their gradients as zeros" in f.message
    assert "filter(lambda p: p.requires_grad, model.parameters())" in f.message

    # the twin: zero_grad() (set_to_none=True, the default) -> torch skips the frozen layer
    _silent(bd.diagnose(FREEZE_MID_NONE, _ns(ADAMW), engine=engine))


def test_sgd_momentum_keeps_moving_a_layer_frozen_mid_training(engine):
    report = bd.diagnose(FREEZE_MID, _ns(SGD_MOMENTUM), engine=engine)
    f = _only(report, "frozen_params_updated")
    assert (f.line, f.iteration, f.evidence["optimizer"]) == (4, 2, "SGD"), _describe(report)
    assert f.evidence["max_change"] > 1e-3
    _silent(bd.diagnose(FREEZE_MID_NONE, _ns(SGD_MOMENTUM), engine=engine))
    # plain SGD steps the zero gradient too, but nothing moves: nothing to say
    _silent(bd.diagnose(FREEZE_MID, _ns(SGD_PLAIN), engine=engine))


MODULE_FREEZE = """\
for step in range(4):
    if step == 1:
        model[0].requires_grad_(False)
    model.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""


def test_a_module_frozen_with_requires_grad_and_zeroed_by_the_model(engine):
    report = bd.diagnose(MODULE_FREEZE, _ns(ADAMW), engine=engine)
    f = _only(report, "frozen_params_updated")
    assert (f.line, f.iteration, f.evidence["zero_grad_line"]) == (3, 1, 4), _describe(report)
    assert f.evidence["fix_code"].startswith("model.zero_grad()  # set_to_none=True")


BY_HAND = """\
for step in range(4):
    if step == 1:
        for p in model[0].parameters(): p.requires_grad = False
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""


def test_gradients_zeroed_by_hand_the_fix_drops_them_at_the_freeze(engine):
    report = bd.diagnose(BY_HAND, _ns(SGD_MOMENTUM), engine=engine)
    f = _only(report, "frozen_params_updated")
    assert (f.line, f.iteration, f.evidence["zero_grad_line"]) == (3, 1, None), _describe(report)
    assert f.evidence["fix_code"] == ("for p in model[0].parameters(): p.requires_grad = False; p.grad = None  "
                                      "# no gradient: the optimizer skips them (no decay, no momentum)")
    fixed = BY_HAND.replace("p.requires_grad = False", "p.requires_grad = False; p.grad = None")
    _silent(bd.diagnose(fixed, _ns(SGD_MOMENTUM), engine=engine))


@pytest.mark.parametrize("flavour", ["foreach", "fused"])
def test_foreach_and_fused_optimizers_write_lists_of_tensors_in_one_op(engine, flavour):
    make = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{flavour: True})  # noqa: E731
    report = bd.diagnose(FREEZE_MID, _ns(make), engine=engine)
    # (no `stale_grad` beside it on the native engine: the `_foreach_zero_` of a foreach/fused optimizer's
    # zero_grad(set_to_none=False) clears a list, which its stale-gradient check now reads)
    f = _only(report, "frozen_params_updated")
    assert (f.line, f.iteration, f.evidence["parameters"]) == (4, 2, ["model.0.weight", "model.0.bias"])
    _silent(bd.diagnose(FREEZE_MID_NONE, _ns(make), engine=engine))
    # gradients never zeroed at all are still stale, on both engines
    never = "\n".join(line for line in FREEZE_MID.splitlines() if "zero_grad" not in line) + "\n"
    # (the error leads, the frozen layer's drift follows as a warning: analysis/rules/__init__.analyze)
    assert [f.kind for f in bd.diagnose(never, _ns(make), engine=engine).findings][:1] == ["stale_grad"]


# ----------------------------------------------------------------------------- correct twins
FROZEN_BEFORE_STEP = """\
for step in range(4):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if step == 1:
        for p in model[0].parameters():
            p.requires_grad_(False)
    opt.step()
"""


def test_frozen_between_backward_and_step_the_last_gradient_is_applied_once(engine):
    # (that step applies the gradient computed before the freeze, as the code asks; zero_grad() then sets it to
    # None and the layer stays: no drift)
    _silent(bd.diagnose(FROZEN_BEFORE_STEP, _ns(ADAMW), engine=engine))


FROZEN_FIRST = """\
for p in model[0].parameters():
    p.requires_grad_(False)
opt = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-2, weight_decay=0.1)
for step in range(4):
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""
BATCHNORM = """\
for step in range(4):
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""


def test_frozen_before_the_optimizer_with_only_trainable_parameters_passed(engine):
    ns = _ns(ADAMW)
    before = ns["model"][0].weight.detach().clone()
    _silent(bd.diagnose(FROZEN_FIRST, ns, engine=engine))
    assert torch.equal(ns["model"][0].weight, before)


def test_frozen_before_the_optimizer_was_built_over_every_parameter(engine):
    # (the frozen layer never gets a gradient: torch skips it although the optimizer holds it)
    ns = _ns(ADAMW)
    for p in ns["model"][0].parameters():
        p.requires_grad_(False)
    _silent(bd.diagnose(BATCHNORM, ns, engine=engine))


def test_batch_norm_running_statistics_are_buffers_not_frozen_parameters(engine):
    ns = _ns(ADAMW, batchnorm=True)
    mean = ns["model"][1].running_mean.clone()
    _silent(bd.diagnose(BATCHNORM, ns, engine=engine))
    assert not torch.equal(ns["model"][1].running_mean, mean)  # (updated, as intended)


def test_peft_lora_base_frozen_adapters_trained(engine):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    ns = {"torch": torch, "F": F, "model": model, "x": torch.randn(6, 8), "y": torch.randint(0, 4, (6,)),
          "opt": torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and any(p.requires_grad for p in model.parameters())
    _silent(bd.diagnose(BATCHNORM, ns, engine=engine))


# ----------------------------------------------------------------------------- library loops
LIT_FREEZE = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitFreeze(pl.LightningModule):
    def __init__(self, keep_zero_grads=True):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        self.keep_zero_grads = keep_zero_grads

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.net[0].requires_grad_(False)  # <-- freeze the encoder after a warm-up
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=not self.keep_zero_grads)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
"""


def test_lightning_fit_with_a_layer_frozen_mid_training(engine):
    fit = dict(module_source=LIT_FREEZE, module_name="LitFreeze", steps=5)
    ns = ll.lit_fit(**fit)
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    # (no `stale_grad` beside it on the native engine: Lightning zeroes inside the step's closure, after the step
    # began, which its stale-gradient check now counts)
    f = _only(report, "frozen_params_updated")
    assert f.evidence["parameters"] == ["model.net.0.weight", "model.net.0.bias"], _describe(report)
    assert f.iteration == 2 and f.evidence["iterations"][0] == 2 and f.evidence["optimizer"] == "AdamW"
    assert f.evidence["grad_zero"] and "their gradients are kept as zeros, not None" in f.message
    # (the freeze is in the module's file, which the trace does not hold: placed where the cell ran the step)
    assert (f.line, f.file) == (1, None) and f.evidence["freeze_line"] is None
    assert f.evidence["fix_code"].startswith("optimizer.zero_grad(set_to_none=True)")

    # the twin: Lightning's own zero_grad (set_to_none=True): the frozen layer has no gradient, torch skips it
    _silent(bd.diagnose(ll.LIT_FIT, ll.lit_fit(**fit | {"module_kwargs": {"keep_zero_grads": False}}),
                        engine=engine))
    # and zeros kept with nothing frozen: nothing stale, nothing frozen (the native engine said `stale_grad`)
    _silent(bd.diagnose(ll.LIT_FIT, ll.lit_fit(LIT_FREEZE.replace("if self.global_step == 2:", "if False:"),
                                               "LitFreeze", steps=5), engine=engine))


def test_hugging_face_trainer_fine_tuning_a_partly_frozen_model_stays_silent(engine):
    ns = ll.hf_trainer(steps=3)
    for name, p in ns["model"].named_parameters():
        if "embeddings" in name:
            p.requires_grad_(False)
    _silent(bd.diagnose(ll.HF_TRAIN, ns, engine=engine))


NAN_LATER = """\
for step in range(12):
    if step == 2:
        for p in model[0].parameters():
            p.requires_grad_(False)
    opt.zero_grad(set_to_none=False)
    xb = x * float("nan") if step == 10 else x
    loss = F.cross_entropy(model(xb), y)
    loss.backward()
    opt.step()
"""


def test_the_drift_is_kept_when_a_later_iteration_is_replayed_for_nan(engine):
    # (the native recorder sleeps through iteration 10 and replays it in detail: the run's frozen updates stand)
    report = bd.diagnose(NAN_LATER, _ns(ADAMW), engine=engine)
    got = [(f.kind, f.line, f.iteration) for f in report.findings]
    # (the run went NaN: that leads; the drift, earlier but no cause of it, follows as a warning)
    assert got == [("nonfinite", 6, 10), ("frozen_params_updated", 4, 2)], _describe(report)
    assert report.trace.iterations.replayed == (10 if engine == "native" else None)
