"""Real-browser test: JupyterLab started here, driven by Playwright in Debian's Chromium.

A notebook with an out-of-memory training step under ``%%backward_doctor --memory-limit``
is run; the panel must render with a visible memory plot, a fix button is clicked, the
after-view must appear, and "Insert as a new cell below" must put the fixed code into a
new cell under the panel's cell. Screenshots go to ``docs/screenshots/`` (the README
shows them).

Needs ``jupyterlab`` and ``playwright`` (the ``test`` extra) and ``/usr/bin/chromium``
(``make test`` apt-installs it). Never run ``playwright install``: it downloads a browser.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("jupyterlab")
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


@contextlib.contextmanager
def jupyterlab(root: str):
    """A JupyterLab server on a free localhost port with a random token; yields (base url, token)."""
    port, token = _free_port(), secrets.token_hex(16)
    settings = os.path.join(root, ".settings")
    os.makedirs(os.path.join(settings, "@jupyterlab", "apputils-extension"))
    with open(os.path.join(settings, "@jupyterlab", "apputils-extension", "notification.jupyterlab-settings"),
              "w") as fh:
        json.dump({"fetchNews": "false", "checkForUpdates": False}, fh)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=os.path.join(root, ".config"),
               JUPYTER_RUNTIME_DIR=os.path.join(root, ".runtime"), IPYTHONDIR=os.path.join(root, ".ipython"),
               JUPYTERLAB_SETTINGS_DIR=settings, JUPYTERLAB_WORKSPACES_DIR=os.path.join(root, ".workspaces"),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
           "--LabApp.extension_manager=readonly", "--ServerApp.port_retries=0"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(os.path.join(root, "server.log"), "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError("JupyterLab exited:\n" + open(os.path.join(root, "server.log")).read()[-3000:])
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


def test_panel_in_jupyterlab(tmp_path):
    root = str(tmp_path)
    write_notebook(os.path.join(root, "oom.ipynb"), [SETUP_CELL, OOM_CELL, "print('next cell')"])
    os.makedirs(SHOTS, exist_ok=True)
    shots = str(tmp_path / "shots")
    os.makedirs(shots)
    with jupyterlab(root) as (base, token), sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 2000}, device_scale_factor=1)
            errors: list[str] = []
            page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
            page.goto(f"{base}/lab/tree/oom.ipynb?token={token}&reset")
            page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content", timeout=60_000)
            # Keys pressed before the kernel is connected are lost: wait for it to say Idle.
            page.locator(".jp-StatusBar-TextItem", has_text="Idle").first.wait_for(timeout=60_000)
            page.keyboard.press("Control+b")  # hide the file browser: more room for the panel
            cells = page.locator(".jp-Notebook .jp-Cell")
            cells.nth(0).locator(".jp-InputPrompt").click()
            page.keyboard.press("Shift+Enter")
            cells.nth(0).locator(".jp-InputPrompt", has_text="[1]").wait_for(timeout=60_000)
            page.keyboard.press("Shift+Enter")
            # The panel renders, with the memory timeline as a visible, loaded image.
            panel = page.locator(".backward-doctor-panel")
            try:
                panel.wait_for(timeout=90_000)
            except Exception:
                page.screenshot(path=os.path.join(root, "failed.png"))
                raise AssertionError("no panel; the notebook shows:\n" + page.locator(".jp-Notebook").inner_text()[-3000:])
            img = panel.locator("img.bd-memory-plot")
            try:
                img.wait_for(state="visible", timeout=30_000)
            except Exception:
                page.screenshot(path=os.path.join(root, "failed.png"))
                raise AssertionError("no image: " + str(page.evaluate(
                    "() => Array.from(document.querySelectorAll('.backward-doctor-panel img')).map("
                    "i => [i.className, i.width, i.height, i.naturalWidth, i.src.slice(0, 40), "
                    "getComputedStyle(i).display])")))
            page.wait_for_function("el => el.complete && el.naturalWidth > 600", arg=img.element_handle(),
                                   timeout=30_000)
            box = img.bounding_box()
            assert box and box["width"] > 400 and box["height"] > 150, box
            assert "Out of memory at cell line 4" in panel.inner_text()
            output = panel
            panel.scroll_into_view_if_needed()
            output.screenshot(path=os.path.join(shots, "panel-oom.png"))
            # Root cause and graph tabs.
            panel.locator(".lm-TabBar-tab", has_text="Root cause").click()
            panel.get_by_text("root cause: cell, line").first.wait_for(timeout=20_000)
            output.screenshot(path=os.path.join(shots, "panel-root-cause.png"))
            panel.locator(".lm-TabBar-tab", has_text="Autograd graph").click()
            panel.locator("svg .bd-node").first.wait_for(timeout=20_000)
            output.screenshot(path=os.path.join(shots, "panel-graph.png"))
            panel.locator(".lm-TabBar-tab", has_text="Memory").click()
            # A fix button re-runs the cell with the fix; the after-view appears.
            button = panel.locator("button", has_text="Try accumulate")
            button.click()
            page.wait_for_function(
                "() => /Code to keep|fix run failed|not available|no result/.test("
                "document.querySelector('.backward-doctor-panel').innerText)", timeout=90_000)
            text = panel.inner_text()
            keep = panel.locator(".bd-keep")
            if not keep.count():
                page.screenshot(path=os.path.join(root, "failed.png"))
                raise AssertionError("no after-view:\n" + text[:4000])
            assert "before" in text and "after" in text and "Code to keep" in text
            after_img = panel.locator("img.bd-after-plot")
            assert after_img.is_visible()
            fix_box = panel.locator(".bd-fix-box")
            fix_box.scroll_into_view_if_needed()
            fix_box.screenshot(path=os.path.join(shots, "panel-fix.png"))
            # "Insert as a new cell below" puts the code to keep under the panel's cell.
            n_before = cells.count()
            code = keep.locator("textarea").input_value()
            keep.get_by_role("button", name="Insert as a new cell below").click()
            keep.get_by_text("Inserted as a new cell below.").wait_for(timeout=10_000)
            assert cells.count() == n_before + 1
            inserted = cells.nth(2).locator(".cm-content").inner_text()
            assert code.splitlines()[0].strip() in inserted and "accumulat" in inserted.lower(), inserted
            assert "next cell" in cells.nth(3).locator(".cm-content").inner_text()
            assert not errors, errors
        finally:
            browser.close()
    for name in os.listdir(shots):  # only a run that got this far replaces the README's pictures
        shutil.copy(os.path.join(shots, name), os.path.join(SHOTS, name))
