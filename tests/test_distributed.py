"""Distributed training (issue 18): ``python -m backward_doctor --nproc 2 FILE.py`` on CPU with gloo.

Each situation is a small script of our own, run on 2 local ranks through the CLI; the combined
report's JSON names the kind, the rank and the line. Every run is bounded: the process group's timeout
in the scripts, ``--timeout`` for the launcher, and the subprocess's own timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from backward_doctor.analysis.distributed import analyze_ranks
from backward_doctor.capture.recorder.collectives import CollectiveRecorder
from backward_doctor.api import check_nproc
from backward_doctor.frontends.launch import free_port, rank_env
from backward_doctor.report.combined import CombinedReport, load_report
from backward_doctor.trace.distributed import Collective, RankRecord, UnusedParams

pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

HEAD = """\
import datetime, os, torch, torch.distributed as dist
import torch.nn as nn
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
torch.manual_seed(0)
"""  # 6 lines: the scripts' own lines start at 7


def _script(tmp_path, name: str, body: str, prefix: str = "") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + prefix + textwrap.dedent(body))
    return str(path)


def _line(path: str, text: str) -> int:
    """The 1-based line of ``path`` holding ``text`` (tests name lines by their code, not by number)."""
    lines = open(path).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _doctor(path: str, *args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, dict]:
    out = path + ".report.json"
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", "--nproc", "2", path, "--json", out, *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout)
    assert os.path.exists(out), proc.stdout + proc.stderr
    with open(out) as fh:
        return proc, json.load(fh)


def _first(data: dict) -> dict:
    assert data["findings"], data
    return data["findings"][0]


MODEL = """\
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
"""

CORRECT = MODEL + """\
g = torch.Generator().manual_seed(rank)
for step in range(5):
    x = torch.randn(4, 8, generator=g); y = torch.randint(0, 2, (4,), generator=g)
    loss = nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step(); opt.zero_grad()
torch.save(model.state_dict(), os.path.join(os.path.dirname(__file__), f"{os.environ.get('TAG', 'doctor')}{rank}.pt"))
"""


def _plain(path: str, tag: str) -> None:
    """The same script on 2 ranks without the doctor (torchrun's environment)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, path], env={**rank_env(k, 2, port, ENV), "TAG": tag},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for k in range(2)]
    for p in procs:
        p.wait(timeout=600)


def test_correct_ddp_loop_is_silent_and_bit_identical(tmp_path):
    path = _script(tmp_path, "correct", CORRECT)
    proc, data = _doctor(path, "--timeout", "240")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert data["ok"] is True and data["findings"] == [] and data["kind"] == "distributed"
    assert proc.stdout.splitlines()[0].startswith("backward_doctor: OK - 2 ranks")
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:  # each rank logged its DDP all-reduces: one backward per step, one bucket of
        backward = [c for c in r["collectives"] if c["op"].startswith("backward")]  # 178 gradients (Flight
        assert len(backward) == 5 and all(c["sizes"] == [[178]] for c in backward)  # Recorder's sizes)
    _plain(path, "plain")
    for k in range(2):
        doctored, plain = torch.load(tmp_path / f"doctor{k}.pt"), torch.load(tmp_path / f"plain{k}.pt")
        assert all(torch.equal(doctored[n], plain[n]) for n in plain), f"rank {k} differs with the doctor"
    assert CombinedReport.from_dict(data).to_dict() == data


def test_unused_parameter_on_every_rank(tmp_path):
    path = _script(tmp_path, "unused", """\
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(8, 16); self.head = nn.Linear(16, 2); self.extra = nn.Linear(16, 2)
            def forward(self, x):
                return self.head(torch.relu(self.body(x)))
        ddp = nn.parallel.DistributedDataParallel(Net())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 8); y = torch.randint(0, 2, (4,))
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "240")
    f = _first(data)
    assert proc.returncode == 1
    assert (f["kind"], f["rank"], f["line"]) == ("unused_parameters", None, _line(path, "ddp(x), y"))
    assert sorted(f["evidence"]["parameters"]) == ["extra.bias", "extra.weight"]
    assert f["evidence"]["same_on_all_ranks"] is True and "find_unused_parameters=True" in f["message"]
    # PyTorch's own error still surfaces, on each rank, as it raised it.
    assert all("Expected to have finished reduction" in r["trace"]["exception"]["message"] for r in data["ranks"])


def test_control_flow_differing_by_rank(tmp_path):
    path = _script(tmp_path, "branch", """\
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(8, 16); self.head = nn.Linear(16, 2); self.aux = nn.Linear(16, 16)
            def forward(self, x, use_aux):
                h = torch.relu(self.body(x))
                if use_aux:
                    h = h + self.aux(h)
                return self.head(h)
        ddp = nn.parallel.DistributedDataParallel(Net())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 8); y = torch.randint(0, 2, (4,))
            loss = nn.functional.cross_entropy(ddp(x, use_aux=(rank == 0)), y)
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "240")
    f = _first(data)
    assert (f["kind"], f["rank"], f["line"]) == ("unused_parameters", 1, _line(path, "use_aux=(rank == 0)"))
    assert f["evidence"]["same_on_all_ranks"] is False and f["evidence"]["by_rank"] == {"1": ["aux.bias", "aux.weight"]}
    # Rank 0's "Connection closed by peer" is listed, as a consequence, never first.
    kinds = [(g["kind"], g["rank"]) for g in data["findings"]]
    assert ("consequence", 0) in kinds and kinds[0][0] != "consequence"


