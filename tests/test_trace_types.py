"""The trace has no hidden schemas: every field is typed (nested dataclasses, not ``dict[str, Any]`` whose
keys one module writes and another reads), and a real trace survives JSON exactly, typed objects and all.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd
from backward_doctor.trace import (Carrier, ExceptionInfo, GraphHolder, LossInfo, OomInfo, OptimizerStep,
                                   OptimizerSummary, ParameterTotals, RunHistory, StaleStep, Trace)

#: Fields whose type still contains ``Any``, each with the reason. Nothing else may.
UNTYPED = {
    "MemoryTimeline.cuda": "allocator figures plus an NVML dict (or its error): CUDA only, not yet typed",
}
#: Maps with arbitrary keys stay dicts (typed values, no ``Any``): documented where they are declared.
OPEN_ENDED = {
    "OomInfo.by_module": "module path (or a label in parentheses) -> bytes",
    "OomInfo.by_category": "memory category -> bytes (as MemoryTimeline.peak_by_category)",
    "Trace.op_totals": "op name -> [count, total microseconds]",
}


def _has_any(tp: Any) -> bool:
    return tp is Any or any(_has_any(a) for a in typing.get_args(tp))


def _dataclasses_in(tp: Any) -> list[type]:
    if dataclasses.is_dataclass(tp):
        return [tp]
    return [c for a in typing.get_args(tp) for c in _dataclasses_in(a)]


def _fields(root: type) -> dict[str, Any]:
    """``Class.field`` -> type hint for every field reachable from ``root`` through nested dataclasses."""
    out: dict[str, Any] = {}
    todo, seen = [root], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f"{cls.__name__}.{f.name}"] = hints[f.name]
            todo.extend(_dataclasses_in(hints[f.name]))
    return out


def test_every_trace_field_is_typed():
    fields = {**_fields(Trace), **_fields(ExceptionInfo)}
    untyped = {name for name, tp in fields.items() if _has_any(tp)}
    assert untyped == set(UNTYPED), f"untyped fields: {sorted(untyped - set(UNTYPED))}; " \
                                    f"typed now, drop from UNTYPED: {sorted(set(UNTYPED) - untyped)}"
    for name in OPEN_ENDED:
        assert typing.get_origin(fields[name]) is dict, name


def _ns(batch: int = 8) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return {"F": F, "model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3),
            "x": torch.randn(batch, 16), "y": torch.randint(0, 4, (batch,)), "history": []}


# No zero_grad (a stale gradient on the second run) and the loss kept with its graph (a leak).
STEP = "out = model(x)\nloss = F.cross_entropy(out, y)\nloss.backward()\nopt.step()\nhistory.append(loss)\n"


def _typed(obj: Any, path: str = "trace") -> None:
    """Every value declared as a dataclass is one (no dict left where a record belongs)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        items = value if isinstance(value, list) else [value]
        classes = _dataclasses_in(tp)
        for i, item in enumerate(items):
            if item is None or not classes:
                continue
            assert isinstance(item, tuple(classes)), f"{path}.{f.name}[{i}] is {type(item).__name__}"
            _typed(item, f"{path}.{f.name}")


def _round_trip(trace: Trace) -> Trace:
    data = json.loads(json.dumps(trace.to_dict()))
    back = Trace.from_dict(data)
    assert back == trace
    assert back.to_dict() == data
    _typed(back)
    return back


def test_json_round_trip_of_a_real_trace_is_exact_and_typed():
    ns = _ns()
    bd.diagnose(STEP, ns)
    report = bd.diagnose(STEP, ns)
    assert {"graph_leak", "stale_grad"} <= {f.kind for f in report.findings}
    t = _round_trip(report.trace)
    assert isinstance(t.optimizer_steps[0], OptimizerStep) and t.optimizer_steps[0].optimizer == "Adam"
    assert isinstance(t.stale_steps[0], StaleStep) and t.stale_steps[0].since_run < t.run_id
    assert isinstance(t.optimizers[0], OptimizerSummary) and t.optimizers[0].name == "opt"
    assert any(isinstance(c, Carrier) and c.variable == "loss" for c in t.carriers)
    leaks = [h for h in t.graph_holders if h.earlier_runs]
    assert leaks and isinstance(leaks[0], GraphHolder) and leaks[0].path.startswith("history[")
    assert isinstance(t.history, RunHistory) and t.history.runs == 2 and len(t.history.live_bytes_end) == 2
    assert isinstance(t.parameters, ParameterTotals) and t.parameters.count == 4 and t.parameters.bytes > 0

    oom = bd.diagnose(STEP, _ns(batch=512), memory_limit="200KB")
    assert oom.findings[0].kind == "oom"
    t = _round_trip(oom.trace)
    info = t.exception.oom
    assert isinstance(info, OomInfo) and info.simulated and info.live > 0 and info.by_module
    assert set(info.by_category) == {"parameters", "gradients", "optimizer", "activations", "other"}
    assert t.exception.loss is None or isinstance(t.exception.loss, LossInfo)


