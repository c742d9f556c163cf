"""Objects in the user's namespace that raise when the doctor looks at them, on both engines.

The doctor reads the namespace before and after the cell (the models and optimizers it holds, tensors still
holding graphs, closures, trainers). A proxy whose ``__getattr__`` raises for every name (an RPC or lazy-import
proxy: ``hasattr(obj, "__dict__")`` raises its error, not ``AttributeError``) or an object whose ``__dict__`` is a
raising property once made ``diagnose()`` raise before the cell ran, and at the end of a run that did. Now they
are not read, the cell runs as without the doctor, and the report comes.
"""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd


class Proxy:
    """A remote object's proxy: every attribute it does not have is asked of a peer that is not there."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls = 0

    def __getattr__(self, name: str):
        raise RuntimeError(f"the remote end is gone (asked for {name!r})")


class NoDict:
    """A ``__dict__`` property that raises."""

    @property
    def __dict__(self):  # type: ignore[override]
        raise ValueError("no attributes here")


LOOP = """\
for i in range(12):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
seen.append(proxy)
"""


def _namespace() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return {"torch": torch, "model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-2),
            "x": torch.randn(16, 4), "y": torch.randn(16, 2), "proxy": Proxy(), "odd": NoDict(),
            "holder": [Proxy(), {"k": NoDict()}], "seen": []}


def _plain() -> dict:
    ns = _namespace()
    exec(LOOP, ns)
    return ns


@pytest.mark.parametrize("source", [LOOP, "loss = model(x).sum()\nloss.backward()\nopt.step()\n"],
                         ids=["loop", "step"])
def test_a_namespace_that_raises_when_read_is_left_unread_and_the_run_is_the_same(engine, source):
    plain = _namespace()
    exec(source, plain)
    ns = _namespace()
    report = bd.diagnose(source, namespace=ns, engine=engine)
    assert report.trace.exception is None
    assert not [f for f in report.findings if f.severity == "error"], [f.kind for f in report.findings]
    for (name, a), b in zip(plain["model"].state_dict().items(), ns["model"].state_dict().values()):
        assert torch.equal(a, b), name  # bit for bit
    assert isinstance(ns["proxy"], Proxy) and isinstance(ns["odd"], NoDict)
