"""Issue 48: bugs that never crash, each named at the user's line with the iteration, in the user's terms, with
the fix as code, and silent on its correct twin. Plain loops in a cell (and models defined in a file of their
own, as a notebook's cell defines them) on both engines; one library loop each where it applies.

``loss_on_probabilities``: a loss that takes logits fed a softmax/sigmoid output (a double softmax), and the
mirror mistakes (``nll_loss`` on raw logits or on probabilities, ``binary_cross_entropy`` on raw logits).

``train_eval_mode``: an evaluation under ``torch.no_grad()`` on a model left in ``train()`` mode (dropout active,
batch-norm statistics updated), and training steps on a model left in ``eval()`` mode.
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


def _classifier_ns(model: nn.Module | None = None, classes: int = 4) -> dict:
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))
    return {"torch": torch, "nn": nn, "F": F, "model": model, "x": torch.randn(6, 8),
            "y": torch.randint(0, classes, (6,)), "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


def _loop(body: str) -> str:
    """A 3-step training loop around ``body`` (lines that set ``loss``), indented in the loop."""
    lines = "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return f"for step in range(3):\n{lines}    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"


# ----------------------------------------------------------------------------- cross_entropy on softmax
CE_ON_SOFTMAX = _loop("probs = F.softmax(model(x), dim=-1)\nloss = F.cross_entropy(probs, y)")
CE_ON_LOGITS = _loop("logits = model(x)\nloss = F.cross_entropy(logits, y)\n"
                     "probs = F.softmax(logits, dim=-1)  # for accuracy")


def test_cross_entropy_on_softmax_output_is_named_at_the_softmax_line(engine):
    report = bd.diagnose(CE_ON_SOFTMAX, _classifier_ns(), engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert (f.line, f.file, f.iteration, f.op) == (2, None, 0, "aten::_softmax"), _describe(report)
    assert f.evidence["problem"] == "double_softmax" and f.evidence["loss_line"] == 3
    assert f.evidence["fix_code"] == "probs = model(x)  # logits: the loss applies log_softmax itself"
    assert "double softmax" in f.message and "with 4 classes it can never go below 0.74" in f.message
    assert f.location() == "cell line 2, in iteration 0 of the loop at line 1 (step = 0)"

    _silent(bd.diagnose(CE_ON_LOGITS, _classifier_ns(), engine=engine))


SOFTMAX_NET = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, softmax=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)
        self.softmax = softmax

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x)))
        if self.softmax:
            return F.softmax(out, dim=1)  # <-- probabilities "for the user"
        return out
"""


def test_softmax_inside_the_model_with_cross_entropy_loss_in_the_cell(engine):
    cell = _loop("loss = criterion(model(x), y)")
    for softmax in (True, False):
        ns = ll.define(SOFTMAX_NET, {}, name="softmax_net")
        ns.update(_classifier_ns(ns["Net"](softmax=softmax), classes=5), criterion=nn.CrossEntropyLoss())
        report = bd.diagnose(cell, ns, engine=engine)
        if not softmax:
            _silent(report)
            continue
        f = _only(report, "loss_on_probabilities")
        assert f.line == ll.marked_line(ns, "Net", "# <-- probabilities") and f.file == ll.defined_in(ns, "Net")
        assert f.function == "Net.forward" and f.iteration == 0 and f.cell_line == 2, _describe(report)
        assert f.evidence["fix_code"] == "return out  # logits: the loss applies log_softmax itself"
        assert "with 5 classes" in f.message and "`loss = criterion(model(x), y)`" in f.message


