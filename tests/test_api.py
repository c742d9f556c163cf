"""The public API contract: arguments, report fields, JSON, last_report, no raising."""
from __future__ import annotations

import json

import pytest
import torch

import backward_doctor as bd

STEP = """
import torch
w = torch.ones(3, requires_grad=True)
loss = (w * 2).sum()
loss.backward()
"""


@pytest.mark.parametrize("kwargs, fragment", [
    ({"memory_limit": "12 parsecs"}, "cannot read memory size"),
    ({"memory_limit": -5}, "positive"),
    ({"timeout": 0}, "timeout must be a positive"),
    ({"timeout": "soon"}, "timeout must be a positive"),
    ({"fix": "magic"}, "unknown fix"),
    ({"fix": "accumulate:1"}, "k >= 2"),
    ({"fix": "amp:fp8"}, "amp takes"),
])
def test_bad_arguments_raise_before_anything_runs(kwargs, fragment):
    ns = {}
    with pytest.raises(ValueError, match=fragment):
        bd.diagnose("ran = True", ns, **kwargs)
    assert "ran" not in ns


def test_bad_source_or_namespace_type():
    with pytest.raises(ValueError):
        bd.diagnose(b"x = 1")
    with pytest.raises(ValueError):
        bd.diagnose("x = 1", namespace=[1])


def test_namespace_is_mutated_like_exec_and_report_is_ok():
    ns = {}
    report = bd.diagnose(STEP, ns)
    assert report.ok and report.findings == [] and report.exception is None
    assert torch.equal(ns["w"].grad, torch.full((3,), 2.0))
    assert bd.last_report() is report


def test_cell_exception_is_recorded_not_raised():
    report = bd.diagnose("x = 1\nraise KeyError('boom')")
    assert not report.ok
    assert report.exception == "KeyError: 'boom'"
    assert report.findings[0].kind == "exception" and report.findings[0].line == 2


def test_syntax_error_is_reported():
    report = bd.diagnose("x = (1,\n")
    assert report.exception.startswith("SyntaxError")


def test_report_json_round_trip():
    report = bd.diagnose("import torch\nx = torch.randn(3, requires_grad=True)\n(x / 0).sum().backward()")
    data = json.loads(json.dumps(report.to_dict()))
    again = bd.Report.from_dict(data)
    assert again.to_dict() == report.to_dict()
    assert again.findings[0].kind == "nonfinite"
    assert str(again) == str(report)


def test_mimebundle_has_text_and_escaped_html():
    src = "s = '</script><script>alert(1)</script>'\nraise ValueError(s)"
    report = bd.diagnose(src)
    bundle = report._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "<script>" not in bundle["text/html"]
    assert "&lt;/script&gt;&lt;script&gt;" in bundle["text/html"]


def test_import_does_not_pull_ipython_or_matplotlib():
    import subprocess
    import sys

    code = ("import sys, backward_doctor as bd; bd.diagnose('x = 1');"
            "print('IPython' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("bad, says", [(dict(timeout=-1), "timeout must be"), (dict(memory_limit="lots"), "lots"),
                                       (dict(engine="fast"), "engine must be one of"),
                                       (dict(every_iteration="no"), "every_iteration must be True or False")])
def test_options_are_refused_in_the_same_words_by_every_entry_point(bad, says):
    """One check (``check_options``) at the public edge: ``diagnose()`` and the callbacks' doctor refuse the same
    values with the same message, before anything runs (the callbacks took ``every_iteration="no"`` as True)."""
    from backward_doctor.integrations.watching import LoopDoctor

    ran = []
    with pytest.raises(ValueError, match=says) as by_diagnose:
        bd.diagnose("ran.append(1)", {"ran": ran}, **bad)
    with pytest.raises(ValueError, match=says) as by_callback:
        LoopDoctor(**bad)
    assert str(by_diagnose.value) == str(by_callback.value) and ran == []
