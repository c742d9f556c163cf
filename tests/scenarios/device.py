"""device_mismatch (the ``meta`` device stands in for cuda)."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns


DEVICE_ERR = (RuntimeError, "is not on the expected device")  # meta-vs-cpu wording


def _setup_model_on_device():
    torch.manual_seed(0)
    device = torch.device("meta")  # stand-in for torch.device("cuda") on a CPU-only box
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    return _ns(
        device=device,
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_noise_layer_on_device():
    torch.manual_seed(0)
    device = torch.device("meta")  # stand-in for "cuda"
    model = nn.Sequential(nn.Linear(10, 32), bm.GaussianNoise(0.1), nn.ReLU(), nn.Linear(32, 3)).to(device)
    return _ns(
        device=device,
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


DEVICE = [
    _cell(
        "model_on_device_batch_left_on_cpu",
        "device_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_model_on_device,
        module="model.0",
        raises=DEVICE_ERR,
        doc="model.to(device) but the batch was never moved.",
    ),
    _cell(
        "targets_left_on_cpu",
        "device_mismatch",
        """\
        optimizer.zero_grad()
        xb = x.to(device)
        logits = model(xb)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_model_on_device,
        module=None,
        raises=DEVICE_ERR,
        doc="inputs moved to the device, labels forgotten.",
    ),
    _in_file(
        "noise_layer_creates_tensor_on_cpu",
        "device_mismatch",
        """\
        optimizer.zero_grad()
        xb, yb = x.to(device), y.to(device)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        """,
        _setup_noise_layer_on_device,
        module="model.1",
        bug="noise_device",
        raises=DEVICE_ERR,
        doc="custom GaussianNoise layer uses torch.randn(x.shape) instead of randn_like(x).",
    ),
]
