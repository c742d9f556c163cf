"""A report handed on, and the folders reports are written to, under attack (issue 46, items 1-3, 7, 14, 15):

1. a crafted ``allocator_snapshot`` never becomes a pickle that runs code: refused in one line, nothing written;
2. a link planted at a report file's name is replaced, never followed; a file is written whole or not at all;
3. control and bidi characters a report carries never reach the terminal or the page raw;
7. a report that cannot be written is still shown, with one line saying why the file is missing;
14. a crafted report of a few MB renders in seconds (the work is bounded per input byte);
15. numbers past what a format holds end in one line and exit 2, never a traceback.
Each runs the real command line in a process where the item is about what the user sees.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import pickle
import pickletools
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import backward_doctor as bd
from backward_doctor.frontends.cell_watch import REPORT_NAME, write_report
from backward_doctor.frontends.cli import main
from backward_doctor.render.memory_viz import PLAIN_OPCODES
from backward_doctor.report.combined import CombinedReport, load_report
from backward_doctor.report.renderers import renderer, write
from backward_doctor.report.schema import ReportError, validate
from backward_doctor.trace.distributed import RankRecord

ROOT = Path(__file__).resolve().parents[1]
NAN_STEP = "import torch\nw = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)\ny = torch.log(w - 1.5)\n" \
           "loss = y.sum()\nloss.backward()\n"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                                       os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _cli(*argv: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backward_doctor", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env(), **kw)


def _exit_2_in_one_line(out: subprocess.CompletedProcess, *fragments: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], out.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def saved() -> dict:
    """A real failing report (NaN in a step, ops, a memory ledger), as JSON data."""
    report = bd.diagnose(NAN_STEP, {}, engine="python")
    assert report.findings and report.findings[0].kind == "nonfinite"
    return json.loads(json.dumps(report.to_dict()))


def _save(path: Path, data: dict) -> str:
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- 1. a snapshot that runs code
class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted_pickles(marker: str) -> dict[str, bytes]:
    snapshot = {"segments": [], "device_traces": [[]]}
    return {
        "reduce": pickle.dumps({**snapshot, "x": _RunsCode(marker)}, protocol=4),
        "protocol 0 GLOBAL": f"cos\nsystem\n(Vtouch {marker}\ntR.".encode(),
        "INST": f"(Vtouch {marker}\nios\nsystem\n.".encode(),
        "BUILD of a class": pickle.dumps({**snapshot, "x": Path("/")}, protocol=2),
        "persistent id": b"\x80\x04P1\n.",
    }


@pytest.mark.parametrize("kind", ["reduce", "protocol 0 GLOBAL", "INST", "BUILD of a class", "persistent id"])
def test_a_crafted_allocator_snapshot_is_refused_in_one_line_and_nothing_written(tmp_path, saved, kind):
    marker = tmp_path / "PWNED"
    data = copy.deepcopy(saved)
    raw = _crafted_pickles(str(marker))[kind]
    data["trace"]["memory"]["cuda"] = {"allocator_snapshot": base64.b64encode(raw).decode("ascii")}
    path = _save(tmp_path / "r.json", data)
    out = tmp_path / "snap.pickle"
    done = _cli("render", path, "--as", "memory_viz", "-o", str(out))
    _exit_2_in_one_line(done, "allocator_snapshot")
    assert not out.exists() and not marker.exists()
    assert os.listdir(tmp_path) == ["r.json"]  # (no half file, no temporary one)
    # In Python: save_memory_snapshot (what the panel's button calls) refuses too, and writes nothing.
    report = load_report(data)
    with pytest.raises(ReportError, match="allocator_snapshot"):
        report.save_memory_snapshot(str(out))
    assert not out.exists() and not marker.exists()


def test_the_panels_export_of_a_crafted_snapshot_says_it_could_not_write(tmp_path, saved):
    pytest.importorskip("ipywidgets")
    from backward_doctor.frontends.panel_export import ExportRow

    marker = tmp_path / "PWNED"
    data = copy.deepcopy(saved)
    raw = _crafted_pickles(str(marker))["reduce"]
    data["trace"]["memory"]["cuda"] = {"allocator_snapshot": base64.b64encode(raw).decode("ascii")}
    row = ExportRow(load_report(data), folder=str(tmp_path))
    assert row.save("memory_viz") is None
    assert "Could not write" in row.status.value and "plain data only" in row.status.value
    assert os.listdir(tmp_path) == [] and not marker.exists()


def test_a_plain_allocator_snapshot_is_rewritten_as_plain_data(tmp_path, saved):
    """What the allocator's own snapshot holds (dicts, lists, a tuple, strings, ints, floats, booleans,
    None) passes, read and pickled again by the exporter: every opcode is plain data."""
    snap = {"segments": [{"device": 0, "address": 139_000_000_000, "total_size": 2 << 20, "segment_pool_id": (0, 0),
                          "is_expandable": False, "frames": [], "blocks": [
                              {"address": 139_000_000_000, "size": 512, "requested_size": 500,
                               "state": "active_allocated",
                               "frames": [{"filename": "x.py", "line": 3, "name": "f"}]}]}],
            "device_traces": [[{"action": "alloc", "addr": 139_000_000_000, "size": 512, "stream": 0,
                                "time_us": 17, "frames": [{"filename": "x.py", "line": 3, "name": "f"}],
                                "compile_context": None, "user_metadata": ""}]],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "ratio": 0.5, "raw": b"\x00"}}
    data = copy.deepcopy(saved)
    data["trace"]["memory"]["cuda"] = {"allocator_snapshot": base64.b64encode(pickle.dumps(snap, protocol=4)).decode()}
    out = tmp_path / "snap.pickle"
    assert main(["render", _save(tmp_path / "r.json", data), "--as", "memory_viz", "-o", str(out)]) == 0  # (rendered)
    raw = out.read_bytes()
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= PLAIN_OPCODES
    assert pickle.loads(raw) == snap


# --------------------------------------------------------------------------- 2. links planted at a name
def _plant(folder: Path, names: list[str], victim: Path) -> None:
    for name in names:
        os.symlink(victim, folder / name)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_text("precious\n", encoding="utf-8")
    return path


def _no_link_followed(folder: Path, names: list[str], victim: Path) -> None:
    assert victim.read_text(encoding="utf-8") == "precious\n"
    for name in names:
        assert not os.path.islink(folder / name) and (folder / name).stat().st_size > 0, name
    assert not [n for n in os.listdir(folder) if n.endswith(".part")]


def test_every_writer_replaces_a_planted_link_never_its_target(tmp_path, victim, saved):
    out = tmp_path / "out"
    out.mkdir()
    report, combined = load_report(saved), CombinedReport(ranks=[RankRecord(0, 1, exitcode=0)], nproc=1)
    names = [f"{REPORT_NAME}.json", f"{REPORT_NAME}.html", "page.html", "snap.pickle", "trace.json", "r.txt",
             "ranks.html", "cli.txt", "cli.html", "combined.json"]
    _plant(out, names, victim)
    assert write_report(report, str(out)) == [str(out / f"{REPORT_NAME}.json"), str(out / f"{REPORT_NAME}.html")]
    report.save_html(str(out / "page.html"))
    report.save_memory_snapshot(str(out / "snap.pickle"))
    report.save_trace(str(out / "trace.json"))
    write(report, "text", str(out / "r.txt"))
    combined.save_html(str(out / "ranks.html"))
    src = _save(tmp_path / "saved.json", saved)
    assert main(["render", src, "-o", str(out / "cli.txt")]) == 0
    assert main(["render", src, "--html", str(out / "cli.html")]) == 0
    folder = tmp_path / "ranks"
    folder.mkdir()
    rec = RankRecord(rank=0, world_size=1, wrote_report=True, trace=bd.Report().trace)
    _save(folder / "rank0.json", rec.to_dict())
    assert main(["combine", str(folder), "--json", str(out / "combined.json")]) == 0
    _no_link_followed(out, names, victim)
    assert json.loads((out / f"{REPORT_NAME}.json").read_text())["findings"][0]["kind"] == "nonfinite"


@pytest.mark.slow
def test_run_output_dir_with_links_planted_keeps_their_targets(tmp_path, victim):
    script = tmp_path / "train.py"
    script.write_text(NAN_STEP + "raise ValueError('the data ran out')\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    names = [f"{REPORT_NAME}.json", f"{REPORT_NAME}.html"]
    _plant(out, names, victim)
    done = _cli("run", "--output-dir", str(out), str(script), timeout=600, cwd=tmp_path)
    assert done.returncode == 1 and "ValueError: the data ran out" in done.stderr, done.stderr[-3000:]
    _no_link_followed(out, names, victim)
    assert json.loads((out / names[0]).read_text())["exception"].startswith("ValueError")


_FULL_DISK = """\
import json, os, resource, signal, sys
import backward_doctor as bd
from backward_doctor.frontends.cell_watch import write_report
folder = sys.argv[1]
report = bd.Report(trace=bd.Trace(source="x = 1  # padding\\n" * 20000))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))   # the disk is full past 64 KiB a file
try:
    write_report(report, folder)
