"""Setups (and the standard step cell) shared by more than one scenario family."""

from __future__ import annotations

import torch
import torch.nn as nn

from scenario_kit import _ns


def _setup_mlp_classifier(in_features=10, hidden=32, classes=3, n=32, opt="adam"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if opt == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    return _ns(
        x=torch.randn(n, in_features),
        y=torch.randint(0, classes, (n,)),
        model=model,
        optimizer=optimizer,
        noise_std=0.01,
    )


_STD_STEP = """\
optimizer.zero_grad()
logits = model(x)
loss = F.cross_entropy(logits, y)
loss.backward()
optimizer.step()
"""


def _setup_gru_stream():
    torch.manual_seed(0)
    rnn, head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 8)
    return _ns(
        x=torch.randn(4, 5, 8),
        y=torch.randn(4, 5, 8),
        hidden=torch.zeros(1, 4, 16),  # initial state, carried from call to call
        rnn=rnn,
        head=head,
        optimizer=torch.optim.SGD(list(rnn.parameters()) + list(head.parameters()), lr=0.1),
    )


def _setup_distillation():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    teacher.eval().requires_grad_(False)  # "pretrained" teacher, frozen as usual
    student = nn.Linear(20, 5)
    return _ns(
        x=torch.randn(32, 20),
        T=2.0,
        teacher=teacher,
        student=student,
        optimizer=torch.optim.Adam(student.parameters(), lr=1e-3),
    )


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
