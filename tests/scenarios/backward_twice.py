"""backward_twice."""

from __future__ import annotations

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _ns
from ._setups import _setup_gru_stream


BACKWARD_TWICE_ERR = (RuntimeError, "Trying to backward through the graph a second time")


def _setup_vae():
    torch.manual_seed(0)
    encoder, to_mu, to_logvar, decoder = nn.Linear(20, 32), nn.Linear(32, 4), nn.Linear(32, 4), nn.Linear(4, 20)
    params = [p for m in (encoder, to_mu, to_logvar, decoder) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 20),
        encoder=encoder,
        to_mu=to_mu,
        to_logvar=to_logvar,
        decoder=decoder,
        optimizer=torch.optim.Adam(params, lr=1e-3),
    )


def _setup_stateful_lstm():
    torch.manual_seed(0)
    model = bm.StatefulLSTM(8, 16)
    return _ns(
        x=torch.randn(4, 5, 8),
        y=torch.randn(4, 5, 8),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_precomputed_features():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
    head = nn.Linear(32, 5)
    x = torch.randn(64, 20)
    feats = backbone(x)  # "cache the features once" -- but outside torch.no_grad()
    return _ns(
        x=x,
        y=torch.randint(0, 5, (64,)),
        backbone=backbone,
        head=head,
        feats=feats,
        optimizer=torch.optim.Adam(head.parameters(), lr=1e-3),
    )


BACKWARD_TWICE = [
    _cell(
        "vae_separate_backward_for_each_loss_term",
        "backward_twice",
        """\
        optimizer.zero_grad()
        h = F.relu(encoder(x))
        mu, logvar = to_mu(h), to_logvar(h)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon_loss = F.mse_loss(decoder(z), x)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).mean()
        recon_loss.backward()
        kl.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_vae,
        module=None,
        raises=BACKWARD_TWICE_ERR,
        doc="VAE: backward() called per loss term; the shared encoder graph is freed by the first.",
    ),
    _cell(
        "rnn_hidden_state_carried_across_cell_runs",
        "backward_twice",
        """\
        optimizer.zero_grad()
        out, hidden = rnn(x, hidden)
        loss = F.mse_loss(head(out), y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_gru_stream,
        module=None,
        runs=2,
        raises=BACKWARD_TWICE_ERR,
        doc="truncated BPTT without hidden.detach(): the 2nd run of the cell backprops into the 1st.",
    ),
    _cell(
        "stateful_lstm_module_keeps_graph",
        "backward_twice",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_stateful_lstm,
        module=None,
        runs=2,
        raises=BACKWARD_TWICE_ERR,
        doc="the LSTM module in buggy_models.py stores its state without detaching it.",
    ),
    _cell(
        "features_cached_with_graph_in_earlier_cell",
        "backward_twice",
        """\
        optimizer.zero_grad()
        logits = head(feats)
        loss = F.cross_entropy(logits, y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_precomputed_features,
        module=None,
        runs=2,
        raises=BACKWARD_TWICE_ERR,
        doc="backbone features cached once (with grad) and reused by every step.",
    ),
]
