"""FSDP2 (issue 49): models sharded with ``torch.distributed.fsdp.fully_shard`` on 2 local ranks (gloo, CPU),
through ``python -m backward_doctor --nproc 2``, on both engines.

A correct FSDP run must never fail or change because of the doctor: the parameters are ``DTensor``s whose own
storage has no data (the ledger counts each rank's local shard), FSDP frees and re-allocates the unsharded
parameters every step, and its all-gathers and reduce-scatters go through ``dist.all_gather_single`` /
``reduce_scatter_single``. Every run is bounded (the process group's timeout, ``--timeout``, the subprocess's).
"""
from __future__ import annotations

import json

import pytest
import torch

from test_distributed import HEAD, _doctor, _line, _plain, _script

pytestmark = pytest.mark.distributed

MODEL = """\
from torch.distributed.fsdp import fully_shard
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
"""

LOOP = """\
for step in range(6):
    xb = torch.randn(8, 16, generator=g); yb = torch.randn(8, 1, generator=g)
    if BAD and rank == 1 and step == 3:
        xb[0, 0] = float("inf")
    loss = ((model(xb) - yb) ** 2).mean()
    loss.backward()
    opt.step(); opt.zero_grad()
state = {k: v.full_tensor() for k, v in model.state_dict().items()}
if rank == 0:
    torch.save(state, os.path.join(os.path.dirname(__file__), f"{os.environ.get('TAG', 'doctor')}.pt"))
"""

ENGINES = ["auto", "python"]  # the native recorder and the Python tier


def _fsdp(tmp_path, name: str, bad: bool) -> str:
    return _script(tmp_path, name, prefix=f"BAD = {bad}\n" + MODEL, body=LOOP)


