"""Real training-step patterns users measured with the wrong kind, line or module (issue 12, item 5).

Each situation is run on both engines and asserts the root cause (kind, line, module); next to it,
the correct version of the same step must stay silent (``report.ok``): a false alarm is as bad as a
miss. Models live in this file, so a line inside a model's ``forward`` is ``(this file, line)``.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd
from backward_doctor.capture.native_capture import native_available

ENGINES = ["native", "python"]
HERE = os.path.abspath(__file__)


def _line(marker: str) -> int:
    """The line of this file that carries ``# <marker>``."""
    with open(HERE) as fh:
        hits = [i for i, text in enumerate(fh, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def _run(src: str, ns: dict, engine: str) -> bd.Report:
    if engine == "native" and not native_available(build=True):
        pytest.skip("native recorder unavailable")
    report = bd.diagnose(src, ns, engine=engine)
    assert report.trace.engine == engine
    return report


def _cause(report: bd.Report) -> bd.Finding:
    assert report.findings, "nothing found"
    return report.findings[0]


def _ns(**kw) -> dict:
    return {"torch": torch, "F": F, "nn": nn, "np": np, **kw}


# ----------------------------------------------------------------------------- 1. attention masks
class Encoder(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(x, x, x, key_padding_mask=pad)  # attention call
        return self.head(h).mean(1)


def _enc_ns() -> dict:
    torch.manual_seed(0)
    return _ns(model=Encoder(), x=torch.randn(4, 5, 8), y=torch.randn(4, 1))


@pytest.mark.parametrize("engine", ENGINES)
def test_key_padding_mask_of_the_wrong_length_is_a_shape_mismatch(engine):
    src = ("pad = torch.zeros(4, 6, dtype=torch.bool)   # one column too many\n"
           "loss = F.mse_loss(model(x, pad), y)\n"
           "loss.backward()")
    f = _cause(_run(src, _enc_ns(), engine))
    assert (f.kind, f.file, f.line, f.module) == ("shape_mismatch", HERE, _line("attention call"), "model.attn")
    assert "key_padding_mask" in f.message


@pytest.mark.parametrize("engine", ENGINES)
def test_attn_mask_of_the_wrong_size_is_a_shape_mismatch(engine):
    src = ("causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)\n"
           "h, _ = model.attn(x, x, x, attn_mask=causal)\n"
           "loss = F.mse_loss(model.head(h).mean(1), y)\n"
           "loss.backward()")
    f = _cause(_run(src, _enc_ns(), engine))
    assert (f.kind, f.file, f.line, f.module) == ("shape_mismatch", None, 2, "model.attn")


@pytest.mark.parametrize("engine", ENGINES)
def test_masks_of_the_right_shape_stay_silent(engine):
    src = ("pad = torch.zeros(4, 5, dtype=torch.bool)\n"
           "pad[:, -1] = True\n"
           "loss = F.mse_loss(model(x, pad), y)\n"
           "causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)\n"
           "h, _ = model.attn(x, x, x, attn_mask=causal)\n"
           "loss = loss + h.pow(2).mean()\n"
           "loss.backward()")
    assert _run(src, _enc_ns(), engine).ok


# ----------------------------------------------------------------------------- 2. indexed writes
def _reg_ns() -> dict:
    torch.manual_seed(0)
    return _ns(model=nn.Linear(4, 1), x=torch.randn(8, 4), labels=np.linspace(0.0, 1.0, 4))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("write", ["target[idx] = torch.from_numpy(labels)",
                                   "target.index_put_((idx,), torch.from_numpy(labels))"])
def test_indexed_write_of_float64_values_is_a_dtype_mismatch(engine, write):
    src = ("pred = model(x).squeeze(1)\n"
           "target = torch.zeros(8)\n"
           "idx = torch.arange(0, 8, 2)\n"
           f"{write}\n"
           "loss = F.mse_loss(pred, target)\n"
           "loss.backward()")
    f = _cause(_run(src, _reg_ns(), engine))
    assert (f.kind, f.line, f.op) == ("dtype_mismatch", 4, "aten::index_put_")
    assert f.evidence["destination"] == "float32" and f.evidence["source"] == "float64"


@pytest.mark.parametrize("engine", ENGINES)
def test_indexed_write_of_the_same_dtype_stays_silent(engine):
    src = ("pred = model(x).squeeze(1)\n"
           "target = torch.zeros(8)\n"
           "idx = torch.arange(0, 8, 2)\n"
           "target[idx] = torch.from_numpy(labels).float()\n"
           "loss = F.mse_loss(pred, target)\n"
           "loss.backward()")
    assert _run(src, _reg_ns(), engine).ok


# ----------------------------------------------------------------------------- GANs (3, 4, 6)
def _gan_ns(conv: bool = False) -> dict:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 12))
    if conv:  # a conv discriminator: autograd saves its weight itself (a leaf), not a view of it
        D = nn.Sequential(nn.Unflatten(1, (3, 2, 2)), nn.Conv2d(3, 4, 2), nn.LeakyReLU(0.2), nn.Flatten(),
                          nn.Linear(4, 1))
    else:
        D = nn.Sequential(nn.Linear(12, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    return _ns(G=G, D=D, z=torch.randn(16, 4), real=torch.randn(16, 12), ones=torch.ones(16, 1),
               zeros=torch.zeros(16, 1), opt_G=torch.optim.Adam(G.parameters(), 1e-3),
               opt_D=torch.optim.Adam(D.parameters(), 1e-3), bce=F.binary_cross_entropy_with_logits)


GAN_D_STEP_FIRST = """fake = G(z)
D_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
G_loss = bce(D(fake), ones)
opt_D.zero_grad()
D_loss.backward()
opt_D.step()
opt_G.zero_grad()
G_loss.backward()
opt_G.step()"""


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("conv", [False, True], ids=["mlp", "conv"])
def test_gan_discriminator_step_before_generator_backward_blames_the_step(engine, conv):
    report = _run(GAN_D_STEP_FIRST, _gan_ns(conv), engine)
    f = _cause(report)
    assert "modified by an inplace operation" in report.exception
    assert (f.kind, f.line, f.file) == ("inplace", 6, None)      # opt_D.step(), not G_loss.backward()
    assert f.module == ("D.4" if conv else "D.2")               # the layer whose saved weight changed
    assert f.evidence["backward_line"] == 8 and f.evidence["optimizer"] == "Adam"
    assert all(p.startswith("D.") for p in f.evidence["parameters"])


def _with_opt_D(ns: dict, kind: str) -> dict:
    params = ns["D"].parameters()
    ns["opt_D"] = (torch.optim.SGD(params, 0.1, momentum=0.9, foreach=True) if kind == "foreach"
                   else torch.optim.AdamW(params, 1e-3, fused=True))
    return ns


@pytest.mark.parametrize("engine", ENGINES)
def test_foreach_optimizer_step_before_generator_backward_still_raises_and_blames_the_step(engine):
    # A foreach optimizer's `_foreach_add_` bumps the weights' version counters; under a Python dispatch
    # mode PyTorch forgets to, and the Python tier used to swallow the error (wrong gradients instead).
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        exec(GAN_D_STEP_FIRST, _with_opt_D(_gan_ns(), "foreach"))
    report = _run(GAN_D_STEP_FIRST, _with_opt_D(_gan_ns(), "foreach"), engine)
    assert "modified by an inplace operation" in report.exception
    f = _cause(report)
    assert (f.kind, f.line, f.module, f.op) == ("inplace", 6, "D.2", "aten::_foreach_add_")


@pytest.mark.parametrize("engine", ENGINES)
def test_fused_optimizer_step_before_generator_backward_is_reported_though_nothing_raises(engine):
    report = _run(GAN_D_STEP_FIRST, _with_opt_D(_gan_ns(), "fused"), engine)
    assert report.exception is None  # a fused step does not bump version counters, even without the doctor
    f = _cause(report)
    assert (f.kind, f.severity, f.line, f.module, f.op) == ("inplace", "error", 6, "D", "aten::_fused_adamw_")
    assert "D.2.weight" in f.evidence["parameters"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_gan_in_the_right_order_with_foreach_or_fused_steps_stays_silent(engine, kind):
    src = GAN_D_STEP_FIRST.replace("G_loss = bce(D(fake), ones)\n", "").replace(
        "opt_G.zero_grad()\n", "G_loss = bce(D(fake), ones)\nopt_G.zero_grad()\n")
    assert src.index("opt_D.step()") < src.index("G_loss = ")
    assert _run(src, _with_opt_D(_gan_ns(), kind), engine).ok


@pytest.mark.parametrize("engine", ENGINES)
def test_gan_with_the_generator_loss_recomputed_after_the_d_step_stays_silent(engine):
    src = ("fake = G(z)\n"
           "D_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)\n"
           "opt_D.zero_grad()\n"
           "D_loss.backward()\n"
           "opt_D.step()\n"
           "G_loss = bce(D(fake), ones)\n"
           "opt_G.zero_grad()\n"
           "G_loss.backward()\n"
           "opt_G.step()")
    assert _run(src, _gan_ns(), engine).ok


WGAN_CLIP_EARLY = """fake = G(z).detach()
loss_D = D(fake).mean() - D(real).mean()
for p in D.parameters():
    p.data.clamp_(-0.01, 0.01)
opt_D.zero_grad()
loss_D.backward()
opt_D.step()"""


@pytest.mark.parametrize("engine", ENGINES)
def test_wgan_clipping_between_forward_and_backward_is_an_inplace_error(engine):
    report = _run(WGAN_CLIP_EARLY, _gan_ns(), engine)
    assert report.exception is None  # autograd never notices a write through .data
    f = _cause(report)
    assert (f.kind, f.severity, f.line, f.module, f.op) == ("inplace", "error", 4, "D", "aten::clamp_")
    assert f.evidence["parameters"] == ["D.0.weight", "D.0.bias", "D.2.weight", "D.2.bias"]
    assert "D.2.weight" in f.evidence["read_by_backward"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("critic_steps", [1, 3])
def test_wgan_clipping_after_the_step_stays_silent(engine, critic_steps):
    src = (f"for _ in range({critic_steps}):\n"
           "    fake = G(z).detach()\n"
           "    loss_D = D(fake).mean() - D(real).mean()\n"
           "    opt_D.zero_grad()\n"
           "    loss_D.backward()\n"
           "    opt_D.step()\n"
           "    for p in D.parameters():\n"
           "        p.data.clamp_(-0.01, 0.01)")
    assert _run(src, _gan_ns(), engine).ok


@pytest.mark.parametrize("engine", ENGINES)
def test_in_place_writes_on_fresh_tensors_stay_silent(engine):
    src = ("noise = torch.empty(16, 12).normal_(0, 0.1)\n"
           "noisy = real.clone()\n"
           "noisy.add_(noise)\n"
           "weights = torch.ones(16, 1)\n"
           "weights[::2] = 2.0\n"
           "score = D(noisy)\n"
           "loss = (F.softplus(-score) * weights).mean()\n"
           "opt_D.zero_grad()\n"
           "loss.backward()\n"
           "with torch.no_grad():\n"
           "    for p in D.parameters():\n"
           "        p.clamp_(-1.0, 1.0)\n"
           "opt_D.step()")
    assert _run(src, _gan_ns(), engine).ok


GAN_LEFT_FROZEN = """for p in D.parameters():
    p.requires_grad_(False)
fake = G(z)
G_loss = bce(D(fake), ones)
opt_G.zero_grad()
G_loss.backward()
opt_G.step()
D_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
opt_D.zero_grad()
D_loss.backward()
opt_D.step()"""


@pytest.mark.parametrize("engine", ENGINES)
def test_discriminator_left_frozen_points_at_the_freeze(engine):
    report = _run(GAN_LEFT_FROZEN, _gan_ns(), engine)
    f = _cause(report)
    assert "does not require grad" in report.exception
    assert (f.kind, f.line, f.module) == ("no_grad_path", 2, "D")  # not the `.detach()` of line 8
    assert f.evidence["cut"] == "frozen" and f.evidence["read_line"] == 8


@pytest.mark.parametrize("engine", ENGINES)
def test_discriminator_frozen_with_a_helper_points_at_the_helper_call(engine):
    src = ("def set_requires_grad(nets, flag):\n"
           "    for net in nets:\n"
           "        for p in net.parameters():\n"
           "            p.requires_grad = flag\n"
           "set_requires_grad([D], False)\n"
           + GAN_LEFT_FROZEN.split("\n", 2)[2])
    f = _cause(_run(src, _gan_ns(), engine))
    assert (f.kind, f.line, f.module) == ("no_grad_path", 5, "D")


@pytest.mark.parametrize("engine", ENGINES)
def test_discriminator_frozen_by_an_earlier_cell_points_at_its_use(engine):
    ns = _gan_ns()
    ns["D"].requires_grad_(False)  # the generator's cell froze it and never gave it back
    src = ("fake = G(z)\n"
           "D_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)\n"
           "opt_D.zero_grad()\n"
           "D_loss.backward()\n"
           "opt_D.step()")
    f = _cause(_run(src, ns, engine))
    assert (f.kind, f.line, f.module, f.title) == ("no_grad_path", 2, "D", "Weights left frozen")


@pytest.mark.parametrize("engine", ENGINES)
def test_discriminator_unfrozen_before_its_step_stays_silent(engine):
    src = GAN_LEFT_FROZEN.replace("D_loss = ", "for p in D.parameters():\n    p.requires_grad_(True)\nD_loss = ")
    assert _run(src, _gan_ns(), engine).ok


# ----------------------------------------------------------------------------- 5. argmax cuts
def _cls_ns() -> dict:
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Sequential(nn.Linear(4, 8), nn.ReLU()), "cls": nn.Linear(8, 3),
                           "reg": nn.Linear(8, 5)})
    return _ns(model=model, x=torch.randn(8, 4), y=torch.randint(0, 3, (8,)),
               t=torch.randint(0, 5, (8,)).float(), opt=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("engine", ENGINES)
def test_loss_on_argmax_points_at_the_argmax(engine):
    src = ("logits = model['cls'](model['body'](x))\n"
           "pred = logits.argmax(-1).float()\n"
           "loss = F.mse_loss(pred, y.float())\n"
           "loss.backward()")
    f = _cause(_run(src, _cls_ns(), engine))
    assert (f.kind, f.line, f.op) == ("no_grad_path", 2, "aten::argmax")
    assert f.evidence["cut"] == "nondiff"


@pytest.mark.parametrize("engine", ENGINES)
def test_argmax_cutting_one_head_off_silently_points_at_the_argmax(engine):
    src = ("h = model['body'](x)\n"
           "logits = model['cls'](h)\n"
           "bucket = model['reg'](h).argmax(-1).float()\n"
           "loss = F.cross_entropy(logits, y) + 0.1 * F.mse_loss(bucket, t)\n"
           "opt.zero_grad()\n"
           "loss.backward()\n"
           "opt.step()")
    f = _cause(_run(src, _cls_ns(), engine))
    assert (f.kind, f.line, f.module, f.op) == ("detached", 3, "model.reg", "aten::argmax")
    assert f.evidence["cut"] == "nondiff"


@pytest.mark.parametrize("engine", ENGINES)
def test_argmax_for_accuracy_stays_silent(engine):
    src = ("h = model['body'](x)\n"
           "logits = model['cls'](h)\n"
           "loss = F.cross_entropy(logits, y) + 0.1 * F.mse_loss(model['reg'](h).max(-1).values, t)\n"
           "acc = (logits.argmax(-1) == y).float().mean()\n"
           "opt.zero_grad()\n"
           "loss.backward()\n"
           "opt.step()")
    assert _run(src, _cls_ns(), engine).ok


# ----------------------------------------------------------------------------- 7. parametrizations
def _mlp_ns(weight_norm_first: bool = False) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if weight_norm_first:  # the right order: parametrize, then build the optimizer
        model[0] = nn.utils.parametrizations.weight_norm(model[0])
    return _ns(model=model, x=torch.randn(8, 4), y=torch.randn(8, 1),
               opt=torch.optim.SGD(model.parameters(), lr=0.1))


STEP = "loss = F.mse_loss(model(x), y)\nopt.zero_grad()\nloss.backward()\nopt.step()"


@pytest.mark.parametrize("engine", ENGINES)
def test_weight_norm_after_the_optimizer_is_orphan_params(engine):
    src = "model[0] = nn.utils.parametrizations.weight_norm(model[0])\n" + STEP
    f = _cause(_run(src, _mlp_ns(), engine))
    assert (f.kind, f.line, f.module) == ("orphan_params", 1, "model.0")
    assert f.evidence["not_stepped"] == ["model.0.parametrizations.weight.original0",
                                         "model.0.parametrizations.weight.original1"]
    assert f.evidence["orphaned"] == ["<parameter (8, 4)>"] and f.evidence["step_line"] == 5


@pytest.mark.parametrize("engine", ENGINES)
def test_weight_norm_before_the_cell_but_after_the_optimizer_points_at_the_step(engine):
    ns = _mlp_ns()
    ns["model"][2] = nn.utils.parametrizations.weight_norm(ns["model"][2])  # an earlier cell did it
    f = _cause(_run(STEP, ns, engine))
    assert (f.kind, f.line, f.module) == ("orphan_params", 4, "model.2")
    assert f.evidence["not_stepped"] == ["model.2.parametrizations.weight.original0",
                                         "model.2.parametrizations.weight.original1"]


@pytest.mark.parametrize("engine", ENGINES)
def test_single_tensor_parametrization_after_the_optimizer_stays_silent(engine):
    class Symmetric(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.triu() + w.triu(1).transpose(-1, -2)

    # With one original tensor, register_parametrization keeps the very Parameter the optimizer holds.
    ns = _mlp_ns()
    ns["model"].insert(2, nn.Linear(8, 8))
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
    src = "nn.utils.parametrize.register_parametrization(model[2], 'weight', Symmetric())\n" + STEP
    assert _run(src, {**ns, "Symmetric": Symmetric}, engine).ok


@pytest.mark.parametrize("engine", ENGINES)
def test_layer_replaced_after_the_optimizer_is_orphan_params(engine):
    src = "model[2] = nn.Linear(8, 1)   # a fresh head for fine-tuning\n" + STEP
    f = _cause(_run(src, _mlp_ns(), engine))
    assert (f.kind, f.line, f.module) == ("orphan_params", 1, "model.2")


@pytest.mark.parametrize("engine", ENGINES)
def test_weight_norm_before_the_optimizer_stays_silent(engine):
    assert _run(STEP, _mlp_ns(weight_norm_first=True), engine).ok


# ----------------------------------------------------------------------------- 8. in-place module
class Residual(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.fc, self.act, self.inplace = nn.Linear(8, 8), nn.Tanh(), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        if self.inplace:
            h += x  # residual in place
            return h
        return h + x


class SelfAttention(nn.Module):
    def __init__(self, d: int, inplace: bool) -> None:
        super().__init__()
        self.qkv, self.proj, self.inplace = nn.Linear(d, 3 * d), nn.Linear(d, d), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        att = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)
        if self.inplace:
            att.mul_(0.5)  # temperature in place
        else:
            att = att * 0.5
        return x + self.proj(att @ v)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bad, expected", [((True, True, True), "model.2"), ((True, False, False), "model.0")],
                         ids=["every-block", "first-block"])
def test_inplace_residual_names_the_block_that_raised(engine, bad, expected):
    torch.manual_seed(0)
    ns = _ns(model=nn.Sequential(*[Residual(b) for b in bad], nn.Linear(8, 1)), x=torch.randn(4, 8),
             y=torch.randn(4, 1))
    f = _cause(_run("loss = F.mse_loss(model(x), y)\nloss.backward()", ns, engine))
    assert (f.kind, f.file, f.line, f.module, f.op) == ("inplace", HERE, _line("residual in place"), expected,
                                                        "aten::add_")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bad, expected", [((True, True), "model.1"), ((True, False), "model.0")],
                         ids=["every-layer", "first-layer"])
def test_inplace_in_attention_names_the_layer_that_raised(engine, bad, expected):
    torch.manual_seed(0)
    ns = _ns(model=nn.Sequential(*[SelfAttention(8, b) for b in bad]), x=torch.randn(2, 5, 8))
    f = _cause(_run("loss = model(x).pow(2).mean()\nloss.backward()", ns, engine))
    assert (f.kind, f.file, f.line, f.module, f.op) == ("inplace", HERE, _line("temperature in place"), expected,
                                                        "aten::mul_")


@pytest.mark.parametrize("engine", ENGINES)
def test_out_of_place_residual_and_attention_stay_silent(engine):
    torch.manual_seed(0)
    ns = _ns(model=nn.Sequential(Residual(False), Residual(False), nn.Unflatten(1, (1, 8)), SelfAttention(8, False)),
             x=torch.randn(4, 8))
    assert _run("loss = model(x).pow(2).mean()\nloss.backward()", ns, engine).ok
