"""The exporters (``render/memory_viz.py``, ``render/perfetto.py``) read back by real readers: the memory
snapshot by PyTorch's own ``torch.cuda._memory_viz`` (its ``trace_plot``, ``segment_plot``, ``segsum`` with its
consistency checks, ``trace``, and the flame graph text of ``memory``/``segments``) and by the opcodes the
viewer's JavaScript unpickler knows; the trace by a strict Trace Event Format reader (``trace_reader.py``;
Perfetto's own trace processor reads it in ``test_perfetto_reader.py``). Each on both engines,
on a plain loop, a Hugging Face model, an out-of-memory step and a NaN; the entry points (``save_*``, ``render
--as``, the magic's and the CLI's options, the panel's buttons).
"""
from __future__ import annotations

import json
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.cuda import _memory_viz as mv

import backward_doctor as bd
from backward_doctor.render.memory_viz import LABELS
from backward_doctor.report.combined import CombinedReport
from backward_doctor.report.renderers import renderer
from backward_doctor.trace.distributed import Collective, RankRecord
from trace_reader import TraceReader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ["python", "native"]

SETUP = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
"""
STEP = """\
for step in range(4):
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
LOOP = SETUP + STEP  # as a script
OOM = """\
import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
x = torch.randn(512, 64)
loss = model(x).sum()
loss.backward()
"""
NAN = """\
import torch
w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
y = torch.log(w - 1.5)
loss = y.sum()
loss.backward()
"""

