"""Graph errors: in-place writes, a second backward, a loss without a graph.

PyTorch raises these at ``loss.backward()``; the root cause is earlier. The
capture's in-place events and per-op data flow lead back to the line that did it.

>>> from backward_doctor.trace import Trace
>>> inplace(Trace()) + backward_twice(Trace()) + no_grad_path(Trace())
[]
"""
from __future__ import annotations

import dataclasses
import re

from ..findings import Finding, at, source_line
from ...trace.records import InplaceEvent, OpRecord, Trace, Where
from .flow import differentiable, loss_roots, numel
from .saved_writes import optimizer_finding, optimizer_write

# A saved leaf (a conv weight) has no "which is output N of Node" part.
_VERSION = re.compile(r"\[torch\.\w+ \[([\d, ]*)\]\](?:, which is output (\d+) of (\w+),)? "
                      r"is at version (\d+); expected version (\d+)")
_LEAF = "a leaf Variable that requires grad is being used in an in-place operation"


_AUGMENTED = {"+=": "aten::add_", "-=": "aten::sub_", "*=": "aten::mul_", "/=": "aten::div_",
              "**=": "aten::pow_", "@=": "aten::matmul"}


def _op_from_code(code: str) -> str | None:
    """The in-place op a line of code performs (``w -= g`` -> ``aten::sub_``), if it says."""
    m = re.search(r"\.(\w+_)\(", code)
    if m:
        return f"aten::{m.group(1)}"
    m = re.search(r"(\*\*=|[-+*/@]=)", code.split("#")[0])
    return _AUGMENTED.get(m.group(1)) if m else None


def _node_op(node: str) -> str:
    """``SigmoidBackward0`` -> ``sigmoid`` (the forward op behind an autograd node)."""
    return re.sub(r"Backward\d*$", "", node).lower()


_VIEWS = {"view", "_unsafe_view", "_reshape_alias", "reshape", "expand", "t", "transpose", "permute", "as_strided",
          "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "narrow",
          "alias", "detach", "detach_", "diagonal", "unfold", "view_as_real", "view_as_complex", "real", "imag",
          "expand_as", "view_as", "flatten", "unflatten", "movedim", "lift_fresh"}


def _read_before_write(trace: Trace, events: list[InplaceEvent]) -> list[InplaceEvent]:
    """The events that overwrote a storage some forward op had read since it was made: only such a
    write can change what autograd saved (dropout's ``bernoulli_`` into a fresh buffer cannot). Storage
    keys are addresses that a later storage may reuse, hence "since it was made" (its producer op)."""
    keys = {e.key for e in events if e.key}
    reads: dict[int, list[int]] = {}
    for op in trace.ops:
        base = op.op.split("::")[-1]
        if op.phase != "forward" or base in _VIEWS or base.endswith("_"):
            continue  # a view shares the storage (what reads the view counts); an in-place op is a writer
        for k in op.in_keys:
            if k in keys:
                reads.setdefault(k, []).append(op.index)
    made = lambda e: -1 if e.producer_index is None else e.producer_index  # noqa: E731
    return [e for e in events if any(made(e) < i < e.index for i in reads.get(e.key, ()))]


#: Ops that allocate a buffer: nothing can have saved it before an in-place op fills it (dropout's mask).
_FACTORIES = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
              "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "rand_like", "randn_like", "arange"}


def _fresh(e: InplaceEvent) -> bool:
    return bool(e.producer_op) and e.producer_op.split("::")[-1] in _FACTORIES


def _pick_inplace(trace: Trace, shape: list[int] | None, node: str | None,
                  expected: int | None) -> InplaceEvent | None:
    # A write through a view (``h[:, 0] = 0.0`` fills a select of ``h``) changed its base, the tensor named.
    events = [e for e in trace.inplace if shape is None or shape in (e.shape, e.base_shape)]
    if not events and shape is not None:
        # Autograd saved a view of the written tensor (``x.view(-1, d)`` for a matmul): same elements.
        events = [e for e in trace.inplace
                  if numel(shape) == numel(e.shape if e.base_shape is None else e.base_shape)]
    events = _read_before_write(trace, events) or [e for e in events if not _fresh(e)] or events
    if node:
        base = _node_op(node)
        named = [e for e in events if e.producer_op and e.producer_op.split("::")[-1].strip("_") == base]
        events = named or events
    if expected is not None:
        exact = [e for e in events if e.version == expected + 1]
        events = exact or events
    if len(events) > 1:
        # The same write in every block (``h += x`` in each residual block, an in-place op in each
        # attention layer): backward visits the newest nodes first, so the one that raised is the
        # latest write whose tensor's node had not run yet when backward stopped.
        ran = _ran_in_failing_backward(trace)
        events = [e for e in events if e.producer_index not in ran] or events
        return events[-1]
    return events[0] if events else None


