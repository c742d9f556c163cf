"""Correct training steps on third-party code nobody here wrote: the compatibility tier's workloads.

Each workload is a function that builds, from a fixed seed, the namespace a user's notebook
would hold (model, optimizer, batch) and returns it with the cell that runs one training step.
Everything is CPU-only and offline: Hugging Face models are built from tiny random configs
(no download), ``peft`` wraps one of them. ``tests/test_compat.py`` runs every workload plainly
and under the doctor (each engine) from the same seed and compares the results bit for bit.

Workloads whose package is missing raise ``pytest.skip`` from the builder (the tier says why).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
import torch.nn.functional as F

#: name -> builder returning (namespace, cell source)
WORKLOADS: dict[str, Callable[[], tuple[dict, str]]] = {}

HF_STEP = """\
opt.zero_grad()
out = model(**batch)
loss = out.loss
loss.backward()
opt.step()
"""


def workload(fn: Callable[[], tuple[dict, str]]) -> Callable[[], tuple[dict, str]]:
    WORKLOADS[fn.__name__] = fn
    return fn


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is a test dependency (pyproject [test])")


def _hf(model: nn.Module, batch: dict) -> tuple[dict, str]:
    model.train()
    return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3), "batch": batch}, HF_STEP


def _lm_batch(vocab: int, b: int = 2, t: int = 8) -> dict:
    ids = torch.randint(0, vocab, (b, t))
    return {"input_ids": ids, "labels": ids.clone()}


def tiny_gpt2(gradient_checkpointing: bool = False) -> nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = tf.GPT2LMHeadModel(cfg)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


@workload
def hf_gpt2():
    model = tiny_gpt2()
    return _hf(model, _lm_batch(97))


@workload
def hf_gpt2_checkpointing():
    model = tiny_gpt2(gradient_checkpointing=True)
    return _hf(model, _lm_batch(97))


@workload
def hf_llama():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return _hf(tf.LlamaForCausalLM(cfg), _lm_batch(101))


@workload
def hf_mixtral_moe():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True)
    return _hf(tf.MixtralForCausalLM(cfg), _lm_batch(101))


@workload
def hf_bert():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = tf.BertForSequenceClassification(cfg)
    ids = torch.randint(0, 99, (2, 8))
    batch = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3]),
             "labels": torch.tensor([0, 2])}
    return _hf(model, batch)


@workload
def hf_t5():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=103, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0)
    model = tf.T5ForConditionalGeneration(cfg)
    batch = {"input_ids": torch.randint(0, 103, (2, 8)), "labels": torch.randint(0, 103, (2, 6))}
    return _hf(model, batch)


@workload
def hf_bart_cross_attention():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.BartConfig(vocab_size=107, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=64)
    model = tf.BartForConditionalGeneration(cfg)
    batch = {"input_ids": torch.randint(3, 107, (2, 9)), "labels": torch.randint(3, 107, (2, 7))}
    return _hf(model, batch)


@workload
def hf_vit():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64, num_labels=5)
    model = tf.ViTForImageClassification(cfg)
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([1, 4])}
    return _hf(model, batch)


@workload
def peft_lora_gpt2():
    peft = pytest.importorskip("peft", reason="peft is a test dependency (pyproject [test])")
    model = tiny_gpt2()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    model = peft.get_peft_model(model, cfg)
    model.train()
    ns = {"model": model, "opt": torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
          "batch": _lm_batch(97)}
    return ns, HF_STEP


# ----------------------------------------------------------------------------- PyTorch mechanisms
STEP = """\
opt.zero_grad()
loss = F.cross_entropy(model(x), y)
loss.backward()
opt.step()
"""


def _mlp(d_in: int = 16, classes: int = 5) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, classes))


def _plain(model: nn.Module, opt: torch.optim.Optimizer | None = None, d_in: int = 16, **extra) -> tuple[dict, str]:
    ns = {"F": F, "torch": torch, "model": model, "opt": opt or torch.optim.SGD(model.parameters(), lr=0.1),
          "x": torch.randn(8, d_in), "y": torch.randint(0, 5, (8,)), **extra}
    return ns, STEP


class Double(torch.autograd.Function):
    """A custom autograd Function (forward and backward written by hand)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ScaledTanh(torch.autograd.Function):
    """A custom Function that saves tensors and returns two outputs."""

    @staticmethod
    def forward(ctx, x, scale):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y * scale, y

    @staticmethod
    def backward(ctx, gy, gy2):
        (y,) = ctx.saved_tensors
        return (gy * ctx.scale + gy2) * (1 - y * y), None


class CustomFunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x):
        h, _ = ScaledTanh.apply(Double.apply(self.a(x)), 0.5)
        return self.b(h)


@workload
def custom_function():
    torch.manual_seed(0)
    return _plain(CustomFunctionNet())


class CheckpointNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1)) for _ in range(3))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@workload
def checkpoint_reentrant():
    torch.manual_seed(0)
    model = CheckpointNet(reentrant=True)
    ns, src = _plain(model)
    ns["x"].requires_grad_(True)  # reentrant checkpointing needs an input that requires grad
    return ns, src


@workload
def checkpoint_non_reentrant():
    torch.manual_seed(0)
    return _plain(CheckpointNet(reentrant=False))


@workload
def full_backward_hooks():
    torch.manual_seed(0)
    model = _mlp()
    seen = []
    model[0].register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0].shape))
    model[2].register_full_backward_pre_hook(lambda m, gout: (gout[0] * 0.5,))
    return _plain(model, seen=seen)


@workload
def tensor_hooks():
    torch.manual_seed(0)
    model = _mlp()
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    return _plain(model)


@workload
def post_accumulate_grad_hooks():
    # The optimizer-in-backward pattern: each parameter steps as soon as its gradient is ready.
    torch.manual_seed(0)
    model = _mlp()
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_now(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    ns = {"F": F, "model": model, "opts": opts, "x": torch.randn(8, 16), "y": torch.randint(0, 5, (8,))}
    return ns, "loss = F.cross_entropy(model(x), y)\nloss.backward()\n"


@workload
def parametrizations():
    torch.manual_seed(0)
    from torch.nn.utils import parametrizations as P

    model = _mlp()
    P.weight_norm(model[0])
    P.orthogonal(model[2])
    P.spectral_norm(model[4])
    return _plain(model, torch.optim.Adam(model.parameters(), lr=1e-3))


@workload
def sparse_embedding_sparse_adam():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8, sparse=True)
    head = nn.Linear(8, 5)
    ns = {"F": F, "emb": emb, "head": head, "opt_sparse": torch.optim.SparseAdam(list(emb.parameters()), lr=0.01),
          "opt": torch.optim.Adam(head.parameters(), lr=0.01), "ids": torch.randint(0, 50, (4, 6)),
          "y": torch.randint(0, 5, (4,))}
    src = ("opt_sparse.zero_grad()\nopt.zero_grad()\nloss = F.cross_entropy(head(emb(ids).mean(1)), y)\n"
           "loss.backward()\nopt_sparse.step()\nopt.step()\n")
    return ns, src


@workload
def bf16_autocast():
    torch.manual_seed(0)
    model = _mlp()
    ns, _ = _plain(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    src = ("opt.zero_grad()\nwith torch.autocast('cpu', dtype=torch.bfloat16):\n"
           "    loss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n")
    return ns, src


@workload
def foreach_adam():
    torch.manual_seed(0)
    model = _mlp()
    return _plain(model, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True))


@workload
def fused_adamw():
    torch.manual_seed(0)
    model = _mlp()
    return _plain(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 5)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


