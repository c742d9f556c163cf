"""shape_mismatch."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns


def _setup_mnist_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    return _ns(
        images=torch.rand(32, 1, 28, 28),
        labels=torch.randint(0, 10, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_mnist_cnn():
    torch.manual_seed(0)
    model = bm.SmallCNN(1, 10)
    return _ns(
        images=torch.rand(8, 1, 28, 28),
        labels=torch.randint(0, 10, (8,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
    )


def _setup_cell_attention():
    torch.manual_seed(0)
    d = 16
    wq, wk, wv = nn.Linear(32, d), nn.Linear(32, d), nn.Linear(32, d)
    out_proj = nn.Linear(d, 32)
    params = [p for m in (wq, wk, wv, out_proj) for p in m.parameters()]
    return _ns(
        d=d,
        x=torch.randn(4, 8, 32),
        target=torch.randn(4, 8, 32),
        wq=wq,
        wk=wk,
        wv=wv,
        out_proj=out_proj,
        optimizer=torch.optim.Adam(params, lr=1e-3),
    )


SHAPE = [
    _cell(
        "forgot_flatten_images_into_mlp",
        "shape_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(images)  # <-- root cause
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_mnist_mlp,
        module="model.0",
        raises=(RuntimeError, "shapes cannot be multiplied"),
        doc="(B, 1, 28, 28) images given to an MLP expecting (B, 784): forgot .flatten(1).",
    ),
    _in_file(
        "cnn_head_sized_for_32x32",
        "shape_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_mnist_cnn,
        module="model.fc",
        bug="fc_in_features",
        raises=(RuntimeError, "shapes cannot be multiplied (8x784 and 1024x10)"),
        doc="CNN copied from a CIFAR example (32x32) and trained on MNIST (28x28).",
    ),
    _cell(
        "attention_scores_missing_transpose",
        "shape_mismatch",
        """\
        optimizer.zero_grad()
        q, k, v = wq(x), wk(x), wv(x)
        scores = q @ k / math.sqrt(d)  # <-- root cause
        out = out_proj(scores.softmax(-1) @ v)
        loss = F.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        """,
        _setup_cell_attention,
        module=None,
        raises=(RuntimeError, "Expected size for first two dimensions of batch2 tensor"),
        doc="attention written in the cell: q @ k instead of q @ k.transpose(-2, -1).",
    ),
]
