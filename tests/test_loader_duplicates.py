"""An ``IterableDataset`` every DataLoader worker iterates in full (``dataloader_worker``, state ``duplicated``):
named at the dataset's ``__iter__`` with the fix as code, on both engines, beside its correct twins asserted
silent and bit-identical: the same stream split by ``get_worker_info()``, one worker, a map-style dataset, a
stream of one constant batch, and workers that each make their own samples."""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd
import library_loops as ll
from test_dataloader_workers import no_stray_workers  # noqa: F401  (the fixture, autouse)

STREAMS = """\
import torch


class Stream(torch.utils.data.IterableDataset):
    '''64 samples read in order, as from a file: every worker that iterates it reads all of them.'''

    def __init__(self, n=64):
        self.n = n

    def __iter__(self):  # <-- iter
        for i in range(self.n):
            yield torch.full((8,), float(i)), torch.tensor(i % 4)


class ShardedStream(Stream):
    '''The same stream, each worker keeping every num_workers-th sample from its id.'''

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(self.n):
            if i % workers == worker:
                yield torch.full((8,), float(i)), torch.tensor(i % 4)


class Constant(torch.utils.data.IterableDataset):
    '''One sample, again and again (a benchmark's synthetic input): not a stream split wrong.'''

    def __iter__(self):
        for _ in range(32):
            yield torch.ones(8), torch.tensor(1)


class Noise(torch.utils.data.IterableDataset):
    '''Each worker draws its own random samples (seeded by worker): different data, nothing duplicated.'''

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        g = torch.Generator().manual_seed(1000 + (info.id if info is not None else 0))
        for _ in range(32):
            yield torch.randn(8, generator=g), torch.tensor(0)


class Table(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((8,), float(i)), torch.tensor(i % 4)
"""

LOOP = """\
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seen = []
for x, y in loader:
    seen.append(x[:, 0].tolist())
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(dataset: str, engine: str | None, num_workers: int = 2) -> tuple[dict, object]:
    d = ll.define(STREAMS, {}, name="streams")
    torch.manual_seed(0)
    ns = {"torch": torch, "loader": torch.utils.data.DataLoader(d[dataset](), batch_size=4,
                                                                num_workers=num_workers)}
    if engine is None:
        exec(LOOP, ns)
        return ns, None
    return ns, bd.diagnose(LOOP, ns, engine=engine, timeout=120)


def test_every_worker_iterating_the_whole_stream_is_named_at_its_iter(engine):
    ns, report = _run("Stream", engine)
    plain, _ = _run("Stream", None)
    assert ns["seen"] == plain["seen"] and len(ns["seen"]) == 32  # (2 workers x 16 batches: each sample twice)
    for p0, p1 in zip(plain["model"].parameters(), ns["model"].parameters()):
        assert torch.equal(p0, p1)
    assert report.exception is None
    [f] = [f for f in report.findings if f.kind == "dataloader_worker"]
    d = ll.define(STREAMS, {}, name="streams")
    assert f.line == ll.marked_line(d, "Stream", "# <-- iter") and f.file.endswith(".py")
    assert f.function == "Stream.__iter__" and f.cell_line == 5  # (called from the cell's `for`)
    assert f.severity == "warning" and f.evidence["state"] == "duplicated"
    assert f.evidence["duplicated"] >= 8 and f.evidence["batches_checked"] >= 16
    assert f.evidence["reads_worker_info"] is False
    assert "Every DataLoader worker iterates the whole `Stream`" in f.message
    assert "num_workers=2" in f.message and "never reads `torch.utils.data.get_worker_info()`" in f.message
    assert "Each sample comes 2 times an epoch" in f.message
    assert "get_worker_info()" in f.evidence["fix_code"] and "i % workers == worker" in f.evidence["fix_code"]
    text = str(report)
    assert "DataLoader workers: DataLoader(Stream, batch_size=4, num_workers=2)" in text
    assert "were equal to a batch another worker delivered" in text
    # (the record survives the JSON round trip the report files and --load use)
    import json

    from backward_doctor.report import Report
    again = Report.from_dict(json.loads(json.dumps(report.to_dict()))).trace
    assert again.loaders[0].duplicated == report.trace.loaders[0].duplicated
    assert again.loaders[0].loop_line == 5


@pytest.mark.parametrize("dataset,workers", [("ShardedStream", 2), ("Stream", 1), ("Table", 2), ("Constant", 2),
                                             ("Noise", 2)])
def test_correct_twins_are_silent_and_bit_identical(dataset, workers, engine):
    ns, report = _run(dataset, engine, workers)
    plain, _ = _run(dataset, None, workers)
    assert ns["seen"] == plain["seen"]
    for p0, p1 in zip(plain["model"].parameters(), ns["model"].parameters()):
        assert torch.equal(p0, p1)
    assert report.exception is None and report.findings == [], str(report)
    assert report.trace.loaders == []