except OSError as exc:
    print(json.dumps([type(exc).__name__, exc.errno, exc.filename, exc.written]))
"""


def test_a_report_that_does_not_fit_on_disk_leaves_no_half_file(tmp_path):
    """A full disk (a file size limit: EFBIG at 64 KiB) midway through the JSON: a clean ``OSError`` naming the
    file, the report written before at that name untouched, no truncated JSON and no temporary file."""
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{REPORT_NAME}.json").write_text('{"an earlier": "report"}', encoding="utf-8")
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                          env=_env())
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    kind, errno, filename, written = json.loads(done.stdout)
    assert (kind, errno, filename) == ("OSError", 27, str(out / f"{REPORT_NAME}.json")), done.stdout  # EFBIG
    assert (out / f"{REPORT_NAME}.json").read_text(encoding="utf-8") == '{"an earlier": "report"}'
    page = out / f"{REPORT_NAME}.html"  # (the smaller page is tried too: there whole, or not at all)
    assert written == ([str(page)] if page.exists() else [])
    assert sorted(os.listdir(out)) == sorted([f"{REPORT_NAME}.json"] + [page.name] * page.exists())
    if page.exists():
        assert page.read_text(encoding="utf-8").endswith("</html>\n")


def test_render_to_a_full_disk_fails_in_one_line_and_keeps_the_old_file(tmp_path, saved):
    src = _save(tmp_path / "r.json", saved)
    out = tmp_path / "page.html"
    out.write_text("the page of yesterday", encoding="utf-8")

    def full_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    done = _cli("render", src, "--html", str(out), preexec_fn=full_disk)
    _exit_2_in_one_line(done, f"cannot write {out}", "File too large")
    assert out.read_text(encoding="utf-8") == "the page of yesterday"
    assert sorted(os.listdir(tmp_path)) == ["page.html", "r.json"]


# --------------------------------------------------------------------------- 3. control characters
HOSTILE = "\x1b[2J\x1b[H\x1b]8;;http://evil.example\x07link\x1b]8;;\x07\x1b[32mOK\x1b[0m\r\b\b\x07\x9b31m" \
          "\u202eyp.live\u2066\u2069\u200f\nbackward_doctor: OK - all good"
#: what must never reach a terminal or a page from a report: C0 controls but tab and newline, DEL, C1
#: controls, bidi marks, embeddings, overrides and isolates
FORBIDDEN = {chr(c) for c in [*range(0, 9), *range(11, 32), *range(0x7f, 0xa0)]} | \
            set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _hostile_everywhere(doc: dict, validate) -> dict:
    """Every string of ``doc`` given the hostile text (where the schema lets a string be anything)."""
    data = copy.deepcopy(doc)

    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(value, str) and key not in ("format", "kind"):
                node[key] = value + HOSTILE
                try:
                    validate(data)
                except ReportError:
                    node[key] = value
            elif isinstance(value, (dict, list)):
                walk(value)
    walk(data)
    return data


def _clean(text: str, what: str) -> None:
    bad = sorted({f"U+{ord(c):04X}" for c in text if c in FORBIDDEN})
    assert not bad, f"{what} shows {bad}"


def _one_verdict_line(text: str) -> None:
    assert [line for line in text.splitlines() if line.startswith("backward_doctor:")] == text.splitlines()[:1]


def test_render_shows_no_control_or_bidi_character_of_a_report(tmp_path, saved):
    data = _hostile_everywhere(saved, load_report)
    assert json.dumps(data).count("\\u202e") > 20  # (messages, notes, the source, op names, places, ...)
    src = _save(tmp_path / "hostile.json", data)
    done = _cli("render", src)
    assert done.returncode == 0, done.stderr[-2000:]  # (rendered: render's status is not the report's)
    _clean(done.stdout, "render (text)")
    _one_verdict_line(done.stdout)
    assert "\\x1b[2J" in done.stdout and "\\u202e" in done.stdout  # (shown, as escapes)
    assert _cli("render", src, "--html", str(tmp_path / "page.html")).returncode == 0
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    _clean(page, "the page")
    report = load_report(data)
    _clean(renderer("html").render(report), "the HTML fragment")
    _clean(str(report), "str(report)")


def test_combine_and_a_combined_report_show_no_control_character(tmp_path, saved):
    rec = RankRecord(rank=0, world_size=2, script="train.py" + HOSTILE, wrote_report=True, exitcode=1,
                     trace=load_report(saved).trace)
    rec_data = _hostile_everywhere(json.loads(json.dumps(rec.to_dict())), lambda d: validate(d, "RankRecord"))
    folder = tmp_path / "ranks"
    folder.mkdir()
    _save(folder / "rank0.json", rec_data)
    done = _cli("combine", str(folder), "--json", str(tmp_path / "combined.json"))
    assert done.returncode == 1, done.stderr[-2000:]
    _clean(done.stdout, "combine")
    _one_verdict_line(done.stdout)
    combined = json.loads((tmp_path / "combined.json").read_text(encoding="utf-8"))
    combined["notes"] = ["a note" + HOSTILE]
    src = _save(tmp_path / "c.json", combined)
    done = _cli("render", src)
    _clean(done.stdout, "render of a combined report")
    _one_verdict_line(done.stdout)
    assert _cli("render", src, "--html", str(tmp_path / "c.html")).returncode == 0
    _clean((tmp_path / "c.html").read_text(encoding="utf-8"), "the combined page")


def test_the_one_error_line_shows_no_control_character_of_a_key(tmp_path):
    src = _save(tmp_path / "r.json", {"trace": {"op_totals": {"\x1b[2J\u202e": "not a list"}}})
    line = _exit_2_in_one_line(_cli("render", src), "op_totals")
    _clean(line, "the error line")


# --------------------------------------------------------------------------- 7. a report not written
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


@pytest.mark.slow
def test_the_trainer_callback_shows_the_report_it_cannot_write(tmp_path):
    """A folder sits where the JSON would go: the report is still printed, one line says why the file is
    missing, the page beside it is written whole, and the script's own traceback and status follow."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    (out / f"{REPORT_NAME}.json").mkdir(parents=True)
    script = tmp_path / "hf_train.py"
    script.write_text(textwrap.dedent(HF_SCRIPT), encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=_env())
    assert done.returncode == 1, done.stderr[-3000:]
    report, _, trace = done.stderr.partition("Traceback (most recent call last):")
    assert "backward_doctor: PROBLEM - Shapes do not fit" in report, done.stderr[-3000:]
    why = [line for line in report.splitlines() if "saved only in part" in line]
    assert len(why) == 1 and "Is a directory" in why[0] and f"{REPORT_NAME}.json" in why[0], report[-2000:]
    assert "RuntimeError" in trace and "backward_doctor" not in trace.split("RuntimeError")[-1]
    assert sorted(os.listdir(out)) == [f"{REPORT_NAME}.html", f"{REPORT_NAME}.json"]
    assert (out / f"{REPORT_NAME}.json").is_dir()
    assert (out / f"{REPORT_NAME}.html").read_text(encoding="utf-8").rstrip().endswith("</html>")


