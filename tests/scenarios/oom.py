"""oom (simulated device memory via ``memory_limit``)."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns


def _setup_wide_batch_mlp():
    torch.manual_seed(0)
    # 397k params = 1.6 MB.  With a batch of 256 a full Adam step (params, grads,
    # 2 moments, activations) needs ~9 MB and fits in 12 MB; the user raised the
    # batch to 4096 and the first hidden activation alone is 4096*1024*4 = 16.8 MB.
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
    return _ns(
        xb=torch.randn(4096, 128),  # 2.1 MB
        yb=torch.randint(0, 10, (4096,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_long_context_lm():
    torch.manual_seed(0)
    # ~0.4 MB of params.  At T=128 the (4, 4, T, T) score matrix is 1 MB; the
    # user raised the context to T=512: 4*4*512*512*4 = 16.8 MB > 8 MB.
    model = bm.LongContextLM(vocab_size=100, dim=64, n_head=4, max_len=1024)
    return _ns(
        tokens=torch.randint(0, 100, (4, 513)),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
    )


def _setup_big_vocab_bag_of_words():
    torch.manual_seed(0)
    # A 32768 x 32 EmbeddingBag is 4.2 MB and fits the 6 MB device, and the
    # forward pass is tiny (64 documents x 20 tokens).  But backward makes a
    # *dense* gradient as big as the table: another 4.2 MB (sparse=True, or a
    # bigger device, would fix it).
    model = nn.Sequential(nn.EmbeddingBag(32768, 32, mode="mean"), nn.Linear(32, 2))
    return _ns(
        docs=torch.randint(0, 32768, (64, 20)),
        y=torch.randint(0, 2, (64,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


OOM = [
    _cell(
        "batch_size_raised_to_4096",
        "oom",
        """\
        optimizer.zero_grad()
        logits = model(xb)  # <-- root cause
        loss = F.cross_entropy(logits, yb)
        loss.backward()
        optimizer.step()
        """,
        _setup_wide_batch_mlp,
        module="model.0",
        kwargs={"memory_limit": "12MB"},
        doc="MLP that trains fine at batch 256 on a 12 MB device; batch 4096 does not fit.",
    ),
    _in_file(
        "attention_scores_at_long_context",
        "oom",
        """\
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_long_context_lm,
        module="model.attn",
        bug="attn_scores",
        kwargs={"memory_limit": 8 * 1024 * 1024},
        doc="naive attention materialises a (B, H, T, T) matrix; context raised from 128 to 512.",
    ),
    _cell(
        "dense_embedding_gradient_in_backward",
        "oom",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(docs), y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_big_vocab_bag_of_words,
        # The allocation that crosses the limit is the backward of model.0 (its
        # dense weight gradient); backward ops are attributed to the module of
        # the forward op they differentiate (backward() itself is in no module).
        module="model.0",
        kwargs={"memory_limit": "6MB"},
        doc="large-vocabulary bag-of-words model: the weights fit, their dense gradient does not.",
    ),
]
