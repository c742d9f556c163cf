"""Which torch: what pyproject declares is what was tested, the running torch is within it, and one of
PyTorch's error wordings the report quotes is pinned, so a run on another torch (``make torch-versions``)
shows when PyTorch rewords what users read."""
from __future__ import annotations

import os
import re

import torch

import backward_doctor as bd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared_minimum() -> tuple[int, int]:
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:
        text = fh.read()
    found = re.findall(r'"torch>=(\d+)\.(\d+)"', text)
    assert len(found) == 1, "pyproject.toml declares torch once, as a lower bound (torch>=X.Y)"
    return int(found[0][0]), int(found[0][1])


def test_the_declared_torch_is_the_oldest_tested_and_this_one_is_within_it():
    """pyproject says torch>=2.10 (the oldest `make torch-versions` runs, TORCH_OLDEST in the Makefile):
    never a version nobody ran. No upper bound: pip would otherwise replace a newer torch a person has."""
    low = _declared_minimum()
    assert low == (2, 10)
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as fh:
        assert f"TORCH_OLDEST ?= {low[0]}.{low[1]}.0" in fh.read()
    running = tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert running >= low, f"torch {torch.__version__} is older than pyproject declares"


def test_pytorchs_newer_wording_of_int32_class_labels_is_pinned_and_both_wordings_are_read():
    """Class labels stored as int32 (`np.int32` data): torch 2.13 says "expected target dtype to be Long or Byte,
    but got Int"; torch 2.10 said "expected scalar type Long but found Int". The dtype rule reads both (the
    second half of this test), and this test pins the newer wording, so on 2.10 it fails by design: it is how
    `make torch-versions` shows, on the oldest torch, that a wording the report quotes has moved."""
    from backward_doctor.analysis import analyze
    from backward_doctor.trace.records import ExceptionInfo, Trace

    torch.manual_seed(0)
    ns = {"torch": torch, "F": torch.nn.functional, "model": torch.nn.Linear(4, 3), "x": torch.randn(8, 4),
          "y": torch.randint(0, 3, (8,), dtype=torch.int32)}
    report = bd.diagnose("loss = F.cross_entropy(model(x), y)\nloss.backward()", ns)
    assert report.findings[0].kind == "dtype_mismatch" and report.findings[0].line == 1
    assert report.exception == "RuntimeError: expected target dtype to be Long or Byte, but got Int"
    for words in ("expected target dtype to be Long or Byte, but got Int", "expected scalar type Long but found Int"):
        trace = Trace(exception=ExceptionInfo("RuntimeError", words))
        assert [f.kind for f in analyze(trace)] == ["dtype_mismatch"], words


def test_pytorchs_newer_wording_of_grad_without_inputs():
    """`torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])` with every parameter
    frozen: torch 2.13 raises RuntimeError "`inputs` argument to `grad()` cannot be empty." in Python; torch
    2.10 raised ValueError "grad requires non-empty inputs." from C++. The report quotes PyTorch's words (this
    test fails on 2.10 by design, as the one above)."""
    model = torch.nn.Linear(4, 2)
    model.requires_grad_(False)
    ns = {"torch": torch, "model": model, "x": torch.randn(3, 4, requires_grad=True)}  # the loss has a graph
    report = bd.diagnose("loss = model(x).pow(2).sum()\n"
                         "grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])", ns)
    assert report.exception == "RuntimeError: `inputs` argument to `grad()` cannot be empty."
    f = report.findings[0]
    assert (f.kind, f.line) == ("exception", 2)
    assert f.message == "The cell raised RuntimeError: `inputs` argument to `grad()` cannot be empty."
