"""``loss_on_probabilities``: a loss fed the wrong kind of score. Nothing raises; the model trains badly.

PyTorch's classification losses each expect one kind of input, and nothing checks which one they got:

- ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` and ``binary_cross_entropy_with_logits`` take *logits* and
  apply (log_)softmax / sigmoid themselves: fed a ``softmax``/``sigmoid`` output, the model is trained through
  two of them (a double softmax), its scores squeezed into [0, 1], the loss bounded away from 0;
- ``F.nll_loss`` takes *log-probabilities* (``log_softmax``'s output): fed probabilities (``softmax`` without
  the log) or raw logits, it minimises minus the score itself, unbounded for logits;
- ``F.binary_cross_entropy`` takes *probabilities* (a ``sigmoid``'s output): fed a layer's raw output.

The rule reads the recorded op chain that made the loss's input: each forward op's outputs are linked to
later inputs by storage key (``OpRecord.out_keys``/``in_keys``); views keep the key, and copies that keep the
values (``clone``, a dtype cast, ``index``) pass their input's origin on. Only losses that a ``backward()``
started from are read, and only known origins answer: a ``softmax`` (or ``sigmoid``) directly under a loss
that applies its own, or a layer (``addmm``, a convolution) directly under one that needs a log or a sigmoid.
A softmax used for something else (attention) reaches the loss through other layers and says nothing.

The finding is placed where the fix goes: at the ``softmax``/``sigmoid`` line when that is the mistake,
at the loss line when the loss is the wrong one; the fix is that line rewritten (``loss_fixes.py``).

>>> from backward_doctor.trace import Trace
>>> loss_on_probabilities(Trace())
[]
"""
from __future__ import annotations

import math
import os

from ..findings import Finding, at, code_at, looped
from ...trace.records import OpRecord, Trace, Where
from .flow import graph_ops, loss_roots
from .loss_fixes import loss_line_fix, prob_line_fix

#: ops that turn scores into probabilities (the in-place ``sigmoid_`` counts as ``sigmoid``)
_PROBABILITY = {"aten::_softmax": "softmax", "aten::softmax": "softmax", "aten::sigmoid": "sigmoid"}
#: a layer's raw output: what a model's last ``nn.Linear``/convolution makes (logits)
_LAYER = {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
          "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution", "aten::_slow_conv2d_forward",
          "aten::thnn_conv2d", "aten::cudnn_convolution", "aten::slow_conv3d_forward"}
#: copies whose values are their (first) input's: the origin is passed on
_SAME_VALUES = {"aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to", "aten::_unsafe_view",
                "aten::reshape", "aten::index", "aten::index_select", "aten::masked_select", "aten::flatten"}
#: in-place ops that do not change a tensor's values (everything else ending in ``_`` writes new values)
_KEEP_VALUES = {"aten::detach_", "aten::requires_grad_", "aten::t_", "aten::transpose_", "aten::squeeze_",
                "aten::unsqueeze_", "aten::as_strided_", "aten::resize_"}
_NLL = {"aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::nll_loss", "aten::nll_loss2d",
        "aten::nll_loss_nd"}
_LOG_SOFTMAX = {"aten::_log_softmax", "aten::log_softmax"}
_BCE_LOGITS = "aten::binary_cross_entropy_with_logits"
_BCE = "aten::binary_cross_entropy"

_TITLES = {
    "double_softmax": "Loss applies softmax to probabilities",
    "double_sigmoid": "Loss applies sigmoid to probabilities",
    "nll_on_probabilities": "nll_loss on probabilities (no log)",
    "nll_on_logits": "nll_loss on raw logits",
    "bce_on_logits": "binary_cross_entropy on raw logits",
}


