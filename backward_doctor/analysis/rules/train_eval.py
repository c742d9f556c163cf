"""``train_eval_mode``: a model switched the wrong way for what it ran. Nothing raises; the numbers are wrong.

- **Evaluated in training mode**: a forward under ``torch.no_grad()`` whose output feeds no loss that a
  ``backward()`` started from (an evaluation, a metric) on a model still in ``train()`` mode with dropout
  (p > 0) or batch norm: dropout drops units at random, batch norm normalises with the batch's own statistics and
  updates its running mean and variance from the evaluation data. A no-grad forward that feeds a loss (a GAN's
  fakes, a target network, a momentum encoder) is part of training and says nothing.
- **Trained in eval mode**: the forward that fed the last ``backward()`` before an ``optimizer.step()`` ran on a
  model in ``eval()`` mode (its own ``training`` flag off, as ``model.eval()`` leaves it) with dropout or batch
  norm: no dropout, frozen batch-norm statistics. Freezing batch norm on purpose (``model.train()`` then the
  norm layers' ``eval()``) leaves the model's own flag on and says nothing; neither does an adversarial attack's
  backward in eval mode before the training one.

Read from ``trace.module_modes`` (``capture/recorder/module_modes.py``: each model's flags at its first calls, with the op
range of that forward) and which forward ops the losses were computed from (storage keys, as ``flow.graph_ops``).

>>> from backward_doctor.trace import Trace
>>> train_eval_mode(Trace())
[]
"""
from __future__ import annotations

import ast
import re

from ..findings import Finding, at, code_at
from ...trace.records import ModuleMode, Trace

_TITLES = {"eval_in_train_mode": "Evaluation ran in training mode", "train_in_eval_mode": "Training ran in eval mode"}


def reaching(trace: Trace, roots: set[int]) -> set[int]:
    """The forward ops whose values the ops ``roots`` were computed from (``roots`` included), in one pass
    (``flow.graph_ops`` for many roots at once: a view or an in-place op does not become a key's producer).

    >>> from backward_doctor.trace.records import OpRecord, Where
    >>> ops = [OpRecord(i, "aten::mul", "forward", [], [], Where(), in_keys=ins, out_keys=[10 + i])
    ...        for i, ins in enumerate([[1], [2], [10]])]
    >>> sorted(reaching(Trace(ops=ops), {2}))
    [0, 2]
    """
    if not roots:
        return set()
    producer: dict[int, int] = {}
    feeds: dict[int, list[int]] = {}
    for op in trace.ops:
        if op.phase != "forward":  # a gradient written into a freed activation's storage is no forward value
            for k in op.out_keys:
                if k not in op.in_keys:
                    producer.pop(k, None)
            continue
        feeds[op.index] = [producer[k] for k in op.in_keys if k in producer]
        for k in op.out_keys:
            if k and k not in op.in_keys:
                producer[k] = op.index
    seen: set[int] = set()
    todo = [r for r in roots if r in feeds]
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(feeds[i])
    return seen


def _backwards(trace: Trace) -> list[tuple[int, int]]:
    """(first op index, the loss's forward op) of each ``backward()`` call recorded."""
    out, previous = [], "forward"
    for op in trace.ops:
        if op.phase == "backward" and previous != "backward" and op.fwd_index is not None:
            out.append((op.index, op.fwd_index))
        previous = op.phase
    return out


def _stepping_roots(trace: Trace, calls: list[tuple[int, int]]) -> set[int]:
    """The loss of the last ``backward()`` of each recorded iteration that stepped an optimizer: what the
    step's gradients came from (an attack's or a probe's backward before it did not feed the step)."""
    bounds = sorted(set(trace.iterations.starts)) or [0]
    bounds = bounds + [max(trace.ops[-1].index + 1 if trace.ops else 0, bounds[-1] + 1)]
    steps = [s.index for s in trace.optimizer_steps]
    roots = set()
    for lo, hi in zip(bounds, bounds[1:]):
        inside = [root for start, root in calls if lo <= start < hi]
        if inside and any(lo <= s < hi for s in steps):
            roots.add(inside[-1])
    return roots


def _ran(trace: Trace, rec: ModuleMode) -> set[int]:
    """The recorded forward ops of that call."""
    return {i for i in range(rec.start, rec.end) if (op := trace.op(i)) is not None and op.phase == "forward"}


def _parts(rec: ModuleMode, training: bool) -> str:
    """``its 1 dropout module(s) and 2 batch-norm module(s)`` in that mode."""
    d = rec.dropout_active if training else rec.dropout - rec.dropout_active
    b = rec.batchnorm_training if training else rec.batchnorm - rec.batchnorm_training
    said = [f"{d} dropout module(s)"] * bool(d) + [f"{b} batch-norm module(s)"] * bool(b)
    return " and ".join(said)


