"""Small ``nn.Module``s used by the test scenarios in ``tests/scenarios/``.

This file plays the part of a user's own ``models.py`` that a notebook imports:
for the "file-side" scenarios the bug lives *here*, not in the notebook cell,
so backward_doctor must report ``file`` = the absolute path of this file and
``line`` = the line of the buggy statement.

Every buggy statement carries a trailing ``# BUG:<name>`` marker.  Tests never
hard-code line numbers: they call :func:`bug_line` (or
``scenario_kit.bug_line``) which reads this file and finds the marker.  Each
marker sits on the line that the diagnoser is expected to report, i.e. the
innermost line of this file that was running when the offending op ran.

The last section holds *correct* reference models (a tiny GPT block, a CNN)
used by the no-findings scenarios; they contain no ``BUG:`` markers.

Everything here is deliberately tiny (a few KB to a few MB of tensors).
"""

from __future__ import annotations

import math
import os
import re
import threading

import numpy as np
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
# nonfinite
# ---------------------------------------------------------------------------


class NaiveSoftmaxClassifier(nn.Module):
    """Linear classifier with a hand-written softmax that forgets to subtract the max.

    With unnormalised inputs (raw pixel values 0..255) the logits reach a few
    hundred and ``exp`` overflows float32 (> ~88.7) to ``inf``; ``inf / inf``
    then gives NaN probabilities and a NaN loss.
    """

    def __init__(self, in_features: int = 784, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x):
        logits = self.fc(x)
        e = torch.exp(logits)  # BUG:exp_overflow
        return e / e.sum(dim=1, keepdim=True)


class ProtoNet(nn.Module):
    """Prototype classifier: logits = -euclidean distance to learnable prototypes.

    The prototypes are initialised from the embeddings of the first samples of
    the training batch (a common trick), so for those samples the distance is
    exactly 0.  The forward pass is finite, but the gradient of ``sqrt`` at 0
    is ``inf`` and ``inf * 0`` in the backward of ``** 2`` gives NaN grads.
    """

    def __init__(self, in_features: int = 16, dim: int = 8, num_classes: int = 4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, dim))
        self.prototypes = nn.Parameter(torch.zeros(num_classes, dim))

    @torch.no_grad()
    def init_prototypes(self, x):
        """Use the embeddings of the first ``num_classes`` samples of ``x`` as prototypes."""
        z = self.encoder(x)
        self.prototypes.copy_(z[: self.prototypes.shape[0]])

    def forward(self, x):
        z = self.encoder(x)
        diff = z[:, None, :] - self.prototypes[None, :, :]
        dist = torch.sqrt((diff**2).sum(-1))  # BUG:sqrt_at_zero
        return -dist


