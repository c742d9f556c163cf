"""The command line (`python -m backward_doctor`) and terminal IPython, as subprocesses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=120, **kw)


def test_cli_finds_problem_exits_1_and_writes_json(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent("""
        import torch
        w = torch.randn(3, requires_grad=True)
        loss = torch.log(w - w).sum()
        loss.backward()
    """))
    out = tmp_path / "report.json"
    proc = _run(["-m", "backward_doctor", str(script), "--json", str(out)])
    assert proc.returncode == 1, proc.stderr
    assert "PROBLEM - NaN/Inf created here at step.py, line 4" in proc.stdout  # in plain words, the script named
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["findings"][0]["kind"] == "nonfinite" and data["findings"][0]["line"] == 4
    assert data["findings"][0]["place"] == "step.py" and data["places"] == {"": "step.py"}  # names in the JSON


def test_cli_ok_exits_0(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import torch\nw = torch.randn(3, requires_grad=True)\n(w * w).sum().backward()\n")
    proc = _run(["-m", "backward_doctor", str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("backward_doctor: OK")


def test_cli_hang_and_memory_limit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()\n")
    proc = _run(["-m", "backward_doctor", str(script), "--timeout", "0.5"])
    assert proc.returncode == 1 and "The step hangs at hang.py, line 4" in proc.stdout


@pytest.mark.parametrize("args", [["--memory-limit", "much"], ["--timeout", "-1"], ["--fix", "nope"],
                                  ["does_not_exist.py"]])
def test_cli_bad_arguments_exit_2_and_run_nothing(tmp_path, args):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    argv = args if args == ["does_not_exist.py"] else [str(script), *args]
    proc = _run(["-m", "backward_doctor", *argv])
    assert proc.returncode == 2 and "error" in proc.stderr
    assert not marker.exists()


def test_terminal_ipython_shows_text_report():
    """A real terminal IPython, cells typed on stdin: the report is text."""
    cells = ("%load_ext backward_doctor\nimport torch\nemb = torch.nn.Embedding(10, 4)\n"
             "%%backward_doctor\nout = emb(torch.tensor([1, 12]))\nout.sum().backward()\n\n\nexit\n")
    proc = subprocess.run([sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner", "--quick",
                           "--colors=NoColor"], input=cells, capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=120)
    # named as IPython's traceback names the cell (In [4]), the module with its class
    assert "backward_doctor: PROBLEM - Index out of range at Cell In[4], line 1, module emb (Embedding)" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "Cell In[4], line 1" in proc.stdout.split("IndexError")[1]  # the traceback says the same
    assert "IndexError: index out of range in self" in proc.stdout
