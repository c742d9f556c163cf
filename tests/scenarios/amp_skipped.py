"""amp_skipped (silent, informational): mixed-precision steps skipped by the grad scaler."""

from __future__ import annotations

import torch

import silent_models as sm
from scenario_kit import _cell, _in_silent_file, _ns
from ._setups import _setup_amp_classifier


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
    _in_silent_file(
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