def test_step_skipped_on_one_rank_is_a_desync_then_a_bounded_hang(tmp_path):
    path = _script(tmp_path, "skip", prefix=MODEL, body="""\
        for step in range(6):
            x = torch.randn(4, 8); y = torch.randint(0, 2, (4,))
            loss = nn.functional.cross_entropy(ddp(x), y)
            if rank == 1 and step == 3:
                continue
            loss.backward()
            opt.step(); opt.zero_grad()
        dist.barrier()
    """)
    proc, data = _doctor(path, "--timeout", "20")
    assert data["duration_s"] < 200  # the launcher's 20 s timeout (plus start-up), not gloo's 300 s (or 30 minutes)
    f = _first(data)
    assert (f["kind"], f["rank"], f["line"]) == ("desync", 1, _line(path, "loss.backward()"))
    ranks = f["evidence"]["ranks"]
    assert ranks["0"]["loop"] == {"step": 3} and ranks["1"]["loop"] == {"step": 4}
    hang = next(g for g in data["findings"] if g["kind"] == "hang")
    assert hang["rank"] == 1 and hang["line"] == _line(path, "dist.barrier()")
    assert all(r["stopped"] == "timeout" for r in data["ranks"])
    assert "rank 0: waiting in backward" in hang["message"] and "rank 1: waiting in barrier" in hang["message"]


def test_all_gather_size_mismatch(tmp_path):
    path = _script(tmp_path, "gather", """\
        shard = torch.randn(17 if rank == 0 else 16, 4)
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard)
    """)
    proc, data = _doctor(path, "--timeout", "240")
    f = _first(data)
    assert (f["kind"], f["rank"], f["line"]) == ("desync", 1, _line(path, "dist.all_gather"))
    assert f["evidence"]["ranks"]["0"]["sizes"][0] == [17, 4] and f["evidence"]["ranks"]["1"]["sizes"][0] == [16, 4]
    assert "[17, 4]" in f["message"] and "[16, 4]" in f["message"]
    # The rank gloo aborted mid-collective (no Python exception) is evidence too, never the only story.
    # (The other rank may also get SIGABRT at interpreter exit, after its report: gloo's teardown.)
    died = [r["rank"] for r in data["ranks"] if r["signal"] == "SIGABRT" and not r["wrote_report"]]
    assert died and [(g["kind"], g["rank"]) for g in data["findings"] if g["kind"] == "crash"] == [("crash", died[0])]


