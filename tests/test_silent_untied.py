"""Issue 48, ``untied_weights``: weights a model declares tied (a Hugging Face model's
``config.tie_word_embeddings=True``, a module's ``__init__`` doing ``self.head.weight = self.embed.weight``) that
are two separate tensors in the step, both trained apart; named at the cell line that broke the tie, with the
fix as code, and silent on the correct twins (tied, re-tied, a config that does not tie). Both engines.

What transformers 5 and torch 2.13 really do (checked plainly in :func:`test_what_transformers_does`, before
the doctor is asked): ``to_empty()`` after a meta-device init gives the embedding and the LM head memory of
their own, two tensors; ``tie_weights()`` (and ``init_weights()``, which calls it) makes them one again;
re-initialising the parameters one by one does not.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from report_check import describe as _describe, only as _only, silent as _silent
import library_loops as ll

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # (the tiny vocabulary's bos/eos warning)


def _gpt2(**kw) -> dict:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32, **kw)
    return {"torch": torch, "nn": nn, "F": F, "GPT2LMHeadModel": transformers.GPT2LMHeadModel, "cfg": cfg,
            "ids": torch.randint(0, 64, (2, 12))}


LOOP = """\
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
#: the model built on the meta device (no memory for the weights), materialised and initialised by hand
META = """\
with torch.device("meta"):
    model = GPT2LMHeadModel(cfg)
model.to_empty(device="cpu")
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02)
""" + LOOP
META_RETIED = META.replace('model.to_empty(device="cpu")\n', 'model.to_empty(device="cpu")\nmodel.tie_weights()\n')
BUILT = "model = GPT2LMHeadModel(cfg)\n" + LOOP
REASSIGNED = ("model = GPT2LMHeadModel(cfg)\n"
              "model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())\n" + LOOP)


def _tied(ns: dict, cell: str) -> bool:
    """Whether the LM head is the embedding after ``cell`` ran plainly (no doctor)."""
    exec(cell, ns)
    return ns["model"].lm_head.weight is ns["model"].transformer.wte.weight


def test_what_transformers_does():
    assert _tied(_gpt2(), BUILT)
    assert not _tied(_gpt2(), META)             # to_empty(): two tensors, trained apart
    assert _tied(_gpt2(), META_RETIED)
    assert _tied(_gpt2(), META.replace("for p in model.parameters():\n    torch.nn.init.normal_(p, std=0.02)\n",
                                       "model.init_weights()\n"))  # (init_weights() ties them again itself)
    assert not _tied(_gpt2(), REASSIGNED)
    assert not _tied(_gpt2(tie_word_embeddings=False), BUILT)


# ----------------------------------------------------------------------------- Hugging Face
def test_a_gpt2_built_on_the_meta_device_and_materialised_with_to_empty(engine):
    report = bd.diagnose(META, _gpt2(), engine=engine)
    f = _only(report, "untied_weights")
    assert (f.line, f.file, f.module, f.severity, f.iteration) == (3, None, "model", "warning", None), \
        _describe(report)
    ev = f.evidence
    assert ev["parameters"] == ["model.lm_head.weight", "model.transformer.wte.weight"]
    assert (ev["class"], ev["declared"], ev["break"], ev["break_line"]) == (
        "GPT2LMHeadModel", "config.tie_word_embeddings=True", "to_empty", 3)
    assert (ev["step_line"], ev["optimizer"], ev["fix_line"]) == (10, "AdamW", 3)
    assert ev["fix_code"] == ('model.to_empty(device="cpu"); model.tie_weights()  # tie again after it, before '
                              'the optimizer is built')
    assert ("`model.lm_head.weight` and `model.transformer.wte.weight` are meant to be one tensor "
            "(`GPT2LMHeadModel` with `config.tie_word_embeddings=True` ties them)") in f.message
    assert "Line 3 (`model.to_empty(device=\"cpu\")`) made them two" in f.message
    assert "`opt.step()` (line 10, AdamW) updated each apart" in f.message

    # the twin: tie_weights() after to_empty() -> one tensor, nothing to say
    _silent(bd.diagnose(META_RETIED, _gpt2(), engine=engine))


