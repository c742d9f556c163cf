"""Issue 48, ``orphan_params`` for a module put on the model after the optimizer was built: a new head, an added
module, a LoRA adapter, resized token embeddings. Its parameters get gradients at every step but are in none of the
optimizer's param groups, so they never change. Named at the line that put the module on the model (a later cell
adding a head: ``diagnose()`` on a namespace an earlier ``exec`` prepared), with the iteration, in the user's
names, with the fix as code; silent on the correct twins (built before the optimizer, frozen, trained by a second
optimizer, a GAN's two optimizers, a linear probe, PEFT's adapters before the optimizer, a Trainer's own
optimizer). Both engines; a Hugging Face ``Trainer`` given an optimizer built before the embeddings were resized.

What torch really does (checked plainly in :func:`test_what_torch_does`, before the doctor is asked): the head
added after ``AdamW(model.parameters())`` gets a gradient at every step and never changes.
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


class Net(nn.Module):
    """A body and, once one is put on it, a head (a classifier built on a pretrained body)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        head = self._modules.get("head")
        return head(h) if head is not None else h[:, :2]


#: an earlier cell: the model and its optimizer
EARLIER = """\
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
"""
#: an earlier cell that puts the head on first, then builds the optimizer (correct)
EARLIER_HEAD_FIRST = """\
torch.manual_seed(0)
model = Net()
model.head = nn.Linear(16, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
"""
LOOP = """\
for step in range(3):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
#: the later cell: a new head, then training
LATE_HEAD = "model.head = nn.Linear(16, 2)\n" + LOOP


def _ns(earlier: str = EARLIER) -> dict:
    ns = {"torch": torch, "nn": nn, "F": F, "Net": Net}
    exec(earlier, ns)
    g = torch.Generator().manual_seed(1)
    ns["x"], ns["y"] = torch.randn(6, 8, generator=g), torch.randint(0, 2, (6,), generator=g)
    return ns


def test_what_torch_does():
    ns = _ns()
    exec("model.head = nn.Linear(16, 2)\nw0 = model.head.weight.detach().clone()\nb0 = model.body[0].weight.detach().clone()\n"
         + LOOP, ns)
    assert ns["model"].head.weight.grad is not None and ns["model"].head.weight.grad.abs().sum() > 0
    assert torch.equal(ns["model"].head.weight, ns["w0"])          # never changes
    assert not torch.equal(ns["model"].body[0].weight, ns["b0"])   # the rest trains


def test_a_head_put_on_the_model_in_a_later_cell(engine):
    report = bd.diagnose(LATE_HEAD, _ns(), engine=engine)
    f = _only(report, "orphan_params")
    assert (f.line, f.file, f.module, f.iteration, f.severity) == (1, None, "model.head", 0, "error"), \
        _describe(report)
    ev = f.evidence
    assert ev["not_stepped"] == ["model.head.weight", "model.head.bias"]
    assert (ev["created"], ev["created_line"], ev["built_line"], ev["step_line"]) == ("assign", 1, None, 5)
    assert (ev["optimizer"], ev["optimizer_class"], ev["values"], ev["held"]) == ("opt", "AdamW", 34, 144)
    assert ev["fix_code"] == ('opt.add_param_group({"params": model.head.parameters()})  # or build the optimizer '
                              'after the model is complete')
    assert f.message.startswith("`model.head` was created after `opt` was built: line 1 (`model.head = "
                                "nn.Linear(16, 2)`) put it on the model, and the optimizer was built before this "
                                "cell. Its 2 parameter tensors (34 values) get gradients at every `backward()` but "
                                "are in none of `opt`'s param groups, so `opt.step()` never changes them"), f.message
    assert f.title == "Module the optimizer never sees"

    # the twin: the head put on before the optimizer was built
    _silent(bd.diagnose(LOOP, _ns(EARLIER_HEAD_FIRST), engine=engine))


def test_the_fix_trains_the_head():
    """The fix as code, run plainly: the head moves."""
    ns = _ns()
    exec("model.head = nn.Linear(16, 2)\n" + 'opt.add_param_group({"params": model.head.parameters()})\n'
         "w0 = model.head.weight.detach().clone()\n" + LOOP, ns)
    assert not torch.equal(ns["model"].head.weight, ns["w0"])


def test_one_cell_that_builds_the_optimizer_then_adds_the_head(engine):
    cell = ("model = Net()\nopt = torch.optim.AdamW(model.parameters(), lr=1e-2)\n"
            "model.add_module('head', nn.Linear(16, 2))\n" + LOOP)
    f = _only(bd.diagnose(cell, _ns(), engine=engine), "orphan_params")
    assert (f.line, f.evidence["created"], f.evidence["built_line"], f.iteration) == (3, "add", 2, 0)
    assert "line 3 (`model.add_module('head', nn.Linear(16, 2))`) put it on the model after line 2 built the " \
           "optimizer" in f.message
    # the twin: the same lines, the optimizer last
    _silent(bd.diagnose("model = Net()\nmodel.add_module('head', nn.Linear(16, 2))\n"
                        "opt = torch.optim.AdamW(model.parameters(), lr=1e-2)\n" + LOOP, _ns(), engine=engine))


def test_a_head_added_before_the_cell_is_named_at_the_step(engine):
    """No line of the cell put it there (an earlier cell did, after the optimizer): named at the step, a warning."""
    ns = _ns(EARLIER + "model.head = nn.Linear(16, 2)\n")
    f = _only(bd.diagnose(LOOP, ns, engine=engine), "orphan_params")
    assert (f.line, f.module, f.iteration, f.severity, f.evidence["created_line"]) == (4, "model.head", 0, "warning",
                                                                                        None), f
    assert "`model.head` is in none of `opt`'s param groups, while it holds the rest of `model` (144 values)" \
        in f.message


def test_a_frozen_new_head_is_silent(engine):
    _silent(bd.diagnose("model.head = nn.Linear(16, 2)\nmodel.head.requires_grad_(False)\n" + LOOP, _ns(),
                        engine=engine))


def test_a_head_a_second_optimizer_trains_is_silent(engine):
    cell = ("model.head = nn.Linear(16, 2)\nopt_head = torch.optim.SGD(model.head.parameters(), lr=0.1)\n"
            + LOOP.replace("    opt.step()\n", "    opt.step()\n    opt_head.step()\n    opt_head.zero_grad()\n"))
    _silent(bd.diagnose(cell, _ns(), engine=engine))
    # held by an optimizer that does not step in this cell (another cell steps it): not a module nobody trains
    ns = _ns(EARLIER + "model.head = nn.Linear(16, 2)\nopt_head = torch.optim.SGD(model.head.parameters(), lr=0.1)\n")
    _silent(bd.diagnose(LOOP, ns, engine=engine))


def test_a_linear_probe_that_leaves_the_backbone_trainable_is_silent(engine):
    """An optimizer given only the head on purpose: the backbone gets gradients and stays as it is."""
    ns = _ns(EARLIER_HEAD_FIRST.replace("model.parameters()", "model.head.parameters()"))
    _silent(bd.diagnose(LOOP, ns, engine=engine))


GAN = """\
for step in range(3):
    fake = G(z)
    d_loss = F.softplus(D(fake.detach())).mean() + F.softplus(-D(real)).mean()
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = F.softplus(-D(fake)).mean()
    opt_g.zero_grad()
    g_loss.backward()   # (D gets gradients here too: opt_d, not opt_g, steps it)
    opt_g.step()
