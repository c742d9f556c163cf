"""``%backward_doctor on`` in a real Jupyter kernel (nbclient): cells that train fine show nothing and
compute exactly what a plain kernel computes; a cell that goes NaN at iteration 300, runs out of memory,
hangs or is interrupted shows the report first, then its traceback, without being run again; ``off``
leaves nothing behind (the checks of ``tests/fault_injection.py``, inside the kernel)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 180
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

pytestmark = pytest.mark.slow

FIRST = ("import torch, hashlib\ntorch.set_num_threads(1)\nimport fault_injection as fi\n"
         "_before = fi.baseline()\n")
SETUP = """\
import torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 8), torch.randn(64, 1)
def digest():
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
"""
TRAIN = """\
for i in range(200):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(digest())
"""
ONE_STEP = """\
opt.zero_grad()
torch.nn.functional.mse_loss(model(x), y).backward()
opt.step()
print(digest(), loss.item())
"""
NAN_AT_300 = """\
steps = 0
for i in range(500):
    opt.zero_grad()
    h = model(x)
    h = torch.log(h - h.max() if i == 300 else h.abs() + 1)
    loss = torch.nn.functional.mse_loss(h, y)
    loss.backward()
    opt.step()
    steps += 1
"""
OOM = "big = model(x.repeat(200, 1))\nbig.sum().backward()\n"
HANG = """\
import time
for i in range(3):
    model(x).sum().backward()
    opt.step()
time.sleep(120)
"""
CTRL_C = """\
import os, signal, threading, time
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # what the kernel's interrupt sends
for i in range(10**6):
    model(x).sum().backward()
    opt.step()
    time.sleep(0.01)
"""

#: a backward() the guess cannot see (a dict's function, defined in a cell before), then an error: the watch
#: opens at the backward()
JOBS = "jobs = {'go': lambda t: t.sum().backward()}\n"
MISSED = "h = model(x)\njobs['go'](h)\nh.nope\n"
#: the same in a cell with a top-level await, which ipykernel runs through run_cell_async (not run_cell)
MISSED_ASYNC = "import asyncio\nawait asyncio.sleep(0)\nh = model(x)\njobs['go'](h)\nh.nope\n"


def _execute(cells: list[str], tmp_path: Path) -> list:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    env_path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"], os.environ["OMP_NUM_THREADS"] = env_path, "1"
    try:
        NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return nb.cells


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _kinds(cell) -> list[str]:
    """The cell's output types, consecutive stream chunks of one stream counted once: ipykernel sends a
    print's writes in one message or two depending on when its 0.2 s flush timer fires (timing, not content:
    a busy CI machine split a plain ``print(digest())`` in two)."""
    kinds: list[str] = []
    for o in cell.outputs:
        kind = o.output_type + (":" + o.name if o.output_type == "stream" else "")
        if not kinds or kind != kinds[-1] or not kind.startswith("stream"):
            kinds.append(kind)
    return kinds


def _errors(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]


def _report_then_traceback(cell, ename: str) -> str:
    """The report is the cell's first output and the user's traceback comes after it; returns the report."""
    kinds = [o.output_type for o in cell.outputs]
    assert kinds and kinds[0] == "display_data" and kinds[-1] == "error", kinds
    error = cell.outputs[-1]
    assert error.ename == ename, error.ename
    shown = _ANSI.sub("", "\n".join(error.traceback))
    assert "backward_doctor/" not in shown and "_raise_simulated_oom" not in shown
    return cell.outputs[0].data["text/plain"]


def test_always_on_in_a_real_kernel(tmp_path):
    cells = [FIRST + "%load_ext backward_doctor\n%backward_doctor on --timeout 5\n", SETUP, TRAIN, ONE_STEP,
             NAN_AT_300, "assert steps == 500, steps\nprint(bd_last := __import__('backward_doctor').last_report().findings[0].kind)",
             "%backward_doctor on --memory-limit 200KB\n", OOM,
             "%backward_doctor on --timeout 2\n", HANG, CTRL_C, JOBS, MISSED, MISSED_ASYNC,
             "%backward_doctor off\nassert fi.leftovers(_before, {'model': model}) == [], fi.leftovers(_before, {'model': model})\n"
             "assert 'run_cell' not in vars(get_ipython()) and 'showtraceback' not in vars(get_ipython())\n"
             "assert not [f for fs in get_ipython().events.callbacks.values() for f in fs if 'AlwaysOn' in repr(f)]\n"
             "print('clean')"]
    plain = _execute([FIRST, SETUP, TRAIN, ONE_STEP], tmp_path)
    watched = _execute(cells, tmp_path)

    assert "always on (timeout 5 s" in _text(watched[0])
    # Cells that train fine: nothing of the doctor's, and the same weights, bit for bit, as a plain kernel
    for i in (1, 2, 3):
        assert not _errors(watched[i]) and not _errors(plain[i]), (watched[i].outputs, plain[i].outputs)
        assert _kinds(watched[i]) == _kinds(plain[i]), (watched[i].outputs, plain[i].outputs)
        assert _text(watched[i]) == _text(plain[i]), (_text(watched[i]), _text(plain[i]))
    assert _text(watched[2]) and _text(watched[3])  # (the weights' digests, printed)
    # NaN at iteration 300: the report names the op, the line and the iteration; the cell ran once
    nan = watched[4]
    assert not _errors(nan) and [o.output_type for o in nan.outputs] == ["display_data"], nan.outputs
    report = nan.outputs[0].data["text/plain"]
    assert report.startswith("backward_doctor: PROBLEM - NaN/Inf created here at Cell In[5], line 5, in iteration "
                             "300 of the loop at line 2 (i = 300)"), report[:300]
    assert "aten::log" in report
    assert not _errors(watched[5]) and _text(watched[5]) == "nonfinite\n"
    # Out of memory under the simulated limit, a hang, a Ctrl-C: the report first, then the traceback
    assert _report_then_traceback(watched[7], "OutOfMemoryError").startswith(
        "backward_doctor: PROBLEM - Out of memory at Cell In[8], line 1")
    hang = _report_then_traceback(watched[9], "KeyboardInterrupt")
    assert hang.startswith("backward_doctor: PROBLEM - The step hangs at Cell In[10], line 5"), hang[:300]
    assert "made no progress for 2 s" in hang
    ctrl_c = _report_then_traceback(watched[10], "KeyboardInterrupt")
    assert ctrl_c.startswith("backward_doctor: PROBLEM - The step hangs at Cell In[11]") and "interrupted by hand" in ctrl_c
    # A backward() the guess missed opens the watch there, in a cell run by run_cell or by ipykernel's async path
    assert watched[11].outputs == [], watched[11].outputs
    for i, line in ((12, 2), (13, 4)):
        missed = _report_then_traceback(watched[i], "AttributeError")
        assert missed.startswith(f"backward_doctor: PROBLEM - AttributeError in the step at Cell In[{i + 1}]"), missed
        assert f"the watch began at the cell's first backward() (line {line})" in missed, missed
    # off: no hook, dispatch mode, thread or handler left
    assert not _errors(watched[14]), _errors(watched[14]) and _errors(watched[14])[0].evalue
    assert _text(watched[14]).endswith("clean\n")
