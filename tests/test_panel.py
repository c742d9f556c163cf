"""Headless tests of the notebook panel, the static HTML report and the plots.

The panel is built for reports of several kinds; tabs are switched and fix buttons are
clicked (``Button.click()``) the way a user would, and the tests read what the widgets
then show. Fix runs use the real ``backward_doctor.fixes`` where it is there, and a
stand-in runner for progress, cancel and "not available yet" paths.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

import backward_doctor as bd
from backward_doctor.report import FixResult

W = pytest.importorskip("ipywidgets")
from backward_doctor.frontends import panel as panel_mod  # noqa: E402
from backward_doctor.frontends.panel import Panel  # noqa: E402

from backward_doctor.frontends.demo import SETUP  # noqa: E402  (the demo's model, optimizer and batch)

CELLS = {
    "ok": ("loss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step(); opt.zero_grad()", {}),
    "oom": ("xb = torch.randn(2048, 256)\nyb = torch.randint(0, 10, (2048,))\n"
            "loss = F.cross_entropy(model(xb), yb)\nloss.backward()\nopt.step(); opt.zero_grad()",
            {"memory_limit": "20MB"}),
    "nonfinite": ("logits = model(x) * 1000\nprobs = torch.softmax(logits, dim=1)\n"
                  "loss = -torch.log(probs[torch.arange(64), y]).mean()\nloss.backward()", {}),
    "inplace": ("h = torch.sigmoid(model[0](x))\nh += 0.1\nloss = F.cross_entropy(model[2:](model[1](h)), y)\n"
                "loss.backward()", {}),
    "shape": ("out = model(x)\nloss = (out - torch.ones(64, 5)).pow(2).mean()\nloss.backward()", {}),
    "no_grad": ("with torch.no_grad():\n    out = model(x)\nloss = F.cross_entropy(out, y)\nloss.backward()", {}),
}


def namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(SETUP, ns)
    return ns


def diagnose(kind: str) -> tuple[bd.Report, str, dict[str, Any], dict[str, Any]]:
    src, kw = CELLS[kind]
    ns = namespace()
    return bd.diagnose(src, ns, **kw), src, ns, kw


@pytest.fixture(scope="module")
def reports() -> dict[str, tuple]:
    return {k: diagnose(k) for k in CELLS}


def text_of(html: str) -> str:
    """Visible text of an HTML fragment (tags dropped, entities decoded)."""
    import html as _html
    import re

    html = re.sub(r"<style.*?</style>", "", html, flags=re.S)
    return _html.unescape(re.sub(r"<[^>]+>", " ", html))


def all_widgets(w: Any) -> list[Any]:
    out, todo = [], [w]
    while todo:
        cur = todo.pop()
        out.append(cur)
        todo.extend(getattr(cur, "children", ()) or ())
    return out


# ------------------------------------------------------------------ building the panel
@pytest.mark.parametrize("kind", list(CELLS))
def test_panel_shows_verdict_memory_findings_graph_and_ops(reports, kind):
    report, src, ns, kw = reports[kind]
    p = Panel(report, src, ns)
    summary = text_of(p.summary.value)
    if kind == "ok":
        assert report.ok and "nothing looks wrong" in summary
    else:
        f = report.findings[0]
        assert f.location() in summary, summary
        assert "step time" in summary and "peak memory" in summary
    # Every tab fills when shown, and says something specific.
    for i in range(4):
        p.tabs.selected_index = i
    assert '<svg' in p.memory_plot.value and 'class="bd-plot"' in p.memory_plot.value
    findings = text_of(p.findings.value)
    svg = p.graph_html.value
    ops = text_of(p.ops_html.value)
    assert "aten::" in ops and "count" in ops
    if kind == "no_grad":
        assert "no autograd graph was recorded" in svg
    else:
        assert "<svg" in svg and "bd-node" in svg
    if kind != "ok":
        f = report.findings[0]
        squash = lambda t: "".join(t.replace("`", "").split())  # noqa: E731
        assert squash(f.message)[:60] in squash(findings)
        assert f"{f.line}" in findings


def test_oom_panel_marks_limit_peak_and_offers_fixes(reports):
    report, src, ns, kw = reports["oom"]
    p = Panel(report, src, ns)
    assert p.tabs.selected_index == 0  # memory first for an OOM
    assert set(p.fix_buttons) == {"accumulate:2", "amp"}
    # Checkpointing cannot lower this peak (half the saved activations are one Linear's own): no button that
    # would refuse when clicked, the reason under the buttons instead.
    assert "checkpoint" in report.fix_offers and "would not lower the peak" in text_of(p.refused.value)
    summary = text_of(p.summary.value)
    assert "Out of memory at cell line 4" in summary and "of 19.1 MiB limit" in summary
    assert "accumulate:2" in summary  # the fixes that apply, in the summary
    p.memory_toggle.value = "by module"
    assert "out-of-memory point" in text_of(p.memory_note.value)
    p.tabs.selected_index = 1
    found = text_of(p.findings.value)
    assert "aten::threshold_backward" in found and "forward line" in found  # backward op -> its forward line
    assert "Predicted peak" in found


def test_nonfinite_panel_shows_origin_stats_and_spread(reports):
    report, src, ns, kw = reports["nonfinite"]
    p = Panel(report, src, ns)
    assert p.tabs.selected_index == 1
    found = text_of(p.findings.value)
    assert "How it spread" in found and "reached" in found
    assert "NaN" in found and "min" in found  # the statistics table of the origin op
    assert "probs = torch.softmax" in found or "loss = -torch.log" in found


def test_graph_highlights_finding_and_expands_modules(reports):
    report, src, ns, kw = reports["inplace"]
    p = Panel(report, src, ns)
    p.tabs.selected_index = 2
    svg = p.graph_html.value
    assert "the finding is here" in svg  # the node of the in-place write is highlighted
    report, src, ns, kw = reports["ok"]
    p = Panel(report, src, ns)
    p.tabs.selected_index = 2
    assert "model.0" in p.graph_html.value or "model.0" in str(p.graph_open.options) or "saved" in p.graph_html.value


def test_ops_table_sorts_and_groups(reports):
    report, src, ns, kw = reports["ok"]
    p = Panel(report, src, ns)
    p.tabs.selected_index = 3
    p.ops_sort.value = "count"
    rows = [line for line in text_of(p.ops_html.value).split("\n") if line.strip()]
    assert rows
    p.ops_group.value = "module"
    assert "model.0" in p.ops_html.value
    p.ops_group.value = "line"
    assert "cell line 1" in p.ops_html.value


# ------------------------------------------------------------------ fixes
def FakeResult(**kw: Any) -> FixResult:  # noqa: N802 - a made-up result of the real type
    return FixResult(**{"applied": True, "message": "ran with the fix", **kw})


def fake_runner(calls: list, *, block: threading.Event | None = None):
    def run_fix(source, namespace, fix, *, original=None, timeout=None, memory_limit=None, rollback=True,
                progress=None, cancel=None):
        calls.append({"fix": fix, "original": original, "memory_limit": memory_limit, "thread":
                      threading.current_thread().name})
        progress(0.25, "original run")
        cancelled = False
        if block is not None:
            t0 = time.time()
            while not cancel() and time.time() - t0 < 10:
                time.sleep(0.01)
            cancelled = cancel()
        progress(1.0, "done")
        after = bd.diagnose("import torch\nw = torch.ones(3, requires_grad=True)\n(w * 2).sum().backward()", {})
        code = "# fixed\n" + source
        after.fix_result = FakeResult(
            name=fix, applied=not cancelled, cancelled=cancelled, code=code, fits=not cancelled,
            diff="--- cell\n+++ cell (fixed)\n@@ -1 +1,2 @@\n+# fixed\n " + source.splitlines()[0],
            comparison={"before": {"peak_bytes": 20_000_000, "peak_by_category": {"activations": 15_000_000,
                                                                                   "parameters": 5_000_000},
                                   "step_s": 0.2, "loss": 2.3},
                        "after": {"peak_bytes": 12_000_000, "peak_by_category": {"activations": 7_000_000,
                                                                                 "parameters": 5_000_000},
                                  "step_s": 0.25, "loss": 2.3},
                        "grad_max_rel_err": 3e-7})
        return after
    return run_fix


def test_fix_button_runs_in_thread_and_shows_after_view(reports):
    report, src, ns, kw = reports["oom"]
    calls: list = []
    p = Panel(report, src, ns, memory_limit=20_000_000, run_fix=fake_runner(calls))
    arg = next(a for a in p.fix_buttons if a.startswith("accumulate"))
    p.fix_buttons[arg].click()
    p.wait(30)
    assert calls and calls[0]["fix"] == arg and calls[0]["original"] is report
    assert calls[0]["thread"] == "backward_doctor-fix" and calls[0]["memory_limit"] == 20_000_000
    after = text_of(p.after.value)
    assert "before" in after and "after" in after and "19.1 MiB" in after and "11.4 MiB" in after
    assert "max relative error" in after and "3.00e-07" in after
    assert "+# fixed" in after  # the diff
    assert 'class="bd-plot"' in p.after_plot.value and p.after_plot.layout.display == "block"
    assert "Insert as a new cell below" in p.keep.value and "# fixed" in text_of(p.keep.value)
    assert p.progress_box.layout.display == "none" and not any(b.disabled for b in p.fix_buttons.values())


def test_cancel_button_stops_the_fix(reports):
    report, src, ns, kw = reports["oom"]
    calls: list = []
    p = Panel(report, src, ns, run_fix=fake_runner(calls, block=threading.Event()))
    next(iter(p.fix_buttons.values())).click()
    for _ in range(200):
        if calls:
            break
        time.sleep(0.01)
    assert p.running and p.progress_box.layout.display == "flex"
    assert all(b.disabled for b in p.fix_buttons.values())
    assert "original run" in p.progress_text.value and p.progress.value == 0.25
    p.cancel_button.click()
    p.wait(30)
    assert not p.running
    assert "Cancelled" in text_of(p.after.value)
    assert p.keep.value == ""  # nothing to keep from a cancelled run


@pytest.mark.parametrize("error", [NotImplementedError("accumulate is coming"), ValueError("unknown fix")])
def test_fix_not_available_yet_is_said_plainly(reports, error):
    report, src, ns, kw = reports["oom"]

    def run_fix(*a, **k):
        raise error

    p = Panel(report, src, ns, run_fix=run_fix)
    next(iter(p.fix_buttons.values())).click()
    p.wait(30)
    assert "not available yet" in text_of(p.status.value) and str(error) in text_of(p.status.value)


def test_fix_module_missing_is_said_plainly(reports, monkeypatch):
    report, src, ns, kw = reports["oom"]

    def missing():
        raise ImportError("No module named 'backward_doctor.fixes'")

    monkeypatch.setattr(panel_mod, "load_run_fix", missing)
    p = Panel(report, src, ns)
    next(iter(p.fix_buttons.values())).click()
    assert "not available yet" in text_of(p.status.value)
    assert not p.running


def _real_run_fix():
    try:
        return panel_mod.load_run_fix()
    except Exception:
        return None


@pytest.mark.skipif(_real_run_fix() is None, reason="backward_doctor.fixes.run_fix not in this checkout yet")
def test_real_accumulate_fix_from_the_panel():
    report, src, ns, kw = diagnose("oom")
    p = Panel(report, src, ns, memory_limit=report.trace.memory.limit_bytes)
    arg = next(a for a in p.fix_buttons if a.startswith("accumulate"))
    p.fix_buttons[arg].click()
    p.wait(120)
    shown = text_of(p.after.value) + text_of(p.status.value)
    assert p.after_report is not None, shown
    result = p.after_report.fix_result
    assert "peak memory" in shown and "before" in shown, shown
    if result.applied:
        assert result.code in text_of(p.keep.value) or result.code.splitlines()[0] in p.keep.value


# ------------------------------------------------------------------ escaping, sizes, speed
EVIL = "</script><script>alert(1)</script>"


def test_user_text_is_escaped_everywhere():
    ns = namespace()
    src = f"s = '{EVIL}'  # {EVIL}\nout = model(x)\nloss = (out - torch.ones(64, 5)).pow(2).mean()\nloss.backward()"
    report = bd.diagnose(src, ns)
    html = report.to_html()
    assert "<script" not in html and "&lt;/script&gt;&lt;script&gt;alert(1)" in html
    p = Panel(report, src, ns)
    for i in range(4):
        p.tabs.selected_index = i
    for w in all_widgets(p.widget):
        value = getattr(w, "value", None)
        if isinstance(value, str):
            assert "<script" not in value, type(w).__name__
    keep = panel_mod.keep_html(src)
    assert "<script" not in keep and "</textarea><script" not in keep


def test_static_html_is_self_contained(reports, tmp_path):
    report, src, ns, kw = reports["oom"]
    path = report.save_html(str(tmp_path / "r.html"))
    page = open(path, encoding="utf-8").read()
    assert page.startswith("<!DOCTYPE html>") and 'class="bd-plot"' in page and "<svg" in page
    for needle in ("http://", "https://", "<script", "<link", "src=\"http"):
        assert needle not in page.replace('xmlns="http://www.w3.org/2000/svg"', ""), needle
    assert "Out of memory" in page and "Memory timeline" in page and "Autograd graph" in page


# Wide rather than deep: freeing a 60k-node deep autograd chain that was captured
# crashes the interpreter during garbage collection (reported to the capture owner).
BIG = """
import torch
w = torch.randn(8, requires_grad=True)
parts = [(w * (i % 7)).sin().sum() for i in range({n})]
loss = torch.stack(parts).sum()
loss.backward()
"""


@pytest.fixture(scope="module")
def big_report():
    report = bd.diagnose(BIG.format(n=14_000), {})
    assert report.trace.op_count >= 95_000, report.trace.op_count
    return report


@pytest.mark.slow
def test_100k_op_step_plots_fast_html_small_widget_state_small(big_report):
    from backward_doctor.render import svg_plots

    t0 = time.perf_counter()
    svg = svg_plots.memory_timeline_svg(big_report.trace)
    elapsed = time.perf_counter() - t0
    assert svg.startswith("<svg") and len(svg) < 200_000 and elapsed < 1.0, (elapsed, len(svg))
    html = big_report.to_html()
    assert len(html.encode()) < 2_000_000, len(html)
    p = Panel(big_report, big_report.trace.source, {})
    for i in range(4):
        p.tabs.selected_index = i
    size = 0
    for w in all_widgets(p.widget):
        for k, v in w.get_state().items():
            size += len(v) if isinstance(v, (bytes, memoryview)) else len(json.dumps(v, default=str))
    assert size < 600_000, size


def test_importing_the_package_does_not_import_widgets_or_matplotlib():
    code = ("import sys, backward_doctor, backward_doctor.render.sections, backward_doctor.render.graph, "
            "backward_doctor.render.html\n"
            "bad = [m for m in ('ipywidgets', 'matplotlib', 'IPython') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# ------------------------------------------------------------------ magic and CLI
class _FakeKernel:
    pass


def test_magic_shows_panel_in_a_kernel_and_text_elsewhere(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from backward_doctor.frontends import magic

    shell = InteractiveShell.instance()
    shell.run_cell(SETUP, store_history=False)
    report = bd.diagnose(CELLS["inplace"][0], shell.user_ns)
    with capture_output() as cap:
        magic._show(shell, report, CELLS["inplace"][0], None, None)
    assert "application/vnd.jupyter.widget-view+json" not in cap.outputs[-1].data  # no kernel: no widgets
    monkeypatch.setattr(shell, "kernel", _FakeKernel(), raising=False)
    with capture_output() as cap:
        magic._show(shell, report, CELLS["inplace"][0], None, None)
    data = cap.outputs[-1].data
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"].startswith("backward_doctor: PROBLEM") and "text/html" in data  # fallbacks
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # ipywidgets missing
    with capture_output() as cap:
        magic._show(shell, report, CELLS["inplace"][0], None, None)
    assert "pip install ipywidgets" in cap.stdout
    assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM")


def test_cli_writes_html(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent(SETUP) + "\n" + CELLS["shape"][0] + "\n")
    out = tmp_path / "report.html"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", str(script), "--html", str(out)],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 1, proc.stderr
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "shape" in page.lower()


@pytest.mark.skipif(_real_run_fix() is None, reason="backward_doctor.fixes.run_fix not in this checkout yet")
def test_fixed_report_panel_leads_with_the_after_view():
    """``%%backward_doctor --fix``: the panel of the fixed run shows what the fix did and the code to keep."""
    src, kw = CELLS["oom"]
    report = _real_run_fix()(src, namespace(), "accumulate:2", **kw)
    assert report.fix_result is not None
    p = Panel(report, src, namespace())
    assert p.fix_box.layout.display == "flex"
    after = text_of(p.after.value)
    assert "accumulate:2" in after and "peak memory" in after
    if report.fix_result.applied:
        assert "Insert as a new cell below" in p.keep.value


# ------------------------------------------------------------------ issue 16: a failed fix says so
def test_a_fix_that_did_not_fit_is_red_with_no_insert_button_and_a_next_step(reports):
    report, src, ns, kw = reports["oom"]

    def still_oom(source, namespace, fix, **kw_):
        after = bd.diagnose("import torch\nw = torch.ones(3, requires_grad=True)\n(w * 2).sum().backward()", {})
        after.fix_result = FixResult(name=fix, applied=True, fits=False, code="# tried\n" + source,
                                     message="The fixed step did not complete: OutOfMemoryError: out of memory.",
                                     comparison={"before": {"peak_bytes": 20_000_000, "completed": False},
                                                 "after": {"peak_bytes": 21_000_000, "completed": False}})
        return after

    p = Panel(report, src, ns, memory_limit=20_000_000, run_fix=still_oom)
    arg = next(a for a in p.fix_buttons if a.startswith("accumulate"))
    k = int(arg.split(":")[1])
    p.fix_buttons[arg].click()
    p.wait(30)
    after = p.after.value
    assert "did not work" in after and "did not fix the step" in text_of(after)
    assert "after the fix" not in after                      # no success styling...
    assert "#c62828" in after                                # ...but red
    assert "Insert as a new cell below" not in p.keep.value and p.keep.value == ""
    assert f"accumulate:{2 * k}" in text_of(after)           # the next step, in words
    assert f"accumulate:{2 * k}" in p.fix_buttons            # and as a button that runs it
    assert p.fix_buttons[f"accumulate:{2 * k}"] in p.fix_box.children[1].children


def test_summary_uses_plain_words_and_counts_only_the_models_the_step_ran():
    ns = namespace()
    exec("import torch\nother = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(5)])", ns)
    report = bd.diagnose("loss = F.cross_entropy(model(x), y)\nloss.backward()\nloss.backward()", ns)
    p = Panel(report, "", ns)
    summary = text_of(p.summary.value)
    assert "backward_twice" not in summary and "Backward run twice" in summary  # the badge in words
    used = sum(1 for _ in ns["model"].parameters())
    assert f"{used} tensors" in summary and "of the models this step ran" in summary
    assert f"({used + 10} in the namespace)" in summary