def _ran_in_failing_backward(trace: Trace) -> set[int]:
    """Forward ops whose backward nodes ran in the last (failing) backward call."""
    ran: set[int] = set()
    previous = "forward"
    for op in trace.ops:
        if op.phase == "backward":
            if previous != "backward":
                ran = set()  # a new backward() call
            if op.fwd_index is not None:
                ran.add(op.fwd_index)
        previous = op.phase
    return ran


def inplace(trace: Trace) -> list[Finding]:
    """In-place write on a leaf that requires grad, or on a tensor saved for backward."""
    exc = trace.exception
    if exc is None:
        return []
    if _LEAF in exc.message:
        code = source_line(trace, exc.where.line, exc.where.file)
        msg = (f"`{code or 'an in-place op'}` writes in place into a leaf tensor that requires grad "
               "(a parameter or an input created with requires_grad=True). Autograd cannot record a change "
               "to a leaf. If this is a weight update, do it under `with torch.no_grad():`; otherwise use "
               "the out-of-place form (`w = w + 1` instead of `w += 1`).")
        return [at("inplace", exc.where, msg, op=_op_from_code(code),
                   title="In-place write on a leaf that requires grad", evidence={"code": code})]
    if "modified by an inplace operation" not in exc.message:
        return []
    m = _VERSION.search(exc.message)
    shape = [int(s) for s in m.group(1).split(",") if s.strip()] if m else None
    node, expected = (m.group(3), int(m.group(5))) if m else (None, None)
    ev_ = _pick_inplace(trace, shape, node, expected)
    evidence = {"shape": shape, "saved_by": node, "expected_version": expected,
                "backward_line": exc.where.line}
    stepped = optimizer_write(trace, shape)
    # An optimizer step between the forward and this backward that rewrote a weight the graph read is
    # the cause whenever the saved tensor is that weight (or PyTorch does not say which tensor it was).
    if stepped is not None and (stepped["exact"] or shape is None or ev_ is None):
        return [optimizer_finding(trace, stepped, evidence)]
    if ev_ is None:
        msg = ("A tensor that autograd saved for the backward pass was changed in place before "
               f"`backward()` ran ({exc.message.splitlines()[0]}). Use the out-of-place form of the op.")
        return [at("inplace", exc.where, msg, title="Saved tensor modified in place", evidence=evidence)]
    code = source_line(trace, ev_.where.line, ev_.where.file)
    producer = ev_.producer_op or "an earlier op"
    evidence.update(op=ev_.op, producer_op=ev_.producer_op, code=code)
    alt = ev_.op.split("::")[-1].rstrip("_")
    written = f"a {list(ev_.shape)} tensor"
    fix = (f"Use the out-of-place form (`{alt}` instead of `{alt}_`, `y = y + 1` instead of `y += 1`, "
           "`nn.ReLU()` instead of `nn.ReLU(inplace=True)`), or `.clone()` before writing.")
    if ev_.base_shape is not None:
        # An index assignment has no out-of-place spelling of its op: the fix is a copy to write into.
        written = f"a {list(ev_.shape)} view of a {list(ev_.base_shape)} tensor"
        evidence["base_shape"] = list(ev_.base_shape)
        var = re.match(r"\s*([A-Za-z_][\w.]*)\s*\[", code or "")  # `h[:, 0] = 0.0`, `h[1].zero_()`: h
        name = var.group(1) if var else "t"
        fix = (f"Write into a copy (`{name} = {name}.clone()` before writing into `{name}`), or build the new "
               f"values out of place (`torch.where(mask, value, {name})`, `torch.cat`).")
    msg = (f"`{ev_.op}` at {'line ' + str(ev_.where.line)} (`{code}`) overwrote {written} "
           f"made by `{producer}`, which autograd had saved to compute gradients ({node or 'a backward node'}). "
           f"`backward()` then found it changed (version {ev_.version}, expected {expected}) and refused "
           f"to compute wrong gradients. {fix}")
    return [at("inplace", ev_.where, msg, op=ev_.op, title="Saved tensor modified in place", evidence=evidence)]


