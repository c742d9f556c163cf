"""DataLoader workers inside library loops (``tests/library_loops.py``): `transformers.Trainer` with
``dataloader_num_workers=2``, Lightning ``fit`` and an Accelerate loop over ``xy_loader(num_workers=2)``.
Each bug (a sample that raises, ragged samples through the default collate, a batch that requires grad)
beside its correct version, silent and bit-identical, on both engines. Hangs are bounded by the
diagnosis's ``timeout``; leftover workers are ended by ``no_stray_workers``.
"""
from __future__ import annotations

import torch

import backward_doctor as bd
import library_loops as ll
from test_dataloader_workers import DATASETS, no_stray_workers  # noqa: F401  (the fixture, autouse)
from test_library_loops import _weights

TOKENS = """\
from library_loops import TokenDataset


class Tokens(TokenDataset):
    '''Tokenized samples; those in ``missing`` lost their label on the way.'''

    def __init__(self, missing=(), **kw):
        super().__init__(**kw)
        self.missing = set(missing)

    def __getitem__(self, i):
        row = super().__getitem__(i)
        if i in self.missing:
            row = {k: v for k, v in row.items() if k != "labels"}
        return {"input_ids": row["input_ids"], "attention_mask": row["attention_mask"], "labels": row["labels"]}  # <-- here
"""


def _compare(build, cell: str, engine: str) -> None:
    """The correct loop: silent on ``engine`` and bit-identical to a plain run."""
    ns = build()
    exec(cell, ns)
    plain = _weights(ns)
    ns = build()
    report = bd.diagnose(cell, ns, engine=engine, timeout=300)
    assert report.findings == [] and report.exception is None, str(report)
    doctored = _weights(ns)
    for k in plain:
        assert torch.equal(doctored[k], plain[k]), k


# ----------------------------------------------------------------------------- transformers.Trainer
def test_trainer_worker_error_names_the_datasets_line(engine):
    d = ll.define(TOKENS, {}, name="tokens")
    ns = ll.hf_trainer(train_ds=d["Tokens"](missing=range(1, 32, 2)), dataloader_num_workers=2)
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine, timeout=300)
    f = report.findings[0]
    assert f.kind == "dataloader_worker", str(report)
    assert (f.line, f.function) == (ll.marked_line(d, "Tokens", "# <-- here"), "Tokens.__getitem__")
    index = int(f.evidence["task"].removeprefix("dataset[").rstrip("]"))
    assert index % 2 == 1                                  # the sample that raised, not its batch
    assert "KeyError" in f.title and "'labels'" in f.message and f.cell_line == 1


def test_trainer_with_persistent_workers_is_silent_and_bit_identical(engine):
    _compare(lambda: ll.hf_trainer(dataloader_num_workers=2, dataloader_persistent_workers=True), ll.HF_TRAIN,
             engine)


# ----------------------------------------------------------------------------- Lightning
def test_lightning_ragged_samples_through_default_collate(engine):
    d = ll.define(DATASETS, {}, name="datasets")
    ns = ll.lit_fit(loader_kwargs={"num_workers": 2, "dataset": d["Numbers"](ragged=True)})
    report = bd.diagnose(ll.LIT_FIT, ns, engine=engine, timeout=300)
    f = report.findings[0]
    assert f.kind == "dataloader_worker" and "different sizes" in f.message, str(report)
    assert f.line == 1 and f.file is None and f.evidence["task"] == "batch [0, 1, 2, 3, 4, 5, 6, 7]"


def test_lightning_persistent_workers_with_padding_collate_silent_and_bit_identical(engine):
    d = ll.define(DATASETS, {}, name="datasets")
    _compare(lambda: ll.lit_fit(loader_kwargs={"num_workers": 2, "persistent_workers": True,
                                               "dataset": d["Numbers"](ragged=True), "collate_fn": d["pad_collate"]}),
             ll.LIT_FIT, engine)


# ----------------------------------------------------------------------------- Accelerate
def _encoder() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(16, 16)


def test_accelerate_batch_requiring_grad_is_lost_in_the_worker(engine):
    d = ll.define(DATASETS, {}, name="datasets")
    ns = ll.accelerate_loop(loader_kwargs={"num_workers": 2, "dataset": d["Numbers"](encoder=_encoder()),
                                           "collate_fn": d["stack_collate"]})
    report = bd.diagnose(ll.ACCEL_LOOP, ns, engine=engine, timeout=4)
    f = report.findings[0]
    assert f.kind == "dataloader_worker" and f.title == "A DataLoader batch was lost", str(report)
    assert (f.line, f.function) == (ll.marked_line(d, "Numbers", "# <-- graph"), "Numbers.__getitem__")


def test_accelerate_encoder_under_no_grad_is_silent_and_bit_identical(engine):
    d = ll.define(DATASETS, {}, name="datasets")
    _compare(lambda: ll.accelerate_loop(loader_kwargs={"num_workers": 2, "collate_fn": d["stack_collate"],
                                                       "dataset": d["Numbers"](encoder=_encoder(), no_grad=True)}),
             ll.ACCEL_LOOP, engine)
