"""CORRECT steps: no findings, 3 runs in the same namespace."""

from __future__ import annotations

import textwrap

import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import Scenario, _ns
from ._setups import _setup_mlp_classifier, _STD_STEP, _setup_gru_stream, _setup_distillation


def _setup_cnn_bn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    return _ns(
        images=torch.randn(8, 3, 16, 16),
        labels=torch.randint(0, 10, (8,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4),
    )


def _setup_tiny_gpt():
    torch.manual_seed(0)
    model = bm.TinyGPT(vocab_size=50, dim=32, n_head=2, max_len=16, p=0.1)
    return _ns(
        tokens=torch.randint(0, 50, (4, 17)),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1),
    )


def _setup_legal_inplace():
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True))
    fc, head = nn.Linear(32, 32), nn.Linear(32, 4)
    return _ns(
        x=torch.randn(32, 16),
        y=torch.randint(0, 4, (32,)),
        stem=stem,
        fc=fc,
        head=head,
        params=[p for m in (stem, fc, head) for p in m.parameters()],
        lr=0.05,
        wd=1e-4,
    )


def _setup_eval_after_step():
    ns = _setup_mlp_classifier(in_features=10, hidden=32, classes=3, n=32)
    ns.update(x_val=torch.randn(64, 10), y_val=torch.randint(0, 3, (64,)), val_history=[])
    return ns


def _setup_padded_lm():
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 17))
    targets = tokens[:, 1:].clone()
    targets[0, 10:] = -100  # padding positions, ignored by cross_entropy's default ignore_index
    targets[2, 5:] = -100
    model = bm.TinyGPT(vocab_size=50, dim=32, n_head=2, max_len=16, p=0.0)
    return _ns(
        inputs=tokens[:, :-1],
        targets=targets,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_partial_freeze():
    torch.manual_seed(0)
    model = bm.FineTuneNet(20, 32, 5)
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    return _ns(
        x=torch.randn(32, 20),
        y=torch.randint(0, 5, (32,)),
        model=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
    )


def _correct(name, source, setup, doc=""):
    return Scenario(name, None, textwrap.dedent(source), setup, None, None, doc=doc)


CORRECT: list[Scenario] = [
    _correct(
        "mlp_adam",
        _STD_STEP,
        _setup_mlp_classifier,
        doc="the canonical step.",
    ),
    _correct(
        "cnn_batchnorm_sgd_momentum",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_cnn_bn,
        doc="BatchNorm2d updates running stats in place (buffers) -- legal.",
    ),
    _correct(
        "gpt_block_dropout_causal_mask",
        """\
        model.train()
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_tiny_gpt,
        doc="-inf from masked_fill is intentional; softmax turns it into exact zeros.",
    ),
    _correct(
        "autocast_bf16_step",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_mlp_classifier(in_features=16, hidden=64, classes=4, n=32),
        doc="mixed precision on CPU: bf16 activations, fp32 params/grads; not a dtype mismatch.",
    ),
    _correct(
        "legal_inplace_ops_and_manual_sgd",
        """\
        for p in params:
            p.grad = None
        h = stem(x)  # Linear -> BatchNorm1d -> ReLU(inplace=True): BN does not save its output
        h = fc(h)
        h = h.relu_()  # fc's output is not saved by addmm's backward
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.mul_(1 - lr * wd).add_(p.grad, alpha=-lr)
        """,
        _setup_legal_inplace,
        doc="in-place ops that autograd allows, and a hand-written SGD update under no_grad.",
    ),
    _correct(
        "loss_item_appended_to_history",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        """,
        lambda: {**_setup_mlp_classifier(), "losses": []},
        doc=".item() for logging, after backward: no graph cut.",
    ),
    _correct(
        "eval_under_no_grad_after_step",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(model(x_val), y_val)
            val_acc = (model(x_val).argmax(1) == y_val).float().mean()
        val_history.append((val_loss.item(), val_acc.item()))
        """,
        _setup_eval_after_step,
        doc="no_grad only around evaluation, which no backward depends on.",
    ),
    _correct(
        "gradient_clipping",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        """,
        _setup_mlp_classifier,
        doc="clip_grad_norm_ scales .grad in place under no_grad: legal.",
    ),
    _correct(
        "tbptt_hidden_detached",
        """\
        optimizer.zero_grad()
        out, hidden = rnn(x, hidden.detach())
        loss = F.mse_loss(head(out), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_gru_stream,
        doc="the fixed version of rnn_hidden_state_carried_across_cell_runs.",
    ),
    _correct(
        "lm_padding_with_ignore_index",
        """\
        optimizer.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_padded_lm,
        doc="negative targets equal to ignore_index (-100) are legal.",
    ),
    _correct(
        "partially_frozen_backbone",
        _STD_STEP,
        _setup_partial_freeze,
        doc="only the backbone is frozen; the head still trains.",
    ),
    _correct(
        "distillation_teacher_under_no_grad",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            teacher_logits = teacher(x)
        student_logits = student(x)
        loss = F.kl_div(
            F.log_softmax(student_logits / T, dim=-1),
            F.softmax(teacher_logits / T, dim=-1),
            reduction="batchmean",
        ) * T * T
        loss.backward()
        optimizer.step()
        """,
        _setup_distillation,
        doc="the fixed version of distillation_student_inside_no_grad_block.",
    ),
]