# --------------------------------------------------------------------------- 14. work bounded per byte
def test_a_shape_of_a_hundred_thousand_huge_dimensions_renders_at_once(tmp_path, saved):
    """3.3 MB: the NaN op's output a tensor of 150,000 dimensions of 2**64-1 (its size was a 9.6-million-bit
    product, seconds per multiplication, several per page: 5 minutes, then "could not be drawn"), in a process
    given 120 s."""
    data = copy.deepcopy(saved)
    op = next(o for o in data["trace"]["ops"] if o["op"] == "aten::log")
    op["outputs"][0]["shape"] = [2 ** 64 - 1] * 150_000
    src = _save(tmp_path / "shapes.json", data)
    assert os.path.getsize(src) < 4 << 20
    done = _cli("render", src, "--html", str(tmp_path / "page.html"), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]  # (rendered)
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "could not be drawn" not in page and "aten::log" in page


def test_a_fragmented_storage_history_exports_at_once(tmp_path, saved):
    """7.5 MB, four ranks' ledgers at the bound of 100,000 events each: 33,000 one-byte storages, every
    other one freed, then 50,000 two-byte ones that fit no hole (first fit looked at all 16,500 holes for
    each: 800 million looks a rank, 4 minutes in all): bounded per event, in a process given 120 s."""
    holes, big = 33_000, 50_000
    flat = []
    for i in range(holes):
        flat += [1, i, 1, 4, 0]
    for i in range(0, holes, 2):
        flat += [0, i, 1, 4, 0]
    for i in range(holes, holes + big):
        flat += [1, i, 2, 4, 0]
    trace = copy.deepcopy(saved["trace"])
    trace["memory"]["storages"] = {"flat": flat, "dropped": 0}
    data = CombinedReport(ranks=[RankRecord(k, 4, exitcode=0, wrote_report=True) for k in range(4)], nproc=4).to_dict()
    for rank in data["ranks"]:
        rank["trace"] = trace
    src = _save(tmp_path / "frag.json", data)
    done = _cli("render", src, "--as", "memory_viz", "-o", str(tmp_path / "snap.pickle"), timeout=120)
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr[-2000:]
    snap = pickle.loads((tmp_path / "snap.pickle").read_bytes())
    assert len(snap["device_traces"]) == len(snap["segments"]) == 4
    for device, segment in zip(snap["device_traces"], snap["segments"]):
        allocs = [e for e in device if e["action"] == "alloc"]
        assert len(allocs) == holes + big and sum(e["size"] for e in allocs) == holes + 2 * big
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]  # (still adds up)


