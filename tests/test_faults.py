"""Faults and bad input: Ctrl-C at any point of set-up and tear-down, two threads, the user's SIGINT
handler, bad arguments, and the command line on files that are not what it expects."""
from __future__ import annotations

import json
import linecache
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import backward_doctor as bd
from backward_doctor.capture.native_capture import native_available

import fault_injection as fi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_a_ctrl_c_at_any_point_of_set_up_or_tear_down_leaves_nothing_behind(engine):
    """Every ``every``-th point (all of them with BD_FAULTS_EVERY=1; ~1,500 per engine, a few minutes)."""
    every = int(os.environ.get("BD_FAULTS_EVERY", "9"))
    result = fi.attack(engine, every=every)
    assert result["tried"] > result["points"] // every // 2, result  # the Ctrl-C really was delivered
    assert result["left_state"] == 0, result["examples"]


def test_a_ctrl_c_in_the_cell_is_the_cells_and_everything_is_undone(engine):
    ns = fi.make_namespace()
    before = fi.baseline()
    ns["interrupt"] = lambda: os.kill(os.getpid(), signal.SIGINT)
    # A process started in the background by a shell without job control ignores SIGINT from the start
    # (POSIX), and so would a plain run of the cell: give it Python's usual handler, as a terminal does.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        report = bd.diagnose("loss = model(x).sum()\ninterrupt()\ntime.sleep(1)\nloss.backward()",
                             {**ns, "time": time}, engine=engine)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert report.exception.startswith("KeyboardInterrupt")
    assert fi.leftovers(before, ns) == []


def test_two_threads_one_diagnosis_at_a_time(engine):
    ns = fi.make_namespace()
    before = fi.baseline()
    started, errors, reports = threading.Event(), [], []

    def slow() -> None:
        reports.append(bd.diagnose("started.set()\ntime.sleep(0.5)\nloss = model(x).sum()\nloss.backward()",
                                   {**ns, "time": time, "started": started}, engine=engine))

    worker = threading.Thread(target=slow)
    worker.start()
    assert started.wait(10)
    ran = []
    try:
        bd.diagnose("ran.append(1)", {"ran": ran}, engine=engine)
    except RuntimeError as exc:
        errors.append(str(exc))
    worker.join(10)
    assert errors and "one step at a time" in errors[0] and ran == []  # refused before anything ran
    assert reports[0].ok, reports[0].findings
    assert fi.leftovers(before, ns) == []
    assert bd.diagnose("x = 1").ok  # and the next one runs


def test_the_cells_own_sigint_handler_stays(engine):
    def mine(signum, frame):
        pass

    before = signal.getsignal(signal.SIGINT)
    try:
        report = bd.diagnose("import signal\nsignal.signal(signal.SIGINT, mine)", {"mine": mine}, timeout=5,
                             engine=engine)
        assert report.ok
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)
    bd.diagnose("x = 1", {}, timeout=5, engine=engine)
    assert signal.getsignal(signal.SIGINT) is before  # a handler the cell did not change is put back


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout": float("inf")}, "finite"), ({"timeout": float("nan")}, "finite"), ({"timeout": -1}, "positive"),
    ({"timeout": 1e12}, "at most"), ({"memory_limit": 0.5}, "at least 1"), ({"memory_limit": float("inf")}, "finite"),
    ({"memory_limit": float("nan")}, "finite"), ({"memory_limit": "0.1B"}, "less than one byte"),
    ({"rollback": "no"}, "True or False"), ({"engine": "fast"}, "engine must be one of"),
])
def test_bad_arguments_are_value_errors_before_anything_runs(kwargs, match):
    ran = []
    with pytest.raises(ValueError, match=match):
        bd.diagnose("ran.append(1)", {"ran": ran}, **kwargs)
    assert ran == []


def test_linecache_keeps_only_the_latest_cells():
    for i in range(80):
        bd.diagnose(f"x = {i}", {})
    ours = [k for k in linecache.cache if k.startswith("<backward_doctor-cell")]
    assert 0 < len(ours) <= 64


# --------------------------------------------------------------------------- command line
def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "backward_doctor", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)


@pytest.mark.slow
def test_cli_on_files_that_are_not_what_it_expects(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    r = _cli(tmp_path, str(binary))
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr

    latin = tmp_path / "latin.py"
    latin.write_bytes("# -*- coding: latin-1 -*-\nname = 'Müller'\nprint(len(name))\n".encode("latin-1"))
    r = _cli(tmp_path, str(latin))
    assert r.returncode == 0 and r.stdout.startswith("6")

    marker = tmp_path / "ran.txt"
    step = tmp_path / "step.py"
    step.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    for flags in (["--json", "no/such/dir/r.json"], ["--html", str(tmp_path)]):
        r = _cli(tmp_path, str(step), *flags)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert not marker.exists()  # checked before the step ran

    if native_available(build=True):
        mlp = tmp_path / "mlp.py"
        mlp.write_text("import torch\nw = torch.randn(256, 256, requires_grad=True)\n"
                       "loss = (torch.randn(64, 256) @ w).relu().sum()\nloss.backward()\n")
        r = _cli(tmp_path, str(mlp), "--engine", "native", "--memory-limit", "300KB")
        assert r.returncode == 1 and "Traceback" not in r.stderr and "oom" in r.stdout, r.stderr


@pytest.mark.slow
def test_cli_reports_a_script_that_calls_os_exit(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import os, torch\nw = torch.ones(3, requires_grad=True)\nloss = (w * 2).sum()\n"
                      "loss.backward()\nos._exit(3)\nprint('never')\n")
    r = _cli(tmp_path, str(script), "--json", "r.json")
    assert r.returncode == 3
    assert "os._exit(3)" in r.stdout and "never" not in r.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert "os._exit(3)" in report["exception"]
    assert [op["op"] for op in report["trace"]["ops"]][:3] == ["aten::ones", "aten::mul", "aten::sum"]
