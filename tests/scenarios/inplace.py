"""inplace: in-place writes to a leaf that requires grad, or to a tensor saved for backward."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns
from ._setups import _setup_mlp_classifier, _STD_STEP


LEAF_INPLACE = (RuntimeError, "a leaf Variable that requires grad is being used in an in-place operation")


SAVED_INPLACE = (RuntimeError, "modified by an inplace operation")


def _setup_raw_linear_regression():
    torch.manual_seed(0)
    X = torch.randn(64, 5)
    return _ns(
        X=X,
        y=X @ torch.randn(5, 1) + 0.1 * torch.randn(64, 1),
        w=torch.randn(5, 1, requires_grad=True),
        b=torch.zeros(1, requires_grad=True),
        lr=0.1,
    )


def _setup_residual_autoencoder():
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(16, 16), nn.Linear(16, 16)
    params = list(encoder.parameters()) + list(decoder.parameters())
    return _ns(x=torch.randn(32, 16), encoder=encoder, decoder=decoder, optimizer=torch.optim.Adam(params, lr=1e-3))


def _setup_sigmoid_relu_sequential():
    torch.manual_seed(0)
    # Built from a config like activations=["sigmoid", "relu"] with inplace=True to "save memory".
    model = nn.Sequential(nn.Linear(10, 32), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(32, 2))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 2, (16,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_residual_mlp():
    torch.manual_seed(0)
    model = bm.ResidualMLP(16, 32, 4, depth=1)
    return _ns(
        x=torch.randn(32, 16),
        y=torch.randint(0, 4, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_temperature():
    torch.manual_seed(0)
    model = bm.TemperatureScaledClassifier(16, 4)
    return _ns(
        x=torch.randn(32, 16),
        y=torch.randint(0, 4, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


INPLACE = [
    _cell(
        "leaf_manual_sgd_update_without_no_grad",
        "inplace",
        """\
        pred = X @ w + b
        loss = ((pred - y) ** 2).mean()
        loss.backward()
        w -= lr * w.grad  # <-- root cause
        b -= lr * b.grad
        w.grad.zero_()
        b.grad.zero_()
        """,
        _setup_raw_linear_regression,
        module=None,
        op="aten::sub_",
        raises=LEAF_INPLACE,
        doc="from-scratch linear regression; the manual update is not wrapped in torch.no_grad().",
    ),
    _cell(
        "leaf_weight_noise_injection",
        "inplace",
        """\
        optimizer.zero_grad()
        for p in model.parameters():
            p += noise_std * torch.randn_like(p)  # <-- root cause
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_mlp_classifier,
        module=None,
        op="aten::add_",
        raises=LEAF_INPLACE,
        doc="weight-noise regularisation written as `p += ...` on parameters outside no_grad.",
    ),
    _cell(
        "residual_iadd_on_saved_tanh_output",
        "inplace",
        """\
        optimizer.zero_grad()
        h = torch.tanh(encoder(x))
        h += x  # <-- root cause
        loss = F.mse_loss(decoder(h), x)
        loss.backward()
        optimizer.step()
        """,
        _setup_residual_autoencoder,
        module=None,
        op="aten::add_",
        raises=SAVED_INPLACE,
        doc="residual connection written with `+=`; tanh saved its output for backward.",
    ),
    _cell(
        "inplace_relu_after_sigmoid_in_sequential",
        "inplace",
        """\
        optimizer.zero_grad()
        logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_sigmoid_relu_sequential,
        module="model.2",
        op="aten::relu_",
        raises=SAVED_INPLACE,
        doc="nn.ReLU(inplace=True) directly after nn.Sigmoid overwrites sigmoid's saved output.",
    ),
    _in_file(
        "residual_block_add_after_relu",
        "inplace",
        _STD_STEP,
        _setup_residual_mlp,
        module="model.blocks.0",
        op="aten::add_",
        bug="residual_add_",
        raises=SAVED_INPLACE,
        doc="custom residual block: relu, then `out.add_(identity)` on relu's saved output.",
    ),
    _in_file(
        "leaf_clamp_temperature_in_forward",
        "inplace",
        _STD_STEP,
        _setup_temperature,
        module="model",
        op="aten::clamp_",
        bug="clamp_temperature",
        raises=LEAF_INPLACE,
        doc="learnable temperature kept positive by clamping the Parameter in place in forward.",
    ),
]
