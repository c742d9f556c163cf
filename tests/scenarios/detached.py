"""detached (silent): parameters cut off from the loss never learn."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

import silent_models as sm
from scenario_kit import _cell, _in_silent_file, _ns
from ._setups import _STD_STEP, _setup_with_model


def _setup_encoder_classifier(**extra):
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
    classifier = nn.Linear(8, 3)
    params = list(encoder.parameters()) + list(classifier.parameters())
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        encoder=encoder,
        classifier=classifier,
        optimizer=torch.optim.Adam(params, lr=1e-3),
        **extra,
    )


def _setup_backbone_head():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    head = nn.Linear(16, 3)
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        backbone=backbone,
        head=head,
        optimizer=torch.optim.SGD(list(backbone.parameters()) + list(head.parameters()), lr=0.1),
    )


def _setup_logit_scale():
    torch.manual_seed(0)
    encoder = nn.Linear(10, 8)
    class_emb = nn.Parameter(torch.randn(3, 8))
    logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))  # learnable temperature, CLIP-style
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        encoder=encoder,
        class_emb=class_emb,
        logit_scale=logit_scale,
        optimizer=torch.optim.Adam([*encoder.parameters(), class_emb, logit_scale], lr=1e-3),
    )


def _setup_weight_norm():
    torch.manual_seed(0)
    model = nn.Sequential(sm.WeightNormLinear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


DETACHED = [
    _cell(
        "embeddings_detached_for_logging_then_trained_on",
        "detached",
        """\
        optimizer.zero_grad()
        emb = encoder(x).detach()  # <-- root cause
        emb_norms.append(emb.norm(dim=1).mean().item())
        logits = classifier(emb)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_encoder_classifier(emb_norms=[]),
        module="encoder",
        op="aten::detach",
        mentions=("encoder.0.weight", "encoder.2.weight"),
        doc="embeddings detached to log their norm, and the detached tensor fed to the classifier.",
    ),
    _cell(
        "numpy_round_trip_whitening",
        "detached",
        """\
        optimizer.zero_grad()
        emb = encoder(x)
        emb_np = emb.detach().numpy()  # <-- root cause
        emb_white = torch.from_numpy((emb_np - emb_np.mean(0)) / (emb_np.std(0) + 1e-5))
        loss = F.cross_entropy(classifier(emb_white), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_encoder_classifier,
        module="encoder",
        op="aten::detach",
        mentions=("encoder.0.weight", "encoder.2.weight"),
        doc="per-batch whitening done in numpy (the detach() is what .numpy() demands).",
    ),
    _cell(
        "backbone_forward_inside_no_grad",
        "detached",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            feats = backbone(x)  # <-- root cause
        logits = head(feats)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_backbone_head,
        module="backbone",
        mentions=("backbone.0.weight", "backbone.2.weight"),
        doc="feature extraction under no_grad copied from an inference notebook, while the "
        "optimizer is meant to fine-tune the backbone.",
    ),
    _cell(
        "old_style_dot_data_on_features",
        "detached",
        """\
        optimizer.zero_grad()
        h = backbone(x).data  # <-- root cause
        logits = head(h)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_backbone_head,
        module="backbone",
        mentions=("backbone.0.weight", "backbone.2.weight"),
        doc="`.data` from a PyTorch 0.3-era tutorial.",
    ),
    _cell(
        "learnable_temperature_through_item",
        "detached",
        """\
        optimizer.zero_grad()
        z = F.normalize(encoder(x), dim=-1)
        scale = torch.tensor(logit_scale.exp().item())  # <-- root cause
        logits = scale * z @ F.normalize(class_emb, dim=-1).T
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_logit_scale,
        module=None,
        op="aten::_local_scalar_dense",
        mentions=("logit_scale",),
        doc="CLIP-style learnable temperature turned into a Python float and back.",
    ),
    _in_silent_file(
        "weight_norm_layer_uses_dot_data",
        "detached",
        _STD_STEP,
        _setup_weight_norm,
        module="model.0",
        bug="weight_norm_data",
        mentions=("model.0.v",),
        doc="hand-written weight normalisation reads `self.v.data`: v never learns (g and bias do).",
    ),
    _in_silent_file(
        "warmup_no_grad_left_in_forward",
        "detached",
        _STD_STEP,
        _setup_with_model(sm.WarmupFrozenNet, opt="sgd"),
        module="model.backbone",
        bug="no_grad_backbone",
        mentions=("model.backbone.0.weight", "model.backbone.2.weight"),
        doc="a warm-up freeze written as `with torch.no_grad()` inside forward() and never removed.",
    ),
    _in_silent_file(
        "gate_reduced_with_item_in_forward",
        "detached",
        _STD_STEP,
        _setup_with_model(sm.GatedHead),
        module="model.gate",
        bug="gate_item",
        op="aten::_local_scalar_dense",
        mentions=("model.gate.weight", "model.gate.bias"),
        doc="an input-dependent gate turned into a float with .item() and wrapped back with torch.tensor().",
    ),
    _in_silent_file(
        "linear_probe_detach_left_in_forward",
        "detached",
        _STD_STEP,
        _setup_with_model(sm.LinearProbeLeftover),
        module="model.encoder",
        bug="detach_encoder_output",
        op="aten::detach",
        mentions=("model.encoder.0.weight", "model.encoder.2.weight"),
        doc="`.detach()` copied from a linear-probe evaluation into an end-to-end model.",
    ),
]
