"""broadcast (silent): a loss over silently broadcast shapes."""

from __future__ import annotations

import torch
import torch.nn as nn

import silent_models as sm
from scenario_kit import _cell, _in_silent_file, _ns


def _setup_flat_targets():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randn(16),  # targets as a flat vector (a pandas Series)
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_column_targets():
    ns = _setup_flat_targets()
    ns["y_col"] = ns.pop("y")[:, None]  # df[["price"]].values: a (N, 1) column
    return ns


def _setup_rmse():
    ns = _setup_flat_targets()
    ns["criterion"] = sm.RMSELoss()
    return ns


def _setup_price_regressor():
    torch.manual_seed(0)
    model = sm.PriceRegressor(10, 16)
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randn(16),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


_SHAPES = ("[16, 1]", "[16]", "[16, 16]")


BROADCAST = [
    _cell(
        "mse_loss_column_prediction_flat_target",
        "broadcast",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_flat_targets,
        module=None,
        op="aten::mse_loss",
        mentions=_SHAPES + ("squeeze",),
        doc="Linear(..., 1) gives (N, 1); the targets are (N,): mse_loss compares all pairs.",
    ),
    _cell(
        "squared_error_written_by_hand",
        "broadcast",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = ((pred - y) ** 2).mean()  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_flat_targets,
        module=None,
        op="aten::sub",
        mentions=_SHAPES + ("squeeze",),
        doc="the same bug in a hand-written MSE.",
    ),
    _cell(
        "flat_prediction_column_target",
        "broadcast",
        """\
        optimizer.zero_grad()
        pred = model(x).squeeze(-1)
        loss = F.mse_loss(pred, y_col)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_column_targets,
        module=None,
        op="aten::mse_loss",
        mentions=("[16]", "[16, 1]", "[16, 16]"),
        doc="the prediction was squeezed, the targets were loaded as a (N, 1) column.",
    ),
    _in_silent_file(
        "rmse_criterion_module",
        "broadcast",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = criterion(pred, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_rmse,
        module="criterion",
        bug="rmse_broadcast",
        op="aten::sub",
        mentions=_SHAPES,
        doc="a custom RMSE loss module computes (pred - target) with mismatched shapes.",
    ),
    _in_silent_file(
        "model_returns_its_own_l1_loss",
        "broadcast",
        """\
        optimizer.zero_grad()
        pred, loss = model(x, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_price_regressor,
        module="model",
        bug="l1_broadcast",
        mentions=_SHAPES,
        doc="the model computes F.l1_loss on its (N, 1) output and the (N,) targets.",
    ),
]
