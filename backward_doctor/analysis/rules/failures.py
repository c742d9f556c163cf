"""Ops that refused their inputs: device, dtype and shape mismatches, bad indices.

These errors are raised inside the failing op, so the capture holds that op with
its inputs' shapes, dtypes, devices and, for index ops, the offending values.

>>> from backward_doctor.trace import Trace
>>> mismatch(Trace())
[]
"""
from __future__ import annotations

import dataclasses
import re

from ..findings import Finding, at, forward_where, same_exception, sentence, source_line
from ...trace.records import FailedOp, Trace, Where

_DEVICE = re.compile(r"same device|expected device|is not on the expected device|device type|"
                     r"Expected all tensors to be on|found at least two devices", re.I)
_DTYPE = re.compile(r"same dtype|expected scalar type|Found dtype|dtype .* but expected|"
                    r"expected both vectors to have same dtype|must have the same dtype|expected target dtype|"
                    r"dtype to be \w+|dtypes match|same scalar type|self\.dtype to be equal to src\.dtype|"
                    r"only bool and floating types of", re.I)
_SHAPE = re.compile(r"shapes cannot be multiplied|size mismatch|must match the size|The size of tensor|"
                    r"Expected input batch_size|is invalid for input of size|Expected .*D.* input|"
                    r"mat1 and mat2 shapes|doesn't match the broadcast shape|expected input with shape|"
                    r"Expected size for|size of dimension|shape mismatch", re.I)
#: nn.MultiheadAttention's (and nn.Transformer's) own checks of its masks and inputs: most are
#: AssertionErrors raised in Python before any op runs, so only the message says it is a shape.
_ATTENTION = re.compile(r"key_padded_mask\.shape|key_padding_mask|attn_mask|was expecting embedding dimension|"
                        r"not divisible by num_heads|does not match value shape|do not match value's|"
                        r"query should be unbatched 2D or batched 3D", re.I)
#: Ops that write a source tensor into a destination (``out[idx] = v``): the destination keeps its dtype.
_WRITES = ("index_put", "_index_put_impl", "index_copy", "masked_scatter", "scatter", "scatter_add", "index_add")
_INDEX = re.compile(r"index out of range|out of bounds|index .* is out of|device-side assert", re.I)


def _failed_where(trace: Trace) -> tuple[Where, FailedOp | None]:
    failed = trace.failed_op if same_exception(trace) else None
    if failed is None:
        return trace.exception.where, None
    if failed.phase == "backward":
        return forward_where(trace, trace.op(failed.fwd_index)) if failed.fwd_index is not None \
            else failed.where, failed
    return failed.where, failed


def _inputs(failed: FailedOp | None) -> str:
    if failed is None:
        return ""
    return ", ".join(m.short() for m in failed.inputs)


def mismatch(trace: Trace) -> list[Finding]:
    """device_mismatch / dtype_mismatch / shape_mismatch from the failing op."""
    exc = trace.exception
    if exc is None:
        return []
    text = exc.message
    where, failed = _failed_where(trace)
    op = failed.op if failed else None
    what = f"`{op}`" if op else "this operation"
    args = _inputs(failed)
    ev = {"inputs": [m.short() for m in failed.inputs]} if failed else {}
    if _DEVICE.search(text):
        devices = sorted({m.device for m in failed.inputs}) if failed else []
        ev["devices"] = devices
        msg = (f"{what} got tensors on different devices ({', '.join(devices) or 'see error'}): {args}. "
               "Every tensor in one op must live on one device. Move the data (and the target) to the "
               "model's device before the forward pass, e.g. `x = x.to(next(model.parameters()).device)`, "
               "and create new tensors with `device=x.device`.")
        return [at("device_mismatch", where, msg, op=op, title="Tensors on different devices", evidence=ev)]
    if _DTYPE.search(text):
        dtypes = sorted({m.dtype for m in failed.inputs}) if failed else []
        ev["dtypes"] = dtypes
        if _ATTENTION.search(text):
            return [_attention(where, text, "dtype_mismatch", ev)]
        if (op or "").split("::")[-1].rstrip("_") in _WRITES or "Index put" in text:
            return [_write_dtype(trace, where, failed, op, ev)]
        msg = (f"{what} got tensors of different dtypes ({', '.join(dtypes) or 'see error'}): {args}. "
               "PyTorch does not mix float64 data with float32 weights. NumPy arrays become float64 "
               "tensors: convert the data with `x = x.float()` (or `torch.as_tensor(a, dtype=torch.float32)`) "
               "rather than turning the model into float64.")
        return [at("dtype_mismatch", where, msg, op=op, title="Mixed dtypes in one op", evidence=ev)]
    if _ATTENTION.search(text):
        return [_attention(where, text, "shape_mismatch", ev)]
    if _SHAPE.search(text) and not _INDEX.search(text):
        msg = (f"{what} cannot combine these shapes: {args or text}. "
               f"PyTorch said: {sentence(text.splitlines()[0])} Check that the layer's input size matches the "
               "data (for `nn.Linear(in, out)`, the last dimension of the input must equal `in`; "
               "flatten conv features before a Linear), and that prediction and target have the same batch size.")
        return [at("shape_mismatch", where, msg, op=op, title="Shapes do not fit", evidence=ev)]
    return []