def test_a_gpt2_whose_lm_head_is_given_a_parameter_of_its_own(engine):
    report = bd.diagnose(REASSIGNED, _gpt2(), engine=engine)
    f = _only(report, "untied_weights")
    assert (f.line, f.evidence["break"]) == (2, "assign"), _describe(report)
    assert f.evidence["fix_code"] == "model.tie_weights()  # instead of line 2: one tensor again"


LOADED = """\
with torch.device("meta"):
    model = GPT2LMHeadModel(cfg)
model.load_state_dict(state, assign=True)
""" + LOOP


@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_a_gpt2_on_the_meta_device_loaded_with_assign(engine, shared):
    """``load_state_dict(..., assign=True)`` puts a parameter of its own for each key: from a state dict of
    copies, two tensors; from one that kept the tie's sharing (``torch.load`` of a saved ``state_dict()``), two
    parameters over one memory, each with its own gradient and its own update of that memory."""
    ns = _gpt2()
    state = transformers.GPT2LMHeadModel(ns["cfg"]).state_dict()
    ns["state"] = state if shared else {k: v.clone() for k, v in state.items()}
    report = bd.diagnose(LOADED, ns, engine=engine)
    f = _only(report, "untied_weights")
    assert (f.line, f.evidence["break"]) == (3, "load"), _describe(report)
    assert f.evidence["fix_code"] == ("model.load_state_dict(state, assign=True); model.tie_weights()  # tie again "
                                      "after it, before the optimizer is built")
    assert ("two parameters over one memory" in f.message) == shared, f.message
    # the twin: tied again after the load
    ns["model"] = None
    _silent(bd.diagnose(LOADED.replace("assign=True)\n", "assign=True)\nmodel.tie_weights()\n"), ns, engine=engine))


def test_a_tied_gpt2_and_one_whose_config_does_not_tie_are_silent(engine):
    _silent(bd.diagnose(BUILT, _gpt2(), engine=engine))
    _silent(bd.diagnose(BUILT, _gpt2(tie_word_embeddings=False), engine=engine))
    # materialised from the meta device too: two tensors, as the config asks
    _silent(bd.diagnose(META, _gpt2(tie_word_embeddings=False), engine=engine))


def test_untied_on_purpose_through_the_config_is_silent(engine):
    """``config.tie_word_embeddings = False`` set after the model was built, then a head of its own: what
    ``tie_weights()`` would read now says two tensors."""
    cell = REASSIGNED.replace("model.lm_head.weight =",
                              "model.config.tie_word_embeddings = False\nmodel.lm_head.weight =")
    _silent(bd.diagnose(cell, _gpt2(), engine=engine))


def test_untied_but_not_trained_says_nothing(engine):
    """An evaluation of the untied model: nothing trains apart (no gradient, no step)."""
    cell = META.split("opt =")[0] + "model.eval()\nwith torch.no_grad():\n    logits = model(input_ids=ids).logits\n"
    _silent(bd.diagnose(cell, _gpt2(), engine=engine))


# ----------------------------------------------------------------------------- a plain module
class TinyLM(nn.Module):
    """A language model that ties its output layer to its embedding in ``__init__``."""

    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


def _plain() -> dict:
    torch.manual_seed(0)
    return {"torch": torch, "nn": nn, "F": F, "model": TinyLM(), "ids": torch.randint(0, 32, (4, 6))}


