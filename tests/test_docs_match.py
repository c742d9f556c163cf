"""The README says what the screen shows: its first example is what that cell prints, and its table of
kinds has every kind the rules report, under the name the panel shows."""
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
