"""Real-browser test: JupyterLab started here, driven by Playwright in Debian's Chromium.

A notebook with an out-of-memory training step under ``%%backward_doctor --memory-limit``
is run; the panel must render with a visible memory plot, a fix button is clicked, the
after-view must appear, and "Insert as a new cell below" must put the fixed code into a
new cell under the panel's cell. With ``BD_UPDATE_SCREENSHOTS=1`` its screenshots replace
``docs/screenshots/`` (the README shows them).

Needs ``jupyterlab`` and ``playwright`` (the ``test`` extra) and ``/usr/bin/chromium``
(``make test`` apt-installs it). Never run ``playwright install``: it downloads a browser.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = os.environ.get("BD_CHROMIUM", "/usr/bin/chromium")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOTS = os.path.join(ROOT, "docs", "screenshots")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                                   reason=f"{CHROMIUM} missing (make test apt-installs chromium)")]

SETUP_CELL = """\
%load_ext backward_doctor
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)"""

OOM_CELL = """\
%%backward_doctor --memory-limit 20MB
xb = torch.randn(2048, 256)          # a batch too big for the (simulated) 20 MB device
yb = torch.randint(0, 10, (2048,))
loss = F.cross_entropy(model(xb), yb)
loss.backward()
opt.step(); opt.zero_grad()"""

LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: front end -> (Python module that serves it, URL path of a notebook)
APPS = {"lab": ("jupyterlab", "/lab/tree/{nb}"), "notebook": ("notebook", "/notebooks/{nb}"),
        "nbclassic": ("nbclassic", "/nbclassic/notebooks/{nb}")}


@contextlib.contextmanager
def jupyter_server(root: str, app: str = "lab", theme: str | None = None):
    """JupyterLab / Notebook 7 / classic Notebook on a free localhost port with a random token;
    yields (base url, token). ``theme``: JupyterLab's theme ("JupyterLab Dark")."""
    port, token = _free_port(), secrets.token_hex(16)
    settings = os.path.join(root, ".settings")
    os.makedirs(os.path.join(settings, "@jupyterlab", "apputils-extension"), exist_ok=True)
    with open(os.path.join(settings, "@jupyterlab", "apputils-extension", "notification.jupyterlab-settings"),
              "w") as fh:
        json.dump({"fetchNews": "false", "checkForUpdates": False}, fh)
    if theme:
        with open(os.path.join(settings, "@jupyterlab", "apputils-extension", "themes.jupyterlab-settings"),
                  "w") as fh:
            json.dump({"theme": theme}, fh)
    # Private config/data/runtime dirs: a user-level kernelspec or setting cannot leak in; the
    # "python3" kernel is this interpreter (the one running the tests).
    env = dict(os.environ, JUPYTER_CONFIG_DIR=os.path.join(root, ".config"),
               JUPYTER_DATA_DIR=os.path.join(root, ".data"),
               JUPYTER_RUNTIME_DIR=os.path.join(root, ".runtime"), IPYTHONDIR=os.path.join(root, ".ipython"),
               JUPYTERLAB_SETTINGS_DIR=settings, JUPYTERLAB_WORKSPACES_DIR=os.path.join(root, ".workspaces"),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", APPS[app][0], "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0"]
    if app == "lab":
        cmd += ["--LabApp.news_url=", "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(os.path.join(root, "server.log"), "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{app} exited:\n" + open(os.path.join(root, "server.log")).read()[-3000:])
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.3)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def write_notebook(path: str, cells: list[str]) -> None:
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                     "source": src} for i, src in enumerate(cells)],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    with open(path, "w") as fh:
        json.dump(nb, fh)


def _run_cells(page, app: str, setup_s: float = 120) -> None:
    """Run the setup cell, then the diagnosed one, as a user would (the classic UI through its API).
    ``setup_s``: how long the setup cell may take once the kernel took it (importing torch or transformers
    takes a while on a busy machine)."""
    if app == "nbclassic":
        # Outputs that arrive before the widgets extension has loaded fall back to text/html.
        page.wait_for_function("() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel && "
                               "Jupyter.notebook.kernel.is_connected() && Jupyter.notebook.kernel.widget_manager && "
                               "require.defined('nbextensions/jupyter-js-widgets/extension')", timeout=60_000)
        page.wait_for_timeout(1000)
        page.evaluate("Jupyter.notebook.execute_cells([0, 1])")
        return
    page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content", timeout=60_000)
    if app == "lab":
        page.keyboard.press("Control+b")  # hide the file browser: more room for the panel
    cells = page.locator(".jp-Notebook .jp-Cell")
    first = cells.nth(0).locator(".jp-InputPrompt")
    # Keys pressed before the kernel is connected are lost: run the setup cell until it has run.
    # On a loaded machine JupyterLab may ask which kernel to use: answer as a user would (accept).
    for _ in range(12):
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            print("JupyterLab dialog:", dialog.first.inner_text()[:300].replace("\n", " | "))
            dialog.locator(".jp-mod-accept").first.click()
            continue
        try:
            first.click(timeout=5_000)
        except sync_api.TimeoutError:
            continue
        page.keyboard.press("Shift+Enter")
        try:  # taken by the kernel ([*]: running) or already run: never run it twice (its In[] would move)
            first.filter(has_text=re.compile(r"\[(\*|1)\]")).wait_for(timeout=10_000)
        except sync_api.TimeoutError:
            continue
        first.filter(has_text="[1]").wait_for(timeout=setup_s * 1000)
        break
    page.keyboard.press("Shift+Enter")


