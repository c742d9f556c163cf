"""Exports at their edges (issue 47, item 6), through the real command line in a subprocess and real diagnoses:
``render -o`` into a folder that does not exist yet (created, parents included; a render that fails creates
nothing); ``render`` exits 0 once it rendered, whatever the report found, while the diagnosis keeps its
status and every command's ``--help`` says what its status means; what ``torch.cuda._memory_viz`` does offline
(its HTML plots load their viewer from a CDN: the docs say so and name what works offline); the Perfetto trace of
a sampled loop whose NaN iteration was replayed holds every recorded iteration, not only the replay; and the
counter track Perfetto names ``live bytes`` (not ``live bytes bytes``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd
from backward_doctor.capture.native_capture import native_available
from backward_doctor.report.renderers import renderer
from trace_reader import TraceReader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPLACE = "import torch\nw = torch.ones(3, requires_grad=True)\nw.add_(1)\nloss = w.sum()\nloss.backward()\n"
SCRIPT_LOOP = ("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 2)\n"
               "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor i in range(5):\n"
               "    opt.zero_grad()\n    loss = model(torch.randn(4, 8)).pow(2).mean()\n    loss.backward()\n"
               "    opt.step()\nw = torch.ones(3, requires_grad=True)\nw.add_(1)\n")
LOOP = ("for i in range({n}):\n    opt.zero_grad()\n    xb = x * float('nan') if i == {bad} else x\n"
        "    loss = F.cross_entropy(model(xb), y)\n    loss.backward()\n    opt.step()\n")


def _cli(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backward_doctor", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def _save(report: bd.Report, path) -> str:
    path.write_text(json.dumps(report.to_dict()), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    """A script with a training loop that ends in an in-place write on a leaf: diagnosed by the real CLI
    (``--json``), which exits 1 for it."""
    folder = tmp_path_factory.mktemp("problem")
    (folder / "step.py").write_text(SCRIPT_LOOP, encoding="utf-8")
    proc = _cli("step.py", "--json", "r.json", cwd=str(folder))
    assert proc.returncode == 1 and "PROBLEM" in proc.stdout, proc.stdout + proc.stderr
    return folder


# ------------------------------------------------------------------ render -o into a new folder
def test_render_creates_the_output_folder_as_the_readme_writes_it(problem, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = str(problem / "r.json")
    proc = _cli("render", report, "--as", "tensorboard", "-o", "runs/step/events.out.tfevents.bd", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    written = tmp_path / "runs" / "step" / "events.out.tfevents.bd"
    assert written.is_file() and not proc.stdout
    events = EventAccumulator(str(written.parent))
    events.Reload()
    loss = events.Scalars("iterations/loss")
    assert [e.step for e in loss] == [0, 1, 2, 3, 4]  # TensorBoard reads the run's five iterations
    # Other renderers too, several levels deep, through --html as well.
    assert _cli("render", report, "--as", "perfetto", "-o", str(tmp_path / "a" / "b" / "t.json")).returncode == 0
    TraceReader(str(tmp_path / "a" / "b" / "t.json"))
    assert _cli("render", report, "--html", str(tmp_path / "p" / "q" / "r.html")).returncode == 0
    assert (tmp_path / "p" / "q" / "r.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_a_folder_that_cannot_be_made_is_one_line_and_exit_2(problem, tmp_path):
    (tmp_path / "plain").write_text("a file, not a folder", encoding="utf-8")
    proc = _cli("render", str(problem / "r.json"), "-o", str(tmp_path / "plain" / "sub" / "r.txt"))
    line = proc.stderr.strip().splitlines()[-1]  # (argparse's usage, then the error in one line)
    assert proc.returncode == 2 and "plain" in line and "is not a folder" in line, proc.stderr
    assert (tmp_path / "plain").read_text(encoding="utf-8") == "a file, not a folder"


def test_a_render_that_fails_creates_no_folder(problem, tmp_path):
    data = json.loads((problem / "r.json").read_text(encoding="utf-8"))
    data["trace"]["ops"][0]["start_us"] = 1e300  # past any time a trace holds: refused, nothing written
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    proc = _cli("render", str(bad), "--as", "perfetto", "-o", str(tmp_path / "new" / "t.json"))
    assert proc.returncode == 2 and "cannot be rendered" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ exit status
def test_render_exits_0_when_it_rendered_and_the_diagnosis_keeps_1(problem, tmp_path):
    report = str(problem / "r.json")
    proc = _cli("render", report)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("backward_doctor: PROBLEM - In-place write on a leaf")
    for kind in ("perfetto", "memory_viz", "page", "json"):
        out = tmp_path / f"out.{kind}"
        assert _cli("render", report, "--as", kind, "-o", str(out)).returncode == 0 and out.stat().st_size > 0
    # The diagnosis of the same script still says "a problem" by its status.
    assert _cli("step.py", cwd=str(problem)).returncode == 1
    # Bad arguments are still 2.
    assert _cli("render", report, "--as", "nope").returncode == 2


def test_every_commands_help_says_what_its_exit_status_means():
    render = " ".join(_cli("render", "--help").stdout.split())
    assert "exit status" in render.lower() and "0 when it rendered" in render, render
    assert "whatever the report found" in render
    diagnose = " ".join(_cli("--help").stdout.split())
    assert "1 when a problem was found" in diagnose and "2 for bad arguments" in diagnose, diagnose
    combine = " ".join(_cli("combine", "--help").stdout.split())
    assert "1 when a problem was found" in combine, combine
    run = " ".join(_cli("run", "--help").stdout.split())
    assert "exit status" in run.lower() and "the script's own" in run, run


def test_the_docs_state_the_render_status():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = " ".join(fh.read().split())
    assert "`render` exits 0 once it has rendered" in readme


# ------------------------------------------------------------------ torch's memory viewer offline
def test_the_docs_say_what_torchs_memory_viewer_needs_offline(tmp_path):
    """torch's ``trace_plot`` page imports its viewer (``MemoryViz.js``) from a CDN and torch ships no copy, so the
    page is blank offline; ``stats`` and ``trace`` print what they find without any network. The docs say that,
    naming the host the page really loads from, and point at the report's own page (self-contained)."""
    report = bd.diagnose(INPLACE, {})
    snap = report.save_memory_snapshot(str(tmp_path / "s.pickle"))
    page = tmp_path / "s.html"
    plot = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", snap, "-o", str(page)],
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr
    imported = re.findall(r'from\s+"(https?://[^"/]+)/[^"]*MemoryViz\.js"', page.read_text(encoding="utf-8"))
    assert imported, "torch's trace_plot page no longer imports its viewer from the network: update the docs"
    viz = os.path.join(os.path.dirname(torch.__file__), "utils", "viz")
    assert not any(name.endswith(".js") for _, _, files in os.walk(viz) for name in files)  # nothing to embed
    for action, expect in (("stats", "total_allocated"), ("trace", "TOTAL MEM")):
        proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", action, snap], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0 and expect in proc.stdout, proc.stderr
    host = imported[0].split("://", 1)[1]
    for doc in ("docs/exports.md", "README.md"):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
            text = " ".join(fh.read().split())
        assert host in text and "offline" in text and "_memory_viz stats" in text, doc
    # The report's own page, the offline view the docs offer, fetches nothing.
    html = renderer("page").render(report)
    assert not re.search(r'(src|href)\s*=\s*"https?://|import\s[^;]*https?://', html) and "<svg" in html