def _attention(where: Where, text: str, kind: str, ev: dict) -> Finding:
    """nn.MultiheadAttention refused a mask (or q/k/v) before computing anything."""
    first = text.splitlines()[0].rstrip(".")
    ev["attention_check"] = first
    what = "dtype" if kind == "dtype_mismatch" else "shape"
    module = f"`{where.module}`" if where.module else "the attention module"
    msg = (f"{module} refused its inputs: {first}. The {what} of a mask (or of query/key/value) does not fit "
           "the attention call. `key_padding_mask` must be bool [batch, key length] (True = ignore that key); "
           "`attn_mask` must be [query length, key length] or [batch * num_heads, query length, key length] "
           "(bool, or float added to the scores); with `batch_first=True` the query is [batch, length, embed_dim], "
           "otherwise [length, batch, embed_dim]. Build the mask from the same batch and sequence length as the "
           "keys (after padding/truncation), e.g. `key_padding_mask = tokens == pad_id`.")
    return at(kind, where, msg, title=f"Attention mask {what} does not fit", evidence=ev)


def _write_dtype(trace: Trace, where: Where, failed: FailedOp | None, op: str | None, ev: dict) -> Finding:
    """``out[idx] = values``: an indexed write keeps the destination's dtype and refuses another one."""
    dest = failed.inputs[0].dtype if failed and failed.inputs else "the destination's dtype"
    floats = [m.dtype for m in (failed.inputs[1:] if failed else []) if not m.dtype.startswith(("int", "bool", "uint"))]
    src = floats[-1] if floats else "another dtype"
    code = source_line(trace, where.line, where.file)
    ev.update(destination=dest, source=src, code=code)
    msg = (f"`{code or op or 'an indexed write'}` writes {src} values into a {dest} tensor "
           f"(`{op or 'index_put_'}`). An indexed write (`out[idx] = values`, `index_put_`, `index_copy_`, "
           "`scatter_`) keeps the destination's dtype and does not convert the values. Tensors made from NumPy "
           "float arrays (`torch.from_numpy`, `torch.tensor(array)`) are float64: cast the values, "
           "`out[idx] = values.to(out.dtype)`, or create them as float32.")
    return at("dtype_mismatch", where, msg, op=op, title="Indexed write of another dtype", evidence=ev)


def index_out_of_range(trace: Trace) -> list[Finding]:
    """An index (embedding id, class target, gather index) outside its valid range."""
    exc = trace.exception
    if exc is None or not (exc.type == "IndexError" or _INDEX.search(exc.message)):
        return []
    where, failed = _failed_where(trace)
    check = failed.index_check if failed else None
    op = failed.op if failed else None
    ev: dict = dataclasses.asdict(check) if check else {}
    if check:
        lo, hi = check.valid
        bad = ", ".join(str(b) for b in check.bad)
        msg = (f"`{op}` was given {check.argument} value(s) {bad} ({check.bad_count} in all; "
               f"observed range {check.min}..{check.max}) but only {lo}..{hi} is valid "
               f"({check.what}). ")
    else:
        msg = f"An index was out of range: {sentence(exc.message.splitlines()[0])} "
    if op and "nll_loss" in op:
        msg += ("Class targets must be 0..C-1 for C output classes: a label of C (or -1) means the "
                "last layer has too few outputs or the labels are 1-based. Fix the labels "
                "(`y = y - 1`) or the number of classes in the final layer.")
    elif op and "embedding" in op:
        msg += ("An embedding with num_embeddings=N accepts ids 0..N-1: the vocabulary is larger than "
                "the table. Build the embedding with `nn.Embedding(vocab_size, dim)` from the tokenizer's "
                "vocabulary size, or map unknown ids to an <unk> id.")
    else:
        msg += "Clamp or fix the indices so they stay inside the dimension they index."
    if "device-side assert" in exc.message:
        ev["cuda_context_lost"] = True
        msg += (" On CUDA this is a device-side assert: the CUDA context is now unusable and the kernel "
                "must be restarted. Re-run with fix 'sync' to validate indices before each kernel, or "
                "replay the step on CPU for a readable error.")
    return [at("index_out_of_range", where, msg, op=op, title="Index out of range", evidence=ev,
               fixes=["sync"] if ev.get("cuda_context_lost") else [])]


def generic_exception(trace: Trace) -> list[Finding]:
    """Any other error: say where it came from, with PyTorch's own words."""
    exc = trace.exception
    if exc is None or (exc.type == "KeyboardInterrupt" and not exc.raised):  # (a Ctrl-C: the hang rule's)
        return []
    where, failed = _failed_where(trace)
    first = exc.message.splitlines()[0].strip() if exc.message else ""
    msg = f"The cell raised {exc.type}" + (f": {first}" if first else "")
    if failed is not None:
        msg = sentence(msg) + f" It came from `{failed.op}` with inputs {_inputs(failed)}"
    return [at("exception", where, sentence(msg), op=failed.op if failed else None, title=f"{exc.type} in the step")]
