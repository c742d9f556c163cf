"""The README says what the screen shows: its first example is what that cell prints, its table of
kinds has every kind the rules report, under the name the panel shows, it shows every screenshot the browser
tests take, and it and ``docs/panel.md`` say where the panel goes among a cell's outputs and how it lays out on
a narrow screen, as the magic and the panel do it."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def _blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def _normal(text: str) -> list[str]:
    """Lines without what changes from run to run (the cell's number, the seconds)."""
    text = re.sub(r"Cell In\[\d+\]", "Cell In[N]", text)
    text = re.sub(r"\d+ ops in [\d.]+ s", "ops in S", text)
    return [ln.rstrip() for ln in text.strip().splitlines()]


@pytest.mark.ipython
def test_the_readmes_first_example_prints_what_the_readme_shows():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    import backward_doctor as bd

    load, setup, cell, shown = _blocks(_readme())[:4]
    assert load.strip() == "%load_ext backward_doctor" and cell.startswith("%%backward_doctor")
    shell = InteractiveShell.instance()
    # (the instance is shared by every IPython-tier module: start from an empty namespace, or the tensors an
    # earlier module left count in the peak the report prints)
    shell.reset(new_session=False)
    with capture_output():
        for source in (load, setup, cell):
            shell.run_cell(source, store_history=True)
    report = bd.last_report()
    if report.trace.engine != "native":
        pytest.skip("the README shows the native recorder's report (the Python tier records more ops)")
    assert _normal(str(report)) == _normal(shown)
    assert "h += 0.1" in cell and "> " in shown and "| h += 0.1" in shown   # the line it prints is the cell's


def _kinds_reported() -> set[str]:
    """Every ``kind`` a rule can give a finding, read from the analysis layer's source."""
    kinds: set[str] = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "backward_doctor", "analysis")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as fh:
                    source = fh.read()
                kinds |= set(re.findall(r'\bat\(\s*"([a-z_]+)"', source))
                kinds |= set(re.findall(r'\bFinding\(\s*"([a-z_]+)"', source))
                kinds |= set(re.findall(r'\bkind="([a-z_]+)"', source))
    return kinds


def test_every_kind_the_rules_report_is_in_the_readmes_table_under_its_screen_name():
    from backward_doctor.render.wording import KIND_WORDS

    text = _readme()
    table = text[text.index("## What it diagnoses"):text.index("## Training loops")]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    documented = {k for ln in rows for k in re.findall(r"`([a-z_]+)`", ln.split("|")[1])}
    kinds = _kinds_reported()
    assert {"exception", "stale_grad", "oom", "hang"} <= kinds          # the scan finds the rules' kinds
    assert kinds - documented == set(), "kinds the doctor reports that the README's table lacks"
    for ln in rows:
        first = ln.split("|")[1]
        for kind in re.findall(r"`([a-z_]+)`", first):
            if kind in KIND_WORDS:
                assert KIND_WORDS[kind] in first, (kind, KIND_WORDS[kind], first)


def _panel_md() -> str:
    with open(os.path.join(ROOT, "docs", "panel.md"), encoding="utf-8") as fh:
        return fh.read()


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_readme_shows_every_screenshot_the_browser_tests_take():
    """``BD_UPDATE_SCREENSHOTS=1`` refreshes what the browser tests photograph: each of those pictures is in the
    README, and each picture the README shows is one of them (none left stale, none missing)."""
    taken: set[str] = set()
    for name in os.listdir(os.path.join(ROOT, "tests")):
        if name.startswith("test_browser") and name.endswith(".py"):
            with open(os.path.join(ROOT, "tests", name), encoding="utf-8") as fh:
                taken |= set(re.findall(r'shots, "([\w-]+\.png)"', fh.read()))
    shown = set(re.findall(r"\]\(docs/screenshots/([\w-]+\.png)\)", _readme()))
    assert {"panel-oom.png", "panel-prints-first.png", "panel-fix-narrow.png"} <= taken
    assert shown == taken, (sorted(shown - taken), sorted(taken - shown))
    missing = [n for n in shown if not os.path.isfile(os.path.join(ROOT, "docs", "screenshots", n))]
    assert not missing, missing


