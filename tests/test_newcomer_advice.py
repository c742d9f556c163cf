"""Issue 47, as a first-time user meets it: the verdict and its advice come from what this run did.

* Item 2: the clip-before-unscale advice names Accelerate's clip only when Accelerate drove the GradScaler in
  this run (``accelerator.backward``), never because an ``accelerator`` sits in the namespace; no empty
  ``fix:`` block is ever printed.
* Item 3: an exception the user's own code raised (``raise SystemExit("training diverged")``, an ``assert``)
  after a problem the doctor located (NaN/Inf) is that problem's consequence: the problem is the headline,
  the exception is still reported, second, with its line. An error torch raised stays the headline.

The unit tier reads stored traces (``tests/unit/fixtures``) with a field changed; the real paths are
``backward_doctor.diagnose`` and ``python -m backward_doctor run`` in a subprocess.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.analysis import Finding, analyze
from backward_doctor.report import Report
from backward_doctor.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "unit" / "fixtures"


def _stored(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["trace"]


def _amp(trace: Trace) -> Finding:
    return next(f for f in analyze(trace) if f.kind == "amp_misuse")


# ---------------------------------------------------------------- item 2: unit tier
def test_an_accelerator_configured_elsewhere_does_not_change_a_plain_scalers_advice():
    """The namespace held an Accelerator set for 4 accumulation steps (``trace.accumulation.settings``), but this
    run's GradScaler was the user's own: unscale it, as in a fresh kernel."""
    plain = _amp(Trace.from_dict(_stored("amp_clip_before_unscale")))
    data = _stored("amp_clip_before_unscale")
    data["accumulation"]["settings"] = ["accelerator.gradient_accumulation_steps=4"]
    other = _amp(Trace.from_dict(data))
    assert plain.evidence["fix_code"].startswith("scaler.unscale_(")
    assert other.evidence["fix_code"] == plain.evidence["fix_code"] and other.message == plain.message
    assert "accelerator" not in other.message


def test_the_word_accelerator_in_the_cell_text_is_not_what_the_run_did():
    data = _stored("amp_clip_before_unscale")
    data["source"] += "\n# accelerator = Accelerator() is for the next experiment\n"
    f = _amp(Trace.from_dict(data))
    assert f.evidence["fix_code"].startswith("scaler.unscale_(") and "accelerator." not in f.message


def test_a_scaler_accelerate_drove_gets_accelerates_clip():
    """The clip record says Accelerate's ``backward`` scaled these gradients: its own clip unscales first."""
    data = _stored("amp_clip_before_unscale")
    data["precision"]["clips"][0]["scaled_by"] = "accelerate"
    f = _amp(Trace.from_dict(data))
    assert f.evidence["fix_code"] == "accelerator.clip_grad_norm_(model.parameters(), 1)"
    assert "`accelerator.clip_grad_norm_(model.parameters(), 1)` (it unscales first)" in f.message


@pytest.mark.parametrize("code", ["", "   ", "\n\n", " \n  \n"])
def test_no_empty_fix_block_is_printed(code):
    trace = Trace.from_dict(_stored("amp_clip_before_unscale"))
    f = _amp(trace)
    f.evidence["fix_code"] = code
    text = str(Report(findings=[f], trace=trace))
    assert "fix:" not in text and "Mixed precision misused" in text


def test_a_fix_block_with_code_is_printed_without_blank_lines_around_the_code():
    trace = Trace.from_dict(_stored("amp_clip_before_unscale"))
    f = _amp(trace)
    f.evidence["fix_code"] = "\nscaler.unscale_(opt)\n\nclip()\n"
    lines = str(Report(findings=[f], trace=trace)).splitlines()
    at = lines.index("    fix:")
    assert lines[at + 1:at + 4] == ["      scaler.unscale_(opt)", "", "      clip()"]  # (a blank line inside stays)
    assert not lines[at + 4].startswith("      ")
    html = Report(findings=[f], trace=trace).to_html()
    assert "<pre style=\"padding:6px 8px\">scaler.unscale_(opt)\n\nclip()</pre>" in html
    f.evidence["fix_code"] = " \n "
    assert "padding:6px 8px" not in Report(findings=[f], trace=trace).to_html()


# ---------------------------------------------------------------- item 2: the real path
_PLAIN_AMP = """\
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = F.cross_entropy(model(x), y)
scaler.scale(loss).backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()
"""


