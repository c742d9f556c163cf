"""Renderers registered in one place, and ``python -m backward_doctor render REPORT.json``.

A saved report renders again exactly as the live one did, with any registered renderer, without
running anything.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import backward_doctor as bd
from backward_doctor.frontends.cli import main
from backward_doctor.report import Report
from backward_doctor.report.renderers import Renderer, _REGISTRY, names, register, renderer
from backward_doctor.trace import Trace

INPLACE = "import torch\nw = torch.ones(3, requires_grad=True)\nw += 1\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    report = bd.diagnose(INPLACE, {})
    path = tmp_path_factory.mktemp("r") / "report.json"
    path.write_text(json.dumps(report.to_dict()), encoding="utf-8")
    return report, path


def test_the_report_uses_the_registered_renderers():
    assert {"text", "html", "page", "json"} <= set(names())
    r = Report()
    assert str(r) == renderer("text").render(r)
    assert r.to_html() == renderer("html").render(r)
    assert json.loads(renderer("json").render(r)) == r.to_dict()


def test_render_gives_back_the_same_text_and_page(saved, capsys, tmp_path):
    report, path = saved
    assert main(["render", str(path)]) == 0  # rendered (the report found a problem: its run said so)
    assert capsys.readouterr().out.rstrip("\n") == str(report)
    page = tmp_path / "r.html"
    assert main(["render", str(path), "--html", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == renderer("page").render(Report.from_dict(report.to_dict()))
    assert "In-place write" in page.read_text(encoding="utf-8")  # the kind in plain words


def test_render_of_a_healthy_report_exits_0(tmp_path, capsys):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(bd.diagnose("x = 1", {}).to_dict()), encoding="utf-8")
    assert main(["render", str(path), "--as", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_a_renderer_registered_later_is_offered(saved, capsys):
    @register
    class Verdict(Renderer):
        name = "verdict-test"

        def render(self, report):
            return report.findings[0].kind if report.findings else "ok"

    try:
        assert main(["render", str(saved[1]), "--as", "verdict-test"]) == 0
        assert capsys.readouterr().out.strip() == "inplace"
    finally:
        _REGISTRY.pop("verdict-test")


@pytest.mark.parametrize("content, fragment", [
    (None, "cannot read"),
    ("not json", "is not a saved backward_doctor report"),
    ('{"findings": 3}', "is not a saved backward_doctor report"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(["render", str(path)])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_unknown_renderer_and_unwritable_output_exit_2(saved, tmp_path):
    (tmp_path / "file").write_text("", encoding="utf-8")  # (a missing folder is made: one under a file cannot be)
    for argv in (["--as", "nope"], ["-o", str(tmp_path / "file" / "such" / "r.txt")], ["-o", str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:
            main(["render", str(saved[1]), *argv])
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="no renderer 'nope'"):
        renderer("nope")


def test_render_runs_from_the_command_line(saved):
    out = subprocess.run([sys.executable, "-m", "backward_doctor", "render", str(saved[1])], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("backward_doctor: PROBLEM - In-place write on a leaf that requires grad at cell line 3")


# --------------------------------------------------------------------------- issue 16: plain words, less clutter
def test_failed_fix_is_red_offers_no_code_and_proposes_the_next_step():
    from backward_doctor.render.sections import fix_result_parts
    from backward_doctor.report import FixResult

    failed = FixResult("accumulate:4", applied=True, fits=False, code="x = 1\n",
                       message="The fixed step did not complete: OutOfMemoryError: ...",
                       comparison={"before": {"peak_bytes": 100, "completed": False,
                                              "peak_by_category": {"gradients": 0}},
                                   "after": {"peak_bytes": 90, "completed": False,
                                             "peak_by_category": {"gradients": 50}}})
    head, table, _ = fix_result_parts(failed)
    assert "did not work" in head and "after the fix" not in head and "bd-fix-failed" in head
    assert "#c62828" in head and "accumulate:8" in head                   # red, and a bigger k next
    assert 'class="num good"' not in table and 'class="num bad"' not in table  # no verdicts on a failed run
    assert "until it failed" in table
    page = Report(fix_result=failed, exception="OutOfMemoryError: x").to_html()
    assert "Code to keep" not in page and "Insert as a new cell" not in page
    text = str(Report(fix_result=failed, exception="OutOfMemoryError: x"))
    assert "DID NOT WORK" in text and "Next: Try accumulate:8" in text and "code to keep" not in text
    worked = FixResult("accumulate:4", applied=True, fits=True, code="a = 1\nb = 2\n", original={
        "findings": [{"kind": "oom", "message": "", "line": 4, "title": "Out of memory"}]})
    text = str(Report(fix_result=worked))
    assert text.startswith("backward_doctor: FIXED - the step ran with accumulate:4; without it: Out of memory at "
                           "cell line 4")
    assert "\na = 1\nb = 2\n" in text and "| a = 1" not in text         # pastes as it is


def test_ops_table_leaves_out_profiler_markers_and_empty_columns():
    from backward_doctor.render.sections import ops_table_html, tensors_html
    from backward_doctor.trace.records import OpRecord, TensorMeta, Where

    ops = [OpRecord(0, "profiler::_record_function_enter_new", "forward", [], [], Where(line=1)),
           OpRecord(1, "aten::mm", "forward", [], [], Where(line=1))]
    html_ = ops_table_html(Trace(ops=ops))
    assert "aten::mm" in html_ and "profiler::" not in html_ and "allocated" not in html_
    t = tensors_html([TensorMeta(shape=[2, 3], dtype="float32", device="cpu")], [])
    assert "min" not in t and "not recorded" not in t and "<th>grad</th>" not in t and "all on cpu" in t


def test_hang_report_shows_the_threads_that_matter():
    """The main thread, a thread of the user's and a DataLoader's pin-memory thread show; multiprocessing's
    queue feeders are folded to a count; the kernel's threads (ipykernel 6 and 7) and the doctor's own are
    never named, in the stacks nor in the finding's message; the last op named is the user's, not the
    profiler's ``record_function`` marker after it."""
    from backward_doctor.analysis import analyze
    from backward_doctor.trace.records import OpRecord, Where
    from backward_doctor.trace.stacks import FrameInfo, ThreadStack

    threads = [ThreadStack("MainThread", 1, True, [FrameInfo("<cell>", 3, "<module>", in_cell=True,
                                                             code="while True:")])]
    threads += [ThreadStack(n, i + 2, False, [FrameInfo("/site/zmq/x.py", 9, "run", code="poll()")])
                for i, n in enumerate(["Heartbeat", "IOPub", "Control", "IPythonHistorySavingThread"])]
    threads += [ThreadStack(n, 10 + i, False, [FrameInfo("/py/threading.py", 320, "wait", code="waiter.acquire()")])
                for i, n in enumerate(["Shell channel", "subshell-1f2e", "backward_doctor-progress",
                                       "backward_doctor-native-build"])]
    feeder = [FrameInfo("/py/multiprocessing/queues.py", 231, "_feed", code="nonempty.wait()")]
    threads += [ThreadStack("QueueFeederThread", 20 + i, False, feeder) for i in range(6)]
    threads += [ThreadStack("Thread-7 (_pin_memory_loop)", 30, False, [FrameInfo(
        "/site/torch/utils/data/_utils/pin_memory.py", 52, "_pin_memory_loop", code="r = in_queue.get()")]),
        ThreadStack("producer", 31, False, [FrameInfo("<cell>", 1, "produce", in_cell=True, code="q.put(x)")])]
    ops = [OpRecord(0, "aten::mm", "forward", [], [], Where(line=2)),
           OpRecord(1, "profiler::_record_function_exit", "optimizer", [], [], Where(line=2))]
    trace = Trace(threads=threads, timed_out=True, timeout_s=5.0, ops=ops, op_count=2)
    report = Report(findings=analyze(trace), trace=trace, places={"": "Cell In[5]"})
    message = report.findings[0].message
    assert "the last PyTorch op was `aten::mm` in forward" in message
    assert "Other threads: Thread-7 (_pin_memory_loop), producer." in message
    text, page = str(report), report.to_html()
    for shown in (text, page):
        assert "Cell In[5], line 3 in <module>: while True:" in shown.replace("<code>", "").replace("</code>", "") \
            or "Cell In[5], line 3" in shown
        assert "producer" in shown and "_pin_memory_loop" in shown and "QueueFeederThread ×6" in shown
        for own in ("Heartbeat", "IOPub", "Control", "Shell channel", "subshell-", "backward_doctor-", "poll()"):
            assert own not in shown, own
