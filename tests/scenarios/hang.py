"""hang (small timeouts; tests/test_scenarios_plain.py interrupts them with SIGALRM)."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns


def _setup_prefetch_never_started():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    ns = _ns(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    batch_ready = threading.Event()
    batch = {}

    def prefetch():
        batch["x"], batch["y"] = torch.randn(16, 10), torch.randint(0, 2, (16,))
        batch_ready.set()

    # The prefetch thread is created but never .start()ed.
    ns.update(batch_ready=batch_ready, batch=batch, loader_thread=threading.Thread(target=prefetch, daemon=True))
    return ns


def _setup_one_class_labels():
    torch.manual_seed(0)
    all_labels = torch.randint(0, 2, (200,))
    keep = all_labels == 0  # a filtering bug dropped every positive example
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    return _ns(
        X_all=torch.randn(200, 10)[keep],
        labels=all_labels[keep].float(),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_metrics_logger():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    metrics_lock = threading.Lock()
    flush_requested = threading.Event()
    holding = threading.Event()

    def metrics_logger():
        # Holds the lock while waiting for the training loop's flush request; the
        # training loop only sends it after taking the same lock -> deadlock.
        # (The 60 s cap only keeps leaked test threads from living forever.)
        with metrics_lock:
            holding.set()
            flush_requested.wait(timeout=60)

    threading.Thread(target=metrics_logger, daemon=True, name="metrics-logger").start()
    holding.wait()
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 2, (16,)),
        history=[],
        metrics_lock=metrics_lock,
        flush_requested=flush_requested,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_normalized_mlp():
    torch.manual_seed(0)
    model = bm.NormalizedMLP(8, 16, 1)
    return _ns(
        x=torch.randn(32, 8),
        y=torch.randn(32, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


HANG = [
    _cell(
        "wait_for_prefetch_thread_never_started",
        "hang",
        """\
        batch_ready.wait()  # <-- root cause
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        """,
        _setup_prefetch_never_started,
        module=None,
        kwargs={"timeout": 1.0},
        doc="hand-rolled prefetcher: the main thread waits on an Event a never-started thread sets.",
    ),
    _cell(
        "resample_until_batch_has_both_classes",
        "hang",
        """\
        idx = torch.randint(0, len(labels), (32,))
        while labels[idx].unique().numel() < 2: idx = torch.randint(0, len(labels), (32,))  # <-- root cause
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(X_all[idx]).squeeze(1), labels[idx])
        loss.backward()
        optimizer.step()
        """,
        _setup_one_class_labels,
        module=None,
        kwargs={"timeout": 1.0},
        doc="rejection-sampling a batch with both classes (for AUC) from data with only one class: "
        "an endless loop (written on one line so the stuck line is unambiguous).",
    ),
    _cell(
        "deadlock_with_metrics_logger_thread",
        "hang",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        with metrics_lock:  # <-- root cause
            history.append(loss.item())
            flush_requested.set()
        """,
        _setup_metrics_logger,
        module=None,
        kwargs={"timeout": 1.5},
        doc="lock-order deadlock with a background logging thread.",
    ),
    _in_file(
        "normalizer_relocks_its_own_lock",
        "hang",
        """\
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_normalized_mlp,
        module="model.norm",
        bug="stats_lock_deadlock",
        kwargs={"timeout": 1.0},
        doc="module re-acquires its own non-reentrant threading.Lock (should be an RLock).",
    ),
]