@workload
def packed_lstm():
    torch.manual_seed(0)
    model = PackedLSTM()
    ns = {"F": F, "model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3),
          "x": torch.randn(4, 7, 6), "lengths": torch.tensor([7, 3, 5, 2]), "y": torch.randint(0, 5, (4,))}
    return ns, "opt.zero_grad()\nloss = F.cross_entropy(model(x, lengths), y)\nloss.backward()\nopt.step()\n"


class ComplexNet(nn.Module):
    """Complex parameters and FFTs (complex autograd, views as real)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(9, dtype=torch.cfloat) * 0.1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        spec = torch.fft.rfft(x, dim=-1) * self.w
        back = torch.fft.irfft(spec, n=16, dim=-1)
        return self.head(back + torch.view_as_real(spec).sum(-1).mean(-1, keepdim=True))


@workload
def complex_fft():
    torch.manual_seed(0)
    return _plain(ComplexNet())


class ViewsNet(nn.Module):
    """Views, in-place ops on fresh tensors, index_put, scatter, masked_fill, unbind, chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 5)

    def forward(self, x):
        h = self.a(x)
        left, right = h.chunk(2, dim=-1)
        h = torch.cat([right.relu(), left.sigmoid()], -1).view(x.shape[0], 4, 8).transpose(1, 2).reshape(x.shape[0], 32)
        out = torch.zeros_like(h)
        out[:, ::2] = h[:, ::2]
        out = out.index_add(1, torch.arange(0, 32, 2), h[:, 1::2])
        out = out.masked_fill(out.abs() > 5, 0.0)
        rows = list(out.unbind(0))
        return self.b(torch.stack(rows))


@workload
def views_and_indexing():
    torch.manual_seed(0)
    return _plain(ViewsNet())


@workload
def double_backward():
    # A gradient penalty: backward through a backward (create_graph=True).
    torch.manual_seed(0)
    model = _mlp()
    ns, _ = _plain(model)
    ns["x"].requires_grad_(True)
    src = ("opt.zero_grad()\nloss = F.cross_entropy(model(x), y)\n"
           "(gx,) = torch.autograd.grad(loss, x, create_graph=True)\n"
           "total = loss + 0.1 * gx.pow(2).sum()\ntotal.backward()\nopt.step()\n")
    return ns, src


@workload
def torch_compile():
    torch.manual_seed(0)
    model = _mlp()
    ns, src = _plain(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ns["model"] = torch.compile(model)
    return ns, src


@workload
def flop_counter_mode():
    # A user's own dispatch mode inside the step (PyTorch's FlopCounterMode and its ModuleTracker).
    torch.manual_seed(0)
    model = _mlp()
    ns, _ = _plain(model)
    src = ("from torch.utils.flop_counter import FlopCounterMode\nopt.zero_grad()\n"
           "with FlopCounterMode(display=False) as fc:\n    loss = F.cross_entropy(model(x), y)\n    loss.backward()\n"
           "opt.step()\nflops = fc.get_total_flops()\n")
    return ns, src


class JaggedPool(nn.Module):
    """Variable-length sequences as a nested (jagged) tensor, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, seqs):
        nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
        h = torch.relu(self.proj(nt))
        pooled = torch.stack([t.mean(0) for t in h.unbind()])
        return self.head(pooled)


@workload
def nested_jagged():
    torch.manual_seed(0)
    model = JaggedPool()
    ns = {"F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
          "seqs": [torch.randn(n, 6) for n in (3, 5, 2, 4)], "y": torch.randint(0, 5, (4,))}
    return ns, "opt.zero_grad()\nloss = F.cross_entropy(model(seqs), y)\nloss.backward()\nopt.step()\n"


def bits(t: torch.Tensor) -> tuple:
    """A tensor's exact content (NaN-safe, any dtype, sparse too) for equality."""
    t = t.detach()
    if t.is_nested:
        t = t.to_padded_tensor(0.0)
    elif t.layout != torch.strided:
        t = t.coalesce().to_dense() if t.is_sparse else t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.bool else flat
    return (str(t.dtype), tuple(t.shape), raw.clone())
