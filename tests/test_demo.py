"""``make demo``: the tour executed headlessly and written as one self-contained HTML page.

The slow test runs ``python -m backward_doctor.frontends.demo`` as the Makefile does and checks the page:
every panel's static view is there (the failing step's diagnosis, the fixed run's before/after and
code to keep), plots are embedded, and nothing in it would be fetched from the network.
"""
from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from backward_doctor.frontends import demo

ROOT = Path(__file__).resolve().parents[1]


def test_static_views_keep_the_html_and_drop_the_widget():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("%%backward_doctor\nloss.backward()")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        demo.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0},
        "text/html": "<div>report</div>", "text/plain": "report"})]
    nb.cells = [cell]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    demo.static_views(nb)
    data = nb.cells[0].outputs[0].data
    assert demo.WIDGET_VIEW not in data and data["text/html"] == "<div>report</div>"
    assert "widgets" not in nb.metadata


@pytest.mark.parametrize("page, remote", [
    ('<script src="https://unpkg.com/x.js"></script>', True),
    ("<script src='//cdn.example/require.js'></script>", True),
    ('<link rel="stylesheet" href="http://fonts.example/a.css">', True),
    ('<style>@font-face { src: url("https://fonts.example/f.woff") }</style>', True),
    ('<img src="data:image/png;base64,iVBOR">', False),
    ('<a href="https://pytorch.org/docs">the docs</a>', False),  # a link is not fetched
    ('<svg xmlns="http://www.w3.org/2000/svg"></svg>', False),
])
def test_remote_references(page, remote):
    assert bool(demo.remote_references(page)) is remote


def test_text_option_still_prints_the_scenarios(capsys, monkeypatch):
    monkeypatch.setattr(demo, "SCENARIOS", [s for s in demo.SCENARIOS if s.title == "a correct step"])
    assert demo.main(["--text"]) == 0
    assert "OK - the step ran and nothing looks wrong" in capsys.readouterr().out


def test_missing_notebook_is_a_usage_error(tmp_path, capsys):
    assert demo.main(["--notebook", str(tmp_path / "none.ipynb")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.slow
def test_make_demo_writes_the_tour_as_one_self_contained_page(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-m", "backward_doctor.frontends.demo"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page_path = Path(run.stdout.strip().splitlines()[-1])          # it prints the page's path last
    assert page_path == (tmp_path / "out" / "tour.html").resolve() and page_path.is_file()
    page = page_path.read_text(encoding="utf-8")

    assert demo.remote_references(page) == []
    assert "<script" not in page and demo.WIDGET_VIEW not in page
    text = html.unescape(re.sub(r"<[^>]+>", "", page))  # what a reader sees (code is highlighted in spans)
    # The tour's text and code, and every cell ran.
    assert "A five-minute tour" in text and "%%backward_doctor --memory-limit 100MiB --fix accumulate" in text
    assert "every weight after the step is bit for bit" in text
    # The failing step's panel (static view): verdict, memory timeline, root cause, graph, fixes.
    assert text.count("backward_doctor report") >= 2
    assert re.search(r"Out of memory at Cell In\[\d+\], line 4", text) and "Memory timeline" in text
    assert "backward_doctor: running" not in text  # the placeholder was replaced by the report
    assert "Autograd graph by module" in text and "accumulate:2" in text
    # The fixed run: what the fix did, before/after, the code to keep.
    assert "AFTER THE FIX" in text.upper() and "Code to keep" in text
    images = re.findall(r'<img[^>]+src="([^"]{0,30})', page)
    assert all(src.startswith("data:image/png;base64,") for src in images), images
    assert page.count('class="bd-plot"') >= 3  # the memory plots, inline SVG
