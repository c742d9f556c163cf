"""The three CPU workloads the benchmarks time: a 4-layer MLP, a small CNN with BatchNorm,
and a small GPT-style transformer. Each ``make_*(device)`` returns a zero-argument training step
whose model, optimizer state and batch live on ``device``."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


def _step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
    return step


def make_mlp(device: str = "cpu") -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(128, 256, device=device), torch.randint(0, 10, (128,), device=device)
    return _step(model, opt, lambda: F.cross_entropy(model(x), y))


def make_cnn(device: str = "cpu") -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)
    return _step(model, opt, lambda: F.cross_entropy(model(x), y))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, t: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def make_transformer(device: str = "cpu") -> Callable[[], None]:
    torch.manual_seed(0)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 256, (8, 64), device=device)
    return _step(model, opt, lambda: F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()))


WORKLOADS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer}