def backward_twice(trace: Trace) -> list[Finding]:
    """backward() through a graph whose saved tensors were already freed."""
    exc = trace.exception
    if exc is None or "backward through the graph a second time" not in exc.message:
        return []
    used = {k for op in trace.ops if op.phase == "forward" for k in op.in_keys}
    carriers = [c for c in trace.carriers if c.key in used] or trace.carriers
    if carriers:
        names = ", ".join(f"`{c.variable}`" for c in carriers)
        var = carriers[0].variable
        msg = (f"{names} still carried the autograd graph of an earlier run of this cell (it was computed "
               "from tensors that required grad and never detached). This run's loss depends on it, so "
               "`backward()` walked into the old graph, whose saved tensors the previous backward already "
               f"freed. Detach the carried state at the start of each step: `{var} = {var}.detach()` "
               "(truncated backprop). `retain_graph=True` would hide the error while the graph, and the "
               "memory it holds, grows with every step.")
    else:
        first = trace.backward_calls[0] if trace.backward_calls else None
        where_first = f" at line {first.cell_line or first.line}" if first else ""
        msg = ("The graph was already consumed: the first `backward()`" + where_first + " freed the tensors "
               "it saved, and this second `backward()` needed them. Add the losses and call backward once "
               "(`(loss_a + loss_b).backward()`), or compute the second loss from a fresh forward pass; "
               "use `retain_graph=True` on the first call only if you truly need both.")
    return [at("backward_twice", exc.where, msg, title="Backward through a freed graph",
               evidence={"carriers": [c.variable for c in carriers]})]


#: Ops that hand back a storage they were given without writing values into it (``torch.tensor(x,
#: requires_grad=True)`` runs ``detach_`` on its fresh tensor under the native recorder).
_NO_VALUES = ("aten::detach", "aten::alias", "aten::detach_")


def _user_detach(trace: Trace, key: int, before: int, writer: OpRecord | None) -> OpRecord | None:
    """The user's ``.detach()`` that produced ``key``, if any.

    Autograd itself dispatches ``aten::detach`` when it saves an op's output; that
    one runs inside the same Python call as the op (same frame position), a user's
    ``.detach()`` is a call of its own.
    """
    found = None
    for op in trace.ops:
        if op.index >= before:
            break
        if op.op in ("aten::detach", "aten::alias") and key in op.out_keys:
            if writer is None or (op.where.line, op.where.lasti) != (writer.where.line, writer.where.lasti):
                found = op
    return found


def _cut(trace: Trace, start: int | None) -> tuple[OpRecord, str] | None:
    """Walk the data flow back from the loss to the op where requires_grad was lost."""
    writer: dict[int, int] = {}
    producers: dict[int, list[int]] = {}
    seen_rg: set[int] = set()
    #: per op, its inputs read without requires_grad whose storage an earlier op read with it (as things
    #: stood when it ran: a storage freed later may come back under the same key)
    cut_inputs: dict[int, list[int]] = {}
    for op in trace.ops:
        producers[op.index] = [writer[k] for k in op.in_keys if k in writer]
        for k, m in zip(op.in_keys, op.inputs):
            if m.requires_grad:
                seen_rg.add(k)
        cut_inputs[op.index] = [k for k, m in zip(op.in_keys, op.inputs) if k in seen_rg and not m.requires_grad]
        # A freshly allocated output may reuse the key of a freed storage: forget what that one was.
        seen_rg.difference_update(k for k in op.out_keys if k not in op.in_keys)
        if op.op not in _NO_VALUES:  # views of a storage, not new values
            for k in op.out_keys:
                writer[k] = op.index
    queue, visited = [start], set()
    nondiff = None
    while queue:
        idx = queue.pop(0)
        if idx is None or idx in visited:
            continue
        visited.add(idx)
        op = trace.op(idx)
        if op is None or op.phase != "forward":
            continue
        rg = [m.requires_grad for m in op.inputs]
        if any(rg) and not op.grad_enabled:
            return op, "no_grad"
        if op.op == "aten::_local_scalar_dense":
            return op, "item"
        if not op.inputs or op.op in ("aten::lift_fresh", "aten::scalar_tensor"):
            # Checked first: torch.tensor(...)'s input is made outside any op and may reuse a freed key.
            return op, "new_tensor"
        if any(rg) and op.outputs and not any(differentiable(m.dtype) for m in op.outputs):
            # argmax / a comparison / .long(): integers have no gradient. Only the answer when nothing
            # else cut the graph: labels made by an argmax are fine where a detach is the real cut.
            nondiff = nondiff or op
        for k in cut_inputs.get(idx, ()):
            wrote = trace.op(_last_writer_before(trace, k, op.index))
            detach = _user_detach(trace, k, op.index, wrote)
            return (detach, "detach") if detach is not None else (_data_site(trace, k, op), "data")
        queue.extend(producers.get(idx, []))
    return (nondiff, "nondiff") if nondiff is not None else None


