"""Issue 48, ``label_misalignment``: a Hugging Face causal LM (its loss shifts the labels itself) given labels the
cell already shifted, named at the call with the fix as code, on both engines; each correct twin silent
(unshifted labels, labels masked with -100, a custom LM computing its loss on shifted targets, T5, BERT MLM).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from report_check import describe as _describe, silent as _silent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()

V = 97


def _ns(model: nn.Module) -> dict:
    torch.manual_seed(1)
    return {"torch": torch, "F": F, "model": model, "ids": torch.randint(1, V, (2, 9)),
            "opt": torch.optim.SGD(model.parameters(), lr=0.01)}


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                                            bos_token_id=0, eos_token_id=0))


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                              max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                              pad_token_id=0))


def _loop(body: str) -> str:
    lines = "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return f"for step in range(2):\n{lines}    opt.zero_grad()\n    out.loss.backward()\n    opt.step()\n"


DOUBLE = "out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])\nout.loss.backward()\nopt.step()\n"


def test_double_shift_into_a_gpt2_is_named_at_the_call(engine):
    report = bd.diagnose(DOUBLE, _ns(_gpt2()), engine=engine)
    assert report.exception is None and [f.kind for f in report.findings] == ["label_misalignment"], \
        _describe(report)
    f = report.findings[0]
    assert (f.line, f.file) == (1, None), _describe(report)
    assert f.evidence["problem"] == "double_shift" and f.evidence["labels"] == "ids[:, 1:]"
    assert f.evidence["fix_code"] == "out = model(input_ids=ids, labels=ids)  # the model shifts the labels itself"
    assert "two ahead" in f.message and "`model`" in f.message


def test_double_shift_through_names_in_a_loop_on_a_llama(engine):
    src = _loop("inputs, labels = ids[:, :-1], ids[:, 1:]\nout = model(input_ids=inputs, labels=labels)")
    report = bd.diagnose(src, _ns(_llama()), engine=engine)
    assert report.exception is None and [f.kind for f in report.findings] == ["label_misalignment"], \
        _describe(report)
    f = report.findings[0]
    assert f.line == 3 and f.evidence["tokens"] == "ids", _describe(report)
    assert f.evidence["fix_code"].startswith("out = model(input_ids=ids, labels=ids)")


def test_separate_assignments_and_a_clone_are_followed(engine):
    src = ("x = ids[:, :-1]\ny = ids[:, 1:].clone()\nout = model(x, labels=y)\nout.loss.backward()\n"
           "opt.step()\n")
    report = bd.diagnose(src, _ns(_gpt2()), engine=engine)
    assert [f.kind for f in report.findings] == ["label_misalignment"], _describe(report)
    assert report.findings[0].line == 3


@pytest.mark.parametrize("body", [
    "out = model(input_ids=ids, labels=ids)",  # the model shifts: right
    "labels = ids.masked_fill(ids < 5, -100)\nout = model(input_ids=ids, labels=labels)",  # -100 padding
    "out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])",  # a shorter window, unshifted
], ids=["unshifted", "masked", "shorter-window"])
def test_correct_labels_for_a_causal_lm_say_nothing(engine, body):
    _silent(bd.diagnose(_loop(body), _ns(_gpt2()), engine=engine))


class TinyLM(nn.Module):
    """A custom LM that computes its loss on the targets as given (no shift of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.emb(input_ids))
        loss = F.cross_entropy(logits.view(-1, V), labels.reshape(-1)) if labels is not None else None
        return type("Out", (), {"loss": loss, "logits": logits})()


def test_a_model_that_does_not_shift_given_shifted_targets_says_nothing(engine):
    _silent(bd.diagnose(_loop("out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])"), _ns(TinyLM()),
                        engine=engine))


def test_seq2seq_and_masked_lm_labels_say_nothing(engine):
    torch.manual_seed(0)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0))
    _silent(bd.diagnose(_loop("out = model(input_ids=ids[:, :-1], labels=ids[:, 1:].contiguous())"), _ns(t5),
                        engine=engine))
    bert = tf.BertForMaskedLM(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=4, intermediate_size=64,
                                            max_position_embeddings=32))
    _silent(bd.diagnose(_loop("out = model(input_ids=ids[:, :-1], labels=ids[:, 1:].contiguous())"), _ns(bert),
                        engine=engine))