@pytest.mark.parametrize("engine", ["auto", "python"])  # the native recorder and the Python tier
def test_nan_from_one_ranks_batch(tmp_path, engine):
    path = _script(tmp_path, "nan", prefix=MODEL, body="""\
        for step in range(4):
            x = torch.randn(4, 8); y = torch.randint(0, 2, (4,))
            if rank == 1 and step == 2:
                x[0, 0] = float("nan")
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "240", "--engine", engine)
    f = _first(data)
    assert proc.returncode == 1
    assert (f["kind"], f["rank"], f["line"]) == ("nonfinite", 1, _line(path, 'float("nan")'))
    assert f["evidence"]["spread_to"] == [0]
    assert [(g["kind"], g["rank"]) for g in data["findings"][1:]] == [("consequence", 0)]


# ---------------------------------------------------------------- no processes: arguments, rules, records

@pytest.mark.parametrize("args", [["--nproc", "2", "--fix", "amp"], ["--nproc", "2", "--memory-limit", "lots"],
                                  ["--nproc", "x"], ["--nproc", "2", "--timeout", "0"]])
def test_cli_nproc_bad_combinations_exit_2(tmp_path, args):
    script = tmp_path / "s.py"
    script.write_text("x = 1\n")
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", str(script), *args], capture_output=True,
                          text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and "error" in proc.stderr


@pytest.mark.parametrize("bad", [0, -1, 65, 1.5, True, "2"])
def test_bad_nproc_is_a_value_error(bad):
    with pytest.raises(ValueError, match="--nproc"):
        check_nproc(bad)


def test_cli_nproc_0_exits_2_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", "--nproc", "0", str(script)],
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and "--nproc" in proc.stderr and not marker.exists()


def test_recorder_restores_every_global_even_on_exceptions():
    import torch.distributed as dist

    before = {n: dist.__dict__.get(n) for n in ("all_reduce", "all_gather", "barrier")}
    backward, forward = torch.autograd.backward, torch.nn.parallel.DistributedDataParallel.__dict__["forward"]
    with pytest.raises(ZeroDivisionError):
        with CollectiveRecorder():
            assert dist.all_reduce is not before["all_reduce"]
            1 / 0
    assert {n: dist.__dict__.get(n) for n in before} == before
    assert torch.autograd.backward is backward
    assert torch.nn.parallel.DistributedDataParallel.__dict__["forward"] is forward


def test_combined_report_round_trips_and_renders_a_line_per_rank():
    u = UnusedParams(names=["aux.weight"], module="Net", forward_line=20, backward_line=21, total=6)
    ranks = [RankRecord(0, 2, exitcode=1, output_tail="RuntimeError: Connection closed by peer [127.0.0.1]:1",
                        collectives=[Collective(0, "backward (DDP gradient all-reduce)", seq=3, count=1, line=21)]),
             RankRecord(1, 2, exitcode=1, unused=[u])]
    report = CombinedReport(findings=analyze_ranks(ranks), ranks=ranks, script="/x/train.py", nproc=2)
    assert [(f.kind, f.rank) for f in report.findings] == [("unused_parameters", 1), ("consequence", 0)]
    again = load_report(json.loads(json.dumps(report.to_dict())))
    assert isinstance(again, CombinedReport) and again.to_dict() == report.to_dict()
    text = str(again)
    assert "rank 0: exited 1" in text and "rank 1: exited 1" in text and "at rank 1, cell line 20" in text
    html = again.to_html()
    assert html.count('<td class="num">0</td>') >= 1 and "rank 1" in html


def test_desync_culprit_is_the_minority_of_three():
    calls = [Collective(0, "all_reduce", seq=5, count=1, sizes=[[8]], line=12) for _ in range(3)]
    calls[2].sizes = [[9]]
    ranks = [RankRecord(k, 3, collectives=[calls[k]]) for k in range(3)]
    (f,) = analyze_ranks(ranks)
    assert (f.kind, f.rank, f.line) == ("desync", 2, 12) and "collective #6" in f.message


# ---------------------------------------------------------------- the magic (forked ranks) and torchrun

MAGIC_DRIVER = """\
import json, sys, torch, torch.nn as nn
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "backward_doctor")
# The kernel used OpenMP before forking (a multi-threaded matmul): the ranks must still not deadlock.
torch.set_num_threads(2)
ip.run_cell("import torch, torch.nn as nn\\ntorch.ones(256, 256) @ torch.ones(256, 256)\\n"
            "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))")
