"""Silent training bugs: nothing raises, the step just trains wrong.

Each rule reads one run's trace (plus the cell's history copied into it) and
must stay silent on correct code: legitimate accumulation, frozen layers, a GAN
discriminator step on ``fake.detach()``, truncated BPTT, evaluation under
``no_grad`` after the step, ``-inf`` masks, bf16 autocast.

>>> from backward_doctor.trace import Trace
>>> graph_leak(Trace()) + stale_grad(Trace()) + detached(Trace()) + broadcast(Trace()) + amp_skipped(Trace())
[]
"""
from __future__ import annotations

import math
import os

from ..findings import Finding, at, source_line
from ...util.stores import function_at, store_line
from ...trace.queries import sharded_by_fsdp, skipped_amp_steps
from ...trace.parts import GraphHolder
from ...trace.records import OpRecord, Trace, Where
from ...util.units import format_bytes
from .amp import collapsed
from .autograd import _data_site, _user_detach
from .flow import differentiable, joins_graph, loss_roots
from .keep_fix import detached_statement
from .params import orphans

_LOSS_OPS = {"aten::mse_loss", "aten::l1_loss", "aten::smooth_l1_loss", "aten::huber_loss",
             "aten::binary_cross_entropy", "aten::binary_cross_entropy_with_logits", "aten::soft_margin_loss"}
_ELEMENTWISE = {"aten::sub", "aten::add", "aten::mul", "aten::div", "aten::rsub", "aten::sub_", "aten::add_"}


def _root(path: str) -> str:
    for sep in ("[", "."):
        path = path.split(sep, 1)[0]
    return path


def _code(trace: Trace, line: int | None, file: str | None) -> str:
    """A source line for a message: without its trailing comment."""
    return source_line(trace, line, file).split("  #")[0].split(" # ")[0].strip()


def holder_place(trace: Trace, holder: GraphHolder) -> tuple[str, Where]:
    """The variable a graph holder hangs from, and the line that stores it there: in a module's class or
    a closure's function, else the cell's line assigning or appending to the variable (else the op
    that made it, when this run did). Shared by the leaks across runs and across a loop's iterations."""
    var = _root(holder.path)
    # (an object's: a ``Trainer`` subclass's ``self.seen``, else the cell's ``runner.seen.append(...)`` below)
    if holder.store in ("module", "closure") or (holder.store == "object" and holder.store_line is not None):
        function = function_at(holder.store_file, holder.store_line) if holder.store_file and holder.store_line \
            else None
        return var, Where(line=holder.store_line, file=holder.store_file, module=holder.module, function=function)
    line = store_line(trace.source, [*holder.target[0].split("."), *holder.target[1:]] if holder.target else [var])
    if line is not None:
        return var, Where(line=line, cell_line=line)
    if holder.own_run == trace.run_id and holder.own_index is not None:
        rec = trace.op(holder.own_index)
        if rec is not None:
            return var, rec.where
    return var, Where()


def keeping_code(trace: Trace, where: Where, scalar: bool | None) -> str | None:
    """The storing line rewritten to keep a number or a detached tensor (the finding's ``fix_code``), or None."""
    code = _code(trace, where.line, where.file)
    return detached_statement(code, scalar) if scalar is not None and code else None


def keeping_fix(trace: Trace, where: Where, var: str, store: str, scalar: bool | None = None) -> str:
    """What to store instead, from the storing line: that line rewritten when it stores one value (``.item()``
    for a scalar, else ``.detach()``), else a number for an accumulation, ``.item()`` or ``.detach()`` for an
    append."""
    code = _code(trace, where.line, where.file)
    fixed = keeping_code(trace, where, scalar)
    if fixed is not None:
        return f"`{fixed}`" + (" (or `.detach()` if you need the tensor)" if scalar
                                else " (or `.item()` for a number you only log)")
    if "+=" in code or ("=" in code and var in code.split("=", 1)[-1] and store == "cell"):
        return f"accumulate a number: `{var} += loss.item()`"
    if ".append(" in code or ".extend(" in code:
        return "append a number: `.append(loss.item())`, or `.detach()` if you need the tensor"
    return "store `.detach()` (or `.item()` for a number) instead of the tensor itself"


