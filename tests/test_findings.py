"""backward_doctor against the scenarios in tests/scenarios/, via the public API only:

    report = bd.diagnose(source, namespace, timeout=..., memory_limit=...)

* failing scenarios: after ``runs`` runs of the cell in one namespace, the
  last report's ``findings[0]`` has the expected kind / line / file / module
  (and op where the scenario names one), and ``report.exception`` is the
  PyTorch error the plain run raises (tests/test_scenarios_plain.py proves
  those), ``torch.OutOfMemoryError`` for oom, None for nonfinite and for the
  silent no_grad_path scenario;
* CORRECT scenarios: ``report.ok`` and no findings over 3 runs, and a run
  under ``diagnose`` leaves bit-identical gradients, parameters and buffers
  to a plain ``exec`` of the same cell.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import backward_doctor as bd
import scenarios as S
from report_check import fits_the_schema


def _ids(scs):
    return [s.name for s in scs]


def diagnose(sc: S.Scenario, ns: dict, **overrides):
    kwargs = {**sc.kwargs, **overrides}
    return bd.diagnose(sc.source, ns, **kwargs)


def last_report(sc: S.Scenario, check: bool = True, **overrides):
    """Run the cell ``sc.runs`` times under diagnose in one namespace; return the last report, which fits
    backward_doctor/report/schema.json exactly (``check``)."""
    ns = sc.setup()
    for _ in range(sc.runs - 1):
        diagnose(sc, ns, **overrides)
    report = diagnose(sc, ns, **overrides)
    return fits_the_schema(report) if check else report


def _same_path(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def describe(report) -> str:
    lines = [f"ok={report.ok} exception={report.exception!r}"]
    for f in report.findings:
        lines.append(
            f"  {f.kind} line={f.line} file={f.file} module={f.module} op={f.op}: {f.message}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# failing scenarios
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sc", S.FAILING, ids=_ids(S.FAILING))
def test_root_cause_finding(sc):
    t0 = time.monotonic()
    report = last_report(sc, check=False)
    if sc.kind == "hang":
        # (a hang the watchdog missed never ends: any bound shows it; a loaded machine needs room)
        assert time.monotonic() - t0 < sc.kwargs["timeout"] * sc.runs + 120, "diagnose did not honour timeout"
    fits_the_schema(report)
    assert report.ok is False, describe(report)
    assert report.findings, describe(report)
    f = report.findings[0]

    got = {"kind": f.kind, "line": f.line, "module": f.module}
    want = {"kind": sc.kind, "line": sc.line, "module": sc.module}
    if sc.op is not None:
        got["op"], want["op"] = f.op, sc.op
    got["file"] = "buggy_models.py" if _same_path(f.file, sc.file) else f.file
    want["file"] = "buggy_models.py" if sc.file else None
    assert got == want, describe(report)

    if f.file is not None:
        assert os.path.isabs(f.file), f.file
    assert isinstance(f.line, int)
    assert isinstance(f.message, str) and f.message
    assert isinstance(f.fixes, list) and all(isinstance(x, str) for x in f.fixes)
    assert isinstance(f.evidence, dict)
    for name in sc.mentions:  # non-finite input data: the variable is named in the evidence
        assert name in repr(f.evidence), f.evidence


def _expected_exception(sc: S.Scenario):
    """(type name, message fragment) for report.exception, or None."""
    if sc.kind == "oom":
        return torch.OutOfMemoryError.__name__, ""
    if sc.raises is None:
        return None  # nonfinite and the silent no_grad_path scenario raise nothing
    exc_type, fragment = sc.raises
    return exc_type.__name__, fragment


EXC_SCENARIOS = [s for s in S.FAILING if s.kind != "hang"]  # what a hang reports is not specified


@pytest.mark.parametrize("sc", EXC_SCENARIOS, ids=_ids(EXC_SCENARIOS))
def test_report_exception(sc):
    report = last_report(sc)
    expected = _expected_exception(sc)
    if expected is None:
        assert report.exception is None, describe(report)
        return
    type_name, fragment = expected
    assert isinstance(report.exception, str), describe(report)
    head, sep, message = report.exception.partition(": ")
    assert head.rsplit(".", 1)[-1] == type_name, report.exception
    assert fragment in report.exception, report.exception


OOM = [s for s in S.FAILING if s.kind == "oom"]


@pytest.mark.parametrize("sc", OOM, ids=_ids(OOM))
def test_oom_scenario_is_fine_without_memory_limit(sc):
    """The only thing wrong with the oom steps is their size."""
    ns = sc.setup()
    kwargs = {k: v for k, v in sc.kwargs.items() if k != "memory_limit"}
    report = bd.diagnose(sc.source, ns, **kwargs)
    assert report.ok and report.findings == [], describe(report)


# ---------------------------------------------------------------------------
# correct scenarios
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sc", S.CORRECT, ids=_ids(S.CORRECT))
def test_correct_step_has_no_findings(sc):
    ns = sc.setup()
    for run in range(3):
        report = bd.diagnose(sc.source, ns)
        assert report.ok, f"run {run + 1}: {describe(report)}"
        assert report.findings == [], f"run {run + 1}: {describe(report)}"
        assert report.exception is None, f"run {run + 1}: {describe(report)}"


def _state(ns: dict):
    """Everything the step may change: params, their grads, module buffers, the loss."""
    out = {}
    for name, p in S.module_params(ns):
        out[name] = p.detach()
        out[name + ".grad"] = p.grad
    for var, value in ns.items():
        if isinstance(value, torch.nn.Module):
            for bname, b in value.named_buffers():
                out[f"{var}.{bname}"] = b
    if isinstance(ns.get("loss"), torch.Tensor):
        out["loss"] = ns["loss"].detach()
    return out


@pytest.mark.parametrize("sc", S.CORRECT, ids=_ids(S.CORRECT))
def test_correct_step_is_bit_identical_under_diagnose(sc):
    plain_ns = sc.setup()
    exec(compile(sc.source, "<cell>", "exec"), plain_ns)
    plain = _state(plain_ns)

    diag_ns = sc.setup()
    report = bd.diagnose(sc.source, diag_ns)
    assert report.ok, describe(report)
    diag = _state(diag_ns)

    assert plain.keys() == diag.keys()
    assert any(k.endswith(".grad") and v is not None for k, v in plain.items())
    for key, a in plain.items():
        b = diag[key]
        if a is None or b is None:
            assert a is None and b is None, key
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), key
