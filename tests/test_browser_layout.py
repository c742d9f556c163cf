"""The panel's layout in a real JupyterLab at a laptop's width (issue 47, item 7: a newcomer's findings).

One notebook, driven by Playwright in Debian's Chromium as ``test_browser.py`` drives it, 900 px wide (the
width where the newcomer saw it), checks what the screen shows:

- a ``%%backward_doctor`` cell that does not raise keeps its own prints *above* the panel (as always on does),
  and the line the placeholder held before the cell ran leaves no gap;
- the Export buttons keep their whole text after a click wrote a file (the line saying so used to squeeze
  them to "Memory sna…" and "Tr…");
- a fix's after-view stays inside the cell: the headline wraps, and the diff's long lines scroll inside the
  diff's own box instead of running past the cell's right edge.

With ``BD_UPDATE_SCREENSHOTS=1`` its screenshots replace those in ``docs/screenshots/`` (the README shows them).
"""
from __future__ import annotations

import os

import pytest

from test_browser import OOM_CELL, SETUP_CELL, _run_cells, notebook_page, pytestmark, sync_api  # noqa: F401

#: A cell that trains without raising and prints around its step (a training log, as newcomers write it).
PRINTS_CELL = """\
%%backward_doctor
print('epoch 1: starting')
loss = F.cross_entropy(model(torch.randn(8, 256)), torch.randint(0, 10, (8,)))
loss.backward(); opt.step(); opt.zero_grad()
print('epoch 1: loss', round(loss.item(), 1))"""

WIDTH = 900


def _outputs(cell) -> list[dict]:
    """The cell's outputs, top to bottom: their text (first 200 characters), box, and whether the panel is in it."""
    return cell.locator(".jp-OutputArea-child").evaluate_all(
        """els => els.map(e => { const r = e.getBoundingClientRect();
            return {text: e.innerText.slice(0, 200), top: r.top, bottom: r.bottom, height: r.height,
                    panel: !!e.querySelector('.backward-doctor-panel')}; })""")


def test_the_panel_fits_the_screen_of_a_laptop(tmp_path):
    pytest.importorskip("jupyterlab")
    cells = [SETUP_CELL, PRINTS_CELL, OOM_CELL]
    with notebook_page(tmp_path, "layout.ipynb", cells, height=1800) as (page, url, shots):
        page.set_viewport_size({"width": WIDTH, "height": 1800})
        page.goto(url)
        _run_cells(page, "lab")
        # 1. A cell that does not raise: its own prints first, then the panel.
        cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
        cell.locator(".backward-doctor-panel").wait_for(timeout=120_000)
        cell.locator(".jp-OutputArea-child", has_text="epoch 1: loss").wait_for(timeout=30_000)
        page.wait_for_timeout(500)  # (the last display update lands)
        outs = _outputs(cell)
        printed = [i for i, o in enumerate(outs) if "epoch 1: starting" in o["text"]]
        panel_at = [i for i, o in enumerate(outs) if o["panel"]]
        assert printed and panel_at and printed[-1] < panel_at[0], outs
        assert all("epoch 1: loss" not in o["text"] for o in outs[panel_at[0]:]), outs
        # what the placeholder held before the cell ran takes no room above the prints
        assert all(o["height"] <= 2 for o in outs[:printed[0]]), outs
        assert "The step ran and nothing looks wrong" in cell.locator(".backward-doctor-panel").inner_text()
        page.evaluate("() => document.querySelector('.jp-Notebook').scrollTo(0, 0)")
        cell.screenshot(path=os.path.join(shots, "panel-prints-first.png"))

        # 2. The OOM cell: the Export buttons keep their text after a click.
        page.keyboard.press("Shift+Enter")
        oom = page.locator(".jp-Notebook .jp-Cell").nth(2)
        panel = oom.locator(".backward-doctor-panel")
        panel.wait_for(timeout=120_000)
        buttons = {t: panel.locator(".widget-button", has_text=t).first for t in ("Memory snapshot", "Trace")}
        width = {t: b.bounding_box()["width"] for t, b in buttons.items()}
        buttons["Memory snapshot"].click()
        panel.get_by_text("Wrote backward_doctor_run").wait_for(timeout=60_000)
        page.wait_for_timeout(300)
        for text, b in buttons.items():
            client, scroll = b.evaluate("e => [e.clientWidth, e.scrollWidth]")
            assert scroll <= client and b.bounding_box()["width"] >= width[text] - 1, (text, client, scroll, width)
        export = panel.locator(".bd-export")
        assert export.bounding_box()["x"] + export.bounding_box()["width"] <= _right_edge(oom) + 1

        # 3. A fix's after-view stays inside the cell.
        panel.locator("button", has_text="Try accumulate").first.click()
        panel.locator(".bd-keep").wait_for(timeout=120_000)
        page.wait_for_timeout(300)
        edge = _right_edge(oom)
        for what in (".bd-fix-verdict", ".bd-fix-verdict .headline", ".bd-fix-verdict .sub", ".diff", ".bd-keep"):
            box = panel.locator(what).first.bounding_box()
            assert box["x"] + box["width"] <= edge + 1, (what, box, edge)
        diff = panel.locator(".diff").first
        client, scroll = diff.evaluate("e => [e.clientWidth, e.scrollWidth]")
        assert scroll > client, (client, scroll)  # (the long lines are all there: the diff's own box scrolls)
        fix_box = panel.locator(".bd-fix-box")
        fix_box.scroll_into_view_if_needed()
        fix_box.screenshot(path=os.path.join(shots, "panel-fix-narrow.png"))


def _right_edge(cell) -> float:
    """The right edge of the cell's output area: what runs past it is cut off (or scrolls the whole cell)."""
    return cell.locator(".jp-OutputArea").evaluate("e => e.getBoundingClientRect().right")