def graph_leak(trace: Trace) -> list[Finding]:
    """Tensors from earlier runs, graph and all, still reachable from the namespace."""
    if trace.exception is not None:
        return []  # a failed run may never reach the line that rebinds a variable: no verdict on leaks
    leaks = [h for h in trace.graph_holders if h.earlier_runs]
    if not leaks:
        return []
    first = leaks[0]
    var, where = holder_place(trace, first)
    nbytes = sum(h.bytes + h.graph_bytes for h in leaks)
    runs = sorted({r for h in leaks for r in h.earlier_runs})
    series = trace.history.live_bytes_end
    growth = ""
    if len(series) >= 2 and series[-1] > series[0]:
        growth = (" Live memory at the end of the step grew run after run: "
                  + " -> ".join(format_bytes(b) for b in series[-4:]) + ".")
    fix = keeping_fix(trace, where, var, first.store, scalar=not first.shape)
    paths = ", ".join(f"`{h.path}`" for h in leaks[:4]) + (" ..." if len(leaks) > 4 else "")
    msg = (f"`{var}` keeps tensors that still carry the autograd graph of {len(runs)} earlier run(s) of this "
           f"step ({paths}): {format_bytes(nbytes)} kept alive, tensors and the activations their graphs saved. "
           f"Every run adds one more, so memory creeps up until it runs out.{growth} Fix: {fix}.")
    return [at("graph_leak", where, msg, severity="warning", title="Graphs of earlier steps kept alive",
               evidence={"variable": var, "holders": [h.path for h in leaks], "bytes": nbytes,
                         "graphs": len(runs), "live_bytes_end": series,
                         **_fix_code(keeping_code(trace, where, not first.shape))})]


def _fix_code(code: str | None) -> dict[str, str]:
    return {"fix_code": code} if code else {}


def stale_grad(trace: Trace) -> list[Finding]:
    """optimizer.step() on gradients that an earlier step already used: zero_grad() is missing."""
    out = []
    for s in trace.stale_steps[:1]:
        where = Where(line=s.line, file=s.file, cell_line=s.cell_line, function=s.function)
        code = _code(trace, where.line, where.file)
        earlier = "iteration of this loop" if s.since_run == trace.run_id else "run"
        msg = (f"`{code or 'optimizer.step()'}` used gradients that still contain the gradients of an earlier "
               f"{earlier} ({s.params} parameters): `zero_grad()` was never called since the previous step, so "
               "backward() keeps adding into `.grad` and every step follows the sum of all past gradients - "
               "gradient accumulation by accident. Call `optimizer.zero_grad()` at the start of the step "
               "(before `loss.backward()`), or right after `optimizer.step()`.")
        out.append(at("stale_grad", where, msg, title="Gradients were never zeroed", severity="error",
                      evidence={"parameters": s.params, "since_run": s.since_run, "op_index": s.index}))
    return out


def _cut_from(trace: Trace, keys: set[int]) -> tuple[OpRecord, str] | None:
    """Follow the data flowing out of ``keys`` forward to where it stops requiring grad."""
    derived = set(keys)
    nondiff = None
    for op in trace.ops:
        if op.phase != "forward":
            continue
        hits = [(k, m) for k, m in zip(op.in_keys, op.inputs) if k in derived]
        if not hits:
            derived.difference_update(k for k in op.out_keys if k not in keys)  # key reused by a new tensor
            continue
        if not op.grad_enabled and any(k in keys and k not in op.out_keys for k, _ in hits):
            # (an op writing into the parameter itself under no_grad, ``nn.init``'s ``uniform_`` in a model the
            # cell builds, is its initialisation, not a use whose output was cut off)
            return op, "no_grad"
        if op.op == "aten::_local_scalar_dense":
            return op, "item"
        for k, m in hits:
            if not m.requires_grad and k not in keys:
                detach = _user_detach(trace, k, op.index, None)
                if detach is not None and ".data" not in _code(trace, detach.where.line, detach.where.file):
                    return detach, "detach"
                return (detach or _data_site(trace, k, op)), "data"
        if op.grad_enabled and op.op not in ("aten::detach", "aten::alias"):
            # Integer/bool results (argmax, comparisons) have no gradient by nature: not followed further.
            derived.update(k for k, m in zip(op.out_keys, op.outputs) if k and differentiable(m.dtype))
            if nondiff is None and op.outputs and any(m.requires_grad for _, m in hits) \
                    and not any(differentiable(m.dtype) for m in op.outputs):
                nondiff = op
    # Such a result used as a metric is fine; one that flows on into the loss (``argmax().float()`` in an
    # MSE) is where these parameters were cut off, when nothing else cut them.
    if nondiff is not None and joins_graph(trace, nondiff):
        return nondiff, "nondiff"
    return None


