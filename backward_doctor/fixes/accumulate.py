"""``accumulate:k``: the same step in k micro-batches, gradients added up in ``.grad``.

The batch is found by name: tensors the cell reads (or tuples, lists, dicts of
tensors) that share a leading dimension and are not parameters or buffers. The
lines from the first one that reads the batch through ``backward()`` become the
body of an explicit loop over micro-batches; ``zero_grad()`` stays before it and
``step()`` after it, so the optimizer sees the whole batch's gradient once.

>>> import torch
>>> ns = {"model": torch.nn.Linear(3, 1), "x": torch.ones(8, 3), "y": torch.ones(8, 1), "torch": torch}
>>> src = "opt.zero_grad()\\nloss = torch.nn.functional.mse_loss(model(x), y)\\nloss.backward()\\nopt.step()\\n"
>>> print(rewrite(src, ns, 2).code, end="")  # doctest: +ELLIPSIS
opt.zero_grad()
# backward_doctor fix accumulate:2 - the same step in 2 micro-batches...
...
for start in range(0, batch_size, micro_size):
    x_micro = x[start:start + micro_size]
    y_micro = y[start:start + micro_size]
    share = x_micro.shape[0] / batch_size  # the loss is a mean over its batch: weight each part by its size
    loss = torch.nn.functional.mse_loss(model(x_micro), y_micro)
    (loss * share).backward()
    loss_total += loss.detach() * share
loss = loss_total  # the loss of the whole batch, as the original cell computed it
opt.step()
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture import namespace as ns_mod
from ..util.cell import Cell, NotApplicable, check_compiles, fresh_name, indent


@dataclass
class Rewrite:
    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class BatchItem:
    name: str
    kind: str      # "tensor", "tuple", "list", "dict"
    size: int      # leading dimension
    nbytes: int
    first_key: Any = None


def _owned_ids(namespace: dict[str, Any]) -> set[int]:
    """ids of every parameter and buffer of the namespace's modules and optimizers."""
    ids: set[int] = set()
    for _, mod in ns_mod.modules(namespace):
        ids.update(id(p) for p in mod.parameters())
        ids.update(id(b) for b in mod.buffers())
    for _, opt in ns_mod.optimizers(namespace):
        for group in opt.param_groups:
            ids.update(id(p) for p in group["params"])
    return ids