def _amp_namespace(**extra: object) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    return dict(torch=torch, F=F, model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1),
                scaler=torch.amp.GradScaler("cpu"), x=torch.randn(8, 10), y=torch.randint(0, 3, (8,)), **extra)


def _fresh_accelerator(**kwargs: object):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is a test dependency (pyproject [test])")
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps process-wide singletons: a fresh accelerator, not the last test's.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, **kwargs)


def test_diagnose_a_plain_scaler_cell_with_an_accelerator_from_an_earlier_cell():
    fresh = bd.diagnose(_PLAIN_AMP, _amp_namespace())
    ns = _amp_namespace(accelerator=_fresh_accelerator(gradient_accumulation_steps=4))
    report = bd.diagnose(_PLAIN_AMP, ns)
    f = report.findings[0]
    assert f.kind == "amp_misuse" and f.evidence["problem"] == "clip_before_unscale"
    assert f.evidence["fix_code"] == fresh.findings[0].evidence["fix_code"] == \
        "scaler.unscale_(opt)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
    text = str(report)
    assert "accelerator" not in text and "      scaler.unscale_(opt)" in text
    assert f.message == fresh.findings[0].message


def test_diagnose_a_step_whose_scaler_accelerate_drives_gets_accelerates_clip():
    """``accelerator.backward(loss)`` scales the loss with ``accelerator.scaler`` (Accelerate builds one for fp16
    on a GPU; on this CPU the test hands it a CPU GradScaler, the same class): the run records that Accelerate
    drove the scaler, and the advice is Accelerate's clip."""
    acc = _fresh_accelerator()
    acc.scaler = torch.amp.GradScaler("cpu")
    cell = _PLAIN_AMP.replace("scaler.scale(loss).backward()", "accelerator.backward(loss)") \
        .replace("scaler.", "accelerator.scaler.")
    report = bd.diagnose(cell, _amp_namespace(accelerator=acc))
    f = report.findings[0]
    assert f.kind == "amp_misuse" and report.trace.precision.clips[0].scaled_by == "accelerate"
    assert f.evidence["fix_code"] == "accelerator.clip_grad_norm_(model.parameters(), 1)"


# ---------------------------------------------------------------- item 3: unit tier
_GUARD = "if not torch.isfinite(loss):\n    raise SystemExit(\"training diverged\")\n"


def _guarded(raised: bool = True, user: bool = True, type_: str = "SystemExit",
             name: str = "nan_from_log_of_negative") -> dict:
    """A stored trace (by default NaN from a log of a negative at line 3) with a guard after the step that raised."""
    data = _stored(name)
    data["source"] = data["source"].rstrip("\n") + "\n" + _GUARD
    line = data["source"].count("\n")  # the raise, the last line
    frames = [{"file": "<cell>", "line": line, "function": "<module>", "in_cell": True, "user": True,
               "code": 'raise SystemExit("training diverged")'}]
    if not user:  # raised inside a library's own Python code the cell called
        frames.append({"file": "/site-packages/torch/nn/functional.py", "line": 3000, "function": "check",
                       "in_cell": False, "user": False, "code": "raise ValueError(msg)"})
    data["exception"] = {"type": type_, "message": "training diverged", "frames": frames,
                         "where": {"line": line, "cell_line": line}, "raised": raised}
    data["completed"] = False
    return data


def test_a_guard_the_user_raised_after_nan_is_the_consequence_not_the_headline():
    findings = analyze(Trace.from_dict(_guarded()))
    assert [f.kind for f in findings] == ["nonfinite", "exception"]
    first, exc = findings
    assert first.line == 3
    assert exc.line == 7 and exc.severity == "warning" and "SystemExit: training diverged" in exc.message
    assert "consequence" in exc.message and "consequence" in exc.title
    report = Report(findings=findings, exception="SystemExit: training diverged", trace=Trace.from_dict(_guarded()))
    text = str(report)
    assert text.splitlines()[0].startswith("backward_doctor: PROBLEM - NaN/Inf created here at cell line 3")
    assert "exception: SystemExit: training diverged" in text and "cell line 7" in text


def test_an_assert_is_a_guard_too():
    findings = analyze(Trace.from_dict(_guarded(type_="AssertionError")))
    assert [f.kind for f in findings] == ["nonfinite", "exception"]


