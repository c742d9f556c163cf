"""Writes between a forward pass and its backward that the in-place events alone do not explain.

All of them are about weights a graph saved before something changed them:

* an optimizer step between the forward and the backward that needs those weights (a GAN
  step running ``opt_D.step()`` before ``G_loss.backward()``): autograd raises at the backward,
  but the step is the cause. Optimizer-phase writes are not in ``trace.inplace``; the ops are.
  A fused optimizer does not bump version counters: then nothing raises and it is reported
  as a silent finding.
* a write through ``.data`` between the forward and its backward (WGAN weight clipping in the
  wrong place): ``.data`` has a version counter of its own, so autograd never notices and the
  gradients are silently computed from the clipped weights.

The evidence is the storage keys: a forward op that read the storage, the write, then a
backward op, for a node created before the write, that read the same storage.

>>> from backward_doctor.trace import Trace
>>> optimizer_write(Trace(), None) is None, unseen_write(Trace())
(True, [])
"""
from __future__ import annotations

import bisect

from typing import Any

from ..findings import Finding, at, source_line
from ...trace.parts import OptimizerStep
from ...trace.records import OpRecord, Trace, Where
from .flow import graph_ops, loss_op, numel, owner


def _step_of(trace: Trace, index: int) -> OptimizerStep | None:
    """The optimizer step whose ops include op ``index`` (steps start at their recorded ``index``)."""
    best = None
    for s in trace.optimizer_steps:
        if s.index <= index and (best is None or s.index > best.index):
            best = s
    return best


def _step_writes(trace: Trace) -> list[tuple[int, int, int]]:
    """Parameters written in place by optimizer steps: (op index, key, -1)."""
    params = {p.key for p in trace.params if p.key}
    out = []
    for op in trace.ops:
        if op.phase == "optimizer" and op.op.endswith("_"):
            multi = op.op.startswith(("aten::_foreach_", "aten::_fused_"))  # return nothing; write the weights
            out.extend((op.index, k, -1) for k in dict.fromkeys(op.in_keys if multi else op.out_keys) if k in params)
    return out


def optimizer_write(trace: Trace, shape: list[int] | None) -> dict[str, Any] | None:
    """An optimizer step that wrote, in place, a parameter the failing backward's graph had read.

    ``shape`` is the saved tensor's shape from PyTorch's message (None when it does not say):
    a parameter matches when it, or a view of it that the graph made, has that shape (``exact``),
    or the same number of elements (a view autograd saved).
    """
    params = {p.key: p.name for p in trace.params if p.key}
    graph = graph_ops(trace, loss_op(trace))
    if not params or not graph:
        return None
    reads: dict[int, int] = {}     # parameter key -> last graph op that read it
    shapes: dict[int, list[list[int]]] = {}
    for i in sorted(graph):
        op = trace.op(i)
        if op is None:
            continue
        for k, m in zip(op.in_keys, op.inputs):
            if k in params:
                reads[k] = i
                shapes.setdefault(k, []).append(list(m.shape))
        for k, m in zip(op.out_keys, op.outputs):
            if k in params:  # a view of the weight (``t()``): autograd saves the view
                shapes.setdefault(k, []).append(list(m.shape))
    exact, close = [], []
    for index, k, _ in _step_writes(trace):
        if k not in reads or reads[k] >= index:
            continue
        if shape is None or shape in shapes[k]:
            exact.append((index, k))
        elif any(numel(s) == numel(shape) for s in shapes[k]):
            close.append((index, k))
    hits = exact or close
    if not hits:
        return None
    index, key = hits[0]
    step, op = _step_of(trace, index), trace.op(index)
    if step is None or op is None:
        return None
    written = list(dict.fromkeys(params[k] for _, k in hits))
    return {"op": op, "key": key, "step": step, "exact": bool(exact) and shape is not None,
            "parameter": params[key], "parameters": written, "read_by": trace.op(reads[key])}


