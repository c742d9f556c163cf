"""graph_leak (silent): a tensor kept across runs holds on to its step's autograd graph."""

from __future__ import annotations

import collections

import silent_models as sm
from scenario_kit import _cell, _in_silent_file
from ._setups import _STD_STEP, _setup_classifier, _setup_with_model, _setup_regressor, _setup_train_val


_LEAK_FIX = ".item()"  # the one-line fix every graph_leak message must show


GRAPH_LEAK = [
    _cell(
        "loss_tensor_appended_to_history",
        "graph_leak",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        history.append(loss)  # <-- root cause
        """,
        lambda: _setup_classifier(history=[]),
        module=None,
        runs=2,
        mentions=("history", _LEAK_FIX),
        doc="the classic: a loss curve kept as tensors; each entry keeps its step's graph.",
    ),
    _cell(
        "epoch_loss_accumulated_with_iadd",
        "graph_leak",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        epoch_loss += loss  # <-- root cause
        n_batches += 1
        """,
        lambda: _setup_classifier(epoch_loss=0.0, n_batches=0),
        module=None,
        runs=2,
        mentions=("epoch_loss", _LEAK_FIX),
        doc="`epoch_loss += loss` turns the float into a tensor chaining every step's graph.",
    ),
    _cell(
        "running_mae_metric_kept_as_tensor",
        "graph_leak",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        ema_mae = 0.9 * ema_mae + 0.1 * (pred - y).abs().mean()  # <-- root cause
        """,
        lambda: _setup_regressor(ema_mae=0.0),
        module=None,
        runs=2,
        mentions=("ema_mae", _LEAK_FIX),
        doc="a smoothed MAE for the progress bar computed from `pred` with grad: a graph never backwarded.",
    ),
    _cell(
        "validation_loss_without_no_grad_appended",
        "graph_leak",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        model.eval()
        val_loss = F.cross_entropy(model(x_val), y_val)
        val_losses.append(val_loss)  # <-- root cause
        """,
        _setup_train_val,
        module=None,
        runs=2,
        mentions=("val_losses", _LEAK_FIX),
        doc="evaluation after the step without torch.no_grad(); the kept val loss holds the whole "
        "validation forward's saved activations (never freed by a backward).",
    ),
    _cell(
        "loss_appended_to_defaultdict_of_metrics",
        "graph_leak",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        metrics["train_loss"].append(loss)  # <-- root cause
        """,
        lambda: _setup_classifier(metrics=collections.defaultdict(list)),
        module=None,
        runs=2,
        mentions=("metrics", _LEAK_FIX),
        doc="metrics kept in a defaultdict(list) (a common logging idiom), appended as tensors.",
    ),
    _in_silent_file(
        "module_caches_features_in_attribute_list",
        "graph_leak",
        _STD_STEP,
        _setup_with_model(sm.FeatureCachingNet),
        module="model",
        bug="cache_features",
        runs=2,
        mentions=("model.feature_maps", _LEAK_FIX),
        doc="features kept for a t-SNE plot: `self.feature_maps.append(h)` in forward().",
    ),
    _in_silent_file(
        "module_activation_mean_plain_attribute",
        "graph_leak",
        _STD_STEP,
        _setup_with_model(sm.ActivationMonitorNet),
        module="model",
        bug="act_mean_ema",
        runs=2,
        mentions=("model.act_mean", _LEAK_FIX),
        doc="a monitoring EMA of activations stored as a plain attribute and computed with grad.",
    ),
    _in_silent_file(
        "manual_batchnorm_running_stats_with_graph",
        "graph_leak",
        _STD_STEP,
        _setup_with_model(sm.ManualBNNet),
        module="model.norm",
        bug="running_mean_with_graph",
        runs=2,
        mentions=("model.norm.running_mean", _LEAK_FIX),
        doc="hand-written BatchNorm: running stats updated outside no_grad, so every buffer "
        "carries a graph that reaches back through all earlier steps.",
    ),
    _in_silent_file(
        "logging_closure_keeps_loss_tensors",
        "graph_leak",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        log_loss(loss)
        """,
        lambda: _setup_classifier(log_loss=sm.make_loss_logger()),
        module=None,
        bug="closure_append",
        runs=2,
        mentions=("log_loss", _LEAK_FIX),
        doc="a logging callback from a helper module keeps what it is given in its closure.",
    ),
]
