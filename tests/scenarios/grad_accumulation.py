"""grad_accumulation (silent): gradient accumulation written wrong, and written right.

Each cell trains over a ``loader`` of 8 micro-batches (a list of ``(x, y)`` pairs, as a DataLoader yields
them), 4 micro-batches per optimizer step. The bugs are the ones users file most (transformers#37766,
nanoGPT#206, accelerate#2341): the loss not divided by the number of micro-batches, ``zero_grad()`` in
every micro-batch, ``optimizer.step()`` in every micro-batch. The correct ones must stay silent:
accumulation divided and zeroed after the step, nanoGPT's inner micro-batch loop, two losses of one
step on two lines (a GAN discriminator), L-BFGS's closure.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scenario_kit import _cell, _in_silent_file, _ns
from .silent_correct import _silent


def _setup_accum(opt: str = "sgd"):
    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
        xs, ys = torch.randn(8, 6, 10), torch.randint(0, 3, (8, 6))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd" else \
            torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        return _ns(model=model, optimizer=optimizer, loader=list(zip(xs, ys)), x=xs[0], y=ys[0])
    return setup


GRAD_ACCUMULATION = [
    _cell(
        "accumulation_loss_not_divided",
        "grad_accumulation",
        """\
        accum_steps = 4
        for i, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()  # <-- root cause
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
        """,
        _setup_accum(),
        module=None,
        mentions=("not divided by 4", "4.00x", "(loss / accum_steps)"),
        doc="the classic: every micro-batch's mean loss is backpropagated as is, so each step follows the sum of "
        "4 micro-batch gradients (4x a full batch's).",
    ),
    _cell(
        "accumulation_zero_grad_every_micro_batch",
        "grad_accumulation",
        """\
        accum_steps = 4
        for i, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
            optimizer.zero_grad()  # <-- root cause
        """,
        _setup_accum(),
        module=None,
        mentions=("3 thrown away", "once per optimizer step"),
        doc="zero_grad() one indent too far out: every micro-batch wipes the ones before it.",
    ),
    _cell(
        "accumulation_zero_grad_inside_micro_batch_loop",
        "grad_accumulation",
        """\
        for it in range(2):
            for micro in range(4):
                optimizer.zero_grad()  # <-- root cause
                xb, yb = loader[4 * it + micro]
                loss = F.cross_entropy(model(xb), yb) / 4
                loss.backward()
            optimizer.step()
        """,
        _setup_accum(),
        module=None,
        mentions=("3 thrown away", "once per optimizer step", "before"),
        doc="nanoGPT's micro-batch loop with zero_grad() moved into it.",
    ),
    _cell(
        "accumulation_step_every_micro_batch",
        "grad_accumulation",
        """\
        accum_steps = 4
        for i, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                print(f"step {i // accum_steps}: loss {loss.item() * accum_steps:.3f}")
            optimizer.step()  # <-- root cause
            optimizer.zero_grad()
        """,
        _setup_accum(),
        module=None,
        mentions=("divided by 4", "after every backward()", "in effect 4x smaller"),
        doc="step and zero_grad left outside the guard that only kept the logging: 8 steps, each on a quarter "
        "of one micro-batch's gradient.",
    ),
    _in_silent_file(
        "accumulation_helper_loss_not_divided",
        "grad_accumulation",
        """\
        sm.train_accumulating(model, optimizer, loader, accum_steps=4)
        """,
        _setup_accum(),
        module=None,
        bug="accum_loss_not_divided",
        mentions=("not divided by 4", "4.00x"),
        doc="the accumulation loop lives in the project's train.py.",
    ),
]

GRAD_ACCUMULATION_CORRECT = [
    _silent(
        "accumulation_divided_and_zeroed_after_step",
        """\
        accum_steps = 4
        for i, (xb, yb) in enumerate(loader):
            if i % accum_steps == 0:
                optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
        """,
        _setup_accum(),
    ),
    _silent(
        "accumulation_nanogpt_micro_batch_loop",
        """\
        for it in range(2):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(4):
                xb, yb = loader[4 * it + micro]
                loss = F.cross_entropy(model(xb), yb) / 4
                loss.backward()
            optimizer.step()
        """,
        _setup_accum(),
    ),
    _silent(
        "two_losses_two_backwards_one_step",
        """\
        for xb, yb in loader[:3]:
            optimizer.zero_grad()
            loss_real = F.cross_entropy(model(xb), yb)
            loss_real.backward()
            loss_fake = F.cross_entropy(model(xb.flip(0)), yb.flip(0))
            loss_fake.backward()
            optimizer.step()
        """,
        _setup_accum(),
    ),
    _silent(
        "lbfgs_closure_evaluated_several_times",
        """\
        for it in range(2):
            def closure():
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            optimizer.step(closure)
        """,
        _setup_accum(opt="lbfgs"),
    ),
    _silent(
        "halved_loss_and_a_logging_guard",
        """\
        for step, (xb, yb) in enumerate(loader):
            optimizer.zero_grad()
            loss = 0.5 * F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            if step % 4 == 0:
                print(f"step {step}: {loss.item():.3f}")
        """,
        _setup_accum(),
    ),
    _silent(
        "accumulation_helper_once_per_cell",
        """\
        optimizer.zero_grad()
        for xb, yb in loader[:4]:
            (F.cross_entropy(model(xb), yb) / 4).backward()
        optimizer.step()
        """,
        _setup_accum(),
    ),
]