def detached(trace: Trace) -> list[Finding]:
    """Trainable parameters the forward used that got no gradient: the graph was cut."""
    if not any(p.got_grad for p in trace.params):
        return []  # no backward reached any parameter: not this rule's case
    if sharded_by_fsdp(trace):
        # FSDP2 reads every sharded parameter under no_grad (to shard it, to all-gather it) and the forward uses
        # the unsharded copy: a cut cannot be told from its machinery here (an output that never reaches the
        # loss stays silent, as it does without FSDP).
        return []
    used = {k for op in trace.ops if op.phase == "forward" for k in op.in_keys}
    replaced = {id(p) for p in orphans(trace)[0]}  # orphan_params explains those: no module uses them
    starved = [p for p in trace.params if p.requires_grad and p.stepped and not p.got_grad and p.key in used
               and id(p) not in replaced]
    if not starved:
        return []
    found = _cut_from(trace, {p.key for p in starved})
    if found is None:
        return []  # used but never led to the loss, with no cut in sight: stay silent
    op, how = found
    names = [p.name for p in starved]
    parts = [n.split(".") for n in names]
    common = os.path.commonprefix(parts)
    module = ".".join(common if len(names) > 1 else common[:-1]) or None
    code = _code(trace, op.where.line, op.where.file)
    how_text = {"no_grad": "runs it under `torch.no_grad()`", "item": "turns its output into a Python number",
                "detach": "detaches its output (`.detach()` / `.numpy()`)", "data": "uses `.data`",
                "nondiff": "turns its output into integers (`argmax`, a comparison), which have no gradient"}[how]
    count = sum(p.numel for p in starved)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    msg = (f"{len(names)} trainable parameter tensor(s) ({count:,} values: {shown}) took part in the forward pass "
           f"but got no gradient, so the optimizer never updates them: line {op.where.line} (`{code}`) {how_text}, "
           "which cuts the graph between them and the loss. Remove the cut (keep `.detach()`/`no_grad` for "
           "logging and evaluation), or freeze them on purpose with `requires_grad_(False)`.")
    where = Where(line=op.where.line, file=op.where.file, cell_line=op.where.cell_line, module=module,
                  function=op.where.function)
    return [at("detached", where, msg, op=op.op, title="Parameters starved of gradient",
               evidence={"parameters": names, "cut": how, "values": count, "op_index": op.index})]


_TOWARD_LOSS = {"aten::pow", "aten::abs", "aten::mean", "aten::sum", "aten::mul", "aten::div", "aten::sqrt",
                "aten::neg", "aten::square", "aten::smooth_l1_loss", "aten::huber_loss", "aten::mse_loss",
                "aten::l1_loss", "aten::add", "aten::sub", "aten::clamp", "aten::log", "aten::exp"}


def _feeds_loss(trace: Trace, op: OpRecord, roots: set[int]) -> bool:
    """``op``'s result reaches a backward root through loss arithmetic only (no layer in between)."""
    if op.index in roots:
        return True
    frontier = {k for k in op.out_keys if k}
    for later in trace.ops:
        if later.index <= op.index or later.phase != "forward":
            continue
        if later.index - op.index > 12:  # a loss is computed right after the comparison
            break
        if frontier & set(later.in_keys):
            if later.index in roots:
                return True
            if later.op in _TOWARD_LOSS:
                frontier |= {k for k in later.out_keys if k}
                continue
        frontier -= set(later.out_keys)  # a freed storage's key reused by an unrelated tensor
    return False


def _original_shape(trace: Trace, i: int, k: int) -> list[int] | None:
    """Shape of input ``k`` of op ``i`` before a broadcasting ``aten::expand`` just before it."""
    op = trace.ops[i]
    key, meta = op.in_keys[k], op.inputs[k]
    for prev in reversed(trace.ops[max(0, i - 3):i]):
        if prev.op == "aten::expand" and prev.out_keys and prev.out_keys[0] == key \
                and prev.outputs[0].shape == meta.shape:
            return prev.inputs[0].shape  # an expand is a view: same storage as what it expanded
    return meta.shape


