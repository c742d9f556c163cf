"""``%%backward_doctor`` in a real Jupyter kernel (nbclient): where the report goes among the cell's own outputs.

A cell that raises: the report first (it takes the place of the placeholder displayed before the cell ran),
then what the cell printed, then its traceback: the verdict is the first thing on the screen. A cell that does
not raise: what it printed first, then the report, as always on shows it (issue 47, item 7); the placeholder's
output is left empty (a kernel cannot remove one output of a cell). ``test_browser_layout.py`` checks the same
on the screen.
"""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SETUP = """\
%load_ext backward_doctor
import torch, torch.nn as nn
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)"""
PRINTS = """\
%%backward_doctor
print('epoch 1: starting')
loss = model(torch.randn(8, 64)).pow(2).mean()
loss.backward(); opt.step(); opt.zero_grad()
print('epoch 1: done')"""
RAISES = """\
%%backward_doctor --memory-limit 300KB
print('epoch 2: starting')
loss = model(torch.randn(4096, 64)).pow(2).mean()
loss.backward()"""


def _execute(cells: list[str], tmp_path: Path) -> list:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), old]))
    try:
        NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return nb.cells


def _shape(cell) -> list[str]:
    """The cell's outputs in order: ``empty`` (a display with nothing in it), ``report``, ``print`` (consecutive
    stdout chunks counted once: ipykernel flushes a print in one message or two), ``error``, ``other``."""
    shape: list[str] = []
    for o in cell.outputs:
        if o.output_type == "stream" and o.name == "stdout":
            kind = "print"
        elif o.output_type == "error":
            kind = "error"
        elif o.output_type == "display_data" and o.data == {"text/plain": ""}:
            kind = "empty"
        elif o.output_type == "display_data" and o.data.get("text/plain", "").startswith("backward_doctor: "):
            kind = "report"
        else:
            kind = "other"
        if not (kind == "print" and shape and shape[-1] == "print"):
            shape.append(kind)
    return shape


def test_the_report_follows_the_prints_of_a_cell_that_does_not_raise(tmp_path):
    pytest.importorskip("ipywidgets")
    setup, prints, raises = _execute([SETUP, PRINTS, RAISES], tmp_path)
    assert not [o for o in setup.outputs if o.output_type == "error"], setup.outputs
    # No exception: the prints, then the report; the placeholder's place above them is empty
    assert _shape(prints) == ["empty", "print", "report"], prints.outputs
    text = "".join(o.text for o in prints.outputs if o.output_type == "stream")
    assert text == "epoch 1: starting\nepoch 1: done\n", text
    assert "application/vnd.jupyter.widget-view+json" in prints.outputs[-1].data  # the panel
    # An exception: the verdict first, then the prints, then the traceback
    assert _shape(raises) == ["report", "print", "error"], raises.outputs
    assert raises.outputs[0].data["text/plain"].startswith("backward_doctor: PROBLEM - Out of memory")
    assert raises.outputs[-1].ename == "OutOfMemoryError"
