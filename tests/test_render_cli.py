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
    assert main(["render", str(path)]) == 1  # a problem was found: same status as the diagnosis
    assert capsys.readouterr().out.rstrip("\n") == str(report)
    page = tmp_path / "r.html"
    assert main(["render", str(path), "--html", str(page)]) == 1
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
        assert main(["render", str(saved[1]), "--as", "verdict-test"]) == 1
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
    for argv in (["--as", "nope"], ["-o", str(tmp_path / "no" / "such" / "r.txt")], ["-o", str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:
            main(["render", str(saved[1]), *argv])
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="no renderer 'nope'"):
        renderer("nope")


def test_render_runs_from_the_command_line(saved):
    out = subprocess.run([sys.executable, "-m", "backward_doctor", "render", str(saved[1])], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stdout.startswith("backward_doctor: PROBLEM - In-place write on a leaf that requires grad at cell line 3")