def _as_batch(name: str, value: Any, owned: set[int]) -> BatchItem | None:
    def ok(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and id(t) not in owned \
            and t.dim() >= 1 and t.shape[0] >= 1 and t.layout == torch.strided
    if ok(value):
        return BatchItem(name, "tensor", int(value.shape[0]), value.numel() * value.element_size())
    if isinstance(value, (tuple, list)) and value and len(value) <= 64 and all(ok(t) for t in value):
        sizes = {int(t.shape[0]) for t in value}
        if len(sizes) == 1:
            return BatchItem(name, "tuple" if isinstance(value, tuple) else "list", sizes.pop(),
                             sum(t.numel() * t.element_size() for t in value))
    if isinstance(value, dict) and value and len(value) <= 64 and all(ok(t) for t in value.values()):
        sizes = {int(t.shape[0]) for t in value.values()}
        if len(sizes) == 1:
            return BatchItem(name, "dict", sizes.pop(), sum(t.numel() * t.element_size() for t in value.values()),
                             first_key=next(iter(value)))
    return None


def find_batch(cell: Cell, namespace: dict[str, Any], upto: int) -> tuple[list[BatchItem], int]:
    """The batch the step reads by name, and the statement where the per-micro-batch part starts.

    The part starts at the first statement that calls a model from the namespace (else at the
    first that reads a batch-like tensor); the batch is the largest group of batch-like tensors
    read from there to ``backward()`` that share a leading dimension. Tensors made inside that
    part before they are read (``h = model.body(x)``) are intermediates, not the batch.
    """
    owned = _owned_ids(namespace)
    fwd = cell.forward_start(namespace, upto)
    lo = 0 if fwd is None else fwd
    first_load: dict[str, int] = {}
    first_store: dict[str, int] = {}
    for i in range(lo, upto + 1):
        for n in cell.loads_in_order(i):
            first_load.setdefault(n, i)
        for n in cell.stores(i):
            first_store.setdefault(n, i)
    items = []
    for name, i in sorted(first_load.items(), key=lambda kv: kv[1]):
        if name not in namespace or first_store.get(name, upto + 1) < i:
            continue
        item = _as_batch(name, namespace[name], owned)
        if item is not None:
            items.append(item)
    if not items:
        made = sorted(n for n in first_store if n in namespace and _as_batch(n, namespace[n], owned))
        hint = (f" {', '.join('`' + n + '`' for n in made[:4])} {'is' if len(made) == 1 else 'are'} made inside "
                "the step itself; make the batch before the line that calls the model.") if made else ""
        raise NotApplicable("found no batch to split: from the model call to backward() the cell reads no tensor "
                            "(or tuple/dict of tensors) by name that is not a parameter or buffer." + hint)
    groups: dict[int, list[BatchItem]] = {}
    for item in items:
        groups.setdefault(item.size, []).append(item)
    size, group = max(groups.items(), key=lambda kv: sum(it.nbytes for it in kv[1]))
    if size < 2:
        raise NotApplicable(f"the batch ({', '.join(it.name for it in group)}) has a leading dimension of {size}: "
                            "there is nothing to split into micro-batches")
    start = fwd if fwd is not None else min(first_load[it.name] for it in group)
    return group, start


def _reduction(cell: Cell, namespace: dict[str, Any], region: range, loss: str | None) -> str:
    """'sum' when the loss is visibly a sum over the batch, else 'mean' (the PyTorch default)."""
    exprs: list[ast.AST] = []
    recv = cell.backward_receiver()
    if recv is not None:
        exprs.append(recv)
    if loss:
        for i in region:
            stmt = cell.stmts[i]
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and loss in cell.stores(i):
                exprs = [stmt.value] + exprs
    for expr in exprs:
        for node in ast.walk(expr):
            for kw in getattr(node, "keywords", []) or []:
                if kw.arg == "reduction" and isinstance(kw.value, ast.Constant) and kw.value.value == "sum":
                    return "sum"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                crit = namespace.get(node.func.id)
                if isinstance(crit, torch.nn.Module) and getattr(crit, "reduction", None) == "sum":
                    return "sum"
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "sum" \
                and not expr.args:
            return "sum"
    return "mean"


def _default_k(original: Any, batch: int) -> tuple[int, str]:
    """k from the OOM finding's predictions (smallest that fits 90% of the device), else 4."""
    finding = next((f for f in getattr(original, "findings", []) if f.kind == "oom"), None)
    if finding is not None:
        ev = finding.evidence
        limit = ev.get("limit")
        preds = ev.get("predicted_peak") or {}
        if limit:
            for k in (2, 4, 8, 16, 32, 64):
                pred = preds.get(f"accumulate:{k}")
                if pred is None and k > 8 and "accumulate:8" in preds and "accumulate:4" in preds:
                    per = preds["accumulate:4"] - preds["accumulate:8"]   # = act/8
                    pred = preds["accumulate:8"] - per + per * 8 // k
                if pred is not None and pred <= 0.9 * limit and k <= batch:
                    return k, f"k={k} is the smallest predicted to fit the device"
    return min(4, batch), "k=4 by default (no prediction to choose from)"


def split_batch(k: int | None, original: Any, batch: int) -> int:
    """How many equal micro-batches a library's batch of ``batch`` is split into: ``k`` when given, else the
    smallest divisor of ``batch`` from the prediction's choice up (``_default_k``); ``NotApplicable`` when it does
    not split evenly.

    >>> split_batch(None, None, 6), split_batch(2, None, 8)
    (6, 2)
    """
    if k is None:
        k, _ = _default_k(original, batch)
        k = next((d for d in range(max(2, k), batch + 1) if batch % d == 0), batch)
    if k < 2 or batch % k:
        raise NotApplicable(f"a batch of {batch} does not split into {k} equal micro-batches")
    return k


def rewrite(source: str, namespace: dict[str, Any], k: int | None, original: Any = None,
            reuse: set[str] = frozenset()) -> Rewrite:
    """The cell with an explicit micro-batch loop (``reuse``: names a previous rewrite made, free to take again)."""
    cell = Cell(source)
    b = cell.backward_index()
    group, start_i = find_batch(cell, namespace, b)
    names = {it.name for it in group}
    # A step before backward, or zero_grad between forward and backward, must be moved or refused.
    for i in range(start_i, b + 1):
        if cell.calls_attr(i, ("step",)) and i < b:
            raise NotApplicable(f"line {cell.stmts[i].lineno} calls .step() before backward; the fix needs "
                                "zero_grad, forward, loss, backward, step in that order")
    hoisted = [i for i in range(start_i, b) if cell.is_call(i, "zero_grad")]
    made = sorted({n for n in names for i in range(start_i) if n in cell.stores(i)})
    if made:
        warnings_pre = [f"the cell makes {', '.join('`' + n + '`' for n in made)} itself, so the fixed run splits "
                        "what that code gives then (from a data iterator: the next batch)"]
    else:
        warnings_pre = []
    body = [i for i in range(start_i, b + 1) if i not in hoisted]
    size = group[0].size
    note = ""
    if k is None:
        k, note = _default_k(original, size)
    warnings: list[str] = list(warnings_pre)
    if k > size:
        warnings.append(f"accumulate:{k} asked for more micro-batches than the batch has rows ({size}); using {size}")
        k = size
    loss = cell.loss_name()
    reduction = _reduction(cell, namespace, range(start_i, b + 1), loss)

    taken = cell.all_names() | (set(namespace) - set(reuse))
    steps_v = fresh_name("accum_steps", taken)
    size_v = fresh_name("batch_size", taken)
    micro_v = fresh_name("micro_size", taken)
    start_v = fresh_name("start", taken)
    share_v = fresh_name("share", taken) if reduction == "mean" else None
    total_v = fresh_name(f"{loss}_total", taken) if loss else None
    micro_names = {it.name: fresh_name(f"{it.name}_micro", taken) for it in group}

    first = group[0]
    if first.kind == "tensor":
        size_expr = f"{first.name}.shape[0]"
    elif first.kind == "dict":
        size_expr = f"{first.name}[{first.first_key!r}].shape[0]"
    else:
        size_expr = f"{first.name}[0].shape[0]"
    sl = f"[{start_v}:{start_v} + {micro_v}]"
    lines = [f"# backward_doctor fix accumulate:{k} - the same step in {k} micro-batches. Each backward adds its\n",
             "# gradients into .grad, so the optimizer step below sees the gradient of the whole batch.\n",
             f"{steps_v} = {k}\n",
             f"{size_v} = {size_expr}\n",
             f"{micro_v} = -(-{size_v} // {steps_v})  # rows per micro-batch (the last one may be smaller)\n"]
    if total_v:
        lines.append(f"{total_v} = 0.0\n")
    lines.append(f"for {start_v} in range(0, {size_v}, {micro_v}):\n")
    for it in group:
        m = micro_names[it.name]
        if it.kind == "tensor":
            lines.append(f"    {m} = {it.name}{sl}\n")
        elif it.kind == "dict":
            lines.append(f"    {m} = {{key: value{sl} for key, value in {it.name}.items()}}\n")
        elif it.kind == "tuple":
            lines.append(f"    {m} = tuple(t{sl} for t in {it.name})\n")
        else:
            lines.append(f"    {m} = [t{sl} for t in {it.name}]\n")
    if share_v:
        first_micro = micro_names[first.name]
        mshape = {"tensor": f"{first_micro}.shape[0]", "dict": f"{first_micro}[{first.first_key!r}].shape[0]"}.get(
            first.kind, f"{first_micro}[0].shape[0]")
        lines.append(f"    {share_v} = {mshape} / {size_v}  # the loss is a mean over its batch: "
                     "weight each part by its size\n")
    call = cell.backward_call()
    recv = cell.backward_receiver()
    for i in body:
        edits = [(*cell.span(n), micro_names[n.id]) for n in cell.names_in(i, names)]
        if i == b and share_v:
            if recv is not None:
                lo, hi = cell.span(recv)
                inner = cell.edited_span(lo, hi, edits)
                edits = [e for e in edits if not (lo <= e[0] and e[1] <= hi)]
                edits.append((lo, hi, f"({inner} * {share_v})"))
            else:  # torch.autograd.backward(loss): scale its first argument
                arg = call.args[0]
                lo, hi = cell.span(arg)
                inner = cell.edited_span(lo, hi, edits)
                edits = [e for e in edits if not (lo <= e[0] and e[1] <= hi)]
                edits.append((lo, hi, f"{inner} * {share_v}"))
        lines.append(indent(cell.edited(i, edits)))
    if total_v:
        lines.append(f"    {total_v} += {loss}.detach(){' * ' + share_v if share_v else ''}\n")
        lines.append(f"{loss} = {total_v}  # the loss of the whole batch, as the original cell computed it\n")
    prefix = cell.kept(range(start_i)) + cell.kept(hoisted)  # untouched lines stay as written (`a; b`)
    suffix = cell.kept(range(b + 1, len(cell.stmts)))
    code = prefix + "".join(lines) + suffix
    check_compiles(code)

    # What changes besides memory, said plainly.
    loop_vars = sorted(set().union(*(cell.stores(i) for i in body)) - {loss} - names)
    later = sorted(v for v in loop_vars if any(v in cell.loads(i) for i in range(b + 1, len(cell.stmts))))
    if later:
        warnings.append(f"after the loop {', '.join('`' + v + '`' for v in later)} hold the last micro-batch's "
                        "values, not the whole batch's")
    bn = [type(m).__name__ for _, mod in ns_mod.modules(namespace) for m in mod.modules()
          if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if bn:
        warnings.append(f"the model has {bn[0]} layers in training mode: they normalise each micro-batch with its "
                        "own statistics, so gradients are close to, not equal to, the full batch's")
    dropout = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
                  for _, mod in ns_mod.modules(namespace) for m in mod.modules())
    if dropout:
        warnings.append("dropout draws different random masks per micro-batch (same distribution)")
    batch_desc = ", ".join(f"`{it.name}`" for it in group)
    how = (f"each micro-batch's loss is weighted by its share of the batch (assumes the loss is a mean over the batch, "
           f"PyTorch's default)" if share_v else "the loss is a sum over the batch, so micro-batch losses add up as they are")
    msg = (f"Split the batch {batch_desc} ({size} rows) into {k} micro-batches of up to {-(-size // k)} rows; "
           f"{how}. {note + '. ' if note else ''}")
    return Rewrite(code=code, message=msg, warnings=warnings,
                   details={"k": k, "batch": [it.name for it in group], "batch_size": size, "reduction": reduction,
                            "loss": loss, "loop_start_line": cell.stmts[start_i].lineno})
