"""Models and training helpers for the *silent* scenarios in ``tests/scenarios/`` (``scenarios.silent``).

Like ``tests/buggy_models.py`` this file plays the part of a user's own
``models.py`` that a notebook imports: for the file-side scenarios the bug lives
*here*, so backward_doctor must report ``file`` = the absolute path of this
file and ``line`` = the line marked ``# BUG:<name>`` (found by :func:`bug_line`,
never hard-coded).  Nothing here raises: every bug is silent (a leak, stale
gradients, parameters that never learn, a loss over the wrong shape, skipped
mixed-precision steps).

The last section holds *correct* models used by the must-stay-silent scenarios;
they carry no ``BUG:`` markers.

Everything is deliberately tiny (a few KB of tensors).
"""

from __future__ import annotations

import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

#: Absolute path of this file, as backward_doctor should report it in ``Finding.file``.
PATH = os.path.abspath(__file__)


def bug_line(name: str) -> int:
    """1-based line number of the statement marked ``# BUG:<name>`` in this file.

    Raises ``LookupError`` unless exactly one line carries the marker.
    """
    pattern = re.compile(r"#\s*BUG:" + re.escape(name) + r"(\s|$)")
    with open(PATH, encoding="utf-8") as fh:
        hits = [i for i, text in enumerate(fh, start=1) if pattern.search(text)]
    if len(hits) != 1:
        raise LookupError(f"marker BUG:{name} found {len(hits)} times in {PATH}")
    return hits[0]


# ---------------------------------------------------------------------------
# graph_leak: tensors with their autograd graph kept alive across steps
# ---------------------------------------------------------------------------