class ShiftingLM(TinyLM):
    """A custom LM that shifts its labels itself, as transformers did before its ``ForCausalLMLoss``."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.emb(input_ids))
        shift_logits, shift_labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def test_a_custom_model_that_shifts_itself_given_shifted_labels(engine):
    report = bd.diagnose(_loop("out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])"), _ns(ShiftingLM()),
                         engine=engine)
    assert [f.kind for f in report.findings] == ["label_misalignment"], _describe(report)
    _silent(bd.diagnose(_loop("out = model(input_ids=ids, labels=ids)"), _ns(ShiftingLM()), engine=engine))


# ----------------------------------------------------------------------------- no shift: targets are the inputs
class PlainLM(nn.Module):
    """A causal LM that returns logits only: the cell computes the loss (nanoGPT-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


def _plain_loop(body: str) -> str:
    lines = "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return f"for step in range(2):\n{lines}    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"


def _plain_ns(model: nn.Module | None = None) -> dict:
    ns = _ns(model if model is not None else PlainLM())
    ns.update({"V": V, "data": torch.randint(1, V, (40,)), "T": 8})
    return ns


NO_SHIFT = _plain_loop("x = ids\nlogits = model(x)\nloss = F.cross_entropy(logits.view(-1, V), x.view(-1))")


def test_targets_that_are_the_inputs_are_named_at_the_loss_line(engine):
    report = bd.diagnose(NO_SHIFT, _plain_ns(), engine=engine)
    assert report.exception is None and [f.kind for f in report.findings] == ["label_misalignment"], \
        _describe(report)
    f = report.findings[0]
    assert (f.line, f.file) == (4, None) and f.evidence["problem"] == "no_shift", _describe(report)
    assert f.evidence["model_line"] == 3 and f.evidence["target"] == "x.view(-1)"
    assert f.evidence["fix_code"] == ("loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))"
                                      "  # position t predicts token t+1")
    assert "copy its input" in f.message


@pytest.mark.parametrize("body", [
    # nanoGPT: two windows of one tensor, one token apart
    "i = step\nx, y = data[i:i + T].view(1, T), data[i + 1:i + 1 + T].view(1, T)\nlogits = model(x)\n"
    "loss = F.cross_entropy(logits.view(-1, V), y.view(-1))",
    # shifted in the cell
    "logits = model(ids)\nloss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))",
    "targets = ids[:, 1:]\nlogits = model(ids)[:, :-1]\nloss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))",
], ids=["nanogpt", "sliced", "named"])
def test_shifted_targets_say_nothing(engine, body):
    _silent(bd.diagnose(_plain_loop(body), _plain_ns(), engine=engine))


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(V, 8), nn.Linear(8, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


def test_a_reconstruction_against_the_input_says_nothing(engine):
    ns = _plain_ns(AutoEncoder())
    ns["z"] = torch.randn(4, V)
    _silent(bd.diagnose(_plain_loop("loss = F.mse_loss(model(z), z)"), ns, engine=engine))
    # a masked LM scores the unmasked tokens (another tensor) from the masked ones: silent too
    _silent(bd.diagnose(_plain_loop("masked = ids.masked_fill(ids < 20, 0)\nlogits = model(masked)\n"
                                    "loss = F.cross_entropy(logits.view(-1, V), ids.view(-1))"),
                        _plain_ns(), engine=engine))


def test_no_shift_through_a_loss_module_and_a_hugging_face_model(engine):
    ns = _plain_ns()
    ns["crit"] = nn.CrossEntropyLoss()
    src = _plain_loop("logits = model(ids)\nloss = crit(logits.reshape(-1, V), ids.reshape(-1))")
    report = bd.diagnose(src, ns, engine=engine)
    assert [f.kind for f in report.findings] == ["label_misalignment"], _describe(report)
    assert report.findings[0].line == 3
    src = _plain_loop("logits = model(input_ids=ids).logits\nloss = F.cross_entropy(logits.view(-1, V), ids.view(-1))")
    report = bd.diagnose(src, _plain_ns(_gpt2()), engine=engine)
    assert [f.kind for f in report.findings] == ["label_misalignment"], _describe(report)
    assert report.findings[0].evidence["model_line"] == 2