def _data_site(trace: Trace, key: int, consumer: OpRecord) -> OpRecord:
    """Where ``.data`` cut the graph when no op marks the cut (``.data`` runs no op the native
    recorder sees): the line that made the value, or the cell statement that made it, if it
    reads ``.data``; else the op that consumed the cut value."""
    made = trace.op(_last_writer_before(trace, key, consumer.index))
    for op in (made, consumer):
        if op is None:
            continue
        if ".data" in source_line(trace, op.where.line, op.where.file):
            return op
        cell = op.where.cell_line
        if cell is not None and op.where.file is not None and ".data" in source_line(trace, cell, None):
            return dataclasses.replace(op, where=Where(line=cell, file=None, cell_line=cell, module=op.where.module))
    return consumer


def _last_writer_before(trace: Trace, key: int, before: int) -> int | None:
    last = None
    for op in trace.ops:
        if op.index >= before:
            break
        if key in op.out_keys and op.op not in _NO_VALUES:
            last = op.index
    return last


_WHY = {
    "no_grad": "runs inside `torch.no_grad()` (or inference mode), so no graph was recorded from here on",
    "detach": "calls `.detach()`, which returns a tensor cut off from the graph",
    "item": "turns a tensor into a Python number (`.item()`), which has no graph",
    "data": "uses `.data`, which reads the values without the graph",
    "new_tensor": "creates a new tensor from Python numbers or NumPy (`torch.tensor(...)`, "
                  "`torch.from_numpy(...)`), which starts with no history",
    "nondiff": "returns integers or booleans (`argmax`, `argmin`, a comparison, `.long()`), which have no "
               "gradient; turning them back into floats (`.float()`) does not bring the graph back",
}


def _rebuilt_from_numbers(trace: Trace) -> OpRecord | None:
    """The op that made a tensor from Python numbers (``torch.tensor(loss.item(), requires_grad=True)``) the
    loss was computed from, when the forward used trainable parameters and none got a gradient: a library
    that scales the loss first (a Trainer divides it by the accumulation steps) puts an op between the rebuilt
    leaf and ``backward()``, so the walk starts at each backward's root and goes back. A tensor the user
    made to differentiate (``torch.ones(2, requires_grad=True)``) is not one: no ``.item()`` came before."""
    used = {k for op in trace.ops if op.phase == "forward" for k in op.in_keys}
    if any(p.got_grad for p in trace.params) or not any(p.requires_grad and p.key in used for p in trace.params):
        return None
    for root in sorted(loss_roots(trace)):
        found = _cut(trace, root)
        if found is None or found[1] != "new_tensor" or found[0].op not in ("aten::lift_fresh", "aten::scalar_tensor"):
            continue
        if any(op.op == "aten::_local_scalar_dense" and op.index < found[0].index and op.inputs
               and op.inputs[0].requires_grad for op in trace.ops):
            return found[0]
    return None


