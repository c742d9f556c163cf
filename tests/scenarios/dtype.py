"""dtype_mismatch."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns


def _setup_numpy_features():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    return _ns(
        X_np=rng.normal(size=(64, 10)),  # float64, as numpy / pandas give it
        y=torch.randint(0, 3, (64,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_fourier():
    torch.manual_seed(0)
    model = bm.FourierFeatureNet(32, 64)
    return _ns(
        coords=torch.rand(256, 2),
        rgb=torch.rand(256, 3),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_int32_labels():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    return _ns(
        x=torch.randn(64, 10),
        y=torch.from_numpy(rng.integers(0, 3, size=64).astype(np.int32)),  # labels saved as int32
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


DTYPE = [
    _cell(
        "float64_numpy_features_into_float32_model",
        "dtype_mismatch",
        """\
        optimizer.zero_grad()
        xb = torch.from_numpy(X_np)
        logits = model(xb)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_numpy_features,
        module="model.0",
        raises=(RuntimeError, "must have the same dtype"),
        doc="numpy arrays default to float64; torch.from_numpy keeps it.",
    ),
    _in_file(
        "float64_buffer_in_fourier_features",
        "dtype_mismatch",
        """\
        optimizer.zero_grad()
        pred = model(coords)
        loss = F.mse_loss(pred, rgb)
        loss.backward()
        optimizer.step()
        """,
        _setup_fourier,
        module="model.encoding",
        bug="float64_buffer",
        raises=(RuntimeError, "same dtype"),
        doc="random Fourier projection drawn with numpy and registered as a float64 buffer.",
    ),
    _cell(
        "int32_class_labels",
        "dtype_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_int32_labels,
        module=None,
        # "expected target dtype to be Long or Byte, but got Int" (2.13), "expected scalar type Long but found
        # Int" (2.10): the words both say (tests/test_torch_versions.py pins the newer wording)
        raises=(RuntimeError, "Long"),
        doc="class labels stored as int32 (np.int32); cross_entropy wants int64.",
    ),
]
