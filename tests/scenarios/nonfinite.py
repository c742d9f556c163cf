"""nonfinite: NaN/Inf made in the forward, only in backward, or brought in by the input data."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns, module_params


def any_nonfinite_grad(ns: dict) -> bool:
    return any(p.grad is not None and not torch.isfinite(p.grad).all() for _, p in module_params(ns))


def nonfinite_loss_or_grad(ns: dict) -> bool:
    loss = ns.get("loss")
    bad_loss = isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all()
    return bad_loss or any_nonfinite_grad(ns)


def _setup_count_features():
    torch.manual_seed(0)
    counts = torch.poisson(torch.full((64, 8), 1.5))  # ~22% zeros
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        counts=counts,
        y=torch.randn(64, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_constant_column():
    torch.manual_seed(0)
    X = torch.randn(64, 6)
    X[:, 5] = 1.0  # an "is_active" flag that happens to be 1 for every row of this batch
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    return _ns(
        X=X,
        y=torch.randint(0, 2, (64,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_naive_softmax():
    torch.manual_seed(0)
    model = bm.NaiveSoftmaxClassifier(784, 10)
    return _ns(
        images=torch.randint(0, 256, (32, 784)).float(),  # raw pixels, never divided by 255
        labels=torch.randint(0, 10, (32,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
    )


def _setup_contrastive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return _ns(
        x=torch.randn(16, 16),
        labels=torch.randint(0, 4, (16,)),
        margin=1.0,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_protonet():
    torch.manual_seed(0)
    model = bm.ProtoNet(16, 8, 4)
    x = torch.randn(32, 16)
    model.init_prototypes(x)
    return _ns(
        x=x,
        y=torch.randint(0, 4, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_nan_features():
    torch.manual_seed(0)
    X_train = torch.randn(128, 6)
    X_train[5, 2] = float("nan")  # missing values read from a CSV
    X_train[40, 0] = float("nan")
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        X_train=X_train,
        y_train=torch.randn(128, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_log_price_targets():
    torch.manual_seed(0)
    prices = torch.rand(64, 1) * 100
    prices[7] = 0.0  # a free item in the catalogue
    y_log = torch.log(prices)  # preprocessing done in an earlier cell: contains -inf
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        x=torch.randn(64, 10),
        y_log=y_log,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


NONFINITE = [
    _cell(
        "log_of_zero_count_features",
        "nonfinite",
        """\
        optimizer.zero_grad()
        feats = torch.log(counts)  # <-- root cause
        pred = model(feats)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_count_features,
        module=None,
        op="aten::log",
        check=nonfinite_loss_or_grad,
        doc="log-transforming count features that contain zeros (should be log1p).",
    ),
    _cell(
        "div_by_zero_standardize_constant_column",
        "nonfinite",
        """\
        optimizer.zero_grad()
        xb = (X - X.mean(0)) / X.std(0)  # <-- root cause
        loss = F.cross_entropy(model(xb), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_constant_column,
        module=None,
        op="aten::div",
        check=nonfinite_loss_or_grad,
        doc="per-batch standardisation without eps; a constant column has std 0 -> 0/0 = NaN.",
    ),
    _in_file(
        "exp_overflow_naive_softmax",
        "nonfinite",
        """\
        optimizer.zero_grad()
        probs = model(images)
        loss = F.nll_loss(torch.log(probs), labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_naive_softmax,
        module="model",
        op="aten::exp",
        bug="exp_overflow",
        check=nonfinite_loss_or_grad,
        doc="hand-written softmax without max-subtraction on unnormalised pixels: exp overflows.",
    ),
    _cell(
        "sqrt_at_zero_pairwise_distance_backward_only",
        "nonfinite",
        """\
        optimizer.zero_grad()
        emb = model(x)
        dist = (emb[:, None, :] - emb[None, :, :]).pow(2).sum(-1).sqrt()  # <-- root cause
        same = labels[:, None] == labels[None, :]
        loss = torch.where(same, dist, F.relu(margin - dist)).mean()
        loss.backward()
        optimizer.step()
        """,
        _setup_contrastive,
        module=None,
        op="aten::sqrt",
        check=lambda ns: torch.isfinite(ns["loss"]).all() and any_nonfinite_grad(ns),
        doc="contrastive loss with a manual pairwise distance: the diagonal is 0, forward is "
        "finite, d sqrt/dx at 0 is inf and the backward produces NaN grads.",
    ),
    _in_file(
        "sqrt_at_zero_prototype_distance_backward_only",
        "nonfinite",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_protonet,
        module="model",
        op="aten::sqrt",
        bug="sqrt_at_zero",
        check=lambda ns: torch.isfinite(ns["loss"]).all() and any_nonfinite_grad(ns),
        doc="prototypes initialised from the batch's own embeddings: distance exactly 0, "
        "NaN only in backward.",
    ),
    _cell(
        "nan_in_input_features",
        "nonfinite",
        """\
        optimizer.zero_grad()
        pred = model(X_train)  # <-- root cause
        loss = F.mse_loss(pred, y_train)
        loss.backward()
        optimizer.step()
        """,
        _setup_nan_features,
        module="model.0",  # the first op that consumes X_train is model.0's linear
        check=nonfinite_loss_or_grad,
        mentions=("X_train",),
        doc="tabular data with missing values (NaN) fed straight to the model.",
    ),
    _cell(
        "inf_in_log_targets",
        "nonfinite",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y_log)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_log_price_targets,
        module=None,
        check=nonfinite_loss_or_grad,
        mentions=("y_log",),
        doc="regression on log(price) where one price is 0: the targets hold -inf.",
    ),
]