@pytest.mark.parametrize("changes", [{"raised": False}, {"user": False}])
def test_an_error_torch_raised_stays_the_headline(changes):
    """Not raised by a ``raise`` statement (a C++ error surfacing at the call), or raised inside a library's code:
    the exception is what it was, first."""
    findings = analyze(Trace.from_dict(_guarded(**changes)))
    assert findings[0].kind == "exception" and findings[0].severity == "error"
    assert "consequence" not in findings[0].message
    assert [f.kind for f in findings][1:] == ["nonfinite"]


def test_a_guard_without_a_problem_found_stays_the_headline():
    data = _guarded(name="healthy_step")
    findings = analyze(Trace.from_dict(data))
    assert [f.kind for f in findings] == ["exception"] and findings[0].severity == "error"


def test_the_rules_stay_pure_on_a_guarded_trace():
    data = _guarded()
    trace = Trace.from_dict(copy.deepcopy(data))
    a, b = analyze(trace), analyze(trace)
    assert [f.to_dict() for f in a] == [f.to_dict() for f in b] and trace.to_dict() == Trace.from_dict(data).to_dict()


def test_diagnose_a_torch_error_caused_by_nan_stays_the_headline():
    """``torch.multinomial`` refusing NaN probabilities is torch's error, not the user's guard: it stays first."""
    cell = "p = torch.log(w - 10).exp()\nloss = p.sum()\nloss.backward()\ntorch.multinomial(p.detach(), 1)\n"
    report = bd.diagnose(cell, {"torch": torch, "w": torch.ones(4, requires_grad=True)})
    assert report.exception and report.exception.startswith("RuntimeError")
    assert report.findings[0].kind != "nonfinite" and "consequence" not in report.findings[0].message


# ---------------------------------------------------------------- item 3: the CLI, as a process
SCRIPT = """\
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
xs = torch.randn(40, 8, 10)
ys = torch.randint(0, 3, (40, 8))
xs[20, 3, 4] = float("nan")
losses = []
for i in range(40):
    x, y = xs[i], ys[i]
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if not torch.isfinite(loss):
        raise SystemExit("training diverged")
print("done")
"""


@pytest.mark.slow
def test_cli_run_a_script_whose_guard_exits_after_nan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "reports"
    done = subprocess.run([sys.executable, "-m", "backward_doctor", "run", "--output-dir", str(out), str(script)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 1 and "training diverged" in done.stderr  # as python runs it
    head = done.stderr.splitlines()[0]
    assert head.startswith("backward_doctor: PROBLEM - Non-finite values in the input data at train.py, line 13"), \
        done.stderr[:1500]
    assert "SystemExit" not in head and "iteration 20" in head
    saved = json.loads((out / "backward_doctor-report.json").read_text(encoding="utf-8"))
    kinds = [f["kind"] for f in saved["findings"]]
    assert kinds[:2] == ["nonfinite", "exception"], kinds
    exc = saved["findings"][1]
    assert (exc["line"], exc["file"], exc["place"], exc["iteration"]) == (18, None, "train.py", 20)  # the script
    assert "consequence" in exc["message"] and exc["severity"] == "warning"
    assert saved["exception"] == "SystemExit: training diverged"
    assert "[2] SystemExit raised by your code (a consequence) at train.py, line 18" in done.stderr


def _stuck_trace(settings: list[str]) -> Trace:
    """bf16 weights whose AdamW updates rounded away (90 of 100 sampled values unchanged) in a plain cell."""
    from backward_doctor.trace.precision import LowPrecisionUpdate

    trace = Trace(source="loss = model(x).sum()\nloss.backward()\noptimizer.step()\n")
    trace.precision.updates = [LowPrecisionUpdate(iteration=0, optimizer="AdamW", dtype="bfloat16", lr=1e-4,
                                                  sampled=100, unchanged=90, line=3, cell_line=3)]
    trace.accumulation.settings = settings
    return trace


def test_a_trainer_left_in_the_namespace_does_not_change_a_plain_cells_bf16_advice():
    plain = _amp(_stuck_trace([]))
    other = _amp(_stuck_trace(["trainer.args.gradient_accumulation_steps=4"]))
    assert other.evidence["problem"] == "update_below_precision" and other.message == plain.message
    assert "torch.autocast" in other.message and "TrainingArguments" not in other.message