# --------------------------------------------------------------------------- 15. numbers past a format
@pytest.mark.parametrize("where, value, kind, fragment", [
    (("trace", "duration_s"), 10 ** 400, "text", "trace.duration_s: "),
    (("trace", "ops", 0, "duration_us"), 10 ** 309, "perfetto", "trace.ops[0].duration_us: "),
    (("trace", "ops", 0, "start_us"), 1.5e308, "perfetto", "trace.ops[0].start_us: "),
    (("trace", "ops", 0, "duration_us"), 1.5e308, "perfetto", "trace.ops[0].duration_us: "),
    (("trace", "iterations", "stride"), 2 ** 63, "tensorboard", "trace.iterations.stride: "),
], ids=["int past a float", "int past a float in an op", "start 1e308", "duration 1e308", "step past int64"])
def test_a_number_past_what_a_format_holds_is_one_line_and_exit_2(tmp_path, saved, where, value, kind, fragment):
    if kind == "tensorboard":
        pytest.importorskip("tensorboard")
    data = copy.deepcopy(saved)
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    if kind == "tensorboard":
        data["trace"]["iterations"]["loss"] = [1.0, 0.5]
    src = _save(tmp_path / "r.json", data)
    out = tmp_path / f"out.{kind}"
    done = _cli("render", src, "--as", kind, "-o", str(out))
    _exit_2_in_one_line(done, fragment)
    assert not out.exists()