ip.run_cell_magic("backward_doctor", "--nproc 2 --timeout 240", open(sys.argv[1]).read())
import backward_doctor as bd
json.dump(bd.last_report().to_dict(), open(sys.argv[2], "w"))
print("kernel in a process group:", torch.distributed.is_initialized())
"""

MAGIC_CELL = """\
import datetime, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
ddp = nn.parallel.DistributedDataParallel(model)
for step in range(3):
    x = torch.randn(4, 8)
    if rank == 1 and step == 1:
        x[0, 0] = float("nan")
    ddp(x).sum().backward()
"""


def test_magic_nproc_forks_ranks_from_the_kernel(tmp_path):
    driver, cell, out = tmp_path / "driver.py", tmp_path / "cell.py", tmp_path / "report.json"
    driver.write_text(MAGIC_DRIVER)
    cell.write_text(MAGIC_CELL)
    proc = subprocess.run([sys.executable, str(driver), str(cell), str(out)], capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    f = _first(data)
    assert (f["kind"], f["rank"], f["line"]) == ("nonfinite", 1, 8)
    assert "nonfinite at rank 1, cell line 8" in proc.stdout  # the report shown under the cell
    assert "kernel in a process group: False" in proc.stdout


def test_torchrun_ranks_combined_afterwards(tmp_path):
    path = _script(tmp_path, "gather", """\
        shard = torch.randn(17 if rank == 0 else 16, 4)
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard)
    """)
    folder = tmp_path / "ranks"
    folder.mkdir()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(free_port()), "-m", "backward_doctor.run.rank", path, str(folder)],
                   capture_output=True, text=True, env=ENV, timeout=600)
    out = tmp_path / "combined.json"
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", "combine", str(folder), "--json", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    f = _first(json.loads(out.read_text()))
    assert (f["kind"], f["rank"], f["line"]) == ("desync", 1, _line(path, "dist.all_gather"))


def test_a_loop_strided_by_rank_is_not_a_desync():
    # for i in range(rank, 8, 2): rank 0 sees i = 0, 2, 4, rank 1 sees 1, 3, 5, in step: no desync.
    ranks = [RankRecord(k, 2, collectives=[Collective(j, "all_reduce", seq=3 + j, count=1, sizes=[[4]], line=9,
                                                      loop={"i": k + 2 * j}) for j in range(3)]) for k in range(2)]
    assert analyze_ranks(ranks) == []
    ranks[1].collectives[2].loop = {"i": 7}  # rank 1 jumped a step
    (f,) = analyze_ranks(ranks)
    assert (f.kind, f.rank, f.evidence["seq"]) == ("desync", 1, 5)


def test_calls_in_flight_when_the_time_limit_stopped_advancing_ranks_are_not_a_desync():
    # A correct DDP loop stopped by --timeout mid-step (seen once in CI): rank 0 inside the backward's
    # all-reduce, rank 1 inside the forward's buffer sync, both numbered #1675 (DDP's C++ all-reduce is counted
    # when launched, asynchronously). Both had progressed 0.2 s before: a slow run, not a desync.
    def rank(k, op, line):
        done = [Collective(j, "all_reduce", seq=j, count=1, sizes=[[4]], line=9) for j in range(3)]
        return RankRecord(k, 2, stopped="timeout", progress_s=0.2,
                          collectives=done + [Collective(3, op, seq=3, count=None, sizes=[[4]], line=line)])
    ranks = [rank(0, "all_reduce", 9), rank(1, "broadcast", 8)]
    assert [f.kind for f in analyze_ranks(ranks, timeout=8)][:1] == ["timeout"]
    # the same calls after the ranks had stopped advancing (waiting on each other for 5 s): a desync
    for r in ranks:
        r.progress_s = 5.0
    assert analyze_ranks(ranks, timeout=8)[0].kind == "desync"
    # and calls that returned are compared as ever, however recent the progress
    for r in ranks:
        r.progress_s, r.collectives[-1].count = 0.2, 1
    assert analyze_ranks(ranks, timeout=8)[0].kind == "desync"


def test_recorder_restores_on_keyboard_interrupt():
    import torch.distributed as dist

    before = dist.all_gather
    with pytest.raises(KeyboardInterrupt):
        with CollectiveRecorder():
            raise KeyboardInterrupt
    assert dist.all_gather is before and torch.autograd.backward.__module__ == "torch.autograd"


def test_a_rank_stuck_in_its_own_code_is_named_by_its_stack(tmp_path):
    path = _script(tmp_path, "busy", """\
        import time
        t = torch.ones(3)
        if rank == 1:
            while True:
                time.sleep(0.01)  # waiting for a file that never comes
        dist.all_reduce(t)
    """)
    proc, data = _doctor(path, "--timeout", "20")
    f = _first(data)
    assert (f["kind"], f["rank"], f["line"]) == ("hang", 1, _line(path, "time.sleep(0.01)"))
    assert "rank 0: waiting in all_reduce [3]" in f["message"]
    assert data["duration_s"] < 200  # the launcher's 20 s timeout (plus start-up), not gloo's 300 s


def test_process_group_timeout_is_a_hang_at_the_busy_rank_and_the_timeout_a_consequence():
    from backward_doctor.trace.stacks import FrameInfo, ThreadStack

    waiting = RankRecord(0, 2, exitcode=1, output_tail="RuntimeError: Timed out waiting 5000ms for recv operation",
                         collectives=[Collective(0, "all_reduce", seq=0, count=1, sizes=[[3]], line=8,
                                                 error="RuntimeError: Timed out waiting 5000ms")])
    busy = RankRecord(1, 2, exitcode=-9, stopped="after rank 0 failed", script="/x/busy.py", stacks=[ThreadStack(
        "thread 0x1", 1, True, [FrameInfo("/x/busy.py", 7, "<module>", in_cell=True, user=True, code="time.sleep(1)")])])
    findings = analyze_ranks([waiting, busy])
    assert [(f.kind, f.rank, f.line) for f in findings] == [("hang", 1, 7), ("consequence", 0, 8)]
    assert "rank 0: failed in all_reduce [3] at line 8" in findings[0].message


def test_an_ordinary_error_on_one_rank_is_the_root_and_the_peers_lost_connection_a_consequence(tmp_path):
    path = _script(tmp_path, "shape", """\
        w = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4 if rank == 0 else 5)
        loss = (x @ w).sum()
        loss.backward()
        t = torch.ones(2); dist.all_reduce(t)
    """)
    proc, data = _doctor(path, "--timeout", "240")
    assert [(f["kind"], f["rank"], f["line"]) for f in data["findings"]] == [
        ("shape_mismatch", 1, _line(path, "(x @ w)")), ("consequence", 0, _line(path, "dist.all_reduce(t)"))]
    assert "mat1 and mat2 shapes cannot be multiplied" in data["ranks"][1]["trace"]["exception"]["message"]
