"""In-place writes through indexing (issue 47, item 1): ``h[:, 0] = 0.0`` on a tensor autograd saved.

Index assignment dispatches as ``fill_``/``copy_``/``index_put_`` on a *view* of the saved tensor, so the
written tensor's shape is the view's (``[4]``), not the saved one's (``[4, 32]``) that PyTorch's error
names. The doctor must still name the assignment's line and op, on both engines, and the user's
exception must be PyTorch's own, word for word.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

import backward_doctor as bd

# (statement, the op it dispatches as). Each writes into the sigmoid's output, which SigmoidBackward saved.
WRITES = {
    "slice": ("h[:, :16] = 0.0", "aten::fill_"),
    "select": ("h[:, 0] = 0.0", "aten::fill_"),
    "select_tensor": ("h[:, 0] = torch.zeros(4)", "aten::copy_"),
    "row_method": ("h[1].zero_()", "aten::zero_"),
    "mask": ("h[h > 0.9] = 0.9", "aten::index_put_"),  # placed right before the fix: kept right
    "augmented": ("h += 0.1", "aten::add_"),           # likewise
}

CELL = "h = torch.sigmoid(x @ w)\n{write}\nloss = h.sum()\nloss.backward()\n"

MODULE_CELL = textwrap.dedent("""\
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 32)

        def forward(self, x):
            h = torch.sigmoid(self.lin(x))
            {write}
            return h

    model = Gate()
    loss = model(x).sum()
    loss.backward()
""")


def _ns() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"torch": torch, "nn": torch.nn, "x": torch.randn(4, 8, generator=g),
            "w": torch.randn(8, 32, generator=g, requires_grad=True)}


def _plain_error(source: str) -> str:
    """The exception the cell raises without the doctor, as the report writes it."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        exec(compile(source, "<plain>", "exec"), _ns())
    return f"RuntimeError: {plain.value}"


@pytest.mark.parametrize("case", list(WRITES))
def test_indexed_write_is_placed_at_its_line(engine, case):
    write, op = WRITES[case]
    source = CELL.format(write=write)
    report = bd.diagnose(source, _ns(), engine=engine)
    assert report.exception == _plain_error(source)  # PyTorch's error, unchanged
    assert report.trace.exception.where.line == 4      # raised at backward() ...
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("inplace", 2, op), str(report)  # ... caused at the write
    assert f.evidence["producer_op"] == "aten::sigmoid"
    assert f.evidence["saved_by"] == "Sigmoid"  # (torch 2.x names the node so)
    assert f.evidence["code"] == write


@pytest.mark.parametrize("case", ["slice", "select", "mask"])
def test_indexed_write_in_a_modules_forward(engine, case):
    write, op = WRITES[case]
    source = MODULE_CELL.format(write=write)
    report = bd.diagnose(source, _ns(), engine=engine)
    assert report.exception == _plain_error(source)
    assert report.trace.exception.where.line == 13
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("inplace", 8, op), str(report)
    assert f.evidence["code"] == write


@pytest.mark.parametrize("case", ["slice", "select"])
def test_the_message_says_it_wrote_through_a_view(engine, case):
    write, op = WRITES[case]
    report = bd.diagnose(CELL.format(write=write), _ns(), engine=engine)
    f = report.findings[0]
    assert f.evidence["base_shape"] == [4, 32]
    assert "view of a [4, 32] tensor" in f.message
    assert ".clone()" in f.message
    # (no "`fill` instead of `fill_`": there is no out-of-place spelling of an index assignment)
    assert "instead of `fill_`" not in f.message


def test_a_write_into_a_fresh_buffer_is_not_blamed(engine):
    """A slice write into a buffer nothing read (a mask being built) is not the cause; the write into the
    saved tensor is, though it comes first."""
    source = ("h = torch.sigmoid(x @ w)\nh[:, 0] = 0.0\nbuf = torch.zeros(4, 32)\nbuf[:, :2] = 1.0\n"
              "loss = (h + buf).sum()\nloss.backward()\n")
    report = bd.diagnose(source, _ns(), engine=engine)
    assert report.exception == _plain_error(source)
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("inplace", 2, "aten::fill_"), str(report)


def test_a_saved_input_made_before_the_cell(engine):
    """``x`` came from the namespace (no op of the cell made it, so no producer to read its shape from); the
    mul saved it, and the write into a column of it is the cause."""
    source = "y = x * v\nx[:, 0] = 0.0\nloss = y.sum()\nloss.backward()\n"

    def ns() -> dict:
        return {"torch": torch, "x": torch.randn(4, 8), "v": torch.randn(8, requires_grad=True)}

    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        exec(compile(source, "<plain>", "exec"), ns())
    report = bd.diagnose(source, ns(), engine=engine)
    assert report.exception == f"RuntimeError: {plain.value}"
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("inplace", 2, "aten::fill_"), str(report)
    assert f.evidence["base_shape"] == [4, 8]
    assert "`x = x.clone()`" in f.message