def _cell_texts(page, app: str) -> list[str]:
    if app == "nbclassic":
        return page.evaluate("Jupyter.notebook.get_cells().map(c => c.get_text())")
    return page.locator(".jp-Notebook .jp-Cell .cm-content").all_inner_texts()


@contextlib.contextmanager
def notebook_page(tmp_path, nb: str, cells: list[str], app: str = "lab", theme: str | None = None,
                  height: int = 2000):
    """A notebook of ``cells`` written as ``nb``, its server and a headless Chromium page on it: yields
    (page, the notebook's url, the folder for screenshots). The browser is closed whatever happens;
    the screenshots replace the tracked ones only on request (``BD_UPDATE_SCREENSHOTS=1``: a normal run
    must not dirty the tracked pictures) and only by a run that got to the end."""
    root = str(tmp_path)
    write_notebook(os.path.join(root, nb), cells)
    shots = str(tmp_path / "shots")
    os.makedirs(shots)
    with jupyter_server(root, app, theme=theme) as (base, token), sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": height}, device_scale_factor=1)
        page.set_default_timeout(60_000)  # a loaded 2-core machine (the whole suite at once) is slow
        try:
            yield page, base + APPS[app][1].format(nb=nb) + f"?token={token}&reset", shots
        finally:
            browser.close()
    if os.environ.get("BD_UPDATE_SCREENSHOTS") == "1":
        os.makedirs(SHOTS, exist_ok=True)
        for name in os.listdir(shots):
            shutil.copy(os.path.join(shots, name), os.path.join(SHOTS, name))


@pytest.mark.parametrize("app", list(APPS))
def test_panel_in_the_browser(tmp_path, app):
    pytest.importorskip(APPS[app][0])
    cells = [SETUP_CELL, OOM_CELL, "print('next cell')"]
    with notebook_page(tmp_path, "oom.ipynb", cells, app=app) as (page, url, shots):
        errors: list[str] = []
        page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))

        def fail(what: str) -> None:
            page.screenshot(path=str(tmp_path / "failed.png"))
            raise AssertionError(f"{app}: {what} (screenshot: {tmp_path}/failed.png)")

        page.goto(url)
        _run_cells(page, app)
        # The panel renders, with the memory timeline as a visible, loaded image.
        panel = page.locator(".backward-doctor-panel")
        try:
            panel.wait_for(timeout=90_000)
        except sync_api.TimeoutError:
            fail("no panel; the page shows:\n" + page.locator("body").inner_text()[-3000:])
        plot = panel.locator(".bd-memory-plot svg.bd-plot")  # the memory timeline, inline SVG
        plot.wait_for(state="visible", timeout=30_000)
        box = plot.bounding_box()
        assert box and box["width"] > 400 and box["height"] > 100, box
        assert plot.locator("polygon").count() >= 1 and "peak" in (plot.text_content() or "")
        assert "Out of memory at Cell In[2], line 4" in panel.inner_text()  # named as IPython names it
        if app == "lab":  # the README's pictures
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=os.path.join(shots, "panel-oom.png"))
            panel.locator(".lm-TabBar-tab", has_text="Root cause").click()
            panel.get_by_text("root cause: Cell In[2], line").first.wait_for(timeout=20_000)
            panel.screenshot(path=os.path.join(shots, "panel-root-cause.png"))
            panel.locator(".lm-TabBar-tab", has_text="Autograd graph").click()
            panel.locator("svg .bd-node").first.wait_for(timeout=20_000)
            panel.screenshot(path=os.path.join(shots, "panel-graph.png"))
            panel.locator(".lm-TabBar-tab", has_text="Memory").click()
        # A fix button re-runs the cell with the fix; the after-view appears.
        panel.locator("button", has_text="Try accumulate").click()
        try:
            page.wait_for_function(
                "() => /Code to keep|fix run failed|not available|no result/.test("
                "document.querySelector('.backward-doctor-panel').innerText)", timeout=90_000)
        except sync_api.TimeoutError:
            fail("no after-view")
        text = panel.inner_text()
        keep = panel.locator(".bd-keep")
        if not keep.count():
            fail("no code to keep:\n" + text[:4000])
        assert "before" in text and "after" in text and "peak memory" in text
        assert panel.locator(".bd-after-plot svg.bd-plot").is_visible()
        if app == "lab":
            fix_box = panel.locator(".bd-fix-box")
            fix_box.scroll_into_view_if_needed()
            fix_box.screenshot(path=os.path.join(shots, "panel-fix.png"))
        # "Insert as a new cell below" puts the code to keep under the panel's cell.
        before = _cell_texts(page, app)
        code = keep.locator("textarea").input_value()
        keep.get_by_role("button", name="Insert as a new cell below").click()
        keep.get_by_text("Inserted as a new cell below.").wait_for(timeout=10_000)
        after = _cell_texts(page, app)
        assert len(after) == len(before) + 1, (before, after)
        assert code.splitlines()[0].strip() in after[2] and "accumulat" in after[2].lower(), after[2]
        assert "next cell" in after[3] and "%%backward_doctor" in after[1]
        assert not errors, errors