@pytest.mark.ipython
def test_where_the_panel_goes_is_what_the_docs_say(monkeypatch):
    """A cell that raises: the panel takes the placeholder's place, above the traceback. A cell that does not:
    the placeholder is emptied and the panel comes after what the cell printed. (The order on the screen and in a
    real kernel: ``test_browser_layout.py``, ``test_magic_kernel.py``.)"""
    pytest.importorskip("ipywidgets")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    monkeypatch.setattr(shell, "kernel", object(), raising=False)  # as in Jupyter: placeholder and panel
    with capture_output():
        shell.run_cell("%load_ext backward_doctor\nimport torch\nlin = torch.nn.Linear(16, 16)", store_history=True)
    step = "print('printed')\nlin(torch.randn(512, 16)).sum().backward()\n"
    with capture_output() as fine:
        shell.run_cell("%%backward_doctor\n" + step, store_history=True)
    with capture_output() as raised:
        shell.run_cell("%%backward_doctor --memory-limit 20KB\n" + step, store_history=True)
    placeholder = fine.outputs[0].transient["display_id"]
    *_, emptied, panel = fine.outputs
    assert emptied.update and emptied.transient["display_id"] == placeholder and emptied.data == {"text/plain": ""}
    assert not panel.update and "application/vnd.jupyter.widget-view+json" in panel.data  # shown after the prints
    last = raised.outputs[-1]
    assert last.update and last.data["text/plain"].startswith("backward_doctor: PROBLEM - Out of memory")
    assert "OutOfMemoryError" in raised.stdout                              # (IPython drew the traceback)
    readme, panel_md = _one_line(_readme()), _one_line(_panel_md())
    assert "**above the cell's traceback**: a placeholder takes its place before the cell runs" in readme
    assert "A cell that does not raise keeps what it printed above the panel" in readme
    assert "a cell that does not raise keeps its own output above the report, the line left empty" in readme
    assert "the panel *replaces* the line, so it sits above the cell's traceback" in panel_md
    assert "If it did not, the line is left empty" in panel_md
    assert "a cell that does not raise keeps its prints above the panel" in panel_md


def test_the_panel_docs_say_how_it_fits_a_narrow_screen():
    """docs/panel.md's "Narrow screens": no button of the panel can shrink (every one, the Export row's too, is
    ``flex: 0 0 auto`` in a row that wraps) and the panel's CSS gives HTML widgets ``min-width: 0``. The screen
    itself: ``test_browser_layout.py``."""
    pytest.importorskip("ipywidgets")
    import ipywidgets as W

    import backward_doctor as bd
    from backward_doctor.frontends.panel import Panel

    ns = {"torch": __import__("torch"), "lin": __import__("torch").nn.Linear(16, 16)}
    src = "x = torch.randn(512, 16)\nloss = lin(x).sum()\nloss.backward()\n"
    report = bd.diagnose(src, ns, memory_limit=20_000)
    panel = Panel(report, src, ns)
    assert panel.fix_buttons, "an OOM offers fix buttons"

    def walk(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from walk(child)
    widgets = list(walk(panel.widget))
    buttons = [w for w in widgets if isinstance(w, W.Button)]
    assert len(buttons) >= len(panel.fix_buttons) + 2 and all(b.layout.flex == "0 0 auto" for b in buttons), \
        [(b.description, b.layout.flex) for b in buttons]
    rows = [w for w in widgets if isinstance(w, W.HBox) and any(isinstance(c, W.Button) for c in w.children)]
    assert rows and all(r.layout.flex_flow == "row wrap" for r in rows), [r.layout.flex_flow for r in rows]
    assert "{min-width:0}" in panel.style.value and ".widget-html-content" in panel.style.value
    doc = _one_line(_panel_md())
    assert "Buttons never shrink (`flex: 0 0 auto`" in doc and "their rows wrap instead" in doc
    assert "The panel sets `min-width: 0` on it, so text wraps and the diff scrolls in its own box" in doc
