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

import ast
import math
import os

from ..findings import Finding, at, source_line
from ..trace import OpRecord, Trace, Where
from ..units import format_bytes
from .autograd import _user_detach

_STORE_METHODS = {"append", "extend", "insert", "add", "update", "setdefault", "__setitem__"}
_LOSS_OPS = {"aten::mse_loss", "aten::l1_loss", "aten::smooth_l1_loss", "aten::huber_loss",
             "aten::binary_cross_entropy", "aten::binary_cross_entropy_with_logits", "aten::soft_margin_loss"}
_ELEMENTWISE = {"aten::sub", "aten::add", "aten::mul", "aten::div", "aten::rsub", "aten::sub_", "aten::add_"}


def _root(path: str) -> str:
    for sep in ("[", "."):
        path = path.split(sep, 1)[0]
    return path


def _store_line(source: str, name: str) -> int | None:
    """The line of the cell that stores into ``name`` (``name.append(...)``, ``name += ...``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name \
                and node.func.attr in _STORE_METHODS:
            return node.lineno
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.lineno
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                        and target.value.id == name:
                    return node.lineno
    return None


def graph_leak(trace: Trace) -> list[Finding]:
    """Tensors from earlier runs, graph and all, still reachable from the namespace."""
    leaks = [h for h in trace.graph_holders if h["earlier_runs"]]
    if not leaks:
        return []
    first = leaks[0]
    var = _root(first["path"])
    where = Where()
    if first["own_run"] == trace.run_id and first["own_index"] is not None:
        rec = trace.op(first["own_index"])
        if rec is not None:
            where = rec.where  # e.g. the `total += loss` that extended the old graph this run
    line = _store_line(trace.source, var)
    if line is not None and (where.line is None or where.file is not None or where.line != line):
        where = Where(line=line, cell_line=line)
    nbytes = sum(h["bytes"] for h in leaks)
    runs = sorted({r for h in leaks for r in h["earlier_runs"]})
    series = trace.history.get("live_bytes_end", [])
    growth = ""
    if len(series) >= 2 and series[-1] > series[0]:
        growth = (" Live memory at the end of the step grew run after run: "
                  + " -> ".join(format_bytes(b) for b in series[-4:]) + ".")
    paths = ", ".join(f"`{h['path']}`" for h in leaks[:4]) + (" ..." if len(leaks) > 4 else "")
    msg = (f"`{var}` keeps tensors that still carry the autograd graph of {len(runs)} earlier run(s) of this "
           f"step ({paths}; {format_bytes(nbytes)} of tensors, each holding its graph). Every run adds one more, "
           f"so memory creeps up until it runs out.{growth} Store a number, not the tensor: "
           f"`{var}.append(loss.item())` / `total += loss.item()`, or `.detach()` if you need a tensor.")
    return [at("graph_leak", where, msg, severity="warning", title="Graphs of earlier steps kept alive",
               evidence={"variable": var, "holders": [h["path"] for h in leaks], "bytes": nbytes,
                         "graphs": len(runs), "live_bytes_end": series})]


def stale_grad(trace: Trace) -> list[Finding]:
    """optimizer.step() on gradients that an earlier step already used: zero_grad() is missing."""
    out = []
    for s in trace.stale_steps[:1]:
        where = Where(line=s["line"], file=s["file"], cell_line=s["cell_line"])
        code = source_line(trace, where.line, where.file)
        msg = (f"`{code or 'optimizer.step()'}` used gradients that still contain the gradients of an earlier "
               f"run ({s['params']} parameters): `zero_grad()` was never called since the previous step, so "
               "backward() keeps adding into `.grad` and every step follows the sum of all past gradients - "
               "gradient accumulation by accident. Call `optimizer.zero_grad()` at the start of the step "
               "(before `loss.backward()`), or right after `optimizer.step()`.")
        out.append(at("stale_grad", where, msg, title="Gradients were never zeroed", severity="error",
                      evidence={"parameters": s["params"], "since_run": s["since_run"]}))
    return out


def _cut_from(trace: Trace, keys: set[int]) -> tuple[OpRecord, str] | None:
    """Follow the data flowing out of ``keys`` forward to where it stops requiring grad."""
    derived = set(keys)
    for op in trace.ops:
        if op.phase != "forward":
            continue
        hits = [(k, m) for k, m in zip(op.in_keys, op.inputs) if k in derived]
        if not hits:
            continue
        if not op.grad_enabled and any(k in keys for k, _ in hits):
            return op, "no_grad"
        if op.op == "aten::_local_scalar_dense":
            return op, "item"
        for k, m in hits:
            if not m.requires_grad and k not in keys:
                detach = _user_detach(trace, k, op.index, None)
                return (detach, "detach") if detach is not None else (op, "data")
        if op.grad_enabled and op.op not in ("aten::detach", "aten::alias"):
            derived.update(k for k in op.out_keys if k)
    return None


def detached(trace: Trace) -> list[Finding]:
    """Trainable parameters the forward used that got no gradient: the graph was cut."""
    if not any(p.got_grad for p in trace.params):
        return []  # no backward reached any parameter: not this rule's case
    used = {k for op in trace.ops if op.phase == "forward" for k in op.in_keys}
    starved = [p for p in trace.params if p.requires_grad and p.stepped and not p.got_grad and p.key in used]
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
    code = source_line(trace, op.where.line, op.where.file)
    how_text = {"no_grad": "runs it under `torch.no_grad()`", "item": "turns its output into a Python number",
                "detach": "detaches its output (`.detach()` / `.numpy()`)", "data": "uses `.data`"}[how]
    count = sum(p.numel for p in starved)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    msg = (f"{len(names)} trainable parameter tensor(s) ({count:,} values: {shown}) took part in the forward pass "
           f"but got no gradient, so the optimizer never updates them: line {op.where.line} (`{code}`) {how_text}, "
           "which cuts the graph between them and the loss. Remove the cut (keep `.detach()`/`no_grad` for "
           "logging and evaluation), or freeze them on purpose with `requires_grad_(False)`.")
    where = Where(line=op.where.line, file=op.where.file, cell_line=op.where.cell_line, module=module)
    return [at("detached", where, msg, op=op.op, title="Parameters starved of gradient",
               evidence={"parameters": names, "cut": how, "values": count})]


def _ancestors(trace: Trace) -> set[int]:
    """Forward ops that fed a backward root (the loss), following the data flow."""
    writer: dict[int, int] = {}
    producers: dict[int, list[int]] = {}
    for op in trace.ops:
        producers[op.index] = [writer[k] for k in op.in_keys if k in writer]
        if op.op not in ("aten::detach", "aten::alias"):
            for k in op.out_keys:
                writer[k] = op.index
    roots = [op.fwd_index for op in trace.ops if op.phase == "backward" and op.fwd_index is not None]
    seen: set[int] = set()
    stack = list(set(roots))
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(producers.get(i, []))
    return seen


def broadcast(trace: Trace) -> list[Finding]:
    """A loss whose prediction and target broadcast to a bigger shape than either."""
    fed = None
    for i, op in enumerate(trace.ops):
        if op.phase != "forward":
            continue
        shapes = None
        if op.op in _LOSS_OPS:
            # F.mse_loss & co. broadcast with two aten::expand right before the loss op.
            before = [o for o in trace.ops[max(0, i - 2):i] if o.op == "aten::expand" and o.inputs and o.outputs]
            if len(before) == 2 and len(op.inputs) >= 2:
                a, b = before[0].inputs[0].shape, before[1].inputs[0].shape
                if a != b and before[0].outputs[0].shape == op.inputs[0].shape:
                    shapes = (a, b, op.inputs[0].shape)
        elif op.op in _ELEMENTWISE and len(op.inputs) == 2 and op.outputs:
            a, b = op.inputs[0], op.inputs[1]
            out_n = math.prod(op.outputs[0].shape)
            if a.shape != b.shape and out_n > max(math.prod(a.shape), math.prod(b.shape)) \
                    and a.requires_grad != b.requires_grad:
                if fed is None:
                    fed = _ancestors(trace)
                if op.index in fed:
                    shapes = (a.shape, b.shape, op.outputs[0].shape)
        if shapes:
            a, b, out = shapes
            msg = (f"The loss compares a prediction of shape {list(a)} with a target of shape {list(b)}; they "
                   f"broadcast to {list(out)}, so every prediction is compared with every target. The loss "
                   "is wrong but raises nothing. Make the shapes equal: `pred.squeeze(-1)` or "
                   "`target.view_as(pred)`.")
            return [at("broadcast", op.where, msg, op=op.op, title="Prediction and target broadcast",
                       evidence={"prediction": list(a), "target": list(b), "broadcast": list(out)})]
    return []


def skipped_amp_steps(trace: Trace) -> list[OpRecord]:
    """GradScaler unscale ops not followed by an optimizer step before the scale update."""
    steps = [s["index"] for s in trace.optimizer_steps]
    skipped = []
    pending = None
    for op in trace.ops:
        if op.op == "aten::_amp_foreach_non_finite_check_and_unscale_":
            pending = op
        elif op.op == "aten::_amp_update_scale_" and pending is not None:
            if not any(pending.index < s <= op.index for s in steps):
                skipped.append(pending)
            pending = None
    return skipped


def amp_skipped(trace: Trace) -> list[Finding]:
    """Informational: GradScaler skipped optimizer.step() because gradients were inf/NaN."""
    skipped = skipped_amp_steps(trace)
    if not skipped:
        return []
    total = sum(trace.history.get("amp_skipped", [])) or len(skipped)
    where = skipped[0].where
    msg = (f"GradScaler skipped `optimizer.step()` ({len(skipped)} this run, {total} so far in this cell) because "
           "the scaled gradients contained inf/NaN. A few skips while the scale settles are normal; if it "
           "keeps skipping, the gradients themselves are non-finite (see a nonfinite finding) or the loss "
           "scale is too high.")
    return [at("amp_skipped", where, msg, severity="info", title="Mixed-precision step skipped",
               evidence={"skipped": len(skipped), "total": total})]
