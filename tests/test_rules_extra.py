"""Root causes that earlier versions got wrong (found while writing the teaching notebooks)."""
from __future__ import annotations

import torch

import backward_doctor as bd


def _ns():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    other = torch.nn.Linear(4, 1)  # a second, trainable model in the same notebook
    return {"torch": torch, "model": model, "other": other, "x": torch.randn(16, 4), "y": torch.randn(16, 1),
            "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_nan_weights_are_not_blamed_on_the_data():
    ns = _ns()
    with torch.no_grad():
        ns["model"][0].weight[0, 0] = float("nan")   # what an earlier bad step leaves behind
    report = bd.diagnose("loss = torch.nn.functional.mse_loss(model(x), y)\nloss.backward()\nopt.step()", ns)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.title == "Weights are already NaN/Inf" and f.line == 1
    assert "data is not to blame" in f.message


def test_frozen_model_is_named_even_when_another_model_could_train():
    ns = _ns()
    ns["model"].requires_grad_(False)
    report = bd.diagnose("loss = torch.nn.functional.mse_loss(model(x), y)\nloss.backward()", ns)
    f = report.findings[0]
    assert (f.kind, f.title, f.line, f.module) == ("no_grad_path", "All parameters frozen", 1, "model")


def test_fully_masked_attention_row_gets_the_mask_explanation():
    src = ("scores = torch.randn(4, 4, requires_grad=True)\n"
           "mask = torch.ones(4, 4, dtype=torch.bool).triu(0)   # masks the diagonal too: row 0 has nothing\n"
           "att = scores.masked_fill(mask, float('-inf')).softmax(-1)\n"
           "att.sum().backward()")
    f = bd.diagnose(src, {"torch": torch}).findings[0]
    assert (f.kind, f.line, f.op) == ("nonfinite", 3, "aten::masked_fill")
    assert "whole row is masked" in f.message


def test_item_round_trip_points_at_the_new_tensor_not_a_data_cut():
    src = ("out = model(x)\n"
           "value = torch.nn.functional.mse_loss(out, y).item()\n"
           "loss = torch.tensor(value)\n"
           "loss.backward()")
    f = bd.diagnose(src, _ns()).findings[0]
    assert f.kind == "no_grad_path" and f.evidence["cut"] in ("new_tensor", "item") and f.line in (2, 3)


def test_hang_on_a_lock_names_the_blocked_call():
    src = "import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()"
    f = bd.diagnose(src, timeout=0.5).findings[0]
    assert f.kind == "hang" and f.line == 4 and "`lock.acquire()`" in f.message


def test_a_float16_overflow_in_backward_says_what_float16_does_and_names_the_grad_scaler(engine):
    """A float16 weight whose backward overflows (``log``'s gradient 1/w is 1e5 at w = 1e-5, the forward finite):
    the origin, and the mixed-precision family's words (rules/amp.py) on float16's range and the GradScaler."""
    w = torch.nn.Parameter(torch.full((4,), 1e-5, dtype=torch.float16))
    ns = {"torch": torch, "w": w, "opt": torch.optim.SGD([w], lr=1e-6)}
    report = bd.diagnose("loss = torch.log(w).sum()\nloss.backward()\nopt.step()\n", ns, engine=engine)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.evidence["phase"] == "backward" and f.evidence["dtype"] == "float16", str(report)
    assert "It ran in float16: float16 overflows to inf above 65,504" in f.message
    assert "torch.amp.GradScaler" in f.message
