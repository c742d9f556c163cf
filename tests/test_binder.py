"""Binder: ``binder/`` installs into a fresh environment that imports backward_doctor and runs the tour.

Binder (repo2docker) reads ``binder/``: ``runtime.txt`` (Python), ``requirements.txt`` (pip, run from
the repository root) and ``postBuild`` (JupyterLab's default workspace opens the tour). This test
does what repo2docker does with those files, in a real fresh virtual environment (no system site
packages): ``pip install -r binder/requirements.txt`` from the repository root, then ``postBuild``,
then the tour top to bottom in a kernel of that environment.

Offline where pip has a local torch 2.13.0 wheel (``find-links``): the CPU index line is then left
out and the wheel is used, which is the same version the index serves. Elsewhere the file is used
as it is. About 70 s, most of it pip.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
TORCH = "torch==2.13.0"


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _local_torch_wheel_dir() -> str | None:
    """A find-links directory of pip's configuration that holds a torch 2.13.0 wheel for this Python."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
        dirs += [d for m in re.finditer(r"find-links='([^']*)'", out) for d in m.group(1).split()]
    except (OSError, subprocess.SubprocessError):
        pass
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for d in dirs:
        d = d.removeprefix("file://")
        if os.path.isdir(d) and any(p.name.startswith("torch-2.13.0") and tag in p.name for p in Path(d).glob("*.whl")):
            return d
    return None


def test_binder_files_say_what_binder_needs():
    lines = _lines(BINDER / "requirements.txt")
    assert CPU_INDEX in lines, "Binder has no GPU: torch must come from the CPU index"
    assert TORCH in lines
    assert "-e ." in lines or "." in lines, "the repository itself must be installed"
    assert any(ln.startswith("jupyterlab") for ln in lines)
    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.(1[0-9])", runtime), runtime
    post = BINDER / "postBuild"
    assert os.access(post, os.X_OK), "postBuild must be executable"
    assert "jupyter lab workspaces import binder/workspace.json" in post.read_text()
    workspace = json.loads((BINDER / "workspace.json").read_text())
    assert workspace["metadata"]["id"] == "default"
    opened = workspace["data"]["layout-restorer:data"]["main"]["dock"]["widgets"]
    assert opened == ["notebook:notebooks/00_tour.ipynb"] and (ROOT / "notebooks" / "00_tour.ipynb").is_file()
    readme = (ROOT / "README.md").read_text()
    assert "urlpath=lab/tree/notebooks/00_tour.ipynb" in readme


@pytest.mark.slow
def test_binder_environment_installs_imports_and_runs_the_tour(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    requirements = BINDER / "requirements.txt"
    extra: list[str] = []
    wheels = _local_torch_wheel_dir()
    if wheels is not None:  # offline: the same torch version from the local wheel instead of the CPU index
        requirements = tmp_path / "requirements.txt"
        requirements.write_text("\n".join(ln for ln in (BINDER / "requirements.txt").read_text().splitlines()
                                          if ln.strip() != CPU_INDEX) + "\n")
        extra = ["--find-links", wheels]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "workspaces")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONHOME", None)

    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
                          str(requirements), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    probe = ("import sys, torch, ipywidgets, backward_doctor as bd; "
             "print(sys.prefix, torch.__version__, bd.__file__, torch.cuda.is_available())")
    out = subprocess.run([str(py), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    prefix, version, where, cuda = out.stdout.split()
    assert Path(prefix).resolve() == venv.resolve()          # a fresh environment, not this one
    assert version.startswith("2.13.0") and cuda == "False"
    assert Path(where).resolve() == (ROOT / "backward_doctor" / "__init__.py").resolve()

    post = subprocess.run([str(BINDER / "postBuild")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert post.returncode == 0, post.stdout[-2000:] + post.stderr[-2000:]
    saved = list((tmp_path / "workspaces").glob("*.jupyterlab-workspace"))
    assert len(saved) == 1 and "notebooks/00_tour.ipynb" in saved[0].read_text()

    # The tour, top to bottom, in a kernel of the Binder environment (what a Binder user runs first).
    page = tmp_path / "tour.html"
    tour = subprocess.run([str(py), "-m", "backward_doctor.frontends.demo", "--out", str(page)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert tour.returncode == 0, tour.stdout[-3000:] + tour.stderr[-3000:]
    assert page.is_file() and "backward_doctor report" in page.read_text()
    shutil.rmtree(venv, ignore_errors=True)
