"""stale_grad (silent): gradients accumulate across steps without ``zero_grad()``."""

from __future__ import annotations

import silent_models as sm
from scenario_kit import _cell, _in_silent_file
from ._setups import _setup_classifier, _setup_gan


_ZERO_FIX = "zero_grad()"


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
    _in_silent_file(
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
    _in_silent_file(
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
