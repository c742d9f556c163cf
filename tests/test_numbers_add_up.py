"""Numbers a newcomer reads side by side must agree: the parameters of the models a step ran, the
iterations of a sampled loop, what ran ("the cell" for a loop), an exception without a message, a
message that already ends in a full stop. Both engines."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd

ENGINES = ["native", "python"]


def _engine(engine: str) -> str:
    from backward_doctor.capture.native_capture import native_available

    if engine == "native" and not native_available(build=True):
        pytest.skip("the native recorder is not built here")
    return engine


def _facts(report) -> str:
    return re.sub(r"<[^>]+>", " ", report.to_html())


class _Holder:
    """Holds what it is given as attributes (as Lightning's ``trainer.strategy`` holds the model)."""

    def __init__(self, **kw) -> None:
        vars(self).update(kw)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_parameters_fact_counts_the_models_the_step_ran_by_identity(engine):
    """A model reached only through a trainer's strategy (no name in the namespace names its parameters),
    an unused model beside it, and an out-of-memory step that stops before its last layer runs: the fact
    counts the 4 tensors of the model whose forward ran, with their exact bytes, of the 6 there are (it said
    all 6 were the step's: with no gradient yet, parameters were matched to the ops' modules by name)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 3), nn.ReLU(), nn.Linear(3, 2))
    ns = {"other": nn.Linear(100, 100), "torch": torch, "trainer": _Holder(strategy=_Holder(model=net))}
    src = "out = trainer.strategy.model(torch.randn(4096, 64))\nout.sum().backward()"
    # 1 MiB of input + 41.2 KB of weights + 48 KiB out of the first Linear fit; the ReLU's 48 KiB do not.
    report = bd.diagnose(src, ns, memory_limit=1_160_000, engine=_engine(engine))
    assert report.exception.startswith("OutOfMemoryError") and report.findings[0].op == "aten::relu"
    used = [p for p in report.trace.params if p.in_run_model]
    assert len(used) == 4 and sum(p.nbytes for p in used) == (64 * 3 + 3 + 3 * 2 + 2) * 4
    text = " ".join(_facts(report).split())
    assert "812 B 4 tensors, 4 trainable, of the models this step ran (6 in the namespace)" in text, text[:800]
    ok = bd.diagnose(src.replace("4096", "8"), ns, engine=engine)
    assert "812 B 4 tensors, 4 trainable, of the models this step ran (6 in the namespace)" in " ".join(
        _facts(ok).split())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_loop_is_the_cell_and_a_step_is_the_step(engine):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ns = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(8, 4), "F": F}
    loop = bd.diagnose("for i in range(60):\n    opt.zero_grad()\n    model(x).pow(2).mean().backward()\n"
                       "    opt.step()", ns, engine=_engine(engine))
    assert str(loop).startswith("backward_doctor: OK - the cell (60 optimizer steps) ran and nothing looks wrong")
    assert "The cell (60 optimizer steps) ran and nothing looks wrong" in loop.to_html()
    step = bd.diagnose("opt.zero_grad()\nmodel(x).pow(2).mean().backward()\nopt.step()", ns, engine=engine)
    assert str(step).startswith("backward_doctor: OK - the step ran and nothing looks wrong")


def test_an_exception_without_a_message_reads_without_a_colon():
    report = bd.diagnose("raise KeyboardInterrupt", {})
    assert report.exception == "KeyboardInterrupt"
    assert "exception: KeyboardInterrupt\n" in str(report) and "KeyboardInterrupt:" not in report.to_html()


def test_pytorchs_own_full_stop_is_not_doubled():
    """DataLoader workers re-raise with "... in DataLoader worker process 0." (its own full stop)."""
    src = "raise ValueError('Caught ValueError in DataLoader worker process 0.')"
    f = bd.diagnose(src, {}).findings[0]
    assert f.message == "The cell raised ValueError: Caught ValueError in DataLoader worker process 0."
    assert ".." not in str(bd.last_report())