"""


def test_a_gan_with_two_optimizers_is_silent(engine):
    torch.manual_seed(0)
    G, D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)), nn.Sequential(nn.Linear(6, 8), nn.ReLU(),
                                                                                   nn.Linear(8, 1))
    ns = {"torch": torch, "F": F, "G": G, "D": D, "z": torch.randn(5, 4), "real": torch.randn(5, 6),
          "opt_g": torch.optim.Adam(G.parameters(), lr=1e-3), "opt_d": torch.optim.Adam(D.parameters(), lr=1e-3)}
    _silent(bd.diagnose(GAN, ns, engine=engine))


# ----------------------------------------------------------------------------- PEFT
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


PEFT_LATE = """\
opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
model = get_peft_model(base, LoraConfig(r=2, target_modules=["fc1", "fc2"], lora_dropout=0.0))
""" + LOOP


def _peft_ns() -> dict:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    ns = _ns()
    ns.update(base=MLP(), get_peft_model=peft.get_peft_model, LoraConfig=peft.LoraConfig)
    return ns


def test_lora_adapters_put_on_after_the_optimizer(engine):
    report = bd.diagnose(PEFT_LATE, _peft_ns(), engine=engine)
    f = _only(report, "orphan_params")
    assert (f.line, f.evidence["created"], f.evidence["built_line"], f.iteration) == (2, "peft", 1, 0), \
        _describe(report)
    assert len(f.evidence["not_stepped"]) == 4 and all("lora_" in n for n in f.evidence["not_stepped"])
    assert "Build it after the model is complete (after `get_peft_model`)" in f.message
    # the twin: the optimizer built on the PEFT model
    lines = PEFT_LATE.splitlines(keepends=True)
    _silent(bd.diagnose(lines[1] + lines[0].replace("base.parameters()", "model.parameters()") + "".join(lines[2:]),
                        _peft_ns(), engine=engine))


# ----------------------------------------------------------------------------- a Hugging Face Trainer
HF_PEFT_LATE = """\
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]))
trainer = Trainer(model=model, args=args, train_dataset=train_ds, optimizers=(opt, None))
trainer.train()
"""


def _hf_peft_ns() -> dict:
    peft = pytest.importorskip("peft")
    ns = ll.hf_trainer(steps=3)
    ns.update(get_peft_model=peft.get_peft_model, LoraConfig=peft.LoraConfig)
    return ns


def test_a_trainer_given_an_optimizer_built_before_the_lora_adapters(engine):
    """The optimizer holds the BERT it was built on, which ``get_peft_model`` then froze; the adapters and the
    classifier copy PEFT trains get gradients and are in none of its groups: nothing trains at all."""
    report = bd.diagnose(HF_PEFT_LATE, _hf_peft_ns(), engine=engine)
    f = _only(report, "orphan_params")
    ev = f.evidence
    assert (f.line, f.module, ev["created"], ev["built_line"], ev["optimizer"], f.iteration) == (
        2, "model", "peft", 1, "opt", 0), _describe(report)
    assert len(ev["modules"]) == 9 and ev["modules"][-1] == "model.base_model.model.classifier.modules_to_save"
    assert all(".lora_" in m for m in ev["modules"][:8]) and len(ev["not_stepped"]) == 10
    assert "after line 1 built the optimizer" in f.message and "`trainer.train()` never changes them" in f.message
    assert ev["fix_code"].startswith('opt.add_param_group({"params": [p for p in model.parameters() if '
                                     'p.requires_grad and not any(p is q for g in opt.param_groups')
    # the twins: the optimizer built on the PEFT model; the Trainer's own optimizer (built in train())
    lines = HF_PEFT_LATE.splitlines(keepends=True)
    _silent(bd.diagnose(lines[1] + lines[0] + "".join(lines[2:]), _hf_peft_ns(), engine=engine))
    _silent(bd.diagnose(lines[1] + lines[2].replace(", optimizers=(opt, None)", "") + lines[3], _hf_peft_ns(),
                        engine=engine))


HF_RESIZED = """\
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.resize_token_embeddings(128)
trainer = Trainer(model=model, args=args, train_dataset=train_ds, optimizers=(opt, None))
trainer.train()
"""


def test_embeddings_resized_after_the_optimizer_keep_their_parameter(engine):
    """transformers 5's ``resize_token_embeddings`` gives the embedding's parameter new data and keeps the
    ``nn.Parameter`` object: the optimizer still holds it, and it trains (silent)."""
    model = ll.tiny_gpt2_lm()
    before = model.transformer.wte.weight
    model.resize_token_embeddings(128)
    assert model.transformer.wte.weight is before and before.shape[0] == 128
    _silent(bd.diagnose(HF_RESIZED, ll.hf_trainer(task="lm", steps=3), engine=engine))


def test_a_parameter_put_on_the_model_after_the_optimizer(engine):
    """A learnable temperature (``nn.Parameter`` on the model, CLIP's ``logit_scale``) added after the optimizer."""
    cell = "model.scale = nn.Parameter(torch.ones(()))\n" + LOOP.replace("model(x), y", "model(x) * model.scale, y")
    f = _only(bd.diagnose(cell, _ns(), engine=engine), "orphan_params")
    assert (f.line, f.module, f.evidence["not_stepped"]) == (1, "model.scale", ["model.scale"])
    assert f.evidence["fix_code"].startswith('opt.add_param_group({"params": [model.scale]})')
    # the twin: the parameter put on the model before the optimizer was built
    _silent(bd.diagnose(LOOP.replace("model(x), y", "model(x) * model.scale, y"),
                        _ns(EARLIER.replace("opt =", "model.scale = nn.Parameter(torch.ones(()))\nopt =")),
                        engine=engine))