def test_a_softmax_module_at_the_end_of_a_sequential(engine):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Softmax(dim=1))
    report = bd.diagnose(_loop("loss = F.cross_entropy(model(x), y)"), _classifier_ns(model), engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert (f.line, f.module, f.iteration) == (2, "model.3", 0), _describe(report)
    assert f.evidence["fix_code"] == "model[3] = nn.Identity()  # logits: the loss applies log_softmax itself"
    assert "in `model.3`" in f.message


ATTENTION = """\
for step in range(3):
    q, k, v = wq(x), wk(x), wv(x)
    att = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1)  # attention weights, not predictions
    logits = head((att @ v).mean(1))
    loss = F.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_attention_softmax_before_a_cross_entropy_on_logits_stays_silent(engine):
    torch.manual_seed(0)
    layers = {name: nn.Linear(16, 16) for name in ("wq", "wk", "wv")} | {"head": nn.Linear(16, 4)}
    params = [p for m in layers.values() for p in m.parameters()]
    ns = {"torch": torch, "F": F, **layers, "x": torch.randn(3, 5, 16), "y": torch.randint(0, 4, (3,)),
          "opt": torch.optim.SGD(params, lr=0.1)}
    _silent(bd.diagnose(ATTENTION, ns, engine=engine))


DISTILL = _loop("""\
s, t = model(x), teacher(x).detach()
soft = F.kl_div(F.log_softmax(s / 2, dim=-1), F.softmax(t / 2, dim=-1), reduction="batchmean")
loss = F.cross_entropy(s, F.softmax(t, dim=-1)) + soft + F.cross_entropy(s, y, label_smoothing=0.1)""")


def test_softmax_as_soft_targets_of_distillation_stays_silent(engine):
    ns = _classifier_ns()
    ns["teacher"] = nn.Linear(8, 4)
    _silent(bd.diagnose(DISTILL, ns, engine=engine))


# ----------------------------------------------------------------------------- nll_loss
def test_nll_loss_on_softmax_and_on_raw_logits_and_on_log_softmax(engine):
    report = bd.diagnose(_loop("p = model(x).softmax(dim=1)\nloss = F.nll_loss(p, y)"), _classifier_ns(),
                         engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert (f.line, f.iteration, f.evidence["problem"]) == (2, 0, "nll_on_probabilities"), _describe(report)
    assert f.evidence["fix_code"] == "p = model(x).log_softmax(dim=1)" and "log-probabilities" in f.message

    report = bd.diagnose(_loop("out = model(x)\nloss = nn.NLLLoss()(out, y)"), _classifier_ns(), engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert (f.line, f.iteration, f.evidence["problem"]) == (3, 0, "nll_on_logits"), _describe(report)
    assert f.op == "aten::nll_loss_forward" and f.evidence["source_op"] == "aten::addmm"
    assert f.evidence["fix_code"] == "loss = nn.CrossEntropyLoss()(out, y)" and "goes negative" in f.message

    _silent(bd.diagnose(_loop("logp = F.log_softmax(model(x), dim=1)\nloss = F.nll_loss(logp, y)"),
                        _classifier_ns(), engine=engine))
    _silent(bd.diagnose(_loop("p = F.softmax(model(x), dim=1)\nloss = F.nll_loss(torch.log(p + 1e-8), y)"),
                        _classifier_ns(), engine=engine))


# ----------------------------------------------------------------------------- binary cross entropy
def _binary_ns(head_bias: float = 0.0) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    with torch.no_grad():  # raw scores near the bias: inside [0, 1] when it is 0.5 (BCE then raises nothing)
        model.weight.uniform_(-0.01, 0.01)
        model.bias.fill_(head_bias)
    return {"torch": torch, "nn": nn, "F": F, "model": model, "x": torch.rand(6, 8), "yb": torch.rand(6, 3).round(),
            "opt": torch.optim.SGD(model.parameters(), lr=0.01)}


def test_bce_with_logits_on_a_sigmoid_output(engine):
    report = bd.diagnose(_loop("p = torch.sigmoid(model(x))\nloss = F.binary_cross_entropy_with_logits(p, yb)"),
                         _binary_ns(), engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert (f.line, f.iteration, f.evidence["problem"], f.op) == (2, 0, "double_sigmoid", "aten::sigmoid")
    assert f.evidence["fix_code"] == "p = model(x)  # logits: the loss applies the sigmoid itself"
    assert "between 0.5 and 0.73" in f.message

    _silent(bd.diagnose(_loop("loss = F.binary_cross_entropy_with_logits(model(x), yb)"), _binary_ns(),
                        engine=engine))
    _silent(bd.diagnose(_loop("loss = nn.BCELoss()(torch.sigmoid(model(x)), yb)"), _binary_ns(), engine=engine))


def test_bce_on_raw_scores_that_happen_to_lie_in_0_1(engine):
    report = bd.diagnose(_loop("loss = F.binary_cross_entropy(model(x), yb)"), _binary_ns(0.5), engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert (f.line, f.iteration, f.evidence["problem"]) == (2, 0, "bce_on_logits"), _describe(report)
    assert f.evidence["fix_code"] == "loss = F.binary_cross_entropy_with_logits(model(x), yb)"
    _silent(bd.diagnose(_loop("loss = F.binary_cross_entropy(model(x).sigmoid(), yb)"), _binary_ns(0.5),
                        engine=engine))


# ----------------------------------------------------------------------------- a library loop: Lightning fit
LIT_SOFTMAX = ll.LIT_MODULE.replace("        loss = F.cross_entropy(logits, y)\n",
                                    "        probs = F.softmax(logits, dim=-1)  # <-- probabilities\n"
                                    "        loss = F.cross_entropy(probs, y)\n")


def test_lightning_training_step_with_softmax_before_cross_entropy(engine):
    assert LIT_SOFTMAX != ll.LIT_MODULE
    ns = ll.lit_fit(LIT_SOFTMAX, steps=3)
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine)
    f = _only(report, "loss_on_probabilities")
    assert f.line == ll.marked_line(ns, "LitClassifier", "# <-- probabilities"), _describe(report)
    assert f.function == "LitClassifier.training_step" and f.iteration == 0, _describe(report)
    assert f.evidence["fix_code"] == "probs = logits  # logits: the loss applies log_softmax itself"

    _silent(bd.diagnose(ll.LIT_FIT, ll.lit_fit(steps=3), engine=engine))


# ----------------------------------------------------------------------------- train() / eval() mode
def _bn_ns() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
    return {"torch": torch, "nn": nn, "F": F, "model": model, "x": torch.randn(6, 8), "y": torch.randint(0, 4, (6,)),
            "xv": torch.randn(5, 8), "yv": torch.randint(0, 4, (5,)),
            "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


EVAL_IN_TRAIN_MODE = """\
for step in range(3):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        acc = (model(xv).argmax(1) == yv).float().mean()
"""
EVAL_IN_EVAL_MODE = EVAL_IN_TRAIN_MODE.replace(
    "    with torch.no_grad():\n", "    model.eval()\n    with torch.no_grad():\n") + "    model.train()\n"


def test_evaluation_under_no_grad_in_training_mode(engine):
    ns = _bn_ns()
    running_mean = ns["model"][1].running_mean.clone()
    report = bd.diagnose(EVAL_IN_TRAIN_MODE, ns, engine=engine)
    f = _only(report, "train_eval_mode")
    assert (f.line, f.file, f.iteration, f.severity) == (7, None, 0, "warning"), _describe(report)
    assert f.evidence["problem"] == "eval_in_train_mode" and f.evidence["module"] == "model"
    assert (f.evidence["dropout_active"], f.evidence["batchnorm_training"]) == (1, 1)
    assert f.evidence["fix_code"] == ("model.eval()  # dropout off, batch norm on its running statistics\n"
                                      "with torch.no_grad():\n"
                                      "    acc = (model(xv).argmax(1) == yv).float().mean()\n"
                                      "model.train()  # back to training mode before the next step")
    assert "1 dropout module(s) and 1 batch-norm module(s) were in training mode" in f.message
    assert "running mean and variance from the evaluation data" in f.message
    assert not torch.equal(ns["model"][1].running_mean, running_mean)  # (what the message says happened)

    _silent(bd.diagnose(EVAL_IN_EVAL_MODE, _bn_ns(), engine=engine))


def test_a_validation_cell_without_eval(engine):
    cell = "with torch.no_grad():\n    val_loss = F.cross_entropy(model(xv), yv)\n"
    report = bd.diagnose(cell, _bn_ns(), engine=engine)
    f = _only(report, "train_eval_mode")
    assert (f.line, f.iteration, f.evidence["problem"]) == (2, None, "eval_in_train_mode"), _describe(report)
    assert "model.train()" not in f.evidence["fix_code"]  # nothing trains after it in this cell

    ns = _bn_ns()
    ns["model"].eval()
    _silent(bd.diagnose(cell, ns, engine=engine))


TRAIN_IN_EVAL_MODE = """\
for epoch in range(3):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(xv).argmax(1) == yv).float().mean()
"""
TRAIN_IN_TRAIN_MODE = "for epoch in range(3):\n    model.train()\n" + TRAIN_IN_EVAL_MODE.split("\n", 1)[1]


def test_training_steps_after_an_evaluation_that_left_the_model_in_eval_mode(engine):
    report = bd.diagnose(TRAIN_IN_EVAL_MODE, _bn_ns(), engine=engine)
    f = _only(report, "train_eval_mode")
    assert (f.line, f.iteration, f.evidence["problem"]) == (2, 1, "train_in_eval_mode"), _describe(report)
    assert "`model.eval()` at line 6 was never undone by `model.train()`" in f.message
    assert "1 dropout module(s) and 1 batch-norm module(s) in eval mode" in f.message
    assert f.evidence["fix_code"] == ("model.train()  # dropout and batch norm back in training mode\n"
                                      "loss = F.cross_entropy(model(x), y)")
    assert f.location() == "cell line 2, in iteration 1 of the loop at line 1 (epoch = 1)"

    _silent(bd.diagnose(TRAIN_IN_TRAIN_MODE, _bn_ns(), engine=engine))


FROZEN_BN = _loop("model.train()\nmodel[1].eval()  # batch norm frozen on purpose\nloss = F.cross_entropy(model(x), y)")
ADVERSARIAL = """\
for step in range(3):
    model.eval()
    delta = torch.zeros_like(x, requires_grad=True)
    grad, = torch.autograd.grad(F.cross_entropy(model(x + delta), y), delta)
    x_adv = (x + 0.1 * grad.sign()).detach()
    model.train()
    loss = F.cross_entropy(model(x_adv), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
MEAN_TEACHER = _loop("""\
with torch.no_grad():
    target = teacher(x).softmax(dim=-1)  # the teacher in train mode, its output a target
loss = F.cross_entropy(model(x), target)""")


def test_no_grad_and_eval_mode_forwards_that_are_part_of_training_stay_silent(engine):
    _silent(bd.diagnose(FROZEN_BN, _bn_ns(), engine=engine))
    _silent(bd.diagnose(ADVERSARIAL, _bn_ns(), engine=engine))
    ns = _bn_ns()
    ns["teacher"] = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 4))
    _silent(bd.diagnose(MEAN_TEACHER, ns, engine=engine))