def _candidates(trace: Trace) -> list[tuple[str, OpRecord, OpRecord]]:
    """(problem, the loss's op, the op its input's values came from) for every loss op fed a known wrong
    kind of input, in the order they ran."""
    origin: dict[int, int] = {}  # storage key -> index of the op whose values it holds now
    found: list[tuple[str, OpRecord, OpRecord]] = []
    for op in trace.ops:
        if op.phase != "forward":
            continue
        src = trace.op(origin.get(op.in_keys[0])) if op.in_keys and op.in_keys[0] else None
        if src is not None:
            made = _PROBABILITY.get(src.op.rstrip("_"))
            if op.op in _LOG_SOFTMAX and made:
                found.append(("double_softmax", op, src))
            elif op.op == _BCE_LOGITS and made:
                found.append(("double_sigmoid", op, src))
            elif op.op in _NLL and made:
                found.append(("nll_on_probabilities", op, src))
            elif op.op in _NLL and src.op in _LAYER:
                found.append(("nll_on_logits", op, src))
            elif op.op == _BCE and src.op in _LAYER:
                found.append(("bce_on_logits", op, src))
        _advance(origin, op)
    return found


def _advance(origin: dict[int, int], op: OpRecord) -> None:
    """Record which values ``op``'s outputs hold: a view changes nothing (same key), a copy keeps its input's
    origin, an in-place write or a new tensor is its own origin."""
    inplace = op.op.endswith("_")
    if op.op == "aten::copy_" and len(op.in_keys) > 1:
        if op.in_keys[0] and op.in_keys[1] in origin:
            origin[op.in_keys[0]] = origin[op.in_keys[1]]
        return
    for k in op.out_keys:
        if not k:
            continue
        if k in op.in_keys and (not inplace or op.op in _KEEP_VALUES):
            continue  # a view of its input (``view``, ``t``, ``detach``): the same values
        if op.op in _SAME_VALUES and op.in_keys and op.in_keys[0] in origin:
            origin[k] = origin[op.in_keys[0]]
        else:
            origin[k] = op.index


def _line_ref(where: Where) -> str:
    """``line 3`` in the cell, ``models.py:12`` in a file."""
    if where.file is None:
        return f"line {where.line}"
    return f"`{os.path.basename(where.file)}:{where.line}`"


def _said(trace: Trace, where: Where, unless: str = "") -> str:
    """``line 2 (`out = model(x)`, in `model.3`)``: the place, its code, and the module it ran in unless the
    code itself says ``unless`` (a ``softmax`` called on that line is no module's)."""
    code = code_at(trace, where.line, where.file)
    place = _line_ref(where)
    if where.module and not (unless and unless in code.lower()):
        return f"{place} (`{code}`, in `{where.module}`)" if code else f"`{where.module}` at {place}"
    return f"{place} (`{code}`)" if code else place


def _layer(src: OpRecord) -> str:
    """A layer op in words: ``a linear layer (`aten::addmm`)``."""
    what = "a convolution" if "conv" in src.op else "a linear layer"
    return f"{what} (`{src.op}`)"


def _classes(src: OpRecord) -> int | None:
    shape = src.outputs[0].shape if src.outputs else []
    return shape[-1] if len(shape) >= 2 and shape[-1] > 1 else None


