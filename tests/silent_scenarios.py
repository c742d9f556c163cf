"""Silent training bugs across runs (issue 3), as plain data (no pytest here).

Nothing in these cells raises.  Each :class:`SilentScenario` is one notebook
cell (``source``) plus a ``setup()`` building the namespace it runs in; the cell
is run ``runs`` times in that one namespace (the doctor keeps a per-cell
history, so a second run of the same source in the same dict is "the same
cell run again") and the *last* report must contain a finding of ``kind`` at
``line`` / ``file`` / ``module`` (and ``op`` when set).

Conventions (as in ``tests/scenarios.py``)
------------------------------------------
* Cell lines are 1-based lines of ``source``; the expected one carries the
  trailing comment ``# <-- root cause``.  For ``amp_skipped`` (informational)
  that is the ``scaler.step`` line the issue asks for.
* File-side scenarios (the bug lives in ``tests/silent_models.py``) have
  ``file`` = the absolute path of that file and ``line`` = the line of its
  ``# BUG:<name>`` marker.
* ``mentions``: strings the finding's message must contain *outside the code it
  quotes* -- the variable that holds a leak, the starved parameters, the
  shapes, and the one-line fix.
* ``known_engine_gaps``: ``{aspect: reason}`` for aspects (``"location"``,
  ``"message"``, ``"silent"``) where the engine is known to disagree with the
  issue; the tests mark exactly those ``xfail(strict=True)``.
* ``SILENT`` scenarios (``kind`` None) must give ``report.findings == []`` on
  each of ``max(3, runs)`` runs.
* Every setup seeds ``torch.manual_seed(0)`` first, so two calls give
  bit-identical namespaces.
"""

from __future__ import annotations

import collections
import copy
import math
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # imported as tests.silent_scenarios (repo root on sys.path) ...
    from . import silent_models as sm
except ImportError:  # ... or as a top-level module (tests/ on sys.path)
    import silent_models as sm

KINDS = ("graph_leak", "stale_grad", "detached", "broadcast", "amp_skipped")

ROOT_MARKER = "# <-- root cause"
SILENT_MODELS_FILE = sm.PATH
bug_line = sm.bug_line


def cell_line(source: str, marker: str = ROOT_MARKER) -> int:
    """1-based line of ``source`` carrying ``marker`` (exactly one must)."""
    hits = [i for i, text in enumerate(source.splitlines(), start=1) if marker in text]
    if len(hits) != 1:
        raise LookupError(f"{marker!r} found {len(hits)} times in cell source")
    return hits[0]


@dataclass
class SilentScenario:
    name: str
    kind: Optional[str]  # None for must-stay-silent scenarios
    source: str
    setup: Callable[[], dict]
    line: Optional[int] = None
    module: Optional[str] = None
    file: Optional[str] = None
    op: Optional[str] = None
    runs: int = 1
    kwargs: dict = field(default_factory=dict)
    mentions: tuple = ()
    also: tuple = ()  # other finding kinds that may accompany this one (e.g. nonfinite behind amp_skipped)
    known_engine_gaps: dict = field(default_factory=dict)
    doc: str = ""

    def __repr__(self) -> str:  # short ids in pytest output
        return f"SilentScenario({self.name})"


def _cell(name, kind, source, setup, module, **kw) -> SilentScenario:
    """Scenario whose expected line is in the cell (marked ``# <-- root cause``)."""
    source = textwrap.dedent(source)
    return SilentScenario(name, kind, source, setup, line=cell_line(source), module=module, **kw)


def _in_file(name, kind, source, setup, module, bug, **kw) -> SilentScenario:
    """Scenario whose expected line is the ``# BUG:<bug>`` line of silent_models.py."""
    source = textwrap.dedent(source)
    return SilentScenario(name, kind, source, setup, line=bug_line(bug), module=module, file=SILENT_MODELS_FILE, **kw)


def _silent(name, source, setup, runs=3, **kw) -> SilentScenario:
    return SilentScenario(name, None, textwrap.dedent(source), setup, runs=runs, **kw)


def _ns(**values) -> dict:
    """A notebook-like global namespace: the usual imports plus ``values``."""
    ns = {"torch": torch, "nn": nn, "F": F, "np": np, "math": math, "sm": sm}
    ns.update(values)
    return ns


def _mlp(in_features=10, hidden=16, classes=3):
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _setup_classifier(opt="sgd", **extra):
    torch.manual_seed(0)
    model = _mlp()
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd" else torch.optim.Adam(model.parameters(), lr=1e-3)
    )
    return _ns(x=torch.randn(16, 10), y=torch.randint(0, 3, (16,)), model=model, optimizer=optimizer, **extra)