def _leaf_loss(trace: Trace) -> list[Finding]:
    """backward() on a fresh leaf (``torch.tensor(loss.item(), requires_grad=True)``): silent, no grads."""
    if not trace.parameters.trainable or not trace.backward_roots:
        return []
    cut = None
    if "torch::autograd::AccumulateGrad" in trace.backward_roots:
        start = next((c for c, r in zip(trace.backward_calls, trace.backward_roots)
                      if r == "torch::autograd::AccumulateGrad"), None)
        first_bwd = next((op for op in trace.ops if op.phase == "backward" and op.where == start), None)
        before = first_bwd.index if first_bwd else trace.op_count
        for op in trace.ops:
            if op.index >= before:
                break
            if op.phase == "forward" and (op.op in ("aten::lift_fresh", "aten::scalar_tensor",
                                                    "aten::_local_scalar_dense") or not op.inputs):
                cut = op
    else:
        cut = _rebuilt_from_numbers(trace)
    if cut is None:
        return []
    code = source_line(trace, cut.where.line, cut.where.file)
    msg = (f"`backward()` ran on a tensor with no history: line {cut.where.line} (`{code}`) built the loss from "
           "Python numbers, so it is a new leaf. No error is raised (it requires grad itself), but no gradient "
           "reaches any parameter and the optimizer step does nothing. Compute the loss with torch ops on the "
           "model outputs (`loss = loss_cls + 0.5 * loss_box`); use `.item()` only for logging.")
    return [at("no_grad_path", cut.where, msg, op=cut.op, title="The loss was rebuilt from numbers",
               evidence={"cut": "new_tensor", "code": code, "op_index": cut.index})]


def no_grad_path(trace: Trace) -> list[Finding]:
    """The loss has no grad_fn: find the line where the graph was cut."""
    exc = trace.exception
    if exc is None:
        return _leaf_loss(trace)
    if "does not require grad and does not have a grad_fn" not in exc.message:
        return []
    loss = dataclasses.asdict(exc.loss) if exc.loss is not None else {}  # the evidence keeps it a plain dict
    used = {k for op in trace.ops if op.phase == "forward" for k in op.in_keys}
    used_params = [p for p in trace.params if p.key in used]
    if used_params and not any(p.requires_grad for p in used_params):  # every weight the step used is frozen
        first = next((op for op in trace.ops if op.phase == "forward" and op.where.module), None)
        where = exc.where
        if first is not None:  # the call of the model in the cell, not a line inside it
            w = first.where
            where = Where(line=w.cell_line or w.line, file=None if w.cell_line else w.file,
                          cell_line=w.cell_line, module=w.module.split(".")[0] if w.module else None)
        msg = ("Every parameter is frozen (requires_grad=False), so the forward pass built no graph and "
               "there is nothing to backpropagate. Unfreeze what you want to train "
               "(`for p in model.head.parameters(): p.requires_grad_(True)`) before building the optimizer.")
        return [at("no_grad_path", where, msg, op=first.op if first else None, title="All parameters frozen",
                   evidence={"parameters": trace.parameters.count})]
    found = _cut(trace, exc.loss.writer if exc.loss is not None else None)
    if found is None:
        msg = ("The loss does not require grad: it was computed from tensors that are not connected to any "
               "parameter. Make sure the loss is computed from the model's output inside the step, "
               "with gradients enabled.")
        return [at("no_grad_path", exc.where, msg, title="Loss has no graph", evidence={"loss": loss})]
    op, how = found
    code = source_line(trace, op.where.line, op.where.file)
    fix = {"no_grad": "compute the loss outside the `no_grad` block (keep `no_grad` for evaluation only)",
           "detach": "remove `.detach()` on the way to the loss (detach only what you log or store)",
           "item": "keep the value as a tensor; call `.item()` only for logging, after backward",
           "data": "use the tensor itself instead of `.data`",
           "new_tensor": "compute the loss with torch ops on the model output; do not rebuild it from "
                         "`.item()`, `.tolist()` or `.numpy()` values",
           "nondiff": "compute the loss on the scores themselves (`F.cross_entropy(logits, y)` for class labels), "
                      "or use a differentiable stand-in such as a soft argmax "
                      "(`(logits.softmax(-1) * torch.arange(n_classes)).sum(-1)`); keep `argmax` for metrics"}[how]
    item = next((o for o in reversed(trace.ops) if o.index < op.index and o.op == "aten::_local_scalar_dense"
                 and o.inputs and o.inputs[0].requires_grad), None) if how == "new_tensor" else None
    before = (f" The value came from `.item()` at line {item.where.line} "
              f"(`{source_line(trace, item.where.line, item.where.file)}`), where it left the graph."
              if item is not None else "")
    msg = (f"The loss has no `grad_fn`, so `backward()` has nothing to differentiate. The graph was cut at "
           f"line {op.where.line} (`{code}`), which {_WHY[how]}.{before} Fix: {fix}.")
    return [at("no_grad_path", op.where, msg, op=op.op, title="The graph was cut before the loss",
               evidence={"cut": how, "code": code, "loss": loss})]