def broadcast(trace: Trace) -> list[Finding]:
    """A loss whose prediction and target broadcast to a bigger shape than either."""
    roots = loss_roots(trace)  # the forward op behind each backward() call's first node: the loss
    for i, op in enumerate(trace.ops):
        if op.phase != "forward" or len(op.inputs) != 2 or not op.outputs:
            continue
        if op.op not in _LOSS_OPS and op.op not in _ELEMENTWISE:
            continue
        a, b = op.inputs
        sa, sb = _original_shape(trace, i, 0), _original_shape(trace, i, 1)
        if sa == sb:
            continue
        out = op.outputs[0].shape if op.op in _ELEMENTWISE else a.shape
        if math.prod(out) <= max(math.prod(sa), math.prod(sb)) or a.requires_grad == b.requires_grad:
            continue  # ordinary broadcasting (a bias, a mask), or not prediction vs target
        if not _feeds_loss(trace, op, roots):
            continue  # e.g. pairwise distances inside a layer
        pred, target = (sa, sb) if a.requires_grad else (sb, sa)
        msg = (f"The loss compares a prediction of shape {list(pred)} with a target of shape {list(target)}; "
               f"they broadcast to {list(out)}, so every prediction is compared with every target. The loss "
               "is wrong but raises nothing. Make the shapes equal: `pred.squeeze(-1)` or "
               "`target.view_as(pred)`.")
        return [at("broadcast", op.where, msg, op=op.op, title="Prediction and target broadcast",
                   evidence={"prediction": list(pred), "target": list(target), "broadcast": list(out)})]
    return []


def amp_skipped(trace: Trace) -> list[Finding]:
    """Informational: GradScaler skipped optimizer.step() because gradients were inf/NaN."""
    skipped = skipped_amp_steps(trace)
    if not skipped or collapsed(trace):  # a scale that keeps falling is amp_misuse's (rules/amp.py)
        return []
    total = sum(trace.history.amp_skipped) or len(skipped)
    where = skipped[0].where
    msg = (f"GradScaler skipped `optimizer.step()` ({len(skipped)} this run, {total} so far in this cell) because "
           "the scaled gradients contained inf/NaN. A few skips while the scale settles are normal; if it "
           "keeps skipping, the gradients themselves are non-finite (see a nonfinite finding) or the loss "
           "scale is too high.")
    return [at("amp_skipped", where, msg, severity="info", title="Mixed-precision step skipped",
               evidence={"skipped": len(skipped), "total": total})]


def nonleaf_param(trace: Trace) -> list[Finding]:
    """Parameters that are no longer leaves: an in-place update with grad on hung a graph on them."""
    bad = [p for p in trace.params if p.grad_fn]
    if not bad:
        return []
    keys = {p.key for p in bad}
    attach = None
    for ev in trace.inplace:  # this step's in-place write that took a gradient-carrying input
        rec = trace.op(ev.index)
        if ev.key in keys and rec is not None and rec.grad_enabled and any(m.requires_grad for m in rec.inputs):
            attach = ev
            break
    names = [p.name for p in bad]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    nodes = sorted({p.grad_fn for p in bad})
    if attach is not None:
        where = attach.where
        how = (f"the in-place `{attach.op}` at line {where.line} (`{_code(trace, where.line, where.file)}`) ran "
               "with gradients on and took a tensor that requires grad")
    else:
        where = Where()
        how = "an in-place update before this step ran with gradients on"
    msg = (f"{len(names)} parameter tensor(s) ({shown}) are no longer leaves of the autograd graph: {how}, "
           f"so they now hang from `{'`, `'.join(nodes)}`. Such a parameter gets no `.grad` (an optimizer holding it "
           "does not update it), and every further update adds to a graph that keeps memory alive. Do updates "
           "like an EMA teacher or weight averaging under `torch.no_grad()` (`with torch.no_grad(): "
           "t.mul_(d).add_(s, alpha=1 - d)`); `p.detach_()` on each one turns them back into plain leaves.")
    return [at("nonleaf_param", where, msg, op=attach.op if attach else None, title="Parameters turned into non-leaves",
               evidence={"parameters": names, "grad_fn": nodes, "in_this_step": attach is not None})]
