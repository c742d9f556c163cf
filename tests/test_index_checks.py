"""Index ranges checked before a kernel reads them (``capture/recorder/checks.py``): advanced indexing, ``index_put``,
``scatter``/``index_add``/``index_copy`` beside the embedding/gather/NLL checks. On CUDA the check runs before the
launch (a bad index there is a device-side assert that kills the context, seen on an H200); on the CPU PyTorch's
own error is explained after the fact with the same evidence."""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd
from backward_doctor.capture.recorder.checks import index_check

aten = torch.ops.aten


def _bad(func, *args):
    found = index_check(func, args, {})
    return None if found is None else (found.valid, found.bad)


def test_advanced_indexing_counts_negative_indices_from_the_end_and_leaves_masks_alone():
    x = torch.zeros(10, 4)
    assert _bad(aten.index.Tensor, x, [torch.tensor([1, -10, 30])]) == ([-10, 9], [30])
    assert _bad(aten.index.Tensor, x, [torch.tensor([-11, 0])]) == ([-10, 9], [-11])
    assert _bad(aten.index.Tensor, x, [None, torch.tensor([3, -4])]) is None         # x[:, idx]: dimension 1
    assert _bad(aten.index.Tensor, x, [None, torch.tensor([4])]) == ([-4, 3], [4])
    assert _bad(aten.index.Tensor, x, [torch.ones(10, dtype=torch.bool)]) is None     # a mask: PyTorch's check
    assert _bad(aten.index_put_.default, x, [torch.tensor([10])], torch.ones(4)) == ([-10, 9], [10])


def test_writes_along_a_dimension_take_no_negative_index():
    # as PyTorch itself: scatter/index_add/index_copy reject -1 where advanced indexing accepts it
    z = torch.zeros(5)
    assert _bad(aten.scatter_add_.default, z, 0, torch.tensor([5]), torch.ones(1)) == ([0, 4], [5])
    assert _bad(aten.scatter_.value, z, 0, torch.tensor([-1]), 1.0) == ([0, 4], [-1])
    assert _bad(aten.index_add_.default, z, 0, torch.tensor([2, 7]), torch.ones(2)) == ([0, 4], [7])
    assert _bad(aten.index_copy_.default, z, 0, torch.tensor([0]), torch.ones(1)) is None
    for op in (lambda: z.clone().scatter_(0, torch.tensor([-1]), 1.0),
               lambda: z.clone().index_add_(0, torch.tensor([-1]), torch.ones(1))):
        with pytest.raises((IndexError, RuntimeError)):
            op()


class Lookup(torch.nn.Module):
    """A table read by advanced indexing (no nn.Embedding): what custom models and losses do."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids]


CELL = "h = model(ids)\nloss = h.pow(2).sum()\nloss.backward()\n"


def test_a_table_read_past_its_end_is_named_with_the_valid_range(engine):
    ns = {"torch": torch, "model": Lookup(), "ids": torch.tensor([1, 2, 30])}
    with pytest.raises(IndexError) as plain:
        exec(CELL, {"torch": torch, "model": Lookup(), "ids": torch.tensor([1, 2, 30])})
    report = bd.diagnose(CELL, ns, engine=engine)
    f = report.findings[0]
    # the line that indexed: `return self.w[ids]` in the module's forward
    assert (f.kind, f.line, f.module) == ("index_out_of_range", Lookup.forward.__code__.co_firstlineno + 1, "model")
    assert f.evidence["valid"] == [-10, 9] and f.evidence["bad"] == [30]
    assert "-10..9" in f.message and "size 10 of dimension 0" in f.message
    assert report.exception == f"IndexError: {plain.value}"      # PyTorch's own error, unchanged on the CPU


def test_valid_advanced_indexing_runs_bit_identical(engine):
    plain = {"torch": torch, "model": Lookup(), "ids": torch.tensor([1, -1, 9, 0])}
    torch.manual_seed(0)
    plain["model"] = Lookup()
    torch.manual_seed(0)
    doc = {**plain, "model": Lookup()}
    exec(CELL, plain)
    assert bd.diagnose(CELL, doc, engine=engine).ok
    assert torch.equal(plain["model"].w.grad, doc["model"].w.grad)
