"""Healthy code stays healthy under the doctor: each case here was raised into the user's code, reported as a bug
it is not, or computed differently under the doctor, until it was fixed (``tests/test_idioms.py`` runs the idioms
of real scripts under every entry point; these pin the cases found, on both engines, with their reasons)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import backward_doctor as bd
from backward_doctor.capture import state as state_mod


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return {"torch": torch, "F": F, "model": model, "x": torch.randn(16, 4), "y": torch.randn(16, 2),
            "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


ZEROING = {
    "set_to_none=False": "opt.zero_grad(set_to_none=False)",
    "model.zero_grad": "model.zero_grad(set_to_none=False)",
    "by hand": "for p in model.parameters():\n        if p.grad is not None:\n            p.grad.zero_()",
}


@pytest.mark.parametrize("how", sorted(ZEROING))
def test_gradients_zeroed_in_place_are_zeroed(how, engine):
    """``zero_grad(set_to_none=False)`` zeroes in place: the native tier's stale-gradient check, made before the
    recorder's buffers were read, called it "zero_grad() was never called" (iterations 1 on, and every run after
    the first). Twenty iterations (some asleep), twice: the second run checks the first's marks."""
    ns = _setup()
    cell = f"for i in range(20):\n    {ZEROING[how]}\n    loss = F.mse_loss(model(x), y)\n    loss.backward()\n" \
           "    opt.step()\n"
    for _ in range(2):
        report = bd.diagnose(cell, ns, engine=engine)
        assert report.findings == [], report
    # (and never zeroing still is the bug it is)
    report = bd.diagnose(cell.replace(ZEROING[how].splitlines()[0], "pass").replace(
        "\n        if p.grad is not None:\n            p.grad.zero_()", ""), ns, engine=engine)
    assert [f.kind for f in report.findings][:1] == ["stale_grad"], report


def test_a_checkpoint_recomputed_past_the_node_budget_keeps_its_grad_mode(monkeypatch):
    """Past the backward ops whose autograd node the Python tier looks up, the unattributed path screened an op's
    output and then set grad mode to False (its argument, not the mode the op ran under): a non-reentrant
    checkpoint's recomputation, which runs in backward with grad on, saved fewer tensors than its forward and
    torch raised CheckpointError (found after 10,000 backward ops: a long CLI run of a Trainer with
    gradient checkpointing)."""
    monkeypatch.setattr(state_mod, "_NODE_BUDGET", 0)
    ns = {**_setup(), "checkpoint": checkpoint}
    cell = "loss = checkpoint(model, x, use_reentrant=False).pow(2).mean()\nloss.backward()\n"
    plain = {**_setup(), "checkpoint": checkpoint}
    exec(cell, plain)
    report = bd.diagnose(cell, ns, engine="python")
    assert report.exception is None and report.findings == [], report
    for p, q in zip(ns["model"].parameters(), plain["model"].parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("unfreeze_at", [2, 3])
def test_a_backbone_unfrozen_mid_run_got_its_gradients(engine, unfreeze_at):
    """Fine-tuning unfreezes the backbone mid-run (``requires_grad_(True)``, ``add_param_group``): no gradient hook
    can go on a frozen parameter, so the Python tier never saw its gradients and reported "Parameters starved of
    gradient" at iteration 0. Unfrozen at the last iteration too (no later step to see it by)."""
    torch.manual_seed(0)
    backbone, head = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), torch.nn.Linear(8, 2)
    backbone.requires_grad_(False)
    ns = {"torch": torch, "F": F, "backbone": backbone, "head": head, "model": torch.nn.Sequential(backbone, head),
          "x": torch.randn(16, 4), "y": torch.randn(16, 2), "at": unfreeze_at,
          "opt": torch.optim.Adam(head.parameters(), lr=1e-3)}
    cell = ("for step in range(4):\n    if step == at:\n        backbone.requires_grad_(True)\n"
            "        opt.add_param_group({'params': backbone.parameters(), 'lr': 1e-4})\n"
            "    opt.zero_grad()\n    F.mse_loss(model(x), y).backward()\n    opt.step()\n")
    report = bd.diagnose(cell, ns, engine=engine)
    assert report.findings == [], report
