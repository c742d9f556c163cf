"""Unit tier: the renderers (text, HTML fragment, HTML page) on stored traces, with no training step run.

A report is built from each ``fixtures/<name>.json`` exactly as a run builds it (``run/step.py``
``build_report``: the rules' findings, the exception's summary, the trace) and drawn. The tests hold
the drawings to what the fixture says happened: the verdict names the root cause and its line, the
root-cause line of the cell is quoted, every finding is drawn once, a healthy step says so, the
exception is shown, user text is escaped in HTML (no ``<script>`` anywhere), every HTML section draws,
and a report saved as JSON and read back draws the same.

Each HTML rendering (matplotlib plots included) takes ~0.15 s; nothing runs torch code.
"""
from __future__ import annotations

import html
import json
import re
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path

import pytest

from backward_doctor.analysis import analyze  # the rules' import path: named here only
from backward_doctor.render import renderer  # the registry: renderers by name ("text", "html", "page")
from backward_doctor.render.wording import finding_title, kind_words
from backward_doctor.report import Report
from backward_doctor.trace import Trace

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))
PROBLEMS = [n for n in NAMES if not json.loads((FIXTURES / f"{n}.json").read_text(encoding="utf-8"))["expected"]["ok"]]
HEALTHY = [n for n in NAMES if n not in PROBLEMS]
OK_LINE = "backward_doctor: OK - the step ran and nothing looks wrong"


def render_html(report: Report) -> str:
    return renderer("html").render(report)


def render_page(report: Report) -> str:
    """The whole document (``render/html.py`` ``render_page``, what ``report.save_html`` writes)."""
    return renderer("page").render(report)


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


def build(name: str) -> Report:
    """The report of a fixture, built as ``build_report`` builds a live one (a new object each call)."""
    trace = Trace.from_dict(load(name)["trace"])
    exc = trace.exception.summary() if trace.exception else None
    return Report(findings=analyze(trace), exception=exc, trace=trace)


@lru_cache(maxsize=None)
def text_of(name: str) -> str:
    return str(build(name))


@lru_cache(maxsize=None)
def html_of(name: str) -> str:
    return build(name).to_html()


def expected(name: str) -> dict:
    return load(name)["expected"]


def location(exp: dict) -> str:
    """``cell line 4 (model.3)``: where the verdict must say the root cause is (every fixture's is in the cell)."""
    assert exp["first_file"] is None
    return f"cell line {exp['first_line']}" + (f" ({exp['first_module']})" if exp["first_module"] else "")


def cell_line(name: str, line: int) -> str:
    return load(name)["scenario"]["source"].splitlines()[line - 1]


def flat(text: str) -> str:
    """Whitespace collapsed (the text renderer wraps long lines at 100 columns)."""
    return " ".join(text.split())


def bare(text: str) -> str:
    """Whitespace removed: textwrap also breaks after hyphens (``out-of-`` / ``place``)."""
    return re.sub(r"\s+", "", text)


class TagBalance(HTMLParser):
    """Counts open and close tags of the elements that must nest (void elements left out)."""

    CHECKED = ("div", "span", "details", "summary", "table", "tr", "td", "th", "ul", "li", "code", "pre", "b",
               "h3", "svg", "style")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = {t: 0 for t in self.CHECKED}
        self.negative: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag in self.depth:
            self.depth[tag] += 1

    def handle_endtag(self, tag):
        if tag in self.depth:
            self.depth[tag] -= 1
            if self.depth[tag] < 0:
                self.negative.append(tag)


def test_there_are_problem_and_healthy_fixtures():
    assert len(PROBLEMS) >= 10 and HEALTHY, (PROBLEMS, HEALTHY)


# ----------------------------------------------------------------------------------------------- text
@pytest.mark.parametrize("name", PROBLEMS)
def test_text_verdict_names_the_root_cause_and_its_line(name):
    exp, text = expected(name), text_of(name)
    lines = text.splitlines()
    top = build(name).findings[0]
    assert top.kind == exp["first_kind"]
    # The verdict in plain words (the finding's title), not the kind's identifier (STALE_GRAD, NONFINITE)
    when = f", {top.when()}" if top.iteration is not None else ""  # a loop's iteration (grad_accumulation)
    assert lines[0] == f"backward_doctor: PROBLEM - {finding_title(top)} at {location(exp)}{when}"
    assert finding_title(top) != top.kind
    code = cell_line(name, exp["first_line"]).strip()
    assert f"    > {exp['first_line']:>4} | {code}" in lines  # the root-cause line of the cell, quoted
    assert "OK" not in lines[0]


@pytest.mark.parametrize("name", NAMES)
def test_text_draws_each_finding_once(name):
    report, text = build(name), text_of(name)
    headers = [ln for ln in text.splitlines() if re.match(r"\[\d+\] ", ln)]
    assert len(headers) == len(report.findings) == len(expected(name)["kinds"])
    for i, (f, header) in enumerate(zip(report.findings, headers), 1):
        assert header == f"[{i}] {finding_title(f)} at {f.location()} ({f.kind}, {f.severity})"
        assert bare(f.message) in bare(text)
        assert text.count(f"[{i}] ") == 1


@pytest.mark.parametrize("name", NAMES)
def test_text_shows_the_exception(name):
    exc, text = expected(name)["exception"], text_of(name)
    if exc is None:
        assert "exception:" not in text
    else:
        assert bare(f"exception: {exc.splitlines()[0]}") in bare(text)
        assert [ln for ln in text.splitlines() if ln.startswith("  exception: ")] != []