#: pickle opcodes the viewer's JavaScript unpickler (MemoryViz.js) reads; it fails on any other
JS_OPCODES = {"PROTO", "FRAME", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "MEMOIZE", "MARK", "SHORT_BINUNICODE",
              "BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
              "NEWTRUE", "NEWFALSE", "NONE", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "STOP", "TUPLE",
              "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "BINFLOAT"}


def _diagnose(src: str, engine: str, ns: dict | None = None, **kw) -> bd.Report:
    """The cell ``src`` diagnosed (the loop: ``STEP`` after ``SETUP`` ran in its namespace, as in a notebook)."""
    if engine == "native":
        from backward_doctor.capture.native_capture import native_available

        if not native_available(build=True):
            pytest.skip("native recorder not available")
    if ns is None:
        ns = {}
        if src == STEP:
            exec(compile(SETUP, "<setup>", "exec"), ns)
    return bd.diagnose(src, ns, engine=engine, **kw)


def read_snapshot(path: str) -> dict:
    """The file as the viewers read it: protocol 2-4, known opcodes, ints a JS number holds exactly;
    then every reader ``torch.cuda._memory_viz`` has that works offline."""
    with open(path, "rb") as fh:
        raw = fh.read()
    for op, arg, _ in pickletools.genops(raw):
        assert op.name in JS_OPCODES, f"the viewer cannot read opcode {op.name}"
        if op.name == "PROTO":
            assert 2 <= arg <= 4
        if isinstance(arg, int) and op.name.startswith(("BININT", "LONG")):
            assert abs(arg) < 2 ** 53, f"int {arg} is not exact in JavaScript"
    snap = pickle.loads(raw)
    assert mv.trace_plot(snap).startswith("\n<!DOCTYPE html>")
    mv.trace_plot(pickle.loads(raw), filter_freed=True)
    mv.segment_plot(snap)
    summary = mv.segsum(snap)  # raises when the blocks do not add up to their segments
    assert "total_allocated" in summary
    assert "entries" in mv.trace(snap) or not any(snap["device_traces"])
    flat = lambda lines: lines  # noqa: E731  (the flame graph's input text, without its perl script)
    mv.memory(snap, format_flamegraph=flat)
    mv.segments(snap, format_flamegraph=flat)
    return snap


def replay_peak(entries: list[dict]) -> int:
    """The peak of an alloc/free trace, as the viewer's Active Memory Timeline adds it up."""
    live = peak = 0
    for e in entries:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_snapshot_of_a_loop_is_read_by_torch_and_peaks_at_the_reports_peak(engine, tmp_path):
    report = _diagnose(STEP, engine)
    path = report.save_memory_snapshot(str(tmp_path / "snap.pickle"))
    snap = read_snapshot(path)
    entries = snap["device_traces"][0]
    assert replay_peak(entries) == report.trace.memory.peak_bytes > 0
    # Frames: the cell line and op, the module, the category (innermost first); every category seen.
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert {e["category"] for e in allocs} >= {"parameter", "gradient", "optimizer_state", "activation"}
    linear = next(e for e in allocs if e["category"] == "activation" and "model.0" in str(e["frames"]))
    assert linear["frames"][0]["line"] == 3 and linear["frames"][0]["filename"] == "the cell"
    assert linear["frames"][-1] == {"filename": "category", "line": 0, "name": "activation"}
    # What is still live at the end is what the segment holds, block by block.
    live_end = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert live_end == sum(e["size"] for e in allocs) - sum(e["size"] for e in entries
                                                            if e["action"] == "free_completed")


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_snapshot_of_an_oom_under_memory_limit_has_the_oom(engine, tmp_path):
    report = _diagnose(OOM, engine, memory_limit=300_000)
    assert report.root_cause is not None and report.root_cause.kind == "oom"
    snap = read_snapshot(report.save_memory_snapshot(str(tmp_path / "oom.pickle")))
    entries = snap["device_traces"][0]
    oom = [e for e in entries if e["action"] == "oom"]
    assert len(oom) == 1 and oom[0]["size"] > 0 and 0 <= oom[0]["device_free"] < 300_000
    assert replay_peak(entries) == report.trace.memory.peak_bytes


def test_memory_snapshot_of_a_hugging_face_step(tmp_path):
    from compat_workloads import WORKLOADS

    ns, src = WORKLOADS["hf_gpt2"]()
    report = bd.diagnose(src, ns)
    snap = read_snapshot(report.save_memory_snapshot(str(tmp_path / "gpt2.pickle")))
    assert replay_peak(snap["device_traces"][0]) == report.trace.memory.peak_bytes
    modules = {f["name"] for e in snap["device_traces"][0] for f in e["frames"] if f["filename"] == "module"}
    assert any(m.startswith("model.transformer.h.") for m in modules)


def test_storage_history_is_bounded_with_a_note(monkeypatch, tmp_path):
    from backward_doctor.capture.recorder import memory

    monkeypatch.setattr(memory, "STORAGE_EVENTS_CAP", 20)
    report = _diagnose(STEP, "python")
    storages = report.trace.memory.storages
    assert len(storages.events()) == 20 and storages.dropped > 0
    assert any("memory history" in n for n in report.trace.notes)
    read_snapshot(report.save_memory_snapshot(str(tmp_path / "capped.pickle")))


@pytest.mark.parametrize("engine", ENGINES)
def test_trace_is_read_strictly_and_has_the_reports_ops_and_peak(engine, tmp_path):
    report = _diagnose(STEP, engine)
    reader = TraceReader(report.save_trace(str(tmp_path / "trace.json")))
    ops = reader.slices(cat="op")
    assert len(ops) == len(report.trace.ops) > 0
    assert max(v for _, v in reader.counter("live", "bytes")) == report.trace.memory.peak_bytes
    for cat in ("parameters", "gradients", "optimizer", "activations"):
        assert max(v for _, v in reader.counter("memory by category", cat)) > 0
    # Ops inside their phase inside their iteration; args name the module and the line.
    assert {s["depth"] for s in ops} == {2}
    iterations = reader.slices(cat="iteration")
    # (the native engine samples a loop: iteration 3 ran unrecorded, so it has no slice)
    assert [s["name"] for s in iterations] == [f"iteration {i}" for i in report.trace.iterations.recorded
                                               if any(report.trace.iterations.iteration_of(o.index) == i
                                                      for o in report.trace.ops)]
    assert [s["name"] for s in iterations][:3] == ["iteration 0", "iteration 1", "iteration 2"]
    assert {s["name"] for s in reader.slices(cat="phase")} == {"forward", "backward", "optimizer"}
    addmm = next(s for s in ops if s["name"] == "aten::addmm" and s["args"]["phase"] == "forward")
    assert addmm["args"]["module"] == "model.0" and addmm["args"]["line"] == "cell line 3"
    assert reader.processes() == {1: "the cell"}


@pytest.mark.parametrize("engine", ENGINES)
def test_trace_marks_the_first_nan_and_the_finding(engine, tmp_path):
    report = _diagnose(NAN, engine)
    assert report.root_cause.kind == "nonfinite"
    reader = TraceReader(renderer("perfetto").render(report))
    names = [e["name"] for e in reader.instants()]
    assert "first NaN/Inf: aten::log" in names and "finding: nonfinite" in names
    at = {e["name"]: e["ts"] for e in reader.instants()}
    log_op = next(s for s in reader.slices(cat="op") if s["name"] == "aten::log")
    assert at["first NaN/Inf: aten::log"] == log_op["ts"]


def test_trace_marks_the_oom(tmp_path):
    report = _diagnose(OOM, "python", memory_limit=300_000)
    reader = TraceReader(report.save_trace(str(tmp_path / "oom.json")))
    assert "out of memory" in [e["name"] for e in reader.instants()]
    assert max(v for _, v in reader.counter("live", "bytes")) == report.trace.memory.peak_bytes


def test_a_distributed_report_has_one_process_per_rank_with_its_collectives(tmp_path):
    ranks = []
    for k in range(2):
        trace = _diagnose(STEP, "python").trace
        t0 = trace.started_at
        ranks.append(RankRecord(rank=k, world_size=2, exitcode=0, wrote_report=True, trace=trace, collectives=[
            Collective(index=0, op="all_reduce", seq=0, count=1, sizes=[[4]], line=8, start_s=t0 + 0.001,
                       end_s=t0 + 0.002),
            Collective(index=1, op="barrier", seq=1, count=None, line=9, start_s=t0 + 0.003)]))
    report = CombinedReport(ranks=ranks, nproc=2, script="/x/train.py")
    reader = TraceReader(report.save_trace(str(tmp_path / "ranks.json")))
    assert sorted(reader.processes()) == [1, 2] and reader.processes()[1].startswith("rank 0")
    for pid, rank in ((1, ranks[0]), (2, ranks[1])):
        assert len(reader.slices(cat="op", pid=pid)) == len(rank.trace.ops)
        assert reader.threads(pid)[2] == "collectives"
        calls = reader.slices(cat="collective", pid=pid)
        assert [c["name"] for c in calls] == ["all_reduce", "barrier"] and calls[1]["args"]["pending"]
    # One clock: rank 1 ran after rank 0, so its ops start later on the timeline.
    assert reader.slices(cat="op", pid=2)[0]["ts"] > reader.slices(cat="op", pid=1)[0]["ts"]
    snap = read_snapshot(report.save_memory_snapshot(str(tmp_path / "ranks.pickle")))
    assert len(snap["device_traces"]) == 2 and sorted(s["device"] for s in snap["segments"]) == [0, 1]
    for k in range(2):
        assert replay_peak(snap["device_traces"][k]) == ranks[k].trace.memory.peak_bytes


def test_an_old_report_without_the_new_fields_still_exports(tmp_path):
    fixture = os.path.join(ROOT, "tests", "unit", "fixtures", "healthy_step.json")
    with open(fixture, encoding="utf-8") as fh:
        data = {"trace": json.load(fh)["trace"]}
    data["trace"]["memory"].pop("storages", None)
    for op in data["trace"]["ops"]:
        op.pop("start_us", None)
    report = bd.Report.from_dict(data)
    reader = TraceReader(report.save_trace(str(tmp_path / "old.json")))  # ops laid end to end
    assert len(reader.slices(cat="op")) == len(report.trace.ops)
    snap = read_snapshot(report.save_memory_snapshot(str(tmp_path / "old.pickle")))
    assert snap["device_traces"] == [[]] and snap["segments"] == []


# ------------------------------------------------------------------ entry points
def _save_json(report: bd.Report, path) -> str:
    path.write_text(json.dumps(report.to_dict()), encoding="utf-8")
    return str(path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backward_doctor", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def test_render_command_writes_both_formats_and_refuses_binary_to_stdout(tmp_path):
    saved = _save_json(_diagnose(STEP, "python"), tmp_path / "r.json")
    proc = _cli("render", saved, "--as", "memory_viz")
    assert proc.returncode == 2 and "binary" in proc.stderr and "-o OUT" in proc.stderr and not proc.stdout
    out = tmp_path / "s.pickle"
    assert _cli("render", saved, "--as", "memory_viz", "-o", str(out)).returncode == 0
    read_snapshot(str(out))
    proc = _cli("render", saved, "--as", "perfetto")  # text: stdout is fine
    assert proc.returncode == 0 and TraceReader(proc.stdout).slices(cat="op")


def test_cli_memory_snapshot_and_trace_options(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(LOOP)
    snap, trace = tmp_path / "m.pickle", tmp_path / "t.json"
    assert _cli(str(script), "--memory-snapshot", str(tmp_path / "no" / "m.pickle")).returncode == 2
    proc = _cli(str(script), "--memory-snapshot", str(snap), "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    frames = [f for e in read_snapshot(str(snap))["device_traces"][0] for f in e["frames"]]
    assert any(f["filename"] == "step.py" and f["line"] == 7 for f in frames)  # the script named as Python does
    assert TraceReader(str(trace)).slices(cat="op")


def test_magic_writes_both_files_with_ipython_cell_names(tmp_path):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "backward_doctor")
    shell.run_cell(SETUP, store_history=False)
    snap, trace = tmp_path / "m.pickle", tmp_path / "t.json"
    with pytest.raises(UsageError, match="no such folder"):
        shell.run_cell_magic("backward_doctor", f"--memory-snapshot {tmp_path}/no/m.pickle", STEP)
    with capture_output() as cap:
        shell.run_cell_magic("backward_doctor", f"--engine python --memory-snapshot {snap} --trace {trace}", STEP)
    assert f"wrote {snap}" in cap.stdout and f"wrote {trace}" in cap.stdout
    frames = [f for e in read_snapshot(str(snap))["device_traces"][0] for f in e["frames"]]
    assert any(f["filename"].startswith("Cell In[") and f["line"] == 3 for f in frames)
    line = next(s["args"]["line"] for s in TraceReader(str(trace)).slices(cat="op") if s["args"]["phase"] == "forward")
    assert line.startswith("Cell In[")


def test_panel_export_buttons_write_the_files(tmp_path):
    pytest.importorskip("ipywidgets")
    from backward_doctor.frontends.panel import Panel

    report = _diagnose(STEP, "python")
    panel = Panel(report, STEP, {})
    panel.export.folder = str(tmp_path)
    panel.export.buttons["memory_viz"].click()
    assert "pytorch.org/memory_viz" in panel.export.status.value
    panel.export.buttons["perfetto"].click()
    assert "ui.perfetto.dev" in panel.export.status.value
    files = sorted(os.listdir(tmp_path))
    assert files == [f"backward_doctor_run{report.trace.run_id}_memory.pickle",
                     f"backward_doctor_run{report.trace.run_id}_trace.json"]
    read_snapshot(str(tmp_path / files[0]))
    TraceReader(str(tmp_path / files[1]))
    panel.export.folder = str(tmp_path / "missing")
    assert panel.export.save("perfetto") is None and "Could not write" in panel.export.status.value


def test_tensorboard_export_has_the_loops_series_and_the_verdict(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = _diagnose(STEP, "python")
    saved = _save_json(report, tmp_path / "r.json")
    logdir = tmp_path / "runs" / "step"
    logdir.mkdir(parents=True)
    proc = _cli("render", saved, "--as", "tensorboard", "-o", str(logdir / "events.out.tfevents.bd"))
    assert proc.returncode == 0, proc.stderr
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    its = report.trace.iterations
    assert [e.value for e in acc.Scalars("iterations/loss")] == pytest.approx(its.loss)
    assert [e.step for e in acc.Scalars("iterations/learning_rate")] == list(range(len(its.lr)))
    assert acc.Scalars("memory/peak_bytes")[0].value == report.trace.memory.peak_bytes
    verdict = acc.Tensors("backward_doctor/verdict/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "backward_doctor: OK" in verdict


def test_tensorboard_missing_is_said_plainly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        renderer("tensorboard").render(bd.Report())


def test_labels_follow_the_ledgers_categories():
    from backward_doctor.trace.records import CATEGORIES

    assert len(LABELS) == len(CATEGORIES) and LABELS[CATEGORIES.index("other")] == "temporary"


def test_script_with_memory_snapshot_doc_example(tmp_path):
    """README's example runs as written."""
    ns: dict = {}
    exec(compile(textwrap.dedent(SETUP), "<setup>", "exec"), ns)
    report = bd.diagnose("loss = model(torch.randn(8, 16)).sum()\nloss.backward()", ns)
    report.save_memory_snapshot(str(tmp_path / "step.pickle"))
    report.save_trace(str(tmp_path / "step.json"))
    assert os.path.getsize(tmp_path / "step.pickle") > 0 and os.path.getsize(tmp_path / "step.json") > 0
