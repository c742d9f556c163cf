"""Notebook tier: every ``notebooks/*.ipynb`` runs top to bottom in a real Jupyter kernel.

The teaching notebooks show broken training steps on purpose. A cell that is meant to raise
runs under ``%%backward_doctor`` and carries the cell tag ``raises-exception``; nbclient runs
with ``allow_errors=True`` and this test then checks that exactly those cells recorded an
error: an untagged cell that errors is a failure (that includes the assertion cell after each
diagnosed cell, which pins the doctor's diagnosis), and so is a tagged cell that no longer
raises (the lesson around it would be wrong).
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
RAISES = "raises-exception"
CELL_TIMEOUT = 120  # seconds per cell
MAGIC = "%%backward_doctor"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _code_cells(nb):
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _errors(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]


def _describe(index: int, cell, error=None) -> str:
    head = cell.source.strip().splitlines()[:3]
    text = f"cell {index}: " + " | ".join(head)
    if error is not None:
        tb = _ANSI.sub("", "\n".join(error.get("traceback", [])[-6:]))
        text += f"\n    {error.get('ename')}: {error.get('evalue')}\n{tb}"
    return text


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    for expected in ("00_tour.ipynb", "01_out_of_memory.ipynb", "02_hangs_and_async.ipynb",
                     "03_nan_and_device_asserts.ipynb", "04_inplace_and_graph_cuts.ipynb",
                     "05_leaks_and_zero_grad.ipynb", "06_training_loops.ipynb", "07_distributed.ipynb",
                     "08_accumulation_and_precision.ipynb", "09_workers_and_compile.ipynb", "10_always_on.ipynb", "11_library_loops.ipynb"):
        assert expected in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    """Committed without outputs, so diffs stay readable and nothing stale is shown."""
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in _code_cells(nb) if c.get("outputs") or c.get("execution_count") is not None]
    assert not dirty, f"{path.name}: clear the outputs of cells {dirty}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_diagnosis_is_asserted(path):
    """Each ``%%backward_doctor`` cell is followed by a cell asserting on ``bd.last_report()``;
    only such cells may be tagged to raise."""
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    problems = []
    for k, (i, cell) in enumerate(cells):
        is_magic = cell.source.lstrip().startswith(MAGIC)
        if RAISES in _tags(cell) and not is_magic:
            problems.append(f"cell {i} is tagged {RAISES!r} but does not run under {MAGIC}")
        if is_magic:
            nxt = cells[k + 1][1].source if k + 1 < len(cells) else ""
            if "bd.last_report()" not in nxt or "assert" not in nxt:
                problems.append(f"cell {i} ({MAGIC}) is not followed by a cell asserting on bd.last_report()")
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    # The kernel imports this checkout (an installed copy would do too), and uses one intra-op
    # thread: on a small shared machine spinning OpenMP threads make tiny models 10-100x slower.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0

    unexpected, missing = [], []
    for i, cell in _code_cells(nb):
        errors = _errors(cell)
        if errors and RAISES not in _tags(cell):
            unexpected.append(_describe(i, cell, errors[0]))
        elif not errors and RAISES in _tags(cell):
            missing.append(_describe(i, cell))
    message = []
    if unexpected:
        message.append("cells that raised unexpectedly:\n  " + "\n  ".join(unexpected))
    if missing:
        message.append(f"cells tagged {RAISES!r} that did not raise:\n  " + "\n  ".join(missing))
    assert not message, f"{path.name} ({elapsed:.0f} s):\n" + "\n".join(message)


def test_the_verdict_comes_before_the_traceback_in_a_real_kernel(tmp_path):
    """Issue 16, in a real kernel: the doctored cell's first output is the report (the placeholder it
    replaced was displayed before the cell ran), then the traceback; the traceback names the cell as its
    prompt does and shows none of the doctor's frames; the kernel's own threads stay out of the way."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext backward_doctor\nimport torch\n"
                                          "model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),"
                                          " torch.nn.Linear(512, 10))"),
                nbformat.v4.new_code_cell("%%backward_doctor --memory-limit 2MB\nx = torch.randn(2048, 64)\n"
                                          "model(x).sum().backward()")]
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = nb.cells[1].outputs
    kinds = [o.output_type for o in outputs]
    assert kinds[0] == "display_data" and "error" in kinds, kinds
    report = outputs[0].data["text/plain"]
    assert report.startswith("backward_doctor: PROBLEM - Out of memory at Cell In[2], line 2"), report[:300]
    assert "running…" not in report                                          # replaced, not appended
    error = next(o for o in outputs if o.output_type == "error")
    shown = _ANSI.sub("", "\n".join(error.traceback))
    assert "Cell In[2], line 2" in shown and "Cell In[3]" not in shown
    assert "backward_doctor/" not in shown and "_raise_simulated_oom" not in shown
    assert error.ename == "OutOfMemoryError"                                  # the user's exception, unchanged