# ----------------------------------------------------------------------------- a library loop: Lightning fit
LIT_PROBE = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitProbe(pl.LightningModule):
    def __init__(self, probe_in_eval_mode=False):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(32, 5))
        self.x_probe = torch.randn(8, 16)
        self.probe_in_eval_mode = probe_in_eval_mode

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.probe_in_eval_mode:
            self.net.eval()
        with torch.no_grad():
            self.probe = self.net(self.x_probe).softmax(-1).max(-1).values.mean()  # <-- a quick probe
        self.net.train()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_lightning_probe_in_training_mode_and_lightnings_own_validation(engine):
    cell = "trainer.fit(model, loader, val_loader)\n"
    fit = dict(module_source=LIT_PROBE, module_name="LitProbe", steps=4,
               trainer_kwargs={"limit_val_batches": 2, "val_check_interval": 2})
    ns = ll.lit_fit(**fit)
    ns["val_loader"] = ll.xy_loader(n=16)
    report = bd.diagnose(cell, ns, engine=engine)
    f = _only(report, "train_eval_mode")
    assert f.line == ll.marked_line(ns, "LitProbe", "# <-- a quick probe"), _describe(report)
    assert f.function == "LitProbe.training_step" and f.iteration == 0 and f.evidence["module"] == "model.net"
    assert f.evidence["problem"] == "eval_in_train_mode"

    # the probe in eval mode, and Lightning's validation (eval() and no gradients): silent
    ns = ll.lit_fit(**fit | {"module_kwargs": {"probe_in_eval_mode": True}})
    ns["val_loader"] = ll.xy_loader(n=16)
    report = bd.diagnose(cell, ns, engine=engine)
    _silent(report)
    assert any(not m.training and not m.grad_enabled for m in report.trace.module_modes), report.trace.module_modes