# ------------------------------------------------------------------ Perfetto: a sampled loop, its counters
def _ns() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(12, 8),
            "y": torch.randint(0, 3, (12,)), "F": F, "torch": torch}


@pytest.mark.skipif(not native_available(build=True), reason="the native recorder is not built here")
def test_the_trace_of_a_sampled_loop_holds_every_recorded_iteration_and_the_replay(tmp_path):
    report = bd.diagnose(LOOP.format(n=400, bad=300), _ns(), engine="native")
    its = report.trace.iterations
    assert its.replayed == 300 and its.recorded == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256], its
    saved = _save(report, tmp_path / "r.json")
    out = tmp_path / "t.json"
    proc = _cli("render", saved, "--as", "perfetto", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    reader = TraceReader(str(out))  # strict: slices nested, times valid
    slices = reader.slices(cat="iteration")
    names = [s["name"] for s in slices]
    assert names == [f"iteration {k}" for k in its.recorded] + ["iteration 300 (replayed)"], names
    ops = reader.slices(cat="op")

    def inside(s):  # (times are whole nanoseconds written as microseconds: compared to half a nanosecond)
        return [o for o in ops if s["ts"] - 5e-4 <= o["ts"] and o["ts"] + o["dur"] <= s["ts"] + s["dur"] + 5e-4]

    per_iteration = [len(inside(s)) for s in slices]
    assert all(n > 0 for n in per_iteration) and sum(per_iteration) == len(ops)
    # The recorded iterations ran the same body: as many ops each; the replay, one more (its batch times NaN).
    assert len(set(per_iteration[:-1])) == 1 and per_iteration[-1] == per_iteration[0] + 1, per_iteration
    # The replay ran after the run, and its ops are the report's own (the instants and counters are on them).
    replay = slices[-1]
    assert replay["ts"] >= slices[-2]["ts"] + slices[-2]["dur"] and replay["args"]["replayed"] is True
    assert [o["name"] for o in inside(replay)] == [op.op for op in report.trace.ops]
    nan = next(e for e in reader.instants() if e["name"].startswith("first NaN/Inf"))
    assert replay["ts"] <= nan["ts"] <= replay["ts"] + replay["dur"]
    assert max(v for _, v in reader.counter("live", "bytes")) == report.trace.memory.peak_bytes


def test_the_counter_tracks_are_named_once():
    """Perfetto names a JSON counter track ``<name> <series>``: the live-memory track reads ``live bytes``."""
    report = bd.diagnose(INPLACE, {})
    events = json.loads(renderer("perfetto").render(report))["traceEvents"]
    tracks = {f"{e['name']} {key}" for e in events if e["ph"] == "C" for key in e["args"]}
    assert "live bytes" in tracks and "live bytes bytes" not in tracks, tracks
    for track in tracks:
        words = track.split()
        assert all(a != b for a, b in zip(words, words[1:])), track
