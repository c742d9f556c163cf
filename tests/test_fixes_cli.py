"""``--fix`` from the command line (a script is one cell) and from the ``%%backward_doctor`` magic."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import backward_doctor as bd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

SCRIPT = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xb, yb = torch.randn(512, 32), torch.randint(0, 4, (512,))
    a = 1; b = 2; c = a + b
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
""")


def test_cli_fix_reruns_a_script_with_accumulation(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", str(script), "--memory-limit", "1.2MB",
                           "--fix", "accumulate:4", "--json", str(out)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr          # the fixed step runs
    assert "fix accumulate:4: applied, the step ran" in proc.stdout
    # "OK" alone would hide that the original step ran out of memory
    assert proc.stdout.startswith("backward_doctor: FIXED - the step ran with accumulate:4; without it: Out of memory "
                                  "at step.py, line 10")
    assert "code to keep" in proc.stdout and "xb_micro = xb[start:start + micro_size]" in proc.stdout
    data = json.loads(out.read_text())
    fr = data["fix_result"]
    # The code is printed as it is (no "| " before each line), between two rulers: it pastes unchanged.
    printed = proc.stdout.split(" 8< " + "-" * 40 + "\n", 1)[1].split("\n" + "-" * 40 + " >8 ", 1)[0]
    assert printed == fr["code"].rstrip("\n") and "| " not in printed
    # Only the lines the fix must change change: `a = 1; b = 2; c = a + b` stays one line.
    assert "a = 1; b = 2; c = a + b\n" in fr["code"]
    assert [ln for ln in fr["diff"].splitlines() if ln.startswith("-") and "a = 1" in ln] == []
    assert fr["applied"] and fr["fits"] and fr["original"]["exception"].startswith("OutOfMemoryError")
    # the kept script runs on its own
    kept = tmp_path / "kept.py"
    kept.write_text(fr["code"])
    assert subprocess.run([sys.executable, str(kept)], env=ENV, timeout=120).returncode == 0


def test_cli_bad_fix_exits_2(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", str(script), "--fix", "accumulate:1"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "k >= 2" in proc.stderr


@pytest.fixture
def shell():
    """The process-wide shell (other test files use it too): leave its namespace as we found it."""
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    saved = dict(sh.user_ns)
    yield sh
    for name in [n for n in sh.user_ns if n not in saved]:
        del sh.user_ns[name]
    sh.user_ns.update(saved)


SETUP = textwrap.dedent("""\
    import torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xb, yb = torch.randn(512, 32), torch.randint(0, 4, (512,))
""")
CELL = "optimizer.zero_grad()\nloss = F.cross_entropy(model(xb), yb)\nloss.backward()\noptimizer.step()\n"


@pytest.mark.ipython
def test_magic_fix_runs_the_fixed_cell_in_the_user_namespace(shell):
    shell.run_cell(SETUP)
    w0 = shell.user_ns["model"][0].weight.detach().clone()
    with capture_output() as cap:
        result = shell.run_cell("%%backward_doctor --memory-limit 1.2MB --fix accumulate:4\n" + CELL)
    assert result.error_in_exec is None                               # fixed: the cell is not marked failed
    report = bd.last_report()
    assert report.fix_result.applied and report.fix_result.fits
    assert "fix accumulate:4: applied" in cap.outputs[-1].data["text/plain"]
    assert not torch.equal(shell.user_ns["model"][0].weight, w0)      # the namespace holds the fixed step
    assert "xb_micro" in shell.user_ns

    with capture_output():
        result = shell.run_cell("%%backward_doctor --memory-limit 1KB --fix accumulate:2 --no-rollback\n" + CELL)
    assert isinstance(result.error_in_exec, RuntimeError) and "still fails" in str(result.error_in_exec)
    assert "rollback off" in " ".join(bd.last_report().fix_result.warnings)

    with capture_output():
        result = shell.run_cell("%%backward_doctor --fix nonsense\n" + CELL)
    assert result.error_in_exec is not None or result.error_before_exec is not None
