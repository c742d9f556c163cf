"""``python -m backward_doctor run SCRIPT.py [ARGS...]`` and the callbacks in a plain ``python SCRIPT.py``, as
processes: the script's own output, arguments and exit status; the report only when it fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SCRIPT = """\
import sys, torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(16, 4)
def main(n, bad):
    for i in range(n):
        opt.zero_grad()
        out = model(x)
        if i == bad:
            out = torch.log(out - out.max())   # <-- NaN
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
    if bad == -2:
        raise ValueError("the data ran out")
    if bad == -3:
        sys.exit(3)
    print("done", sys.argv[1:], __name__, model[0].weight.sum().item())
if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
"""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                                       os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return path


def _doctor(script: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    extra = ["--output-dir", str(out)] if out is not None else []
    return _run([sys.executable, "-m", "backward_doctor", "run", *extra, str(script), *args], script.parent)


def test_a_script_that_trains_fine_runs_as_python_runs_it(script, tmp_path):
    plain = _run([sys.executable, str(script), "60", "-1"], tmp_path)
    out = tmp_path / "reports"
    doctored = _doctor(script, "60", "-1", out=out)
    assert doctored.returncode == plain.returncode == 0, doctored.stderr
    assert doctored.stdout == plain.stdout and "done ['60', '-1'] __main__" in plain.stdout  # bit-identical weights
    assert "backward_doctor" not in doctored.stderr and not out.exists()


def test_nan_in_an_unrecorded_iteration_inside_main_is_named_and_written(script, tmp_path):
    out = tmp_path / "reports"
    done = _doctor(script, "50", "13", out=out)
    assert done.returncode == 0 and "done" in done.stdout                       # NaN raises nothing
    assert done.stderr.startswith("backward_doctor: PROBLEM - NaN/Inf created here at train.py, line 12, in "
                                  "iteration 13 of the loop at line 8 (i = 13)"), done.stderr[:400]
    saved = json.loads((out / "backward_doctor-report.json").read_text(encoding="utf-8"))
    assert saved["findings"][0]["op"] == "aten::log" and saved["findings"][0]["iteration"] == 13
    assert (out / "backward_doctor-report.html").exists()


def test_an_exception_prints_the_report_then_the_traceback_and_exits_1(script, tmp_path):
    done = _doctor(script, "5", "-2", out=tmp_path)
    assert done.returncode == 1
    report, _, trace = done.stderr.partition("Traceback (most recent call last):")
    assert report.startswith("backward_doctor: PROBLEM - ValueError") and "train.py" in trace
    assert trace.rstrip().endswith("ValueError: the data ran out") and "backward_doctor/" not in trace
    assert (tmp_path / "backward_doctor-report.json").exists()


def test_sys_exit_is_the_scripts_own_business(script, tmp_path):
    done = _doctor(script, "5", "-3", out=tmp_path / "reports")
    assert done.returncode == 3 and done.stderr == "" and not (tmp_path / "reports").exists()


def test_bad_arguments_run_nothing(script, tmp_path):
    for args in (["--timeout", "0", str(script)], ["--engine", "turbo", str(script)], [str(tmp_path / "none.py")]):
        done = _run([sys.executable, "-m", "backward_doctor", "run", *args], tmp_path)
        assert done.returncode == 2 and "done" not in done.stdout, (args, done.stderr)


HF_SCRIPT = """\
import sys
import library_loops as ll
from backward_doctor.integrations import DoctorCallback
SRC = '''
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        if self.state.global_step == 3:
            return out.logits @ out.logits
        return out.loss
'''
ns = ll.hf_trainer(trainer_source=SRC, steps=6, callbacks=[DoctorCallback(sys.argv[1])])
ns["trainer"].train()
"""


def test_the_trainer_callback_in_a_plain_python_script(tmp_path):
    path = tmp_path / "hf_train.py"
    path.write_text(textwrap.dedent(HF_SCRIPT), encoding="utf-8")
    done = _run([sys.executable, str(path), str(tmp_path / "out")], tmp_path)
    assert done.returncode == 1
    report, _, trace = done.stderr.partition("Traceback (most recent call last):")
    assert "backward_doctor: PROBLEM - Shapes do not fit" in report, done.stderr[-3000:]
    assert "RuntimeError" in trace
    saved = json.loads((tmp_path / "out" / "backward_doctor-report.json").read_text(encoding="utf-8"))
    assert saved["findings"][0]["kind"] == "shape_mismatch" and saved["trace"]["iterations"]["steps"] == 3


def test_out_of_memory_advice_names_only_the_fixes_that_apply_to_the_script(tmp_path):
    """The `run` path's report says which fixes `--fix` can apply to the script and why not the others (issue 45)."""
    path = tmp_path / "big.py"
    path.write_text("import torch, torch.nn as nn\ntorch.manual_seed(0)\n"
                    "model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))\nx = torch.randn(16, 4)\n"
                    "big = model(x[:5].repeat(500, 1))\nbig.sum().backward()\n", encoding="utf-8")
    done = _run(
        [sys.executable, "-m", "backward_doctor", "run", "--memory-limit", "100KB", str(path)], tmp_path)
    assert done.returncode == 1 and "OutOfMemoryError" in done.stderr
    assert "fixes: accumulate, amp  (" in done.stderr, done.stderr
    assert "not offered for this cell: checkpoint - checkpointing would not lower the peak" in done.stderr