PLAIN_LOOP = """\
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
PLAIN_UNTIED = "model.head.weight = nn.Parameter(torch.randn(32, 8) * 0.02)\n" + PLAIN_LOOP
PLAIN_EMBED_REPLACED = "model.embed.weight = nn.Parameter(torch.randn(32, 8) * 0.02)\n" + PLAIN_LOOP


def test_a_module_tied_in_init_that_the_cell_unties(engine):
    report = bd.diagnose(PLAIN_UNTIED, _plain(), engine=engine)
    f = _only(report, "untied_weights")
    assert (f.line, f.file, f.module, f.severity) == (1, None, "model", "warning"), _describe(report)
    ev = f.evidence
    assert ev["parameters"] == ["model.head.weight", "model.embed.weight"]
    assert (ev["class"], ev["declared"], ev["break"], ev["step_line"]) == (
        "TinyLM", "self.head.weight = self.embed.weight", "assign", 7)
    assert ev["declared_file"] == __file__ and ev["declared_line"] == TinyLM.__init__.__code__.co_firstlineno + 5
    assert ev["fix_code"] == "model.head.weight = model.embed.weight  # instead of line 1: one tensor again"
    assert "(`TinyLM.__init__` ties them: `self.head.weight = self.embed.weight`)" in f.message

    # the twin: the tie as __init__ made it
    _silent(bd.diagnose(PLAIN_LOOP, _plain(), engine=engine))


def test_a_new_embedding_keeps_its_weights_and_the_head_is_tied_to_it(engine):
    f = _only(bd.diagnose(PLAIN_EMBED_REPLACED, _plain(), engine=engine), "untied_weights")
    assert f.line == 1
    assert f.evidence["fix_code"] == ("model.embed.weight = nn.Parameter(torch.randn(32, 8) * 0.02); "
                                      "model.head.weight = model.embed.weight  # tie again after it, before the "
                                      "optimizer is built")


def test_untied_by_a_function_the_cell_calls_is_named_at_the_step(engine):
    """No line of the cell breaks the tie: the finding is at the optimizer's step, the fix is the tie."""
    ns = _plain()
    exec("def untie(m):\n    m.head.weight = nn.Parameter(m.head.weight.detach().clone())\n", ns)
    f = _only(bd.diagnose("untie(model)\n" + PLAIN_LOOP, ns, engine=engine), "untied_weights")
    assert (f.line, f.evidence["break"], f.evidence["fix_line"]) == (7, None, None)
    assert f.evidence["fix_code"].startswith("model.head.weight = model.embed.weight  # after the model is loaded")


class MaybeTiedLM(TinyLM):
    """Ties only when asked (``if tie:``, as nanoGPT-style models do): ``tie=False`` wants two tensors."""

    def __init__(self, tie: bool) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(32, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_a_tie_made_on_a_condition_counts_only_where_it_was_made(engine):
    ns = {**_plain(), "model": MaybeTiedLM(tie=True)}
    f = _only(bd.diagnose(PLAIN_UNTIED, ns, engine=engine), "untied_weights")
    assert (f.line, f.evidence["class"]) == (1, "MaybeTiedLM")
    # built untied on purpose: two tensors trained apart is what the model asked for
    _silent(bd.diagnose(PLAIN_LOOP, {**_plain(), "model": MaybeTiedLM(tie=False)}, engine=engine))
    _silent(bd.diagnose(PLAIN_UNTIED, {**_plain(), "model": MaybeTiedLM(tie=False)}, engine=engine))


def test_one_step_after_the_untie_is_enough(engine):
    """The new parameter is the cell's own (hooked only once its optimizer steps: its first gradient is not seen
    by the doctor's hooks): one step still names it."""
    cell = PLAIN_UNTIED.replace("for step in range(3):", "for step in range(1):")
    f = _only(bd.diagnose(cell, _plain(), engine=engine), "untied_weights")
    assert (f.line, f.evidence["step_line"]) == (1, 7)


def test_beside_a_loop_that_goes_nan_it_comes_after_the_nan(engine):
    """A run that went wrong leads with that; the untied weights are a warning after it."""
    cell = PLAIN_UNTIED.replace("    loss.backward()\n", "    if step == 2:\n"
                                "        loss = loss * torch.log(torch.tensor(-1.0))\n    loss.backward()\n")
    report = bd.diagnose(cell, _plain(), engine=engine)
    assert [(f.kind, f.line) for f in report.findings] == [("nonfinite", 7), ("untied_weights", 1)], \
        _describe(report)


def test_a_hugging_face_trainer_training_an_untied_gpt2(engine):
    """The tie broken before the cell (no line of it to name): at the cell's ``trainer.train()``, the fix the
    re-tie before the Trainer builds its optimizer; the tied model the Trainer trains is silent."""
    _silent(bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(task="lm", steps=3), engine=engine))
    ns = ll.hf_trainer(task="lm", steps=3)
    ns["model"].lm_head.weight = nn.Parameter(ns["model"].lm_head.weight.detach().clone())
    report = bd.diagnose(ll.HF_TRAIN, ns, engine=engine)
    f = _only(report, "untied_weights")
    assert (f.line, f.file, f.module, f.evidence["break_line"]) == (1, None, "model", None), _describe(report)
    assert f.evidence["fix_code"] == ("model.tie_weights()  # after the model is loaded or materialised, before "
                                      "the optimizer is built")
    assert "`trainer.train()` (line 1, AdamW) updated each apart" in f.message