# ---------------------------------------------------------------------------
# inplace
# ---------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """Residual MLP block that applies ReLU *before* the in-place residual add.

    ``torch.relu`` saves its output for backward; ``out.add_(identity)`` then
    bumps that tensor's version, and backward fails with "modified by an
    inplace operation".  (The correct order is add, then ReLU.)
    """

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        identity = x
        out = torch.relu(self.fc(x))
        out.add_(identity)  # BUG:residual_add_
        return out


class ResidualMLP(nn.Module):
    """stem -> ``blocks`` (a ModuleList of ResidualBlock) -> head."""

    def __init__(self, in_features: int = 16, dim: int = 32, num_classes: int = 4, depth: int = 1):
        super().__init__()
        self.stem = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList([ResidualBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TemperatureScaledClassifier(nn.Module):
    """Classifier with a learnable softmax temperature.

    The user keeps the temperature positive by clamping the *parameter* in
    place inside ``forward`` -- an in-place op on a leaf that requires grad.
    """

    def __init__(self, in_features: int = 16, num_classes: int = 4):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        self.temperature.clamp_(min=0.05)  # BUG:clamp_temperature
        return self.fc(x) / self.temperature


# ---------------------------------------------------------------------------
# device_mismatch / dtype_mismatch / shape_mismatch
# ---------------------------------------------------------------------------


class GaussianNoise(nn.Module):
    """Noise-injection regulariser that creates its noise on the default device.

    ``torch.randn(x.shape)`` lands on the CPU even when the model and ``x``
    live on the accelerator (on the CPU-only test machine: the ``meta``
    device stands in for "cuda").  Correct: ``torch.randn_like(x)``.
    """

    def __init__(self, std: float = 0.1):
        super().__init__()
        self.std = std

    def forward(self, x):
        if not self.training:
            return x
        noise = torch.randn(x.shape) * self.std
        return x + noise  # BUG:noise_device


class FourierFeatures(nn.Module):
    """Random Fourier feature encoding (as in NeRF / SIREN-style coordinate MLPs).

    The projection matrix is drawn with numpy, which gives float64, and
    registered as a buffer without ``.float()``; the float32 input then hits a
    float64 matmul.
    """

    def __init__(self, in_features: int = 2, num_features: int = 32, scale: float = 10.0, seed: int = 0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.register_buffer("B", torch.from_numpy(rng.normal(size=(in_features, num_features)) * scale))

    def forward(self, x):
        proj = 2 * math.pi * x @ self.B  # BUG:float64_buffer
        return torch.cat([proj.sin(), proj.cos()], dim=-1)


class FourierFeatureNet(nn.Module):
    """Coordinate MLP: FourierFeatures -> MLP, regressing an RGB value per (x, y)."""

    def __init__(self, num_features: int = 32, hidden: int = 64):
        super().__init__()
        self.encoding = FourierFeatures(2, num_features)
        self.mlp = nn.Sequential(nn.Linear(2 * num_features, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, coords):
        return self.mlp(self.encoding(coords))


class SmallCNN(nn.Module):
    """Two conv/pool stages and a linear head whose ``in_features`` was computed
    for 32x32 inputs (CIFAR).  Fed 28x28 images (MNIST) the flattened feature
    is 16*7*7 = 784, not 16*8*8 = 1024, and the head's matmul fails."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, num_classes)  # sized for 32x32 inputs

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))  # BUG:fc_in_features


# ---------------------------------------------------------------------------
# index_out_of_range
# ---------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Embedding + GRU language model.

    The scenario's "tokenizer" appends an end-of-sequence id equal to
    ``vocab_size`` (one past the last row of the embedding table).
    """

    def __init__(self, vocab_size: int = 32, dim: int = 16):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx):
        h = self.tok_emb(idx)  # BUG:token_embedding
        h, _ = self.rnn(h)
        return self.head(h)


class LabelSmoothingLoss(nn.Module):
    """Hand-written label-smoothing cross entropy using ``gather``.

    An out-of-range target (e.g. class id == num_classes) makes ``gather``
    raise "index N is out of bounds for dimension 1".
    """

    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits, target):
        logp = F.log_softmax(logits, dim=-1)
        nll = -logp.gather(1, target[:, None]).squeeze(1)  # BUG:label_gather
        smooth = -logp.mean(dim=-1)
        return ((1 - self.smoothing) * nll + self.smoothing * smooth).mean()


# ---------------------------------------------------------------------------
# backward_twice
# ---------------------------------------------------------------------------


class StatefulLSTM(nn.Module):
    """LSTM that carries its hidden state across calls (truncated BPTT) but
    forgets to ``.detach()`` it, so the second training step backpropagates
    into the first step's already-freed graph.  The error surfaces at the
    cell's ``loss.backward()`` line, which is what the diagnoser reports."""

    def __init__(self, in_features: int = 8, hidden: int = 16):
        super().__init__()
        self.lstm = nn.LSTM(in_features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, in_features)
        self.state = None

    def forward(self, x):
        out, self.state = self.lstm(x, self.state)  # BUG:stateful_hidden
        return self.head(out)


# ---------------------------------------------------------------------------
# no_grad_path
# ---------------------------------------------------------------------------


class FineTuneNet(nn.Module):
    """Pretrained backbone + new head, with a ``freeze_backbone`` helper that
    freezes *every* parameter instead of only the backbone's."""

    def __init__(self, in_features: int = 20, hidden: int = 32, num_classes: int = 5):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def freeze_backbone(self):
        for p in self.parameters():  # BUG:freeze_all  (meant self.backbone.parameters())
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))


