"""Issue 3 -- silent training bugs across runs -- via the public API only.

    report = bd.diagnose(source, namespace)   # same source + same dict = the same cell again

* ``FAILING`` scenarios (tests/scenarios/, ``scenarios.silent``): after ``runs`` runs of the
  cell in one namespace, the last report holds a finding of the scenario's kind
  whose line / file / module (and op, when named) are the expected ones, whose
  message names the variable / parameters / shapes involved and the fix, and no
  finding of an unrelated kind (zero false alarms).
* ``SILENT`` scenarios: ``report.findings == []`` on every one of
  ``max(3, runs)`` runs, and one run under ``diagnose`` leaves bit-identical
  gradients, parameters and buffers to a plain ``exec`` of the same cell.
* ``amp_skipped`` on CPU with ``torch.amp.GradScaler("cpu")`` and an inf loss.

Where the engine is known to disagree with the issue, the scenario lists the
aspect in ``known_engine_gaps`` and exactly that test is ``xfail(strict=True)``:
the expectation stays what the issue asks for, and fixing the engine turns the
xfail into an XPASS failure that asks for the marker to be removed.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from scenarios import silent as S
from report_check import fits_the_schema
from scenarios._setups import _setup_classifier


def _params(scenarios, aspect):
    """pytest params; ``xfail(strict=True)`` where the scenario records an engine gap for ``aspect``."""
    out = []
    for sc in scenarios:
        gaps = sc.known_engine_gaps
        reason = gaps.get(aspect)
        if reason is None and aspect in ("location", "message"):
            reason = gaps.get("finding")  # no finding at all: neither where nor what can be right
        marks = [pytest.mark.xfail(strict=True, reason=f"engine: {reason}")] if reason else []
        out.append(pytest.param(sc, id=sc.name, marks=marks))
    return out


def describe(report) -> str:
    lines = [f"ok={report.ok} exception={report.exception!r}"]
    for f in report.findings:
        lines.append(f"  {f.kind} line={f.line} file={f.file} module={f.module} op={f.op}: {f.message}")
    return "\n".join(lines)


def run_cell(sc: S.Scenario, runs: int | None = None):
    """All reports of ``runs`` (default ``sc.runs``) runs of the cell in one fresh namespace."""
    ns = sc.setup()
    return [fits_the_schema(bd.diagnose(sc.source, ns, **sc.kwargs)) for _ in range(runs or sc.runs)]


def finding_of(report, kind):
    found = [f for f in report.findings if f.kind == kind]
    assert found, f"no {kind} finding:\n{describe(report)}"
    return found[0]


def without_quoted_code(message: str, sc: S.Scenario, f) -> str:
    """The message minus the source lines it quotes: a name must be *said*, not just quoted."""
    lines = [t.strip() for t in sc.source.splitlines()]
    if f.file is not None and f.line is not None:
        import linecache

        lines.append(linecache.getline(f.file, f.line).strip())
    for text in sorted({t for t in lines if t}, key=len, reverse=True):
        message = message.replace(text, "")
    return message


def _same_path(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


# ---------------------------------------------------------------------------
# failing scenarios: where, what, and nothing else
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sc", _params(S.FAILING, "location"))
def test_finding_location(sc):
    reports = run_cell(sc)
    report = reports[-1]
    assert report.exception is None, describe(report)  # silent bugs raise nothing
    f = finding_of(report, sc.kind)

    got = {"kind": f.kind, "line": f.line, "module": f.module}
    want = {"kind": sc.kind, "line": sc.line, "module": sc.module}
    if sc.op is not None:
        got["op"], want["op"] = f.op, sc.op
    got["file"] = "silent_models.py" if _same_path(f.file, sc.file) else f.file
    want["file"] = "silent_models.py" if sc.file else None
    assert got == want, describe(report)
    if f.file is not None:
        assert os.path.isabs(f.file), f.file

    if sc.kind == "stale_grad":  # the first run's gradients were fresh: no stale_grad before the last run
        for run, earlier in enumerate(reports[:-1], start=1):
            assert not [x for x in earlier.findings if x.kind == "stale_grad"], f"run {run}: {describe(earlier)}"


@pytest.mark.parametrize("sc", _params(S.FAILING, "message"))
def test_finding_message(sc):
    report = run_cell(sc)[-1]
    f = finding_of(report, sc.kind)
    assert isinstance(f.message, str) and f.message
    said = without_quoted_code(f.message, sc, f)
    missing = [m for m in sc.mentions if m not in said]
    assert not missing, f"message lacks {missing} (outside quoted code):\n{f.message}"
    assert isinstance(f.evidence, dict) and f.evidence
    if sc.kind == "graph_leak":
        # which variable, how many bytes it keeps alive (a size with a unit), the fix
        assert re.search(r"\d+(\.\d+)?\s?(B|KB|KiB|MB|MiB|GB|GiB)\b", said), f.message
        assert ".detach()" in said or ".item()" in said, f.message
    elif sc.kind == "broadcast":
        assert "squeeze" in said or "view_as" in said or "reshape" in said, f.message
    elif sc.kind == "stale_grad":
        assert f.severity in ("error", "warning")
    elif sc.kind == "amp_skipped":
        assert f.severity == "info", "amp_skipped is informational"
        # every run skipped its step: the message counts them all
        assert re.search(rf"\b{sc.runs}\b", said), f.message


@pytest.mark.parametrize("sc", _params(S.FAILING, "extra"))
def test_no_unrelated_findings(sc):
    """One bug, one kind of finding (plus the root cause an informational one points at)."""
    report = run_cell(sc)[-1]
    allowed = {sc.kind, *sc.also}
    extra = [f.kind for f in report.findings if f.kind not in allowed]
    assert not extra, describe(report)


# ---------------------------------------------------------------------------
# must stay silent
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sc", _params(S.SILENT, "silent"))
def test_correct_cell_stays_silent(sc):
    ns = sc.setup()
    for run in range(1, max(3, sc.runs) + 1):
        report = bd.diagnose(sc.source, ns, **sc.kwargs)
        assert report.exception is None, f"run {run}: {describe(report)}"
        assert report.findings == [], f"run {run}: {describe(report)}"


def _state(ns: dict) -> dict:
    """Every parameter, its gradient and every buffer reachable from the namespace, plus the loss."""
    out = {}
    seen = set()

    def add(name, p):
        if id(p) in seen:
            return
        seen.add(id(p))
        out[name] = p.detach()
        out[name + ".grad"] = p.grad

    for var, value in ns.items():
        if isinstance(value, nn.Module):
            for pname, p in value.named_parameters():
                add(f"{var}.{pname}", p)
            for bname, b in value.named_buffers():
                out[f"{var}.{bname}"] = b
        elif isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad:
            add(var, value)
        elif isinstance(value, list) and value and all(isinstance(t, torch.Tensor) for t in value):
            for i, t in enumerate(value):
                if t.requires_grad:
                    add(f"{var}[{i}]", t)
                else:
                    out[f"{var}[{i}]"] = t
    if isinstance(ns.get("loss"), torch.Tensor):
        out["loss"] = ns["loss"].detach()
    return out


@pytest.mark.parametrize("sc", [pytest.param(sc, id=sc.name) for sc in S.SILENT])
def test_correct_cell_bit_identical_under_diagnose(sc):
    plain_ns = sc.setup()
    exec(compile(sc.source, "<cell>", "exec"), plain_ns)
    plain = _state(plain_ns)

    diag_ns = sc.setup()
    report = bd.diagnose(sc.source, diag_ns, **sc.kwargs)
    assert report.exception is None, describe(report)
    diag = _state(diag_ns)

    assert plain.keys() == diag.keys()
    assert any(k.endswith(".grad") and v is not None for k, v in plain.items()), "the cell computed no gradient"
    for key, a in plain.items():
        b = diag[key]
        if a is None or b is None:
            assert a is None and b is None, key
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), key


# ---------------------------------------------------------------------------
# amp_skipped on CPU, and what a graph leak keeps alive
# ---------------------------------------------------------------------------

_INF_LOSS_STEP = """\
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(x)
loss = F.cross_entropy(logits.float(), y) * loss_weight
scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
"""


def _amp_ns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    return {
        "torch": torch,
        "F": F,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "scaler": torch.amp.GradScaler("cpu"),
        "x": torch.randn(16, 10),
        "y": torch.randint(0, 3, (16,)),
        "loss_weight": float("inf"),  # a loss weight read from a config that says "inf"
    }


def test_amp_skipped_on_cpu_grad_scaler_with_inf_loss():
    ns = _amp_ns()
    before = [p.detach().clone() for p in ns["model"].parameters()]
    scales = []
    for _ in range(3):
        report = bd.diagnose(_INF_LOSS_STEP, ns)
        scales.append(ns["scaler"].get_scale())
    # the scaler really skipped: weights untouched, scale backed off each time
    assert all(torch.equal(a, p) for a, p in zip(before, ns["model"].parameters()))
    assert scales == sorted(scales, reverse=True) and scales[0] > scales[-1]

    assert report.exception is None, describe(report)
    f = finding_of(report, "amp_skipped")
    step_line = _INF_LOSS_STEP.splitlines().index("scaler.step(optimizer)") + 1
    assert (f.line, f.file, f.module, f.severity) == (step_line, None, None, "info"), describe(report)
    assert re.search(r"\b3\b", f.message), f.message  # three runs, three skipped steps


def test_amp_finite_loss_is_not_reported():
    ns = _amp_ns()
    ns["loss_weight"] = 1.0
    for run in range(3):
        report = bd.diagnose(_INF_LOSS_STEP, ns)
        assert report.findings == [], f"run {run + 1}: {describe(report)}"


def test_graph_leak_counts_one_more_graph_each_run():
    """Run after run, the leak finding counts one more kept graph and names the entries holding them."""
    sc = S.BY_NAME["loss_tensor_appended_to_history"]
    reports = run_cell(sc, runs=4)
    for run, report in enumerate(reports, start=1):
        leaks = [f for f in report.findings if f.kind == "graph_leak"]
        if run == 1:
            continue  # a single run may or may not be called a leak yet
        assert leaks, f"run {run}: {describe(report)}"
        f = leaks[0]
        assert f.evidence.get("graphs") == run - 1, f.evidence
        assert re.search(rf"\b{run - 1}\b", f.message), f.message
        assert all(f"history[{i}]" in f.message for i in range(min(run - 1, 4))), f.message


def test_graph_leak_reports_the_bytes_the_graphs_keep_alive():
    sc = S.BY_NAME["validation_loss_without_no_grad_appended"]
    ns = sc.setup()
    hidden = ns["model"][0].out_features
    per_graph = ns["x_val"].shape[0] * hidden * 4  # the ReLU output saved by each validation graph
    for _ in range(3):
        report = bd.diagnose(sc.source, ns)
    f = finding_of(report, "graph_leak")
    assert f.evidence["graphs"] == 2, f.evidence
    assert f.evidence["bytes"] >= 2 * per_graph, f"{f.evidence['bytes']} B reported, >= {2 * per_graph} B kept alive"


_BACKWARD_CELL = """\
optimizer.zero_grad({args})
loss = F.cross_entropy(model(x), y)
loss.backward()
"""
_STEP_CELL = """\
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
"""


@pytest.mark.parametrize(
    "args",
    [
        pytest.param("", id="set_to_none"),
        pytest.param("set_to_none=False", id="zeroed_in_place"),
    ],
)
def test_zero_grad_in_another_cell_is_not_stale(args):
    """A notebook split in two cells (zero_grad + backward | clip + step), run alternately."""
    ns = _setup_classifier()
    backward_cell = _BACKWARD_CELL.format(args=args)
    for run in range(1, 4):
        for cell in (backward_cell, _STEP_CELL):
            report = bd.diagnose(cell, ns)
            assert report.findings == [], f"run {run}, cell {cell.splitlines()[-1]!r}: {describe(report)}"


def test_scenario_markers_are_consistent():
    """Every file-side expectation points at a BUG marker, every cell one at a root-cause marker."""
    for sc in S.FAILING:
        assert sc.kind in S.KINDS, sc.name
        if sc.file is None:
            assert sc.line == S.cell_line(sc.source), sc.name
        else:
            assert sc.file == S.SILENT_MODELS_FILE and sc.line is not None, sc.name
    kinds = {sc.kind for sc in S.FAILING}
    assert kinds == set(S.KINDS)
    for kind in S.KINDS:  # at least one scenario in the cell and one in model code, per kind
        assert any(sc.kind == kind and sc.file is None for sc in S.FAILING), kind
        assert any(sc.kind == kind and sc.file is not None for sc in S.FAILING), kind
