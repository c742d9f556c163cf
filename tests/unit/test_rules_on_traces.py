"""Unit tier: the rules (``analysis``) on stored traces, with no training step run.

Each ``fixtures/<name>.json`` holds the trace of one small diagnosed cell and what the live run
found (written by ``make_fixtures.py``; regenerate it when the trace format or a rule changes on
purpose). Here the trace is read back with ``Trace.from_dict`` and the rules must say the same:
the same finding kinds in the same order, the root cause on the same line. The trace must also
survive JSON exactly, and the rules must be pure (same answer twice, the trace untouched).

Nothing here imports a model or runs torch code: these tests take milliseconds.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from backward_doctor.analysis import Finding, analyze  # the rules' import path: named here only
from backward_doctor.trace import Trace

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))
ROOT_MARKER = "# <-- root cause"
SEVERITIES = ("error", "warning", "info")


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


def findings_of(name: str) -> tuple[dict, Trace, list[Finding]]:
    data = load(name)
    trace = Trace.from_dict(data["trace"])
    return data, trace, analyze(trace)


def test_the_fixture_set_covers_the_kinds():
    """A missing or emptied fixtures folder must not pass by testing nothing."""
    assert len(NAMES) >= 12, NAMES
    firsts = {load(n)["expected"]["first_kind"] for n in NAMES}
    assert None in firsts  # at least one healthy step
    assert {"inplace", "nonfinite", "oom", "hang", "shape_mismatch", "index_out_of_range", "no_grad_path",
            "detached", "stale_grad", "graph_leak"} <= firsts


@pytest.mark.parametrize("name", NAMES)
def test_rules_on_the_stored_trace_match_the_live_run(name):
    data, trace, findings = findings_of(name)
    exp = data["expected"]
    assert [f.kind for f in findings] == exp["kinds"]
    first = findings[0] if findings else None
    assert (first.kind if first else None) == exp["first_kind"]
    assert (first.line if first else None) == exp["first_line"]
    assert (first.file if first else None) == exp["first_file"]
    assert (first.module if first else None) == exp["first_module"]
    ok = trace.exception is None and not trace.timed_out and not findings
    assert ok == exp["ok"]


@pytest.mark.parametrize("name", NAMES)
def test_the_root_cause_is_the_marked_line(name):
    """The fixture's cell marks its root cause; the first finding points at that line of the cell."""
    data, trace, findings = findings_of(name)
    assert trace.source == data["scenario"]["source"]
    marked = [i for i, text in enumerate(trace.source.splitlines(), 1) if ROOT_MARKER in text]
    if not findings:
        assert marked == []
        return
    first = findings[0]
    if marked:
        assert (first.line, first.file) == (marked[0], None)
    else:  # a cause with no one line to mark (an OOM): still a line of the cell, one with code on it
        assert first.file is None and 1 <= first.line <= len(trace.source.splitlines())
        assert trace.source.splitlines()[first.line - 1].strip()


@pytest.mark.parametrize("name", NAMES)
def test_findings_are_well_formed(name):
    _, _, findings = findings_of(name)
    for f in findings:
        assert f.severity in SEVERITIES
        assert f.message.strip() and f.kind
        assert f.line is None or f.line >= 1
        assert Finding.from_dict(json.loads(json.dumps(f.to_dict()))) == f


@pytest.mark.parametrize("name", NAMES)
def test_trace_json_round_trip_is_exact(name):
    stored = load(name)["trace"]
    trace = Trace.from_dict(stored)
    first = trace.to_dict()
    assert first == stored  # what was written is what is read back
    again = Trace.from_dict(json.loads(json.dumps(first))).to_dict()
    assert again == first
    assert json.dumps(again, sort_keys=True) == json.dumps(first, sort_keys=True)  # no int/float drift
    assert Trace.from_dict(first) == trace


@pytest.mark.parametrize("name", NAMES)
def test_analyze_is_pure(name):
    data, trace, findings = findings_of(name)
    before = copy.deepcopy(trace.to_dict())
    second = analyze(trace)
    assert [f.to_dict() for f in second] == [f.to_dict() for f in findings]
    assert trace.to_dict() == before == data["trace"]  # the rules did not write on the trace
    # a fresh trace from the same dict gives the same answer too (no state kept between calls)
    assert [f.to_dict() for f in analyze(Trace.from_dict(data["trace"]))] == [f.to_dict() for f in findings]


@pytest.mark.parametrize("name", NAMES)
def test_fixtures_stay_small(name):
    assert (FIXTURES / f"{name}.json").stat().st_size < 100_000


def test_clip_before_unscale_without_the_scale_says_why_not_a_garbled_number():
    """On CUDA the GradScaler's scale is not read (a read would synchronise): the sentence must still read
    (seen on an H200: "their norm is the loss scalex the true one")."""
    data = load("amp_clip_before_unscale")
    data["trace"]["precision"]["clips"][0]["scale"] = None
    f = next(f for f in analyze(Trace.from_dict(data["trace"])) if f.kind == "amp_misuse")
    assert "the scale times the true one" in f.message and "about 1/scale of the limit" in f.message
    assert "not read on CUDA" in f.message and "scalex" not in f.message and f.evidence["scale"] is None
    known = next(f for f in analyze(Trace.from_dict(load("amp_clip_before_unscale")["trace"])) if f.kind == "amp_misuse")
    assert "65536x the true one" in known.message and "1/65536 of the limit" in known.message