def _no_grad_block(source: str, line: int) -> tuple[int, str] | None:
    """(line, header) of the innermost ``with torch.no_grad()``/``inference_mode()`` around ``line``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and node.lineno < line <= (node.end_lineno or node.lineno) and \
                any(re.search(r"no_grad|inference_mode", ast.unparse(i.context_expr)) for i in node.items):
            if best is None or node.lineno > best.lineno:
                best = node
    return None if best is None else (best.lineno, source.splitlines()[best.lineno - 1])


def _eval_fix(trace: Trace, rec: ModuleMode, name: str) -> str:
    """``model.eval()`` before the no-grad block (or the line), ``model.train()`` after it when training goes on."""
    w = rec.where
    code = code_at(trace, w.line, w.file)
    block = _no_grad_block(trace.source, w.line) if w.file is None and w.line else None
    back = f"\n{name}.train()  # back to training mode before the next step" if trace.optimizer_steps else ""
    head = f"{name}.eval()  # dropout off, batch norm on its running statistics\n"
    if block is not None:
        return f"{head}{block[1].strip()}\n    {code}{back}"
    return f"{head}{code}{back}"


def _eval_line(source: str, name: str) -> int | None:
    """The cell's line that calls ``name.eval()`` (the switch never undone), if it has one."""
    for i, text in enumerate(source.splitlines(), 1):
        if re.search(rf"\b{re.escape(name)}\.eval\(\)", text):
            return i
    return None


def _finding(trace: Trace, problem: str, rec: ModuleMode, ops: set[int]) -> Finding:
    name = rec.module
    w = rec.where
    code = code_at(trace, w.line, w.file)
    place = f"line {w.line}" if w.file is None else f"`{w.file.rsplit('/', 1)[-1]}:{w.line}`"
    said = f"{place} (`{code}`)" if code else place
    if problem == "eval_in_train_mode":
        msg = (f"`{name}` was evaluated in training mode: {said} ran it under `torch.no_grad()` and its output fed "
               f"no loss, while {_parts(rec, True)} were in training mode. Dropout still drops units at random, so "
               "the outputs and the metrics are noisy and worse than the model really is; batch norm normalises "
               "with each evaluation batch's own statistics and updates its running mean and variance from the "
               f"evaluation data, which changes the model training goes on with. Nothing raises. Call "
               f"`{name}.eval()` before evaluating" + (f" and `{name}.train()` after it." if trace.optimizer_steps
                                                       else "."))
        fix = _eval_fix(trace, rec, name)
    else:
        line = _eval_line(trace.source, name)
        since = f"`{name}.eval()` at line {line} was never undone by `{name}.train()`" if line is not None else \
            f"`{name}` was left in `eval()` mode"
        msg = (f"`{name}` trained in eval mode: {said} ran the forward that `backward()` and `optimizer.step()` "
               f"used, with {_parts(rec, False)} in eval mode ({since}). Dropout is off, so the model trains "
               "without the regularisation it was built with, and batch norm normalises with frozen running "
               "statistics that no longer follow the weights. Nothing raises. Call "
               f"`{name}.train()` at the start of each training epoch (after any evaluation).")
        fix = f"{name}.train()  # dropout and batch norm back in training mode\n{code}"
    first = min(ops)
    return at("train_eval_mode", w, msg, severity="warning", title=_TITLES[problem],
              evidence={"problem": problem, "module": name, "op_index": first, "training": rec.training,
                        "grad_enabled": rec.grad_enabled, "dropout": rec.dropout, "dropout_active": rec.dropout_active,
                        "batchnorm": rec.batchnorm, "batchnorm_training": rec.batchnorm_training,
                        "steps_before": rec.iteration, "fix_code": fix})


def train_eval_mode(trace: Trace) -> list[Finding]:
    """Evaluations in training mode and training steps in eval mode, one finding per model and mistake."""
    modes = trace.module_modes
    if not modes:
        return []
    calls = _backwards(trace)
    fed: set[int] | None = None
    stepped: set[int] | None = None
    out: list[Finding] = []
    seen: set[tuple[str, str]] = set()
    for rec in modes:
        evaluating = not rec.grad_enabled and rec.training and (rec.dropout_active or rec.batchnorm_training)
        frozen = rec.grad_enabled and not rec.training and trace.optimizer_steps and \
            (rec.dropout > rec.dropout_active or rec.batchnorm > rec.batchnorm_training)
        if not evaluating and not frozen:
            continue
        problem = "eval_in_train_mode" if evaluating else "train_in_eval_mode"
        ops = _ran(trace, rec)
        if not ops or (problem, rec.module) in seen:
            continue  # (its forward was not recorded: nothing to tell where its output went)
        if evaluating:
            if "update_bn" in code_at(trace, rec.where.line, rec.where.file):
                continue  # ``swa_utils.update_bn`` recomputes batch-norm statistics on purpose, in train mode
            fed = reaching(trace, {root for _, root in calls}) if fed is None else fed
            if ops & fed:
                continue  # its output fed a loss: a no-grad part of training (fakes, targets), not an evaluation
        else:
            stepped = reaching(trace, _stepping_roots(trace, calls)) if stepped is None else stepped
            if not ops & stepped:
                continue  # no optimizer step used it (an attack's or a probe's backward)
        seen.add((problem, rec.module))
        out.append(_finding(trace, problem, rec, ops))
    return out


__all__ = ["reaching", "train_eval_mode"]