def _setup_with_model(model_cls, opt="adam", **extra):
    def setup():
        torch.manual_seed(0)
        model = model_cls()
        params = model.parameters()
        optimizer = torch.optim.Adam(params, lr=1e-3) if opt == "adam" else torch.optim.SGD(params, lr=0.1)
        return _ns(x=torch.randn(16, 10), y=torch.randint(0, 3, (16,)), model=model, optimizer=optimizer, **extra)

    return setup


_STD_STEP = """\
optimizer.zero_grad()
logits = model(x)
loss = F.cross_entropy(logits, y)
loss.backward()
optimizer.step()
"""

_LEAK_FIX = ".item()"  # the one-line fix every graph_leak message must show
_ZERO_FIX = "zero_grad()"


# ===========================================================================
# graph_leak
# ===========================================================================


def _setup_regressor(**extra):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randn(16, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        **extra,
    )


def _setup_train_val():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        x_val=torch.randn(128, 10),  # the validation batch is bigger than the training batch
        y_val=torch.randint(0, 3, (128,)),
        val_losses=[],
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


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
    _in_file(
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
    _in_file(
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
    _in_file(
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
    _in_file(
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


# ===========================================================================
# stale_grad
# ===========================================================================


def _setup_gan():
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return _ns(
        real=torch.randn(16, 8),
        z_dim=4,
        G=G,
        D=D,
        g_opt=torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        d_opt=torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999)),
    )


def _setup_trainer(accum=4):
    def setup():
        ns = _setup_classifier()
        ns["trainer"] = sm.AccumulatingTrainer(ns["model"], ns["optimizer"], accum=accum)
        return ns

    return setup


STALE_GRAD = [
    _cell(
        "zero_grad_never_called",
        "stale_grad",
        """\
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()  # <-- root cause
        """,
        _setup_classifier,
        module=None,
        runs=2,
        mentions=(_ZERO_FIX, "accumulat"),
        doc="a step cell written without optimizer.zero_grad().",
    ),
    _cell(
        "gan_generator_optimizer_never_zeroed",
        "stale_grad",
        """\
        z = torch.randn(real.shape[0], z_dim)
        fake = G(z)
        d_opt.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) \\
            + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss.backward()
        d_opt.step()
        g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(real.shape[0], 1))
        g_loss.backward()
        g_opt.step()  # <-- root cause
        """,
        _setup_gan,
        module=None,
        runs=2,
        mentions=(_ZERO_FIX, "accumulat"),
        doc="GAN step that zeroes the discriminator's gradients but forgets g_opt.zero_grad().",
    ),
    _in_file(
        "train_step_helper_without_zero_grad",
        "stale_grad",
        """\
        loss_value = sm.train_step(model, optimizer, x, y)
        """,
        _setup_classifier,
        module=None,
        bug="step_without_zero_grad",
        runs=2,
        mentions=(_ZERO_FIX, "accumulat"),
        doc="the step function imported from the project's train.py never zeroes gradients.",
    ),
    _in_file(
        "half_done_gradient_accumulation",
        "stale_grad",
        """\
        loss_value = trainer.fit_batch(x, y)
        """,
        _setup_trainer(accum=4),
        module=None,
        bug="step_every_batch",
        runs=2,
        mentions=(_ZERO_FIX, "accumulat"),
        doc="accumulation with zero_grad every 4 batches but optimizer.step() on every batch.",
    ),
]


# ===========================================================================
# detached
# ===========================================================================


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
    _in_file(
        "weight_norm_layer_uses_dot_data",
        "detached",
        _STD_STEP,
        _setup_weight_norm,
        module="model.0",
        bug="weight_norm_data",
        mentions=("model.0.v",),
        doc="hand-written weight normalisation reads `self.v.data`: v never learns (g and bias do).",
    ),
    _in_file(
        "warmup_no_grad_left_in_forward",
        "detached",
        _STD_STEP,
        _setup_with_model(sm.WarmupFrozenNet, opt="sgd"),
        module="model.backbone",
        bug="no_grad_backbone",
        mentions=("model.backbone.0.weight", "model.backbone.2.weight"),
        doc="a warm-up freeze written as `with torch.no_grad()` inside forward() and never removed.",
    ),
    _in_file(
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
    _in_file(
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


# ===========================================================================
# broadcast
# ===========================================================================


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
    _in_file(
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
    _in_file(
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


# ===========================================================================
# amp_skipped (informational)
# ===========================================================================


def _setup_amp_classifier(scale_inputs=1.0):
    def setup():
        torch.manual_seed(0)
        model = _mlp(10, 16, 3)
        x = torch.randn(16, 10) * scale_inputs
        return _ns(
            x=x,
            y=torch.randint(0, 3, (16,)),
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            scaler=torch.amp.GradScaler("cpu"),
        )

    return setup


def _setup_poisson():
    torch.manual_seed(0)
    model = sm.PoissonRateNet(6)
    counts_x = torch.rand(32, 6) * 50
    counts_x[:, 1] = 2000.0  # "days since signup", never standardised
    return _ns(
        x=counts_x,
        counts=torch.poisson(torch.full((32,), 3.0)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        scaler=torch.amp.GradScaler("cpu"),
    )


def _setup_amp_helper():
    ns = _setup_amp_classifier()()
    ns["x"][3, 2] = float("inf")  # a corrupted sample in the batch
    return ns


AMP_SKIPPED = [
    _cell(
        "grad_scaler_step_on_inf_loss",
        "amp_skipped",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        probs = logits.float().softmax(-1)
        loss = -torch.log(probs.gather(1, y[:, None])).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # <-- root cause
        scaler.update()
        """,
        _setup_amp_classifier(scale_inputs=1e4),  # raw, unscaled inputs: some probabilities are exactly 0
        module=None,
        runs=2,
        also=("nonfinite",),
        doc="a hand-written NLL takes log(0) = -inf on saturated logits; the scaler skips every step.",
    ),
    _cell(
        "grad_scaler_unscale_clip_then_step",
        "amp_skipped",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        probs = logits.float().softmax(-1)
        loss = -torch.log(probs.gather(1, y[:, None])).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)  # <-- root cause
        scaler.update()
        """,
        _setup_amp_classifier(scale_inputs=1e4),
        module=None,
        runs=2,
        also=("nonfinite",),
        doc="the documented GradScaler + gradient clipping recipe, same inf loss.",
    ),
    _cell(
        "poisson_rate_overflows_in_model",
        "amp_skipped",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rate = model(x)
        loss = F.poisson_nll_loss(rate.float(), counts, log_input=False)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # <-- root cause
        scaler.update()
        """,
        _setup_poisson,
        module=None,
        runs=2,
        also=("nonfinite",),
        doc="the inf comes from the model (exp of an unstandardised feature, silent_models.py "
        "BUG:rate_overflow); the skipped step is reported at the cell's scaler.step.",
    ),
    _in_file(
        "amp_helper_step_on_corrupted_batch",
        "amp_skipped",
        """\
        loss_value = sm.amp_train_step(model, optimizer, scaler, x, y)
        """,
        _setup_amp_helper,
        module=None,
        bug="amp_helper_step",
        runs=2,
        also=("nonfinite",),
        doc="the mixed-precision step lives in the project's train.py; an inf in the batch.",
    ),
]


FAILING: list[SilentScenario] = GRAPH_LEAK + STALE_GRAD + DETACHED + BROADCAST + AMP_SKIPPED


# ===========================================================================
# must stay silent: correct steps, no finding at all on any of >= 3 runs
# ===========================================================================


def _setup_accumulation(**extra):
    ns = _setup_classifier(opt="adam", accum_steps=2, batch_idx=0, **extra)
    return ns


def _setup_frozen_all_params_in_optimizer():
    torch.manual_seed(0)
    model = sm.WarmupFrozenNet()  # its forward's no_grad is not used here: only its modules
    model = nn.Sequential(model.backbone, model.head)
    model[0].requires_grad_(False)  # transfer learning: freeze the pretrained backbone
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),  # built over *all* parameters
    )


def _setup_lstm_stream():
    torch.manual_seed(0)
    lstm, head = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 6)
    return _ns(
        x=torch.randn(4, 5, 6),
        y=torch.randn(4, 5, 6),
        hidden=(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)),
        lstm=lstm,
        head=head,
        optimizer=torch.optim.SGD([*lstm.parameters(), *head.parameters()], lr=0.1),
    )


def _setup_stateful_gru():
    torch.manual_seed(0)
    model = sm.StatefulGRU(6, 8)
    return _ns(
        x=torch.randn(4, 5, 6),
        y=torch.randn(4, 5, 6),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_eval():
    ns = _setup_train_val()
    ns["val_history"] = ns.pop("val_losses")
    return ns


def _setup_masked_lm():
    torch.manual_seed(0)
    idx = torch.randint(0, 20, (4, 8))
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[1, 6:] = True  # right padding on two sequences
    pad[3, 5:] = True
    model = sm.MaskedAttentionLM(20, 16, 8)
    return _ns(
        idx=idx,
        pad=pad,
        targets=torch.randint(0, 20, (4, 8)),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    )


def _setup_legal_inplace():
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True))
    fc, head = nn.Linear(16, 16), nn.Linear(16, 3)
    params = [p for m in (stem, fc, head) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        stem=stem,
        fc=fc,
        head=head,
        params=params,
        ema_params=[p.detach().clone() for p in params],
        lr=0.05,
    )


def _setup_mean_teacher():
    torch.manual_seed(0)
    student = _mlp()
    teacher = copy.deepcopy(student)  # parameters still require grad, but are not in the optimizer
    return _ns(
        x=torch.randn(16, 10),
        x_aug=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        student=student,
        teacher=teacher,
        optimizer=torch.optim.Adam(student.parameters(), lr=1e-3),
    )


def _setup_rbf():
    torch.manual_seed(0)
    model = sm.RBFNet(4, 6, 1)
    x = torch.rand(32, 4)
    return _ns(
        x=x,
        y=torch.sin(3 * x).sum(1, keepdim=True),  # same (N, 1) shape as the prediction
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
    )


def _setup_fixed_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), sm.FixedManualBatchNorm(16), nn.ReLU(), nn.Linear(16, 3))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_aux_head():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU())
    main_head, aux_head = nn.Linear(16, 3), nn.Linear(16, 3)
    params = [p for m in (backbone, main_head, aux_head) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        backbone=backbone,
        main_head=main_head,
        aux_head=aux_head,
        epoch=0,
        aux_from_epoch=5,
        aux_acc=[],
        optimizer=torch.optim.Adam(params, lr=1e-3),
    )


def _setup_lbfgs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.rand(32, 4)
    return _ns(
        x=x,
        y=torch.sin(x.sum(1, keepdim=True)),
        model=model,
        optimizer=torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4),
    )


SILENT: list[SilentScenario] = [
    _silent(
        "gradient_accumulation_step_every_2_runs",
        """\
        loss = F.cross_entropy(model(x), y) / accum_steps
        loss.backward()
        batch_idx += 1
        if batch_idx % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
        """,
        _setup_accumulation,
        runs=5,
        doc="legitimate accumulation: step and zero_grad together every 2 runs (two steps in 5 runs).",
    ),
    _silent(
        "gradient_accumulation_zero_grad_in_place",
        """\
        if batch_idx % accum_steps == 0:
            optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y) / accum_steps
        loss.backward()
        batch_idx += 1
        if batch_idx % accum_steps == 0:
            optimizer.step()
        """,
        _setup_accumulation,
        runs=5,
        doc="accumulation that zeroes .grad in place (set_to_none=False) at the start of each window.",
    ),
    _silent(
        "zero_grad_after_step_in_place",
        """\
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        """,
        _setup_classifier,
        doc="zero_grad at the end of the step instead of the start; same gradients.",
    ),
    _silent(
        "frozen_backbone_optimizer_over_all_parameters",
        _STD_STEP,
        _setup_frozen_all_params_in_optimizer,
        doc="requires_grad_(False) on the backbone, optimizer built over model.parameters().",
    ),
    _silent(
        "gan_discriminator_step_on_fake_detach",
        """\
        z = torch.randn(real.shape[0], z_dim)
        fake = G(z)
        d_opt.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) \\
            + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss.backward()
        d_opt.step()
        """,
        _setup_gan,
        doc="the discriminator step alone (the generator step is another cell).",
    ),
    _silent(
        "gan_full_step_discriminator_on_fake_detach",
        """\
        z = torch.randn(real.shape[0], z_dim)
        fake = G(z)
        d_opt.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) \\
            + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(real.shape[0], 1))
        g_loss.backward()
        g_opt.step()
        """,
        _setup_gan,
        doc="the fixed version of gan_generator_optimizer_never_zeroed.",
    ),
    _silent(
        "truncated_bptt_lstm_hidden_detached",
        """\
        optimizer.zero_grad()
        hidden = tuple(h.detach() for h in hidden)
        out, hidden = lstm(x, hidden)
        loss = F.mse_loss(head(out), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_lstm_stream,
        doc="truncated BPTT: the (h, c) state is carried across runs and detached before use.",
    ),
    _silent(
        "stateful_gru_module_detaches_its_state",
        """\
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_stateful_gru,
        doc="the module keeps self.state (with this run's graph) and detaches it at the next call.",
    ),
    _silent(
        "evaluation_under_no_grad_after_step",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            val_logits = model(x_val)
            val_loss = F.cross_entropy(val_logits, y_val)
            val_acc = (val_logits.argmax(1) == y_val).float().mean()
        val_history.append((val_loss.item(), val_acc.item()))
        """,
        _setup_eval,
        doc="the fixed version of validation_loss_without_no_grad_appended.",
    ),
    _silent(
        "loss_item_kept_in_list",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        history.append(loss.item())
        epoch_loss += loss.item()
        """,
        lambda: _setup_classifier(history=[], epoch_loss=0.0),
        doc="the fixed version of the history / epoch_loss leaks.",
    ),
    _silent(
        "running_metrics_kept_as_detached_tensors",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        ema_mae = 0.9 * ema_mae + 0.1 * (pred.detach() - y).abs().mean()
        losses.append(loss.detach())
        """,
        lambda: _setup_regressor(ema_mae=0.0, losses=[]),
        doc="metrics kept as tensors, but without their graph.",
    ),
    _silent(
        "minus_inf_causal_and_padding_masks",
        """\
        optimizer.zero_grad()
        logits = model(idx, pad)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_masked_lm,
        doc="additive -inf causal mask (broadcast over the batch) and masked_fill(-inf) padding.",
    ),
    _silent(
        "bf16_autocast_step",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_classifier(opt="adam"),
        doc="bf16 activations, fp32 parameters and gradients.",
    ),
    _silent(
        "grad_scaler_finite_loss",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        """,
        _setup_amp_classifier(),
        doc="the GradScaler recipe with finite gradients: no step is skipped.",
    ),
    _silent(
        "legal_inplace_ops_and_ema_update",
        """\
        for p in params:
            p.grad = None
        h = stem(x)
        h = fc(h).relu_()
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        with torch.no_grad():
            for p, e in zip(params, ema_params):
                p.add_(p.grad, alpha=-lr)
                e.lerp_(p, 0.01)
        """,
        _setup_legal_inplace,
        doc="in-place ReLU after BatchNorm and on a Linear output, clipping, a hand-written SGD "
        "update and an EMA of the weights, all legal.",
    ),
    _silent(
        "mean_teacher_under_no_grad",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            target_probs = teacher(x_aug).softmax(-1)
        logits = student(x)
        loss = F.cross_entropy(logits, y) + F.kl_div(logits.log_softmax(-1), target_probs, reduction="batchmean")
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.lerp_(s, 0.01)
        """,
        _setup_mean_teacher,
        doc="mean teacher: the EMA teacher's parameters require grad but are not in the optimizer.",
    ),
    _silent(
        "manual_batchnorm_updated_under_no_grad",
        _STD_STEP,
        _setup_fixed_bn,
        doc="the fixed version of manual_batchnorm_running_stats_with_graph.",
    ),
    _silent(
        "rbf_layer_broadcasts_inputs_against_centres",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_rbf,
        doc="(N, 1, D) - (1, K, D) inside a layer is intended broadcasting; the loss shapes match.",
    ),
    _silent(
        "aux_head_loss_switched_on_after_warmup",
        """\
        optimizer.zero_grad()
        h = backbone(x)
        logits, aux_logits = main_head(h), aux_head(h)
        loss = F.cross_entropy(logits, y)
        if epoch >= aux_from_epoch:
            loss = loss + 0.3 * F.cross_entropy(aux_logits, y)
        aux_acc.append((aux_logits.argmax(1) == y).float().mean().item())
        loss.backward()
        optimizer.step()
        """,
        _setup_aux_head,
        doc="an auxiliary head whose loss is off during warm-up (its accuracy is still logged): "
        "no gradient for it on purpose, and nothing cut the graph.",
    ),
    _silent(
        "lbfgs_step_with_closure",
        """\
        def closure():
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        loss = optimizer.step(closure)
        """,
        _setup_lbfgs,
        doc="full-batch L-BFGS (small regression / PINN): zero_grad is inside the closure.",
    ),
]

ALL: list[SilentScenario] = FAILING + SILENT
BY_NAME: dict[str, SilentScenario] = {s.name: s for s in ALL}
assert len(BY_NAME) == len(ALL), "scenario names must be unique"
