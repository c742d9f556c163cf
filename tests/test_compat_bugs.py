"""Real bugs injected into the compatibility tier's third-party models: the right kind, line and module.

The models are the tier's (``compat_workloads.py``: Hugging Face models from tiny random configs); each
test breaks one the way users break theirs and runs the tier's training cell under the doctor.
"""
from __future__ import annotations

import torch

import backward_doctor as bd

from compat_workloads import WORKLOADS, _lm_batch


def _hook_line() -> int:
    import inspect

    lines, first = inspect.getsourcelines(scale_attention_output)
    return first + next(i for i, text in enumerate(lines) if "mul_" in text)


def scale_attention_output(module, args, output):
    """A user's hook that rescales, in place, what the QKV projection read (after it read it)."""
    args[0].mul_(0.5)


def test_inplace_write_inside_an_attention_module(engine):
    ns, src = WORKLOADS["hf_gpt2"]()
    ns["model"].transformer.h[1].attn.c_attn.register_forward_hook(scale_attention_output)
    report = bd.diagnose(src, ns, engine=engine)
    assert "modified by an inplace operation" in report.exception
    f = report.findings[0]
    assert (f.kind, f.file, f.line, f.op) == ("inplace", __file__, _hook_line(), "aten::mul_")
    # (a module's own forward hooks run after the doctor's global one has left the module)
    assert f.module in ("model.transformer.h.1.attn.c_attn", "model.transformer.h.1.attn")


def test_token_id_past_the_vocabulary(engine):
    ns, src = WORKLOADS["hf_gpt2"]()
    ns["batch"]["input_ids"][1, 3] = 97  # vocab_size is 97: ids go up to 96
    report = bd.diagnose(src, ns, engine=engine)
    f = report.findings[0]
    assert (f.kind, f.line, f.module) == ("index_out_of_range", 2, "model.transformer.wte")
    assert "97" in f.message


def test_nan_in_a_batch_of_images(engine):
    ns, src = WORKLOADS["hf_vit"]()
    ns["batch"]["pixel_values"][1, 0, 5, 5] = float("nan")
    report = bd.diagnose(src, ns, engine=engine)
    assert report.exception is None
    f = report.findings[0]
    assert (f.kind, f.line) == ("nonfinite", 2)
    assert f.evidence.get("variable") == "batch['pixel_values']"
    assert f.module is not None and f.module.startswith("model.vit.embeddings")


def test_out_of_memory_under_a_simulated_device():
    ns, src = WORKLOADS["hf_llama"]()
    ns["batch"] = _lm_batch(101, b=16, t=32)  # activations ~2.9 MB at the peak, parameters 100 KB
    report = bd.diagnose(src, ns, memory_limit="600KB")
    assert "OutOfMemoryError" in report.exception
    f = report.findings[0]
    assert (f.kind, f.line) == ("oom", 2)
    assert f.module.startswith("model.model.layers.0")
    assert {"accumulate", "checkpoint"} <= set(f.fixes)
