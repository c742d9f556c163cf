"""amp_misuse: mixed precision misused (on the CPU: ``torch.autocast("cpu", dtype=torch.bfloat16)`` and
``torch.amp.GradScaler("cpu")``), and used right.

Silent (``AMP_MISUSE``, ``scenarios.silent``): clipping the gradients before ``scaler.unscale_()``
(Pytorch-UNet#468), bf16 weights stepped by AdamW at a small learning rate (updates round away), a
GradScaler whose scale keeps falling because every step overflows. Raising (``AMP_CROSSING``, the raising
families): a tensor autocast made, used after the ``with`` block by a float32 layer (pytorch/examples#1196:
"mat1 and mat2 must have the same dtype"). Correct (``AMP_CORRECT``): the documented GradScaler recipe with
``unscale_`` before clipping, fp32 master weights under autocast with AdamW at a small learning rate, and
autocast outputs cast back with ``.float()``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _in_silent_file, _ns
from .silent_correct import _silent
from ._setups import _setup_amp_classifier

_DTYPE_ERR = (RuntimeError, "must have the same dtype")


def _setup_loader(dtype=torch.float32, opt="sgd", lr=0.1):
    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3))
        xs, ys = torch.randn(6, 8, 10), torch.randint(0, 3, (6, 8))
        model = model.to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd" else \
            torch.optim.AdamW(model.parameters(), lr=lr)
        return _ns(model=model, optimizer=optimizer, loader=list(zip(xs.to(dtype), ys)),
                   scaler=torch.amp.GradScaler("cpu"))
    return setup


def _setup_split():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    head = nn.Linear(32, 3)
    return _ns(backbone=backbone, head=head, x=torch.randn(8, 10), y=torch.randint(0, 3, (8,)),
               optimizer=torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1))


def _setup_half_autocast():
    torch.manual_seed(0)
    model = bm.HalfAutocastClassifier()
    return _ns(model=model, x=torch.randn(8, 12), y=torch.randint(0, 4, (8,)),
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


_AMP_LOOP = """\
for xb, yb in loader:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(xb), yb)
    scaler.scale(loss).backward()
{clip}
    scaler.step(optimizer)
    scaler.update()
"""

AMP_MISUSE = [
    _cell(
        "amp_clip_before_unscale",
        "amp_misuse",
        _AMP_LOOP.format(clip="    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <-- root cause"),
        _setup_loader(),
        module=None,
        mentions=("65536", "scaler.unscale_(optimizer)", "READY"),
        doc="the GradScaler recipe with clipping, but clip_grad_norm_ before scaler.unscale_: max_norm is "
        "compared with the norm of gradients 65536 times too large.",
    ),
    _cell(
        "bf16_weights_adamw_small_lr",
        "amp_misuse",
        """\
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb).float(), yb)
            loss.backward()
            optimizer.step()  # <-- root cause
        """,
        _setup_loader(dtype=torch.bfloat16, opt="adamw", lr=1e-5),
        module=None,
        mentions=("bfloat16", "unchanged", "model.1.weight", "float32"),
        doc="model.to(torch.bfloat16) to save memory, AdamW at a fine-tuning learning rate: the LayerNorm "
        "weights (1.0) can only move in steps of 2**-7, so every update rounds back.",
    ),
    _cell(
        "grad_scaler_scale_keeps_falling",
        "amp_misuse",
        """\
        for step in range(8):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            probs = logits.float().softmax(-1)
            loss = -torch.log(probs.gather(1, y[:, None])).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # <-- root cause
            scaler.update()
        """,
        _setup_amp_classifier(scale_inputs=1e4),
        module=None,
        also=("nonfinite",),
        mentions=("8 optimizer steps in a row", "aten::log"),
        doc="raw inputs saturate the logits, a hand-written NLL takes log(0) = -inf every step: the scaler "
        "skips every step and halves its scale 8 times.",
    ),
    _in_silent_file(
        "amp_helper_clip_before_unscale",
        "amp_misuse",
        """\
        for xb, yb in loader:
            sm.amp_clip_step(model, optimizer, scaler, xb, yb)
        """,
        _setup_loader(),
        module=None,
        bug="amp_clip_before_unscale",
        mentions=("65536", "unscale_"),
        doc="the clipping step lives in the project's train.py.",
    ),
]

AMP_CROSSING = [
    _cell(
        "autocast_features_into_fp32_head",
        "amp_misuse",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            feats = backbone(x)
        logits = head(feats)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_split,
        module="head",
        op="aten::addmm",
        raises=_DTYPE_ERR,
        doc="only the backbone under autocast; its bf16 features meet the fp32 head after the block.",
    ),
    _in_file(
        "autocast_inside_forward_head_outside",
        "amp_misuse",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_half_autocast,
        module="model.head",
        bug="autocast_crossing",
        op="aten::addmm",
        raises=_DTYPE_ERR,
        doc="the model's forward (models.py) closes its autocast block before its head.",
    ),
]

AMP_CORRECT = [
    _silent(
        "amp_unscale_then_clip",
        _AMP_LOOP.format(clip="    scaler.unscale_(optimizer)\n"
                              "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"),
        _setup_loader(),
    ),
    _silent(
        "amp_fp32_master_weights_adamw_small_lr",
        """\
        for xb, yb in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(xb)
            loss = F.cross_entropy(logits.float(), yb)
            loss.backward()
            optimizer.step()
        """,
        _setup_loader(opt="adamw", lr=1e-5),
    ),
    _silent(
        "autocast_features_cast_back",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            feats = backbone(x)
        feats = feats.float()
        logits = head(feats)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_split,
    ),
]
