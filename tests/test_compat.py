"""Compatibility tier: correct steps on third-party code stay correct, silent and bit-identical.

For every workload in ``compat_workloads.py`` and each engine, the step runs twice from the same
seed: once plainly, once under ``backward_doctor.diagnose``. The doctor must report nothing, raise
nothing, and leave parameters, gradients, optimizer state, buffers, the namespace's tensors and the
RNG state bit-identical to the plain run (a compiled model is compared with a compiled plain run).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import backward_doctor as bd

from compat_workloads import WORKLOADS, bits as _bits

CELL = "<compat-cell>"




def _optimizers(value, seen) -> list[torch.optim.Optimizer]:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, dict):
        return [o for v in value.values() for o in _optimizers(v, seen)]
    return []


def state_of(ns: dict) -> dict[str, tuple]:
    """Everything a training step may change, as exact bits: parameters and their gradients, buffers,
    optimizer state, the namespace's tensors, the RNG state."""
    out: dict[str, tuple] = {}
    for name, value in ns.items():
        if name.startswith("__"):
            continue
        if isinstance(value, nn.Module):
            for pname, p in value.named_parameters():
                out[f"{name}.{pname}"] = _bits(p)
                out[f"{name}.{pname}.grad"] = _bits(p.grad) if p.grad is not None else None
            for bname, b in value.named_buffers():
                out[f"{name}.{bname}"] = _bits(b)
        elif isinstance(value, torch.Tensor):
            out[name] = _bits(value)
        for i, opt in enumerate(_optimizers(value, None)):
            for j, st in enumerate(opt.state.values()):
                for k, v in st.items():
                    out[f"{name}[{i}].state[{j}].{k}"] = _bits(v) if isinstance(v, torch.Tensor) else v
    out["rng"] = _bits(torch.get_rng_state())
    return out


def assert_same_state(plain: dict, doctored: dict) -> None:
    assert plain.keys() == doctored.keys()
    different = []
    for key, a in plain.items():
        b = doctored[key]
        if a is None or b is None or not isinstance(a, tuple):
            if a != b:
                different.append(key)
        elif a[:2] != b[:2] or not torch.equal(a[2], b[2]):
            different.append(key)
    assert not different, f"not bit-identical to the plain run: {different[:8]}"


def run_plain(name: str) -> dict:
    ns, src = WORKLOADS[name]()
    torch.manual_seed(1)
    exec(compile(src, CELL, "exec"), ns)
    return state_of(ns)


def run_doctored(name: str, engine: str) -> tuple[bd.Report, dict]:
    ns, src = WORKLOADS[name]()
    torch.manual_seed(1)
    report = bd.diagnose(src, ns, engine=engine)
    return report, state_of(ns)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_correct_step_is_silent_and_bit_identical(name: str, engine: str) -> None:
    plain = run_plain(name)
    report, doctored = run_doctored(name, engine)
    assert report.exception is None, report.exception
    assert report.trace.engine == engine
    assert report.findings == [], [f"{f.kind}: {f.message}" for f in report.findings]
    assert report.ok
    assert_same_state(plain, doctored)


def test_compiled_code_stays_compiled(engine: str) -> None:
    """The doctor compiles nothing differently: the same frames and graphs as a plain compiled step (its
    global hooks would be traced into the graph, and a Python mode would make dynamo fall back to eager),
    and the report says the step ran compiled code."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    seen = []
    for doctored in (False, True):
        dynamo.reset()
        counters.clear()
        ns, src = WORKLOADS["torch_compile"]()
        report = bd.diagnose(src, ns, engine=engine) if doctored else exec(compile(src, CELL, "exec"), ns)
        seen.append((dict(counters["frames"]), dict(counters["stats"]).get("unique_graphs"),
                     sum(counters["graph_break"].values())))
    assert seen[0] == seen[1] and seen[0][2] == 0, seen
    assert any(n.startswith("torch.compile: compiled code ran compiled") for n in report.trace.notes)
    assert any("compiled 1 time(s)" in n for n in report.trace.notes)


def test_compiled_module_shows_no_warning_about_the_doctors_hooks() -> None:
    import warnings

    ns, src = WORKLOADS["torch_compile"]()
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner = list(warnings.filters)
        report = bd.diagnose(src, ns)
        assert list(warnings.filters) == inner  # the doctor's filter entry went with it
    assert report.ok
    assert not [w for w in caught if "global hooks" in str(w.message)]
    assert list(warnings.filters) == before