@pytest.mark.parametrize("name", HEALTHY)
def test_text_of_a_healthy_step_says_so(name):
    text = text_of(name)
    assert text.splitlines()[0] == OK_LINE
    assert "PROBLEM" not in text and "[1]" not in text
    trace = build(name).trace
    assert f"{trace.op_count} ops in " in text.splitlines()[1]  # the summary: ops, phases, peak


def test_text_of_a_failing_op_lists_its_inputs():
    text = text_of("shape_mismatch")
    tail = text.split("failing op aten::mm inputs:", 1)[1].splitlines()
    assert tail[1].strip().startswith("float32[6, 8] ") and tail[2].strip().startswith("float32[4, 3] ")


def test_text_of_a_hang_shows_the_stuck_cell_frame():
    text = text_of("hang_timeout")
    stacks = text.split("thread stacks (innermost last):", 1)[1]
    assert "(main):" in stacks
    assert "cell:4 in <module>: while True:" in stacks


def test_text_of_an_oom_gives_the_predicted_peaks():
    text = flat(text_of("oom_under_memory_limit"))
    assert "predicted peak (lower bounds: the step failed before its peak): accumulate:2" in text
    assert "fixes: accumulate" in text and "by module:" in text


# ----------------------------------------------------------------------------------------------- HTML
@pytest.mark.parametrize("name", NAMES)
def test_html_has_no_script_and_every_section_draws(name):
    frag = html_of(name)
    assert "<script" not in frag.lower()
    assert "could not be drawn" not in frag  # render_html puts that where a section raised
    for title in ("Memory timeline", "Root cause" if expected(name)["kinds"] else "Findings",
                  "Autograd graph by module", "Ops", "Fixes"):
        assert frag.count(f"<h3>{title}</h3>") == 1, title


@pytest.mark.parametrize("name", NAMES)
def test_html_tags_balance(name):
    parser = TagBalance()
    parser.feed(html_of(name))
    parser.close()
    assert parser.negative == []
    assert {t: d for t, d in parser.depth.items() if d} == {}
    assert "script" not in parser.tags and "iframe" not in parser.tags


@pytest.mark.parametrize("name", PROBLEMS)
def test_html_verdict_and_root_cause_line(name):
    exp, frag, report = expected(name), html_of(name), build(name)
    top = report.findings[0]
    assert html.escape(f"{top.title or top.kind} at {location(exp)}") in frag  # the headline
    line = exp["first_line"]
    hit = f'<div class="ln hit"><span class="no">{line}</span><span>{html.escape(cell_line(name, line))}</span>'
    assert frag.count(hit) >= 1  # the root-cause line, highlighted in its context
    if exp["exception"]:
        first = exp["exception"].split("\n")[0]
        assert f"<b>The cell raised</b> <code>{html.escape(first[:600])}</code>" in frag


@pytest.mark.parametrize("name", NAMES)
def test_html_draws_each_finding_once(name):
    frag, report = html_of(name), build(name)
    assert frag.count('<div class="finding"') == len(report.findings)
    for kind in set(expected(name)["kinds"]):
        badge = re.compile(r'<span class="badge" style="--sev:[^"]*">' + re.escape(kind_words(kind)) + r"</span> <b>")
        assert len(badge.findall(frag)) == expected(name)["kinds"].count(kind)


@pytest.mark.parametrize("name", HEALTHY)
def test_html_of_a_healthy_step_says_so(name):
    frag = html_of(name)
    assert '<div class="headline">The step ran and nothing looks wrong</div>' in frag
    assert '<div class="sub">No findings.</div>' in frag
    assert '<div class="finding"' not in frag and "The cell raised" not in frag


def test_html_escapes_markup_from_the_cell():
    """The cell holds ``</script><script>alert(1)</script>``: shown as text, never as markup."""
    src = load("script_in_source")["scenario"]["source"]
    assert "</script><script>alert(1)</script>" in src
    for doc in (html_of("script_in_source"), render_page(build("script_in_source"))):
        assert "<script" not in doc.lower() and "</script>" not in doc
        assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in doc


@pytest.mark.parametrize("name", ["healthy_step", "hang_timeout", "oom_under_memory_limit", "script_in_source"])
def test_page_is_a_whole_document_around_the_fragment(name, tmp_path):
    report = build(name)
    page = render_page(report)
    saved = Path(report.save_html(str(tmp_path / "report.html"))).read_text(encoding="utf-8")
    assert saved == page
    assert page.startswith("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">")
    assert page.endswith("</body></html>\n")
    assert page.count("<body>") == 1 and page.count("<head>") == 1
    assert page.count("<title>backward_doctor report</title>") == 1
    assert html_of(name) in page  # the same fragment: rendering is deterministic
    assert "<script" not in page.lower()


def test_mimebundle_is_the_text_and_the_fragment():
    report = build("inplace_on_saved_tensor")
    bundle = report._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == text_of("inplace_on_saved_tensor")
    assert bundle["text/html"] == html_of("inplace_on_saved_tensor") == render_html(report)


# ----------------------------------------------------------------------------------- saved reports
@pytest.mark.parametrize("name", NAMES)
def test_a_saved_report_reads_back_and_renders_the_same(name):
    report = build(name)
    saved = json.loads(json.dumps(report.to_dict()))
    back = Report.from_dict(saved)
    assert back.to_dict() == report.to_dict()
    assert str(back) == text_of(name)
    assert back.ok == expected(name)["ok"] and back.exception == expected(name)["exception"]
    assert [f.kind for f in back.findings] == expected(name)["kinds"]


@pytest.mark.parametrize("name", ["healthy_step", "nan_from_log_of_negative", "graph_leak_append_loss"])
def test_a_saved_report_renders_the_same_html(name):
    back = Report.from_dict(json.loads(json.dumps(build(name).to_dict())))
    assert back.to_html() == html_of(name)
