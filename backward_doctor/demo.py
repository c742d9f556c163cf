"""``make demo``: the failures users bring (see ``shared/seeds``), diagnosed headlessly.

Each scenario is a small, complete training step on CPU; ``memory_limit`` stands
in for a small GPU and ``timeout`` for a user's patience. Run with
``python -m backward_doctor.demo``; it prints one report per scenario.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from .api import diagnose

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 256)
y = torch.randint(0, 10, (64,))
"""


@dataclass
class Scenario:
    title: str
    folklore: str
    source: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    setup: str = SETUP


SCENARIOS = [
    Scenario(
        "loss.backward() hangs (seed: 'Why does PyTorch sometimes hang when calling loss.backward()?')",
        "Folklore blames memory fragmentation. Measured: the backward is waiting on a lock.",
        """
        import threading
        lock = threading.Lock()
        class Gate(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()
            @staticmethod
            def backward(ctx, g):
                with lock:              # the lock is held by the logging thread below
                    return g
        lock.acquire()                  # a 'logger' took it and never released it
        loss = F.cross_entropy(Gate.apply(model(x)), y)
        loss.backward()
        """, {"timeout": 2.0}),
    Scenario(
        "backward() crashes out of memory (seeds: 'crashing during backward', 'CUDA OOM but not on CPU')",
        "Folklore: `del` tensors and empty the cache. Measured: activations of a big batch fill the card.",
        """
        xb = torch.randn(8192, 256)
        yb = torch.randint(0, 10, (8192,))
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step(); opt.zero_grad()
        """, {"memory_limit": "40MB"}),
    Scenario(
        "the same step with fix='accumulate' (issue 4: fixes)",
        "The cell runs, the state is rolled back, the rewritten cell runs: measured, with the code to keep.",
        """
        xb = torch.randn(8192, 256)
        yb = torch.randint(0, 10, (8192,))
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step(); opt.zero_grad()
        """, {"memory_limit": "40MB", "fix": "accumulate"}),
    Scenario(
        "the 'no_grad saves memory' advice (seed: 'CUDA OOM but not on CPU', example 1)",
        "The article computes outputs under no_grad, then calls backward: there is no graph at all.",
        """
        with torch.no_grad():
            outputs = model(x)
        loss = F.cross_entropy(outputs, y)
        loss.backward()
        """),
    Scenario(
        "device-side assert in backward (seed: 'failing with a CUDA assertion error')",
        "Folklore blames NaN. Measured: a class label outside 0..C-1.",
        """
        y_bad = y.clone(); y_bad[3] = 10    # labels 1..10 instead of 0..9
        loss = F.cross_entropy(model(x), y_bad)
        loss.backward()
        """),
    Scenario(
        "NaN appears after some iterations (seed: 'CUDA assertion error', cause 1)",
        "The NaN is made by one op on one line; everything after it only carries it.",
        """
        logits = model(x) * 1000                      # a temperature bug: logits in the hundreds
        probs = torch.softmax(logits, dim=1)          # underflows to exactly 0 for some classes
        loss = -torch.log(probs[torch.arange(64), y]).mean()
        loss.backward()
        """),
    Scenario(
        "in-place op breaks backward (seed: 'CUDA assertion error', cause 2)",
        "PyTorch raises at backward(); the cause is the in-place write in forward.",
        """
        h = torch.sigmoid(model[0](x))
        h += 0.1                                         # in-place on a tensor sigmoid saved
        loss = F.cross_entropy(model[2:](model[1](h)), y)
        loss.backward()
        """),
    Scenario(
        "a correct step",
        "The doctor stays silent when nothing is wrong.",
        """
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
        """),
]


def main() -> int:
    for i, sc in enumerate(SCENARIOS, 1):
        ns: dict[str, Any] = {}
        exec(sc.setup, ns)
        source = textwrap.dedent(sc.source).strip("\n")
        print("=" * 100)
        print(f"{i}. {sc.title}")
        print(f"   {sc.folklore}")
        print("-" * 100)
        print(textwrap.indent(source, "   | "))
        print("-" * 100, flush=True)
        print(diagnose(source, ns, **sc.kwargs))
        print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
