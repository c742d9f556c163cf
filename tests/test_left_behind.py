"""Nothing left behind (issue 27, items 6, 9, 10, 11, 13, 15): ranks die with the process that started them
and hold none of its ports, a Ctrl-C or a SIGTERM/SIGHUP stops an ``--nproc`` run at once and removes its
folder, a reused torchrun folder's stale files are left out and said, a native build killed mid-compile
blocks nobody, and a slow distributed run is reported as slow, not as a hang.

Every wait here is bounded generously (a loaded machine); nothing asserts on wall time beyond "well before
the limit that would apply without the fix".
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from backward_doctor.frontends.combine import combine_folder
from backward_doctor.trace.distributed import RankRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _wait_for(predicate, limit: float = 240.0, every: float = 0.2) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) is dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _pids(folder) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("pid*") if p.read_text().strip()]


# A cell that hangs on every rank after writing its pid where the test can read it.
HANG = """\
import os, time
open(os.path.join({folder!r}, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""

DRIVER = """\
import signal, socket, sys
from IPython.testing.globalipapp import start_ipython
listener = socket.socket()
listener.bind(("127.0.0.1", int(sys.argv[2])))   # a port of the "kernel", as ZeroMQ's are
listener.listen()
ip = start_ipython()
ip.run_line_magic("load_ext", "backward_doctor")
ip.run_cell_magic("backward_doctor", "--nproc 2 --timeout 300", open(sys.argv[1]).read())
import backward_doctor as bd
r = bd.last_report()
print("REPORT", r.nproc, [x.stopped for x in r.ranks], r.notes, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_driver(tmp_path):
    cell, driver = tmp_path / "cell.py", tmp_path / "driver.py"
    cell.write_text(HANG.format(folder=str(tmp_path)))
    driver.write_text(DRIVER)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(driver), str(cell), str(port)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert _wait_for(lambda: len(_pids(tmp_path)) == 2 or proc.poll() is not None), "the ranks never started"
    assert proc.poll() is None, proc.stdout.read()
    return proc, port


# --------------------------------------------------------------------------- 9. the kernel restarted
@pytest.mark.distributed
def test_ranks_forked_from_a_kernel_die_with_it_and_hold_none_of_its_ports(tmp_path):
    proc, port = _start_driver(tmp_path)
    ranks = _pids(tmp_path)
    for pid in ranks:  # the kernel's listening socket is not held by its forked ranks
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        assert not any(_listening(link, port) for link in links if link.startswith("socket:")), pid
    proc.kill()  # a kernel restart: SIGKILL, no clean-up of its own
    proc.wait(timeout=60)
    assert _wait_for(lambda: not any(_alive(p) for p in ranks), limit=60), "ranks outlived the kernel"
    with socket.socket() as s:  # the restarted kernel can bind its port again
        s.bind(("127.0.0.1", port))


def _listening(link: str, port: int) -> bool:
    """Whether the socket ``socket:[inode]`` listens on ``port`` (from /proc/net/tcp)."""
    inode = link.split("[")[-1].rstrip("]")
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            parts = line.split()
            if parts[9] == inode and int(parts[1].split(":")[1], 16) == port:
                return True
    return False


# --------------------------------------------------------------------------- 10. a kernel interrupt
@pytest.mark.distributed
def test_a_kernel_interrupt_stops_an_nproc_cell_at_once(tmp_path):
    proc, _ = _start_driver(tmp_path)
    ranks = _pids(tmp_path)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)  # Jupyter's "interrupt the kernel"
    out, _ = proc.communicate(timeout=120)  # well before the cell's 300 s limit
    assert "REPORT 2 ['interrupted', 'interrupted']" in out, out[-3000:]
    assert "interrupted (Ctrl-C)" in out
    assert not any(_alive(p) for p in ranks)


# --------------------------------------------------------------------------- 11. SIGTERM / SIGHUP to the launcher
def _launch(tmp_path, hangup: str = "SIG_DFL") -> subprocess.Popen:
    """``python -m backward_doctor --nproc 2 hang.py`` with SIGTERM at its default and SIGHUP as ``hangup``
    says, whatever this process inherited: a terminal's process has both at their default (``SIG_DFL``);
    under ``nohup`` SIGHUP is ignored (``SIG_IGN``), and so it was in a CI run started that way. (Set in a
    small Python that then execs the launcher: an exec keeps both.)"""
    script = tmp_path / "hang.py"
    script.write_text(HANG.format(folder=str(tmp_path)))
    setup = ("import os, signal, sys\n"
             f"signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.signal(signal.SIGHUP, signal.{hangup})\n"
             "os.execv(sys.executable, [sys.executable, '-m', 'backward_doctor', *sys.argv[1:]])\n")
    return subprocess.Popen([sys.executable, "-c", setup, "--nproc", "2", str(script), "--timeout", "300"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_the_launcher_stops_the_ranks_and_removes_their_folder(tmp_path, sig):
    proc = _launch(tmp_path)
    try:
        assert _wait_for(lambda: len(_pids(tmp_path)) == 2 or proc.poll() is not None), "the ranks never started"
        ranks = _pids(tmp_path)
        folders = {open(f"/proc/{p}/cmdline").read().split("\0")[4] for p in ranks}  # rank.py SCRIPT FOLDER
        assert all(os.path.isdir(f) for f in folders)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        assert proc.returncode == -sig  # it ended as the signal ends it, once it had cleaned up
        assert _wait_for(lambda: not any(_alive(p) for p in ranks), limit=30)
        assert not any(os.path.exists(f) for f in folders)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.distributed
def test_a_launcher_under_nohup_keeps_running_through_a_hangup(tmp_path):
    """SIGHUP ignored when the launcher starts (``nohup``): a hangup leaves the run going, as the user asked;
    a SIGTERM then stops the ranks and removes their folder as usual."""
    proc = _launch(tmp_path, hangup="SIG_IGN")
    try:
        assert _wait_for(lambda: len(_pids(tmp_path)) == 2 or proc.poll() is not None), "the ranks never started"
        ranks = _pids(tmp_path)
        folders = {open(f"/proc/{p}/cmdline").read().split("\0")[4] for p in ranks}
        proc.send_signal(signal.SIGHUP)
        time.sleep(3)
        assert proc.poll() is None and all(_alive(p) for p in ranks) and all(os.path.isdir(f) for f in folders)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGTERM
        assert _wait_for(lambda: not any(_alive(p) for p in ranks), limit=30)
        assert not any(os.path.exists(f) for f in folders)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.distributed
def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG.format(folder=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-m", "backward_doctor", "--nproc", "2", str(script), "--timeout", "300"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _wait_for(lambda: len(_pids(tmp_path)) == 2 or proc.poll() is not None)
    ranks = _pids(tmp_path)
    proc.kill()
    proc.wait(timeout=60)
    assert _wait_for(lambda: not any(_alive(p) for p in ranks), limit=60)


# --------------------------------------------------------------------------- 6. a reused torchrun folder
def _rank(script, folder, rank, world, **env):
    return subprocess.run([sys.executable, "-m", "backward_doctor.run.rank", str(script), str(folder), "python"],
                          env={**ENV, "RANK": str(rank), "WORLD_SIZE": str(world), **env}, timeout=600,
                          capture_output=True, text=True)


def test_a_rank_killed_in_a_second_run_is_not_shown_with_the_first_runs_record(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import os, signal
        x = 1
        if os.environ["RANK"] == "1" and os.environ.get("ROUND") == "2":
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    folder = tmp_path / "ranks"
    folder.mkdir()
    for k in range(2):
        _rank(script, folder, k, 2, ROUND="1")
    first = combine_folder(str(folder))
    assert [r.wrote_report for r in first.ranks] == [True, True]
    for k in range(2):
        _rank(script, folder, k, 2, ROUND="2")
    second = combine_folder(str(folder))
    assert second.ranks[1].wrote_report is False, second.ranks[1]
    assert "did not finish its run" in second.ranks[1].ended()


def test_files_of_ranks_of_an_earlier_run_are_left_out_and_said(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    folder = tmp_path / "ranks"
    folder.mkdir()
    for k in range(3):
        _rank(script, folder, k, 3, TORCHELASTIC_RUN_ID="first")
    for k in range(2):
        _rank(script, folder, k, 2, TORCHELASTIC_RUN_ID="second")
    report = combine_folder(str(folder))
    assert [r.rank for r in report.ranks] == [0, 1] and report.nproc == 2
    assert all(r.run == "second/0" for r in report.ranks)
    assert any("rank 2 are from another run" in n for n in report.notes), report.notes


# --------------------------------------------------------------------------- 13. a native build killed mid-compile
def _load_in_child(extra: str = "") -> subprocess.CompletedProcess:
    code = ("import backward_doctor.native as n\n" + extra +
            "m = n.load()\nprint('LOADED' if m is not None else 'NONE', n.status()['reason'])\n")
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)


def test_a_build_killed_mid_compile_blocks_nobody():
    from backward_doctor import native

    if native.load() is None:
        pytest.skip(f"native recorder unavailable: {native.status()['reason']}")
    lock = os.path.join(native._build_dir(), "lock")  # what torch's FileBaton leaves when its build is killed
    try:
        with open(lock, "w"):
            pass
        # A build is needed (a cached one is loaded by Python's importer and never meets torch's lock): the
        # compile finds everything up to date, after the stale lock is gone (before: waited on it forever).
        out = _load_in_child("n.cached = lambda: False\n")
        assert "LOADED" in out.stdout, out.stdout + out.stderr
        assert not os.path.exists(lock)
    finally:
        if os.path.exists(lock):
            os.remove(lock)


def test_a_wait_for_a_live_builder_is_bounded_and_says_why():
    import fcntl

    from backward_doctor import native

    if native.load() is None:
        pytest.skip(f"native recorder unavailable: {native.status()['reason']}")
    fd = os.open(os.path.join(native._build_dir(), "build.lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process is building right now
        out = _load_in_child("n.WAIT_S = 1.0\nn.cached = lambda: False\n")  # (a build is needed)
        assert "NONE" in out.stdout and "another process has been building" in out.stdout, out.stdout + out.stderr
        assert "waiting for another process building the native recorder" in out.stderr
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- 15. slow is not hung
def test_a_timeout_while_every_rank_still_advances_is_a_slow_run_not_a_hang():
    from backward_doctor.analysis.distributed import analyze_ranks
    from backward_doctor.trace.distributed import Collective

    def ranks(progress_s):
        return [RankRecord(k, 2, stopped="timeout", progress_s=progress_s, steps=240,
                           collectives=[Collective(0, "backward (DDP gradient all-reduce)", seq=480, line=9)])
                for k in range(2)]
    slow = analyze_ranks(ranks(0.3), timeout=60)
    assert [f.kind for f in slow] == ["timeout"], slow
    assert "still working" in slow[0].message and "not a hang" in slow[0].message and slow[0].severity == "warning"
    stuck = analyze_ranks(ranks(45.0), timeout=60)  # nothing logged for 45 s: stuck
    assert [f.kind for f in stuck] == ["hang"]
    unknown = analyze_ranks(ranks(None), timeout=60)  # (combined from files: progress unknown)
    assert [f.kind for f in unknown] == ["hang"]


@pytest.mark.distributed
def test_a_correct_ddp_loop_past_its_timeout_is_reported_as_slow(tmp_path):
    path = tmp_path / "long.py"
    path.write_text(textwrap.dedent("""\
        import datetime, torch, torch.distributed as dist
        import torch.nn as nn
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(10 ** 7):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
    """))
    out = str(path) + ".json"
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", "--nproc", "2", str(path), "--timeout", "8",
                           "--json", out], env=ENV, capture_output=True, text=True, timeout=600)
    data = json.load(open(out))
    kinds = [f["kind"] for f in data["findings"]]
    assert kinds[:1] == ["timeout"] and "hang" not in kinds, proc.stdout[-3000:]
    assert all(r["stopped"] == "timeout" and r["progress_s"] is not None for r in data["ranks"])
