"""no_grad_path: the loss (or part of it) never reaches the parameters' graph."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import buggy_models as bm
from scenario_kit import _cell, _in_file, _ns, module_params
from ._setups import _setup_mlp_classifier, _STD_STEP, _setup_distillation


def no_param_got_grad(ns: dict) -> bool:
    """True when no nn.Module parameter received a gradient (the loss itself may be a leaf)."""
    return all(p.grad is None for _, p in module_params(ns, leaves=False))


NO_GRAD_FN = (RuntimeError, "does not require grad and does not have a grad_fn")


def _setup_numpy_metric():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        x=torch.randn(32, 10),
        y_np=np.random.default_rng(0).normal(size=(32, 1)).astype(np.float32),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_two_heads():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    cls_head, box_head = nn.Linear(32, 3), nn.Linear(32, 4)
    params = [p for m in (backbone, cls_head, box_head) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 16),
        y=torch.randint(0, 3, (16,)),
        boxes=torch.rand(16, 4),
        backbone=backbone,
        cls_head=cls_head,
        box_head=box_head,
        optimizer=torch.optim.SGD(params, lr=0.1),
    )


def _setup_finetune_all_frozen():
    torch.manual_seed(0)
    model = bm.FineTuneNet(20, 32, 5)
    model.freeze_backbone()
    return _ns(
        x=torch.randn(32, 20),
        y=torch.randint(0, 5, (32,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_linear_probe():
    torch.manual_seed(0)
    model = bm.LinearProbe(10, 3)
    return _ns(
        x=torch.randn(32, 10),
        y=torch.randint(0, 3, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


NO_GRAD = [
    _cell(
        "distillation_student_inside_no_grad_block",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            teacher_logits = teacher(x)
            student_logits = student(x)  # <-- root cause
        loss = F.kl_div(
            F.log_softmax(student_logits / T, dim=-1),
            F.softmax(teacher_logits / T, dim=-1),
            reduction="batchmean",
        ) * T * T
        loss.backward()
        optimizer.step()
        """,
        _setup_distillation,
        module="student",
        raises=NO_GRAD_FN,
        doc="knowledge distillation: the student forward slipped into the teacher's no_grad block. "
        "The (frozen) teacher's no_grad is legitimate: only the student's op consumes "
        "parameters that require grad, so the graph is cut at the student line.",
    ),
    _cell(
        "detach_for_logging_reused_for_loss",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        logits = model(x).detach()  # <-- root cause
        acc = (logits.argmax(1) == y).float().mean()
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_mlp_classifier(opt="sgd"),
        module=None,
        raises=NO_GRAD_FN,
        doc="logits detached for an accuracy metric, then reused for the loss.",
    ),
    _cell(
        "numpy_metric_used_as_loss",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = torch.tensor(np.mean((pred.detach().numpy() - y_np) ** 2))  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_numpy_metric,
        module=None,
        raises=NO_GRAD_FN,
        doc="loss computed in numpy (after the detach() numpy() demands) and wrapped back.",
    ),
    _cell(
        "loss_rebuilt_from_item_with_requires_grad",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        h = backbone(x)
        loss_cls = F.cross_entropy(cls_head(h), y)
        loss_box = F.l1_loss(box_head(h).sigmoid(), boxes)
        loss = torch.tensor(loss_cls.item() + 0.5 * loss_box.item(), requires_grad=True)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_two_heads,
        module=None,
        check=no_param_got_grad,
        doc="multi-task loss summed via .item(); requires_grad=True silences the error, "
        "so nothing raises and no parameter ever gets a gradient.",
    ),
    _cell(
        "all_parameters_frozen",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_finetune_all_frozen,
        module="model",
        raises=NO_GRAD_FN,
        doc="fine-tuning where freeze_backbone() (buggy_models.py) froze the head as well.",
    ),
    _in_file(
        "no_grad_decorator_on_forward",
        "no_grad_path",
        _STD_STEP,
        _setup_linear_probe,
        module="model.fc",
        bug="no_grad_forward",
        raises=NO_GRAD_FN,
        doc="@torch.no_grad() on forward (copied from a predict helper).",
    ),
]