class LinearProbe(nn.Module):
    """Linear probe on precomputed features whose ``forward`` was decorated
    with ``@torch.no_grad()`` (copied from a ``predict`` helper), so training
    through it builds no graph.

    The forward is a single op line with a single submodule, so "the line
    where the graph was cut" and its module are unambiguous (first op under
    no_grad == last op under no_grad == the op whose output reaches the loss).
    """

    def __init__(self, in_features: int = 10, num_classes: int = 3):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    @torch.no_grad()  # the actual mistake; the graph is cut by the op below
    def forward(self, x):
        return self.fc(x)  # BUG:no_grad_forward


# ---------------------------------------------------------------------------
# oom
# ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Plain (non-flash) multi-head attention that materialises the full
    (B, H, T, T) score matrix: fine at T=128, 16 MB at B=4, H=4, T=512."""

    def __init__(self, dim: int = 64, n_head: int = 4, max_len: int = 1024):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim // n_head)
        self.register_buffer("mask", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * self.scale  # BUG:attn_scores
        scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class LongContextLM(nn.Module):
    """Token + position embedding, one attention layer, LM head."""

    def __init__(self, vocab_size: int = 100, dim: int = 64, n_head: int = 4, max_len: int = 1024):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.attn = CausalSelfAttention(dim, n_head, max_len)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx):
        T = idx.shape[1]
        h = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        h = h + self.attn(h)
        return self.head(h)


# ---------------------------------------------------------------------------
# amp_misuse: autocast's outputs used after the block
# ---------------------------------------------------------------------------


class HalfAutocastClassifier(nn.Module):
    """Runs its backbone under bf16 autocast "to save memory" and its head after the block: the head's
    float32 weights meet the backbone's bfloat16 features."""

    def __init__(self, d_in: int = 12, hidden: int = 24, classes: int = 4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            feats = self.backbone(x)
        return self.head(feats)  # BUG:autocast_crossing


# ---------------------------------------------------------------------------
# hang
# ---------------------------------------------------------------------------


class RunningStatsNormalizer(nn.Module):
    """Feature normaliser that updates running statistics under a lock (so a
    background thread can read them).  ``forward`` takes the lock and calls
    ``_update`` which takes the same non-reentrant ``threading.Lock`` again:
    the main thread deadlocks on itself.  (Correct: ``threading.RLock``.)"""

    def __init__(self, dim: int, momentum: float = 0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(dim))
        self._lock = threading.Lock()

    def _update(self, x):
        with self._lock:  # BUG:stats_lock_deadlock
            self.mean.lerp_(x.detach().mean(0), self.momentum)

    def forward(self, x):
        with self._lock:
            if self.training:
                self._update(x)
            return x - self.mean


class NormalizedMLP(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 1):
        super().__init__()
        self.norm = RunningStatsNormalizer(in_features)
        self.mlp = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))

    def forward(self, x):
        return self.mlp(self.norm(x))


# ===========================================================================
# Correct reference models (no bugs; used by scenarios.CORRECT, tests/scenarios/correct.py)
# ===========================================================================


class TinyGPT(nn.Module):
    """One pre-LN GPT block: token+position embedding, causal self-attention
    with a ``-inf`` mask applied via ``masked_fill``, dropout on attention
    weights and residuals, GELU MLP, LM head.  ``-inf`` is intentional here
    and must not be reported as a non-finite value."""

    def __init__(self, vocab_size: int = 50, dim: int = 32, n_head: int = 2, max_len: int = 16, p: float = 0.1):
        super().__init__()
        self.n_head = n_head
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        self.attn_drop = nn.Dropout(p)
        self.resid_drop = nn.Dropout(p)
        self.register_buffer("mask", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        C, H = x.shape[-1], self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = self.attn_drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.resid_drop(self.proj(y))
        x = x + self.resid_drop(self.mlp(self.ln2(x)))
        return self.head(self.ln_f(x))
