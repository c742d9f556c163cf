"""Must stay silent: correct steps, no finding at all on any of >= 3 runs (``scenarios.silent.SILENT``)."""

from __future__ import annotations

import copy
import textwrap

import torch
import torch.nn as nn

import silent_models as sm
from scenario_kit import Scenario, _ns
from ._setups import (
    _STD_STEP,
    _mlp,
    _setup_amp_classifier,
    _setup_classifier,
    _setup_gan,
    _setup_regressor,
    _setup_train_val,
)


def _silent(name, source, setup, runs=3, **kw) -> Scenario:
    return Scenario(name, None, textwrap.dedent(source), setup, runs=runs, **kw)


def _setup_accumulation(**extra):
    ns = _setup_classifier(opt="adam", accum_steps=2, batch_idx=0, **extra)
    return ns


def _setup_frozen_all_params_in_optimizer():
    torch.manual_seed(0)
    model = sm.WarmupFrozenNet()  # its forward's no_grad is not used here: only its modules
    model = nn.Sequential(model.backbone, model.head)
    model[0].requires_grad_(False)  # transfer learning: freeze the pretrained backbone
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),  # built over *all* parameters
    )


def _setup_lstm_stream():
    torch.manual_seed(0)
    lstm, head = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 6)
    return _ns(
        x=torch.randn(4, 5, 6),
        y=torch.randn(4, 5, 6),
        hidden=(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)),
        lstm=lstm,
        head=head,
        optimizer=torch.optim.SGD([*lstm.parameters(), *head.parameters()], lr=0.1),
    )


def _setup_stateful_gru():
    torch.manual_seed(0)
    model = sm.StatefulGRU(6, 8)
    return _ns(
        x=torch.randn(4, 5, 6),
        y=torch.randn(4, 5, 6),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_eval():
    ns = _setup_train_val()
    ns["val_history"] = ns.pop("val_losses")
    return ns


def _setup_masked_lm():
    torch.manual_seed(0)
    idx = torch.randint(0, 20, (4, 8))
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[1, 6:] = True  # right padding on two sequences
    pad[3, 5:] = True
    model = sm.MaskedAttentionLM(20, 16, 8)
    return _ns(
        idx=idx,
        pad=pad,
        targets=torch.randint(0, 20, (4, 8)),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    )


def _setup_legal_inplace():
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True))
    fc, head = nn.Linear(16, 16), nn.Linear(16, 3)
    params = [p for m in (stem, fc, head) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        stem=stem,
        fc=fc,
        head=head,
        params=params,
        ema_params=[p.detach().clone() for p in params],
        lr=0.05,
    )


def _setup_mean_teacher():
    torch.manual_seed(0)
    student = _mlp()
    teacher = copy.deepcopy(student)  # parameters still require grad, but are not in the optimizer
    return _ns(
        x=torch.randn(16, 10),
        x_aug=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        student=student,
        teacher=teacher,
        optimizer=torch.optim.Adam(student.parameters(), lr=1e-3),
    )


def _setup_rbf():
    torch.manual_seed(0)
    model = sm.RBFNet(4, 6, 1)
    x = torch.rand(32, 4)
    return _ns(
        x=x,
        y=torch.sin(3 * x).sum(1, keepdim=True),  # same (N, 1) shape as the prediction
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
    )


def _setup_fixed_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), sm.FixedManualBatchNorm(16), nn.ReLU(), nn.Linear(16, 3))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_aux_head():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU())
    main_head, aux_head = nn.Linear(16, 3), nn.Linear(16, 3)
    params = [p for m in (backbone, main_head, aux_head) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        backbone=backbone,
        main_head=main_head,
        aux_head=aux_head,
        epoch=0,
        aux_from_epoch=5,
        aux_acc=[],
        optimizer=torch.optim.Adam(params, lr=1e-3),
    )


def _setup_lbfgs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.rand(32, 4)
    return _ns(
        x=x,
        y=torch.sin(x.sum(1, keepdim=True)),
        model=model,
        optimizer=torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4),
    )