class FeatureCachingNet(nn.Module):
    """MLP that keeps every batch's hidden features "for a t-SNE plot at the end of the epoch".

    The features are appended with their graph (no ``.detach()``), so each
    training step adds one more graph to ``self.feature_maps``.
    """

    def __init__(self, in_features: int = 10, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        self.feature_maps: list[torch.Tensor] = []

    def forward(self, x):
        h = self.body(x)
        self.feature_maps.append(h)  # BUG:cache_features
        return self.head(h)


class ActivationMonitorNet(nn.Module):
    """MLP that tracks the mean hidden activation (dead-unit monitoring) as a plain attribute.

    ``self.act_mean`` is an exponential moving average computed from the live
    activations without ``torch.no_grad()``: every step chains its graph onto
    the previous step's, and the chain never ends.
    """

    def __init__(self, in_features: int = 10, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.act_mean = torch.zeros(hidden)  # not a buffer: just "a number to plot"

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        self.act_mean = 0.99 * self.act_mean + 0.01 * h.mean(0)  # BUG:act_mean_ema
        return self.fc2(h)


class ManualBatchNorm(nn.Module):
    """Hand-written BatchNorm1d whose running statistics are updated with the graph attached.

    Training normalises with the batch statistics (correct), but the running
    mean/var buffers are updated outside ``torch.no_grad()``, so each buffer is
    a tensor whose graph reaches back through every earlier step.
    """

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x):
        if self.training:
            mean, var = x.mean(0), x.var(0, unbiased=False)
            m = self.momentum
            self.running_mean = (1 - m) * self.running_mean + m * mean  # BUG:running_mean_with_graph
            self.running_var = (1 - m) * self.running_var + m * var
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class ManualBNNet(nn.Module):
    def __init__(self, in_features: int = 10, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.norm = ManualBatchNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make_loss_logger():
    """A logging callback (as a notebook's helper cell would define it) that keeps what it is given.

    It is meant for numbers, but the training cell hands it the loss tensor:
    the closure's list then holds every step's graph.
    """
    seen = []

    def log_loss(value):
        seen.append(value)  # BUG:closure_append

    return log_loss


# ---------------------------------------------------------------------------
# stale_grad: optimizer.step() on gradients that were never cleared
# ---------------------------------------------------------------------------


def train_step(model, optimizer, x, y):
    """One supervised step, as a project's ``train.py`` might define it -- without ``zero_grad()``."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()  # BUG:step_without_zero_grad
    return loss.item()


class AccumulatingTrainer:
    """Gradient accumulation done half-way: ``zero_grad()`` every ``accum`` batches, but
    ``optimizer.step()`` on *every* batch, so each step re-applies the gradients of the
    batches before it."""

    def __init__(self, model, optimizer, accum: int = 4):
        self.model, self.optimizer, self.accum = model, optimizer, accum
        self.batches = 0

    def fit_batch(self, x, y):
        loss = F.cross_entropy(self.model(x), y) / self.accum
        loss.backward()
        self.batches += 1
        self.optimizer.step()  # BUG:step_every_batch
        if self.batches % self.accum == 0:
            self.optimizer.zero_grad()
        return loss.item() * self.accum


# ---------------------------------------------------------------------------
# detached: trainable parameters used in the forward pass that get no gradient
# ---------------------------------------------------------------------------


class WeightNormLinear(nn.Module):
    """Weight-normalised linear layer ``w = g * v / ||v||`` written with ``.data``.

    ``.data`` hides ``v`` from autograd: ``g`` and ``bias`` learn, ``v`` never does.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.v = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.g = nn.Parameter(torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        direction = self.v.data / self.v.data.norm(dim=1, keepdim=True)  # BUG:weight_norm_data
        return F.linear(x, self.g[:, None] * direction, self.bias)


class WarmupFrozenNet(nn.Module):
    """Backbone + head where a "freeze the backbone during warm-up" ``no_grad`` was left in.

    The optimizer holds the backbone's parameters, which still require grad:
    they are used every step and never updated.
    """

    def __init__(self, in_features: int = 10, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        with torch.no_grad():
            h = self.backbone(x)  # BUG:no_grad_backbone
        return self.head(h)


class GatedHead(nn.Module):
    """Classifier whose output is scaled by a learnable, input-dependent gate.

    The gate is reduced to a Python float with ``.item()`` and wrapped back
    into a tensor, so ``gate`` never gets a gradient.
    """

    def __init__(self, in_features: int = 10, classes: int = 3):
        super().__init__()
        self.fc = nn.Linear(in_features, classes)
        self.gate = nn.Linear(in_features, 1)

    def forward(self, x):
        scale = torch.tensor(self.gate(x).sigmoid().mean().item())  # BUG:gate_item
        return self.fc(x) * scale


class LinearProbeLeftover(nn.Module):
    """Encoder + classifier trained end to end, with a ``.detach()`` copied from a
    linear-probe evaluation script still on the encoder output: only the classifier learns."""

    def __init__(self, in_features: int = 10, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, x):
        feats = self.encoder(x).detach()  # BUG:detach_encoder_output
        return self.classifier(feats)


# ---------------------------------------------------------------------------
# broadcast: a loss whose prediction and target broadcast to a bigger shape
# ---------------------------------------------------------------------------


class RMSELoss(nn.Module):
    """Custom RMSE criterion; the caller passes ``(N, 1)`` predictions and ``(N,)`` targets."""

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, pred, target):
        return torch.sqrt(((pred - target) ** 2).mean() + self.eps)  # BUG:rmse_broadcast


class PriceRegressor(nn.Module):
    """Regressor that returns its own L1 loss when given targets (a common "model computes
    its loss" pattern); ``self.out`` has one output unit, the targets are a flat vector."""

    def __init__(self, in_features: int = 10, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, target=None):
        pred = self.out(self.body(x))
        if target is None:
            return pred
        return pred, F.l1_loss(pred, target)  # BUG:l1_broadcast


# ---------------------------------------------------------------------------
# amp_skipped: GradScaler skips optimizer.step() on inf/NaN gradients
# ---------------------------------------------------------------------------


class PoissonRateNet(nn.Module):
    """Count regression with ``rate = exp(linear(x))``: unnormalised inputs overflow the exp."""

    def __init__(self, in_features: int = 6):
        super().__init__()
        self.fc = nn.Linear(in_features, 1)

    def forward(self, x):
        return torch.exp(self.fc(x)).squeeze(-1)  # BUG:rate_overflow


def amp_train_step(model, optimizer, scaler, x, y):
    """A mixed-precision step as a project's ``train.py`` defines it (the usual GradScaler recipe)."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # BUG:amp_helper_step
    scaler.update()
    return loss.item()


def train_accumulating(model, optimizer, loader, accum_steps):
    """A project's accumulation loop (``train.py``): ``accum_steps`` micro-batches per optimizer step."""
    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # BUG:accum_loss_not_divided
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def amp_clip_step(model, optimizer, scaler, x, y, max_norm=1.0):
    """A mixed-precision step with gradient clipping, as a project's ``train.py`` defines it."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # BUG:amp_clip_before_unscale
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


# ---------------------------------------------------------------------------
# correct reference models (no BUG markers)
# ---------------------------------------------------------------------------


class MaskedAttentionLM(nn.Module):
    """Single-head causal attention LM with an *additive* ``-inf`` causal mask (a float
    buffer, as nn.Transformer's ``generate_square_subsequent_mask`` builds it) and a key
    padding mask applied with ``masked_fill(-inf)``.  The ``-inf`` values are intentional."""

    def __init__(self, vocab_size: int = 20, dim: int = 16, max_len: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab_size)
        mask = torch.triu(torch.full((max_len, max_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask)

    def forward(self, idx, pad):
        T = idx.shape[1]
        h = self.emb(idx) + self.pos[:T]
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.causal_mask[:T, :T]
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return self.out(scores.softmax(-1) @ v)


class StatefulGRU(nn.Module):
    """GRU that carries its hidden state across calls and detaches it (truncated BPTT done right)."""

    def __init__(self, in_features: int = 6, hidden: int = 8):
        super().__init__()
        self.rnn = nn.GRU(in_features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, in_features)
        self.state = None

    def forward(self, x):
        state = None if self.state is None else self.state.detach()
        out, self.state = self.rnn(x, state)
        return self.head(out)


class FixedManualBatchNorm(ManualBatchNorm):
    """The fixed :class:`ManualBatchNorm`: running statistics updated under ``no_grad``."""

    def forward(self, x):
        if self.training:
            mean, var = x.mean(0), x.var(0, unbiased=False)
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class RBFNet(nn.Module):
    """Radial-basis-function network: squared distance from each input to learnable centres.

    ``x[:, None, :] - centers[None]`` broadcasts ``(N, 1, D)`` against ``(1, K, D)``
    on purpose; it is a layer, not a loss, and must not be reported as one."""

    def __init__(self, in_features: int = 4, centers: int = 6, out_features: int = 1):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(centers, in_features))
        self.log_gamma = nn.Parameter(torch.zeros(()))
        self.out = nn.Linear(centers, out_features)

    def forward(self, x):
        d2 = ((x[:, None, :] - self.centers[None, :, :]) ** 2).sum(-1)
        return self.out(torch.exp(-self.log_gamma.exp() * d2))