# --------------------------------------------------------------------------- issue 16: verdict first, dark theme
SLOW_OOM_CELL = """\
%%backward_doctor --memory-limit 20MB
import time
for i in range(12):                  # a few small steps first: the placeholder shows the progress
    time.sleep(0.35)
    loss = F.cross_entropy(model(torch.randn(8, 256)), torch.randint(0, 10, (8,)))
    loss.backward(); opt.step(); opt.zero_grad()
xb = torch.randn(2048, 256)          # then a batch too big for the (simulated) 20 MB device
yb = torch.randint(0, 10, (2048,))
loss = F.cross_entropy(model(xb), yb)
loss.backward()"""


def _luminance(css_color: str) -> float:
    """0 (black) .. 1 (white) of an ``rgb(...)``/``rgba(...)`` computed colour."""
    r, g, b = (int(v) for v in re.findall(r"[\d.]+", css_color)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_verdict_above_the_traceback_in_the_dark_theme(tmp_path):
    """In JupyterLab's dark theme: the placeholder shows the run's progress while the cell runs, then the
    panel takes its place, above the traceback; the traceback has no frame of the doctor's; the cards
    take the theme's colours."""
    pytest.importorskip("jupyterlab")
    cells = [SETUP_CELL, SLOW_OOM_CELL]
    with notebook_page(tmp_path, "dark.ipynb", cells, theme="JupyterLab Dark", height=1600) as (page, url, shots):
        page.goto(url)
        _run_cells(page, "lab")
        cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
        # While the cell runs: the placeholder, updated from the kernel's polling thread.
        running = cell.locator(".bd-running")
        running.filter(has_text="iterations").wait_for(timeout=90_000)
        # iterations done and live memory, from the kernel's polling thread
        assert "backward_doctor: running…" in running.inner_text() and " live" in running.inner_text()
        cell.screenshot(path=os.path.join(shots, "panel-running.png"))
        panel = cell.locator(".backward-doctor-panel")
        panel.wait_for(timeout=120_000)
        error = cell.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        error.first.wait_for(timeout=30_000)
        # The verdict is the first thing in the cell's output, above the traceback.
        assert panel.bounding_box()["y"] < error.first.bounding_box()["y"]
        assert cell.locator(".bd-running").count() == 0
        shown = error.first.inner_text()
        assert "OutOfMemoryError" in shown and "Cell In[2], line 9" in shown, shown
        assert "backward_doctor/" not in shown and "_raise_simulated_oom" not in shown
        assert "Out of memory at Cell In[2], line 9" in panel.inner_text()
        # Dark theme: the cards are dark with light text, not white islands.
        fact = panel.locator(".bd .fact").first
        bg = fact.evaluate("e => getComputedStyle(e).backgroundColor")
        ink = fact.evaluate("e => getComputedStyle(e).color")
        assert _luminance(bg) < 0.35 and _luminance(ink) > 0.6, (bg, ink)
        page.evaluate("() => document.querySelector('.jp-Notebook').scrollTo(0, 0)")
        cell.screenshot(path=os.path.join(shots, "panel-dark-verdict-first.png"))
        # The autograd graph too: a dark box, dark nodes with light ink.
        panel.locator(".lm-TabBar-tab", has_text="Autograd graph").click()
        node = panel.locator("svg .bd-node").nth(0)
        node.wait_for(timeout=20_000)
        graph_bg = panel.locator(".bd .graph").first.evaluate("e => getComputedStyle(e).backgroundColor")
        fills = panel.locator("svg .bd-node").evaluate_all(
            "els => els.map(g => getComputedStyle(g.querySelectorAll('rect')[g.querySelectorAll('rect').length - 1]).fill)")
        # every node but the finding's (light yellow in both themes) is dark
        assert _luminance(graph_bg) < 0.35 and sum(_luminance(f) < 0.35 for f in fills) >= len(fills) - 1, \
            (graph_bg, fills)
        panel.screenshot(path=os.path.join(shots, "panel-dark-graph.png"))


def test_a_fix_that_did_not_work_says_so_and_offers_the_next(tmp_path):
    """On a 12 MB device two micro-batches are not enough: the after-view is red, offers no code to insert,
    and a "Try accumulate:4" button appears; that one works and offers its code."""
    pytest.importorskip("jupyterlab")
    cells = [SETUP_CELL, OOM_CELL.replace("20MB", "12MB")]
    with notebook_page(tmp_path, "failed.ipynb", cells) as (page, url, shots):
        page.goto(url)
        _run_cells(page, "lab")
        panel = page.locator(".backward-doctor-panel")
        panel.wait_for(timeout=90_000)
        panel.locator("button", has_text="Try accumulate:2").click()
        failed = panel.locator(".bd-fix-failed")
        failed.wait_for(timeout=90_000)
        text = failed.inner_text()
        assert "did not work" in text and "accumulate:2 did not fix the step" in text and "Next:" in text
        color = failed.locator(".headline").evaluate("e => getComputedStyle(e).color")
        r, g, b = (int(v) for v in color[color.index("(") + 1:].rstrip(")").split(",")[:3])
        assert r > 150 and g < 90 and b < 90, color                      # red (the theme's error colour)
        assert panel.locator(".bd-keep").count() == 0                   # nothing to insert
        assert "AFTER THE FIX" not in panel.inner_text().upper()
        nxt = panel.locator("button", has_text="Try accumulate:4")
        nxt.wait_for(timeout=10_000)
        fix_box = panel.locator(".bd-fix-box")
        fix_box.scroll_into_view_if_needed()
        fix_box.screenshot(path=os.path.join(shots, "panel-fix-failed.png"))
        nxt.click()
        panel.locator(".bd-keep").wait_for(timeout=90_000)           # the next step works: code to keep
        assert panel.locator(".bd-fix-failed").count() == 0


# --------------------------------------------------------------------------- issue 30: a Trainer notebook
TRAINER_SETUP = """\
%load_ext backward_doctor
import os
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, num_labels=3))
g = torch.Generator().manual_seed(0)
ids, labels = torch.randint(0, 99, (64, 32), generator=g), torch.randint(0, 3, (64,), generator=g)
train_ds = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]"""

TRAINER_CELL = """\
%%backward_doctor --memory-limit 5MB
args = TrainingArguments(output_dir="out", max_steps=2, per_device_train_batch_size=32, use_cpu=True,
                         report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=train_ds)
trainer.train()"""


def test_a_trainer_notebook_gets_the_trainers_own_knobs(tmp_path):
    """A newcomer's `transformers.Trainer` notebook that runs out of memory: the panel offers the Trainer's own
    settings (accumulation, bf16, activation checkpointing), each button applies and measures it, and the code
    to keep is the cell with the changed TrainingArguments."""
    pytest.importorskip("jupyterlab")
    pytest.importorskip("transformers")
    cells = [TRAINER_SETUP, TRAINER_CELL, "print('next cell')"]
    with notebook_page(tmp_path, "trainer.ipynb", cells, height=2200) as (page, url, shots):
        page.goto(url)
        _run_cells(page, "lab", setup_s=180)
        panel = page.locator(".backward-doctor-panel")
        panel.wait_for(timeout=240_000)
        assert "Out of memory at Cell In[2], line 4" in panel.inner_text()   # `trainer.train()`, as IPython names it
        for arg in ("accumulate:2", "amp", "checkpoint"):
            assert panel.locator("button", has_text=f"Try {arg}").count() == 1, arg
        assert "Not offered" not in panel.inner_text()
        panel.scroll_into_view_if_needed()
        panel.screenshot(path=os.path.join(shots, "panel-trainer-oom.png"))
        panel.locator("button", has_text="Try accumulate:2").click()
        keep = panel.locator(".bd-keep")
        keep.wait_for(timeout=300_000)
        code = keep.locator("textarea").input_value()
        assert "per_device_train_batch_size=16" in code and "gradient_accumulation_steps=2" in code, code
        assert "trainer.train()" in code and ".backward(" not in code
        text = panel.inner_text()
        assert "accumulate:2: the step ran" in text and "transformers' own gradient accumulation" in text
        fix_box = panel.locator(".bd-fix-box")
        fix_box.scroll_into_view_if_needed()
        fix_box.screenshot(path=os.path.join(shots, "panel-trainer-fix.png"))