def optimizer_finding(trace: Trace, found: dict[str, Any], evidence: dict[str, Any]) -> Finding:
    """The ``inplace`` finding for :func:`optimizer_write`: located at the step, not the backward."""
    step, op, reader = found["step"], found["op"], found["read_by"]
    where = Where(line=step.line, file=step.file, cell_line=step.cell_line, module=owner([found["parameter"]]))
    code = source_line(trace, where.line, where.file) or f"{step.optimizer}.step()"
    bwd = trace.exception.where if trace.exception is not None else Where()
    fwd_line = reader.where.cell_line or reader.where.line if reader is not None else None
    evidence.update(op=op.op, parameters=found["parameters"], step_line=where.line, code=code,
                    optimizer=step.optimizer, forward_line=fwd_line)
    shown = ", ".join(f"`{n}`" for n in found["parameters"][:4])
    msg = (f"`{code}` (line {where.line}) updated {shown} in place (`{op.op}`) after the forward pass at line "
           f"{fwd_line} had used {'it' if len(found['parameters']) == 1 else 'them'} to build the graph that "
           f"`backward()` at line {bwd.line} walks. Autograd had saved those weights to compute gradients; the step "
           "changed them, so backward refused to compute wrong gradients. Call every `backward()` that goes "
           "through a model before that model's optimizer steps, or recompute the forward after the step. In a "
           "GAN: step D, then compute the generator loss with a fresh `D(fake)` (or run `G_loss.backward()` "
           "before `opt_D.step()`).")
    return at("inplace", where, msg, op=op.op, title="Optimizer step changed weights a graph had saved",
              evidence=evidence)


def _late_reads(trace: Trace, writes: list[tuple[int, int, int]]) -> list[tuple[int, OpRecord]]:
    """For ``writes`` (op index, storage key, index of the op that made the storage or -1): those whose
    storage a backward node made *before* the write read *after* it, with that node's forward op. Such a
    node computed its gradient from the new values while its forward had used the old ones."""
    keys = {k for _, k, _ in writes}
    readers: dict[int, list[OpRecord]] = {}
    for op in trace.ops:
        if op.phase == "backward" and op.fwd_index is not None:
            for k in op.in_keys:
                if k in keys:
                    readers.setdefault(k, []).append(op)
    # Per storage, its readers in op order and the earliest forward op among each suffix of them: a
    # write none of whose later readers has a forward before it is skipped at once (a training loop
    # writes and reads every parameter once per iteration: pairing all of them is quadratic).
    order: dict[int, tuple[list[int], list[int]]] = {}
    for k, ops in readers.items():
        low, m = [0] * len(ops), float("inf")
        for i in range(len(ops) - 1, -1, -1):
            m = min(m, ops[i].fwd_index)
            low[i] = m
        order[k] = ([b.index for b in ops], low)
    out = []
    for n, (index, key, made) in enumerate(writes):
        if key not in order:
            continue
        at_index, low = order[key]
        start = bisect.bisect_right(at_index, index)
        if start == len(at_index) or low[start] >= index:
            continue
        for b in readers[key][start:]:
            fwd = trace.op(b.fwd_index)
            if not made < b.fwd_index < index or fwd is None:
                continue
            # The node's forward op used this storage as part of the graph, with gradients on.
            if fwd.grad_enabled and any(k == key and m.requires_grad for k, m in zip(fwd.in_keys, fwd.inputs)):
                out.append((n, fwd))
                break
    return out


_METADATA_ONLY = {"detach_", "set_", "resize_", "resize_as_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
                  "transpose_", "swapaxes_", "swapdims_", "_coalesced_", "requires_grad_", "_fix_weakref"}


