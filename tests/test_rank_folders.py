"""The ranks' folder of an ``--nproc`` run is removed even when the process that made it is killed outright
(issue 46, item 15): a real Jupyter kernel restarted while a ``%%backward_doctor --nproc 2`` cell runs (the
kernel is SIGKILLed; its forked ranks die with it), and ``python -m backward_doctor --nproc 2`` killed with
SIGKILL. Every wait is a bounded poll; nothing asserts on wall time.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Every rank writes its pid where the test reads it, then hangs.
HANG = """\
import os, time
open(os.path.join({folder!r}, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _until(predicate, limit: float = 240.0) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("pid*") if p.read_text().strip()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _rank_folders(tmp: Path) -> list[str]:
    return glob.glob(str(tmp / "backward_doctor-ranks-*"))


def test_a_kernel_restarted_during_an_nproc_cell_leaves_no_rank_folder(tmp_path):
    from jupyter_client.manager import KernelManager

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=_env(tmp), cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=180)
        reply = kc.execute_interactive("%load_ext backward_doctor", timeout=300)
        assert reply["content"]["status"] == "ok", reply
        kc.execute("%%backward_doctor --nproc 2 --timeout 300\n" + HANG.format(folder=str(tmp_path)))
        assert _until(lambda: len(_pids(tmp_path)) == 2), "the ranks never started"
        ranks, folders = _pids(tmp_path), _rank_folders(tmp)
        assert len(folders) == 1 and os.path.isdir(folders[0])
        km.restart_kernel(now=True)  # the kernel is killed outright (SIGKILL) and a new one started
        assert _until(lambda: not any(_alive(p) for p in ranks)), "ranks outlived the kernel"
        assert _until(lambda: not os.path.exists(folders[0])), os.listdir(folders[0])
        kc.wait_for_ready(timeout=180)  # the restarted kernel works
        assert kc.execute_interactive("1 + 1", timeout=120)["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_launcher_killed_outright_leaves_no_rank_folder(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "hang.py"
    script.write_text(HANG.format(folder=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-m", "backward_doctor", "--nproc", "2", str(script), "--timeout", "300"],
                            env=_env(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _until(lambda: len(_pids(tmp_path)) == 2 or proc.poll() is not None), "the ranks never started"
        ranks, folders = _pids(tmp_path), _rank_folders(tmp)
        assert len(folders) == 1 and os.path.isdir(folders[0])
        proc.kill()
        proc.wait(timeout=60)
        assert _until(lambda: not any(_alive(p) for p in ranks)), "ranks outlived the launcher"
        assert _until(lambda: not os.path.exists(folders[0])), os.listdir(folders[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