def _sharded_bytes() -> int:
    """One rank's share of the model's parameters: each of the 4 tensors split in 2 along dim 0 (float32)."""
    return 4 * sum((n + 1) // 2 * (numel // n) for n, numel in [(32, 32 * 16), (32, 32), (1, 32), (1, 1)])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_correct_fsdp_loop_is_silent_and_bit_identical(tmp_path, engine):
    path = _fsdp(tmp_path, "correct", bad=False)
    proc, data = _doctor(path, "--timeout", "240", "--engine", engine)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert data["ok"] is True and data["findings"] == [], data["findings"]
    for r in data["ranks"]:
        trace = r["trace"]
        # Nothing the doctor installs was switched off by an error (before: DTensor storages stopped the
        # module and optimizer hooks on the native tier, and its iterations went uncounted).
        assert not [n for n in trace["notes"] if "doctor's own error" in n], trace["notes"]
        assert len(trace["optimizer_steps"]) == 6 or trace["iterations"]["steps"] == 6
        # FSDP's own collectives are in the log, the same sequence on both ranks.
        ops = [c["op"] for c in r["collectives"]]
        assert ops.count("reduce_scatter_single") == 6 * 2 and ops.count("all_gather_single") >= 6 * 2, ops
    assert [c["op"] for c in data["ranks"][0]["collectives"]] == [c["op"] for c in data["ranks"][1]["collectives"]]
    _plain(path, "plain")
    doctored, plain = torch.load(tmp_path / "doctor.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(doctored[n], plain[n]) for n in plain), "FSDP weights differ with the doctor"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_ledger_counts_each_ranks_shard_as_parameters(tmp_path, engine):
    """Before the loop the model's parameters are each rank's local shards (``DTensor``'s global size would
    count the whole model on every rank)."""
    path = _script(tmp_path, "ledger", prefix="BAD = False\n" + MODEL, body="""\
        xb = torch.randn(8, 16, generator=g)
        loss = model(xb).sum()
        loss.backward()
        opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "240", "--engine", engine)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in data["ranks"]:
        params = r["trace"]["memory"]["by_category"]["parameters"]
        print(r["rank"], max(params), params[-1], r["trace"]["memory"]["peak_by_category"])
        assert params[-1] == _sharded_bytes(), params


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("every", [False, True])
def test_inf_in_one_ranks_batch_is_named_at_that_rank_and_iteration(tmp_path, engine, every):
    path = _fsdp(tmp_path, "inf", bad=True)
    args = ["--every-iteration"] if every else []
    proc, data = _doctor(path, "--timeout", "240", "--engine", engine, *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    f = data["findings"][0]
    assert (f["kind"], f["rank"], f["iteration"]) == ("nonfinite", 1, 3), f
    assert f["evidence"]["spread_to"] == [0]
    assert [(g["kind"], g["rank"]) for g in data["findings"][1:]] == [("consequence", 0)]
    if engine == "python" or every:  # every op of iteration 3 recorded: the line that put the Inf in
        assert f["line"] == _line(path, 'float("inf")'), f
    else:  # iteration 3 ran with the native recorder off (0, 1, 2, 4 are recorded) and a rank never replays
        assert f["evidence"]["located"] is False and f["line"] == _line(path, "loss.backward()")
        notes = data["ranks"][1]["trace"]["notes"]
        assert any("does not replay" in n and "--every-iteration" in n for n in notes), notes
    # No rank issued a collective of its own (a replay would): both logs are the loop's, call for call.
    logs = [[(c["op"], c["sizes"]) for c in r["collectives"]] for r in data["ranks"]]
    assert logs[0] == logs[1] and sum(op == "reduce_scatter_single" for op, _ in logs[0]) == 12


def test_fsdp_record_round_trips(tmp_path):
    """The combined report of an FSDP run is plain JSON the ``combine``/``render`` tools read back."""
    from backward_doctor.report.combined import CombinedReport
    path = _fsdp(tmp_path, "rt", bad=False)
    _, data = _doctor(path, "--timeout", "240")
    assert CombinedReport.from_dict(json.loads(json.dumps(data))).to_dict() == data


def test_a_watch_the_doctor_switched_off_on_a_rank_is_said_in_the_combined_text():
    """A rank whose watch failed (the doctor's own error) ran on as without it; the combined report says what
    was not seen, once for the ranks that share the note (before: only inside each rank's JSON)."""
    from backward_doctor.analysis.distributed import analyze_ranks
    from backward_doctor.report.combined import CombinedReport
    from backward_doctor.trace.distributed import RankRecord
    from backward_doctor.trace.records import Trace
    note = ("the module hooks stopped: at memory.py, line 46: NameError: x (the doctor's own error: the step ran "
            "on as it would without the doctor). Please report it.")
    ranks = [RankRecord(k, 2, exitcode=0, wrote_report=True, trace=Trace(notes=[note, "training loop: 6 steps"]))
             for k in range(2)]
    text = str(CombinedReport(findings=analyze_ranks(ranks), ranks=ranks, script="/x/train.py", nproc=2))
    assert text.count("the module hooks stopped") == 1 and "note (ranks 0, 1): the module hooks stopped" in text
    assert "training loop: 6 steps" not in text


def test_a_sharded_module_one_rank_skips_is_a_desync_at_that_rank(tmp_path):
    """Rank 1's forward skips module ``b`` in step 2: its next all-gather (the head's) meets rank 0's all-gather
    of ``b``; gloo aborts rank 1 on the size check. The root cause is the desync, at rank 1 and step 2, with
    both ranks' lines; the abort and rank 0's lost connection come after it."""
    path = _script(tmp_path, "skip", prefix="from torch.distributed.fsdp import fully_shard\n", body="""\
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(16, 16); self.b = nn.Linear(16, 16); self.head = nn.Linear(16, 1)
            def forward(self, x, skip=False):
                h = torch.relu(self.a(x))
                if not skip:
                    h = torch.relu(self.b(h))
                return self.head(h)
        model = Net()
        for m in (model.a, model.b, model.head):
            fully_shard(m)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            xb = torch.randn(8, 16, generator=g); yb = torch.randn(8, 1, generator=g)
            out = model(xb, skip=(rank == 1 and step == 2))
            loss = ((out - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "120")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    f = data["findings"][0]
    assert (f["kind"], f["rank"], f["line"]) == ("desync", 1, _line(path, "return self.head(h)")), f
    each = f["evidence"]["ranks"]
    assert each["0"]["line"] == _line(path, "h = torch.relu(self.b(h))") and each["1"]["loop"] == {"step": 2}
    assert "Under FSDP" in f["message"]
    assert {(g["kind"], g["rank"]) for g in data["findings"][1:]} <= {("crash", 1), ("consequence", 0), ("hang", None)}


def test_one_rank_out_of_memory_on_a_simulated_device_is_named_with_its_memory(tmp_path):
    """``--memory-limit`` under ``--nproc`` is each rank's simulated device. Rank 1's batch is 64x rank 0's:
    rank 1 runs out in its forward, with the memory by category at that point (its parameters are its shard,
    not the whole model); rank 0's lost connection is the consequence."""
    path = _script(tmp_path, "oom", prefix="from torch.distributed.fsdp import fully_shard\n", body="""\
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 1))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = 64 if rank == 0 else 4096
        for step in range(3):
            xb = torch.randn(batch, 256); yb = torch.randn(batch, 1)
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "120", "--memory-limit", "16MiB")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    f = data["findings"][0]
    assert (f["kind"], f["rank"], f["line"], f["iteration"]) == ("oom", 1, _line(path, "loss = ((model"), 0), f
    whole = 4 * (256 * 1024 + 1024 + 1024 * 256 + 256 + 256 + 1)
    assert "parameters 1.0 MiB" in f["message"] and whole > 2 * 1024 ** 2  # (the whole model: 2.0 MiB)
    # What FSDP2 offers, the largest share first: here the activations of rank 1's large batch.
    assert "Under FSDP2, activations are most of it: activation checkpointing" in f["message"]
    assert [(g["kind"], g["rank"]) for g in data["findings"][1:]] == [("consequence", 0)]


def test_two_torchrun_nodes_combined_into_one_report(tmp_path):
    """``torchrun --nnodes 2 --rdzv-backend c10d`` started twice on this machine (two "nodes" of 2 ranks), each
    node's ranks writing into that node's folder; the folders copied together and combined: rank 3's NaN is
    named at its line and iteration, the other three ranks received it."""
    import shutil
    import subprocess
    import sys

    from backward_doctor.frontends.launch import free_port
    from test_distributed import ENV
    path = _script(tmp_path, "nodes", prefix="BAD = False\n" + MODEL, body="""\
        for step in range(4):
            xb = torch.randn(8, 16, generator=g); yb = torch.randn(8, 1, generator=g)
            if rank == 3 and step == 2:
                xb[0, 0] = float("nan")
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    port, nodes = free_port(), [tmp_path / "node0", tmp_path / "node1"]
    procs = []
    for k, folder in enumerate(nodes):
        folder.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(k), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
             "--rdzv-conf", "join_timeout=300", "-m", "backward_doctor.run.rank", path, str(folder)],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for folder in nodes:
        assert len(list(folder.glob("rank*.json"))) == 2, outs
        for f in folder.iterdir():
            shutil.copy(f, gathered / f.name)
    out = tmp_path / "combined.json"
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", "combine", str(gathered), "--json", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3] and data["nproc"] == 4
    f = data["findings"][0]
    assert (f["kind"], f["rank"], f["iteration"]) == ("nonfinite", 3, 2), f
    assert sorted(f["evidence"]["spread_to"]) == [0, 1, 2]
    # Each rank says where torchrun placed it: 2 nodes, local ranks 0 and 1 on each; the text names them.
    placed = {r["rank"]: (r["node"], r["local_rank"]) for r in data["ranks"]}
    assert sorted(placed.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)], placed
    node, local = placed[3]
    assert f"rank 3 (node {node}, local rank {local}, on " in proc.stdout, proc.stdout


def test_a_sharded_module_whose_output_never_reaches_the_loss_is_named_on_every_rank(tmp_path):
    """``model.aux`` (its own FSDP unit) runs in the forward and its output is dropped: its parameters get no
    gradient on any rank and FSDP2 raises nothing (DDP would), so they never train. Named once for every rank
    at the line that ran it, as a warning. FSDP reads every parameter under no_grad (to shard and all-gather
    it): before, that was reported as a cut, "line 18 (`fully_shard(m)`) runs it under torch.no_grad()",
    once per rank."""
    path = _script(tmp_path, "unused", prefix="from torch.distributed.fsdp import fully_shard\n", body="""\
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(16, 16); self.aux = nn.Linear(16, 16); self.head = nn.Linear(16, 1)
            def forward(self, x):
                h = torch.relu(self.body(x))
                extra = self.aux(h)
                return self.head(h)
        model = Net()
        for m in (model.body, model.aux, model.head):
            fully_shard(m)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            xb = torch.randn(8, 16); yb = torch.randn(8, 1)
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
    """)
    proc, data = _doctor(path, "--timeout", "120")
    assert [(f["kind"], f["rank"], f["severity"]) for f in data["findings"]] == \
        [("unused_parameters", None, "warning")], proc.stdout
    f = data["findings"][0]
    assert f["line"] == _line(path, "extra = self.aux(h)") and f["module"] == "model.aux", f
    assert f["evidence"]["parameters"] == ["model.aux.weight", "model.aux.bias"] and f["iteration"] == 0
    assert "FSDP2 raises nothing" in f["message"] and "no_grad" not in f["message"]


def test_a_step_one_rank_skips_is_a_desync_then_a_bounded_hang(tmp_path):
    """Rank 1 skips step 2 (`continue`): its all-gathers run one step ahead of rank 0's (the same sizes, so
    gloo pairs them silently) and at the end rank 0 waits in an all-gather while rank 1 waits in the final
    barrier, until the launcher's time limit. The desync is named at rank 1 with both ranks' steps, and the
    hang says where each rank waited."""
    path = _script(tmp_path, "skip_step", prefix=MODEL, body="""\
        for step in range(4):
            xb = torch.randn(8, 16, generator=g); yb = torch.randn(8, 1, generator=g)
            if rank == 1 and step == 2:
                continue
            loss = ((model(xb) - yb) ** 2).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
        dist.barrier()
    """)
    proc, data = _doctor(path, "--timeout", "40")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    f = data["findings"][0]
    assert (f["kind"], f["rank"]) == ("desync", 1), f
    steps = {k: v["loop"] for k, v in f["evidence"]["ranks"].items()}
    assert steps == {"0": {"step": 2}, "1": {"step": 3}}, steps
    hang = next((g for g in data["findings"] if g["kind"] == "hang"), None)
    assert hang is not None, proc.stdout
    assert "waiting in barrier" in hang["message"] and "waiting in all_gather_single" in hang["message"]