def test_a_trace_saved_as_dicts_still_loads():
    """The JSON a trace had before these records were typed (the same keys, some left out) loads typed."""
    old = {
        "graph_holders": [{"path": "history[0]", "shape": [], "bytes": 4, "grad_fn": "NllLossBackward0",
                           "contained": True, "earlier_runs": [1], "own_run": None, "own_index": None,
                           "module": None, "store_file": None, "store_line": None, "store": "cell",
                           "graph_bytes": 0, "target": ["history"]},
                          {"path": "out", "shape": [8, 4], "bytes": 128, "grad_fn": "AddmmBackward0",
                           "contained": False, "earlier_runs": [], "own_run": 2, "own_index": 5, "module": None,
                           "store_file": None, "store_line": None, "store": "cell"}],
        "stale_steps": [{"index": 34, "optimizer": "Adam", "id": 1, "line": 4, "file": None, "cell_line": 4,
                         "params": 4, "since_run": 1, "previous_line": 4}],
        "optimizer_steps": [{"index": 34, "optimizer": "Adam", "id": 1, "line": 4, "file": None, "cell_line": 4}],
        "optimizers": [{"name": "opt", "type": "Adam", "param_bytes": 2704, "largest": 2048, "state_bytes": 0,
                        "momentum": False, "foreach": None, "device": "cpu"}],
        "carriers": [{"variable": "loss", "shape": [], "grad_fn": "NllLossBackward0", "key": 7}],
        "compiles": [{"trigger": "dynamo", "seconds": 1.25}],
        "nonfinite_hint": {"index": 7, "line": 1, "file": None},
        "parameters": {"count": 4, "trainable": 4, "bytes": 2704},
        "history": {},
        "exception": {"type": "OutOfMemoryError", "message": "Simulated device out of memory",
                      "loss": {"shape": [], "requires_grad": True, "grad_fn": "NllLossBackward0", "key": 9,
                               "writer": 8},
                      "oom": {"index": 24, "requested": 65536, "live": 244904,
                              "by_category": {"parameters": 2704, "activations": 73736},
                              "by_module": {"model.1": 65536, "(existing before the step)": 39568},
                              "simulated": True}},
    }
    t = Trace.from_dict(old)
    _typed(t)
    assert t.graph_holders[1].target is None and t.graph_holders[1].graph_bytes == 0
    assert t.history == RunHistory()
    assert t.compiles[0].seconds == 1.25 and t.nonfinite_hint.line == 1
    assert t.exception.oom.by_module["model.1"] == 65536 and t.exception.loss.writer == 8
    data = t.to_dict()
    # (fields added since then take their defaults: the old ones come back as they were)
    for key in ("stale_steps", "optimizer_steps"):
        assert [{k: v for k, v in d.items() if k in o} for d, o in zip(data[key], old[key])] == old[key], key
        assert all(d["function"] is None for d in data[key])
    for key in ("optimizers", "carriers", "compiles", "nonfinite_hint", "parameters"):
        assert data[key] == old[key], key
    oom = {k: v for k, v in data["exception"]["oom"].items() if k in old["exception"]["oom"]}
    assert data["exception"]["oom"]["eval_mode"] is False
    assert oom == old["exception"]["oom"] and data["exception"]["loss"] == old["exception"]["loss"]


def test_the_records_are_not_plain_dicts_anywhere():
    """No field of the trace's records is annotated as a bare dict or list of dicts of anything."""
    for name, tp in {**_fields(Trace), **_fields(ExceptionInfo)}.items():
        if name in UNTYPED:
            continue
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)] if typing.get_origin(tp) in (typing.Union, types.UnionType) \
            else [tp]
        for a in inner:
            if typing.get_origin(a) is list:
                assert typing.get_origin(typing.get_args(a)[0]) is not dict, name
