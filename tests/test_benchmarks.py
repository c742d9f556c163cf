"""The overhead benchmark script keeps running (a smoke run; numbers are in benchmarks/RESULTS.md)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from backward_doctor.capture.native_capture import native_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "run.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KINETO_LOG_LEVEL": "5"})


def test_smoke_run_times_every_mode_on_the_three_workloads():
    out = _run("--smoke")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^(mlp|cnn|transformer)\s+(\d+)\s.*$", out.stdout, re.M)}
    assert set(rows) == {"mlp", "cnn", "transformer"}, out.stdout
    for row in rows.values():
        ratios = [float(x) for x in re.findall(r"([\d.]+)x", row)]
        assert len(ratios) == 6 and ratios[0] == 1.0 and all(r > 0 for r in ratios), row
    assert int(re.search(r"^transformer\s+(\d+)", out.stdout, re.M).group(1)) > 500  # ops per step
    assert re.search(r"report build / plain step: mlp [\d.]+; cnn [\d.]+; transformer [\d.]+", out.stdout)
    assert re.search(r"trace of 2000 ops \(2000 kept one by one, (native|python) tier\): [\d.]+ MiB held",
                     out.stdout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error_and_runs_nothing():
    out = _run("--device", "cuda")
    assert out.returncode == 2
    assert "no CUDA device is available" in out.stderr and "nothing was run" in out.stderr
    assert "workload" not in out.stdout


def test_the_whole_path_benchmark_runs():
    """``whole_path.py --smoke``: diagnose() against the plain cell on two workloads, the panel and the
    per-iteration profile of a loop; every figure printed (not judged: budgets are in RESULTS.md)."""
    script = os.path.join(ROOT, "benchmarks", "whole_path.py")
    out = subprocess.run([sys.executable, script, "--smoke", "--panel", "--iterations"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "KINETO_LOG_LEVEL": "5"})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^(mlp|loop_200)\s+(\d+)\s.*$", out.stdout, re.M)}
    assert set(rows) == {"mlp", "loop_200"}, out.stdout
    for row in rows.values():
        assert len(re.findall(r"\d+\.\d+", row)) >= 8, row
    assert re.search(r"^panel 100k_ops\s+\(100000 ops\): \d+ ms", out.stdout, re.M), out.stdout
    ratios = re.search(r"diagnose / plain: ((?:[\d.]+ ){10})", out.stdout)
    assert ratios and all(float(r) > 0 for r in ratios.group(1).split()), out.stdout


def test_the_always_on_column_runs():
    """``always_on.py --smoke``: %backward_doctor on against the plain cell through IPython's run_cell, on a
    cell with no autograd, a step, a loop and ``trainer.train()``; every figure printed (budgets: RESULTS.md)."""
    script = os.path.join(ROOT, "benchmarks", "always_on.py")
    out = subprocess.run([sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "KINETO_LOG_LEVEL": "5", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    for cell in ("no autograd: eval x40", "no autograd: x = 1", "step: mlp", "loop 200", "trainer.train() tiny BERT"):
        row = re.search(rf"^{re.escape(cell)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)",
                        out.stdout, re.M)
        assert row, (cell, out.stdout)
        assert float(row.group(1)) > 0 and float(row.group(2)) > 0 and row.group(6) == "0", row.group(0)


def test_the_instruction_count_benchmark_refuses_bad_arguments_and_runs_nothing():
    """``asleep_instructions.py`` (callgrind, minutes a process: not run here) says what is wrong with its
    arguments before it starts a process."""
    script = os.path.join(ROOT, "benchmarks", "asleep_instructions.py")
    for args, said in ((["--step", "nope"], "--step: one of mlp, cnn"), (["--step", "mlp", "--runs", "3", "2"],
                       "0 < SHORT < LONG"), (["--iterations", "0", "5"], "0 < SHORT < LONG"),
                      (["--bytecodes", "--step", "mlp"], "not with --step")):
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and said in out.stderr and "instructions per" not in out.stdout, (args, out.stderr)


def test_the_bytecode_count_names_the_hooks_an_asleep_iteration_runs():
    """``asleep_instructions.py --bytecodes`` (a tracer, seconds): what always on adds to an iteration it sleeps
    through, by function: the optimizer hooks, the backward() wrapper, the accumulation watch; the loop watch is
    C on the native tier (no Python function of it runs). A count, not a time: the bound is a regression guard,
    generous (about 370 on Python 3.11 today, 12 iterations: the accumulation watch's first windows are detailed,
    in Python; RESULTS.md)."""
    script = os.path.join(ROOT, "benchmarks", "asleep_instructions.py")
    out = subprocess.run([sys.executable, script, "--bytecodes", "--iterations", "4", "12"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "KINETO_LOG_LEVEL": "5"})
    assert out.returncode == 0, out.stderr[-2000:]
    total = float(re.search(r"always on adds asleep: ([\d,.]+)", out.stdout).group(1).replace(",", ""))
    assert 100 < total < 2000, out.stdout
    for fn in ("_optim_pre", "_optim_post", "_iteration_ended", "backward", "backward_began"):
        # (the backward() wrapper and the watches' callers are written out at install: ``capture/watches/registry.py``)
        assert re.search(rf"^\s+[\d.]+\s+(\S+\.py|<backward_doctor watches: \w+>):\d+ {fn}$", out.stdout, re.M), \
            (fn, out.stdout)
    if native_available(build=False):  # (the script builds it: the loop watch's Python is not what runs)
        assert not re.search(r"loop_watch\.py:\d+ ", out.stdout), out.stdout


@pytest.mark.distributed
def test_the_fsdp_benchmark_runs(tmp_path):
    """``distributed.py --rounds 1 --steps 5``: ``--nproc 2`` on an FSDP2 loop against plain processes; every
    figure printed and written (not judged: the numbers are in RESULTS.md)."""
    script = os.path.join(ROOT, "benchmarks", "distributed.py")
    out_json = tmp_path / "fsdp.json"
    out = subprocess.run([sys.executable, script, "--rounds", "1", "--steps", "5", "--json", str(out_json)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"^median CPU time: whole command [\d.]+x .* loop [\d.]+x", out.stdout, re.M), out.stdout
    import json
    data = json.loads(out_json.read_text())
    assert data["rounds"][0]["doctor"]["loop_cpu_s"] > 0 and data["rounds"][0]["plain"]["cpu_s"] > 0