def unseen_write(trace: Trace) -> list[Finding]:
    """A write autograd cannot see (through ``.data``, or an optimizer step that does not bump version
    counters) between a forward pass and the backward that reads what it overwrote."""
    # Writes of data (not `detach_` & co., which change metadata) into a parameter's storage: a write into
    # any other storage may only share an address some freed tensor had (keys are addresses).
    params = {p.key for p in trace.params if p.key}
    events = [e for e in trace.inplace if e.key in params and not e.requires_grad
              and e.op.split("::")[-1] not in _METADATA_ONLY and 0 not in e.shape]
    hits = _late_reads(trace, [(e.index, e.key, -1 if e.producer_index is None else e.producer_index)
                               for e in events])
    if not hits:
        return _unseen_step(trace)
    first, fwd = events[hits[0][0]], hits[0][1]
    line = (first.where.line, first.where.file)
    names = {p.key: p.name for p in trace.params}
    # The whole loop (``for p in D.parameters(): p.data.clamp_(...)``) is one mistake: name every write.
    same = [e for e in events if (e.where.line, e.where.file) == line]
    written = list(dict.fromkeys(names[e.key] for e in same if e.key in names))
    read = list(dict.fromkeys(names[events[n].key] for n, _ in hits if events[n].key in names))
    module = first.where.module or owner(written)
    code = source_line(trace, first.where.line, first.where.file)
    fwd_line = fwd.where.cell_line or fwd.where.line
    what = ", ".join(f"`{n}`" for n in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    saved = ", ".join(f"`{n}`" for n in read[:4])
    msg = (f"`{code or first.op}` (line {first.where.line}) overwrote {what or 'a tensor'} in place through `.data` "
           f"after the forward pass at line {fwd_line} had used {'it' if len(written) <= 1 else 'them'}, and before "
           f"the `backward()` that read {saved or 'the saved values'} back. `.data` has its own version counter, so "
           "autograd cannot notice: nothing is raised, and the gradients mix the old forward with the new weights. "
           "Do the write "
           "after `optimizer.step()` and before the next forward pass (for WGAN weight clipping: right after "
           "`opt_D.step()`), under `with torch.no_grad():` on the parameter itself rather than `.data`.")
    where = Where(line=first.where.line, file=first.where.file, cell_line=first.where.cell_line, module=module)
    return [at("inplace", where, msg, op=first.op, title="Weights changed between forward and backward",
               evidence={"parameters": written, "read_by_backward": read, "op": first.op, "code": code,
                         "forward_line": fwd_line, "writes": len(same)})]


def _unseen_step(trace: Trace) -> list[Finding]:
    """An optimizer step between a forward pass and its backward that autograd did not notice (a fused
    optimizer, a hand-written one updating ``p.data``): the backward read the stepped weights."""
    writes = _step_writes(trace)
    hits = _late_reads(trace, writes)
    if not hits:
        return []
    index, fwd = writes[hits[0][0]][0], hits[0][1]
    step = _step_of(trace, index)
    op = trace.op(index)
    if step is None or op is None:
        return []
    names = {p.key: p.name for p in trace.params}
    read = list(dict.fromkeys(names[writes[n][1]] for n, _ in hits))
    where = Where(line=step.line, file=step.file, cell_line=step.cell_line, module=owner(read))
    code = source_line(trace, where.line, where.file) or f"{step.optimizer}.step()"
    fwd_line = fwd.where.cell_line or fwd.where.line
    shown = ", ".join(f"`{n}`" for n in read[:4]) + (f" and {len(read) - 4} more" if len(read) > 4 else "")
    msg = (f"`{code}` (line {where.line}) updated {shown} in place (`{op.op}`) after the forward pass at line "
           f"{fwd_line} had used them, and a later `backward()` read the updated values for that forward's "
           "gradients. This update does not bump autograd's version counters (a fused optimizer, or one that "
           "writes `p.data`), so nothing is raised and the gradients are silently wrong. Call every `backward()` "
           "that goes through a model before that model's optimizer steps, or recompute the forward after the "
           "step (in a GAN: the generator loss from a fresh `D(fake)` after `opt_D.step()`).")
    return [at("inplace", where, msg, op=op.op, title="Optimizer step changed weights a graph had saved",
               evidence={"parameters": read, "optimizer": step.optimizer, "forward_line": fwd_line,
                         "code": code})]