def _message(trace: Trace, problem: str, loss: OpRecord, src: OpRecord) -> tuple[str, Where]:
    """The finding's message in the user's terms, and where it goes."""
    made = _PROBABILITY.get(src.op.rstrip("_"), "softmax")
    at_src, at_loss = _said(trace, src.where, made), _said(trace, loss.where, "loss")
    if problem == "double_softmax":
        n = _classes(src)
        floor = (f": with {n} classes it can never go below {math.log1p((n - 1) / math.e):.2f}, however right "
                 "the model is," if n else ",")
        how = "turns the model's scores into probabilities" if made == "softmax" else "squashes the scores into (0, 1)"
        return (f"{at_src} {how}, and the loss at {at_loss} applies log_softmax to them again: cross_entropy "
                f"expects raw logits (it is log_softmax + nll_loss), so the model is trained through a double "
                f"softmax. Probabilities only span [0, 1], so the loss sees nearly equal scores{floor} and the "
                "gradients shrink as the model gets confident, so it trains slowly and plateaus. Nothing raises. "
                f"Give the loss the logits, and apply {made} only where you need probabilities (predictions, "
                "metrics)."), src.where
    if problem == "double_sigmoid":
        return (f"{at_src} applies {made}, and the loss at {at_loss} applies a sigmoid to that again: "
                "binary_cross_entropy_with_logits expects raw logits. Whatever the model says, its predicted "
                "probability stays between 0.5 and 0.73: a negative can never be predicted, the loss never goes "
                "below 0.31 and the gradients are small. Nothing raises. Give the loss the logits (or keep "
                f"the {made} and use `F.binary_cross_entropy`)."), src.where
    if problem == "nll_on_probabilities":
        return (f"{at_src} makes probabilities, and the loss at {at_loss} is nll_loss, which expects "
                "log-probabilities: it minimises minus the probability of the right class instead of minus its "
                "log, so a confidently wrong answer costs at most 1 and its gradient vanishes where it should be "
                "largest. Nothing raises. Use `log_softmax` where the softmax is (or `F.cross_entropy` on the "
                "logits)."), src.where
    same = (src.where.file, src.where.line) == (loss.where.file, loss.where.line)
    made_by = _layer(src) + (" on the same line" + (f" (in `{src.where.module}`)" if src.where.module else "")
                             if same else f" at {_said(trace, src.where)}")
    if problem == "nll_on_logits":
        return (f"The loss at {at_loss} is nll_loss on raw scores: {made_by} made them, with no log_softmax in "
                "between. nll_loss only picks minus the right class's score, so the loss falls forever by "
                "inflating that score (it goes negative) and nothing pushes the other classes down. Nothing "
                "raises. Use `F.cross_entropy` on the logits (it applies log_softmax), or `F.log_softmax` before "
                "nll_loss."), loss.where
    return (f"The loss at {at_loss} is binary_cross_entropy on raw scores: {made_by} made them, with no sigmoid "
            "in between, and it expects probabilities. It raises only once a score leaves [0, 1]; until then it "
            "trains on a wrong loss. Use `F.binary_cross_entropy_with_logits` on the logits (numerically safer "
            "than a sigmoid + BCE)."), loss.where


def loss_on_probabilities(trace: Trace) -> list[Finding]:
    """Losses fed probabilities where they take logits (and the mirror mistakes), one finding per place."""
    found = _candidates(trace)
    if not found:
        return []
    feeding: set[int] = set()
    for root in loss_roots(trace):  # only losses a backward() started from: what the model trains on
        feeding |= graph_ops(trace, root)
    out: list[Finding] = []
    seen: set[tuple[str, str | None, int | None]] = set()
    for problem, loss, src in found:
        if loss.index not in feeding:
            continue
        msg, where = _message(trace, problem, loss, src)
        if (problem, where.file, where.line) in seen:
            continue  # the same mistake in every iteration: named once, in the first
        seen.add((problem, where.file, where.line))
        placed_at = src if where is src.where else loss
        if problem in ("nll_on_logits", "bce_on_logits"):
            fix = loss_line_fix(code_at(trace, loss.where.line, loss.where.file), problem)
        else:
            fix = prob_line_fix(code_at(trace, src.where.line, src.where.file), problem, src.where.module)
        msg = msg[0].upper() + msg[1:] + (f" Fix: `{fix}`." if fix else "")
        its = trace.iterations
        iteration = None
        if where.cell_line is None and its.library:  # (a library's loop: no line of the cell to place it by)
            iteration = looped(trace, its.iteration_of(placed_at.index))
        out.append(at("loss_on_probabilities", where, msg, op=placed_at.op, title=_TITLES[problem],
                      iteration=iteration,
                      evidence={"problem": problem, "op_index": placed_at.index, "loss_op": loss.op,
                                "loss_line": loss.where.line, "loss_file": loss.where.file,
                                "source_op": src.op, "source_line": src.where.line, "source_file": src.where.file,
                                "input": src.outputs[0].short() if src.outputs else "", "fix_code": fix}))
    return out


__all__ = ["loss_on_probabilities"]