SILENT: list[Scenario] = [
    _silent(
        "gradient_accumulation_step_every_2_runs",
        """\
        loss = F.cross_entropy(model(x), y) / accum_steps
        loss.backward()
        batch_idx += 1
        if batch_idx % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
        """,
        _setup_accumulation,
        runs=5,
        doc="legitimate accumulation: step and zero_grad together every 2 runs (two steps in 5 runs).",
    ),
    _silent(
        "gradient_accumulation_zero_grad_in_place",
        """\
        if batch_idx % accum_steps == 0:
            optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y) / accum_steps
        loss.backward()
        batch_idx += 1
        if batch_idx % accum_steps == 0:
            optimizer.step()
        """,
        _setup_accumulation,
        runs=5,
        doc="accumulation that zeroes .grad in place (set_to_none=False) at the start of each window.",
    ),
    _silent(
        "zero_grad_after_step_in_place",
        """\
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        """,
        _setup_classifier,
        doc="zero_grad at the end of the step instead of the start; same gradients.",
    ),
    _silent(
        "frozen_backbone_optimizer_over_all_parameters",
        _STD_STEP,
        _setup_frozen_all_params_in_optimizer,
        doc="requires_grad_(False) on the backbone, optimizer built over model.parameters().",
    ),
    _silent(
        "gan_discriminator_step_on_fake_detach",
        """\
        z = torch.randn(real.shape[0], z_dim)
        fake = G(z)
        d_opt.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) \\
            + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss.backward()
        d_opt.step()
        """,
        _setup_gan,
        doc="the discriminator step alone (the generator step is another cell).",
    ),
    _silent(
        "gan_full_step_discriminator_on_fake_detach",
        """\
        z = torch.randn(real.shape[0], z_dim)
        fake = G(z)
        d_opt.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) \\
            + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(real.shape[0], 1))
        g_loss.backward()
        g_opt.step()
        """,
        _setup_gan,
        doc="the fixed version of gan_generator_optimizer_never_zeroed.",
    ),
    _silent(
        "truncated_bptt_lstm_hidden_detached",
        """\
        optimizer.zero_grad()
        hidden = tuple(h.detach() for h in hidden)
        out, hidden = lstm(x, hidden)
        loss = F.mse_loss(head(out), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_lstm_stream,
        doc="truncated BPTT: the (h, c) state is carried across runs and detached before use.",
    ),
    _silent(
        "stateful_gru_module_detaches_its_state",
        """\
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_stateful_gru,
        doc="the module keeps self.state (with this run's graph) and detaches it at the next call.",
    ),
    _silent(
        "evaluation_under_no_grad_after_step",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            val_logits = model(x_val)
            val_loss = F.cross_entropy(val_logits, y_val)
            val_acc = (val_logits.argmax(1) == y_val).float().mean()
        val_history.append((val_loss.item(), val_acc.item()))
        """,
        _setup_eval,
        doc="the fixed version of validation_loss_without_no_grad_appended.",
    ),
    _silent(
        "loss_item_kept_in_list",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        history.append(loss.item())
        epoch_loss += loss.item()
        """,
        lambda: _setup_classifier(history=[], epoch_loss=0.0),
        doc="the fixed version of the history / epoch_loss leaks.",
    ),
    _silent(
        "running_metrics_kept_as_detached_tensors",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        ema_mae = 0.9 * ema_mae + 0.1 * (pred.detach() - y).abs().mean()
        losses.append(loss.detach())
        """,
        lambda: _setup_regressor(ema_mae=0.0, losses=[]),
        doc="metrics kept as tensors, but without their graph.",
    ),
    _silent(
        "minus_inf_causal_and_padding_masks",
        """\
        optimizer.zero_grad()
        logits = model(idx, pad)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_masked_lm,
        doc="additive -inf causal mask (broadcast over the batch) and masked_fill(-inf) padding.",
    ),
    _silent(
        "bf16_autocast_step",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_classifier(opt="adam"),
        doc="bf16 activations, fp32 parameters and gradients.",
    ),
    _silent(
        "grad_scaler_finite_loss",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        """,
        _setup_amp_classifier(),
        doc="the GradScaler recipe with finite gradients: no step is skipped.",
    ),
    _silent(
        "legal_inplace_ops_and_ema_update",
        """\
        for p in params:
            p.grad = None
        h = stem(x)
        h = fc(h).relu_()
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        with torch.no_grad():
            for p, e in zip(params, ema_params):
                p.add_(p.grad, alpha=-lr)
                e.lerp_(p, 0.01)
        """,
        _setup_legal_inplace,
        doc="in-place ReLU after BatchNorm and on a Linear output, clipping, a hand-written SGD "
        "update and an EMA of the weights, all legal.",
    ),
    _silent(
        "mean_teacher_under_no_grad",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            target_probs = teacher(x_aug).softmax(-1)
        logits = student(x)
        loss = F.cross_entropy(logits, y) + F.kl_div(logits.log_softmax(-1), target_probs, reduction="batchmean")
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.lerp_(s, 0.01)
        """,
        _setup_mean_teacher,
        doc="mean teacher: the EMA teacher's parameters require grad but are not in the optimizer.",
    ),
    _silent(
        "manual_batchnorm_updated_under_no_grad",
        _STD_STEP,
        _setup_fixed_bn,
        doc="the fixed version of manual_batchnorm_running_stats_with_graph.",
    ),
    _silent(
        "rbf_layer_broadcasts_inputs_against_centres",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_rbf,
        doc="(N, 1, D) - (1, K, D) inside a layer is intended broadcasting; the loss shapes match.",
    ),
    _silent(
        "aux_head_loss_switched_on_after_warmup",
        """\
        optimizer.zero_grad()
        h = backbone(x)
        logits, aux_logits = main_head(h), aux_head(h)
        loss = F.cross_entropy(logits, y)
        if epoch >= aux_from_epoch:
            loss = loss + 0.3 * F.cross_entropy(aux_logits, y)
        aux_acc.append((aux_logits.argmax(1) == y).float().mean().item())
        loss.backward()
        optimizer.step()
        """,
        _setup_aux_head,
        doc="an auxiliary head whose loss is off during warm-up (its accuracy is still logged): "
        "no gradient for it on purpose, and nothing cut the graph.",
    ),
    _silent(
        "lbfgs_step_with_closure",
        """\
        def closure():
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        loss = optimizer.step(closure)
        """,
        _setup_lbfgs,
        doc="full-batch L-BFGS (small regression / PINN): zero_grad is inside the closure.",
    ),
]
