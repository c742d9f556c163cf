"""Pure arithmetic on a trace for checkpointing: what each module saves, what it takes in, which to choose.

Used by the checkpoint fix (to choose modules) and by the OOM rule (to predict
the peak with checkpointing). Nothing here touches a tensor.

>>> saved = {"model.blocks.0": 800, "model.blocks.1": 800, "model.blocks.2": 800, "model.head": 100}
>>> inputs = {"model.blocks.0": 100, "model.blocks.1": 100, "model.blocks.2": 100, "model.head": 100}
>>> plan(saved, inputs)
(['model.blocks.0', 'model.blocks.1', 'model.blocks.2'], 1200)
"""
from __future__ import annotations

from typing import Any

from ..trace.parts import OptimizerSummary
from ..trace.records import Trace

_ELSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
           "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


def _bytes(meta: Any) -> int:
    n = 1
    for d in meta.shape:
        n *= d
    return n * _ELSIZE.get(str(meta.dtype).replace("torch.", ""), 4)


def path_key(path: str) -> list[tuple[int, int | str]]:
    """Sort key for module paths: ``blocks.2`` before ``blocks.10``."""
    return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in path.split(".")]


def _under(path: str | None, module: str) -> bool:
    return path is not None and (path == module or path.startswith(module + "."))


def saved_by_module(trace: Trace, oom_by_module: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes of activations saved for backward, by the innermost module whose forward made them."""
    if oom_by_module:
        return {k: v for k, v in oom_by_module.items() if not k.startswith("(")}
    producer: dict[int, tuple[str | None, int, bool]] = {}
    saved: dict[int, tuple[str | None, int]] = {}
    for op in trace.ops:
        ins = set(op.in_keys)
        if op.phase == "forward":
            act = op.grad_enabled and any(m.requires_grad for m in op.inputs)
            for k, meta in zip(op.out_keys, op.outputs):
                if k and k not in ins:
                    producer[k] = (op.where.module, _bytes(meta), act)
        elif op.phase == "backward":
            for k in op.in_keys:
                p = producer.get(k)
                if p is not None and p[2]:
                    saved.setdefault(k, (p[0], p[1]))
            for k in op.out_keys:
                if k and k not in ins:
                    producer.pop(k, None)
    out: dict[str, int] = {}
    for module, nbytes in saved.values():
        if module:
            out[module] = out.get(module, 0) + nbytes
    return out


def input_bytes(trace: Trace, modules: list[str]) -> dict[str, int]:
    """Bytes of activations each module receives from outside itself (what a checkpoint keeps)."""
    producer: dict[int, tuple[str | None, int, bool]] = {}
    seen: dict[str, set[int]] = {m: set() for m in modules}
    out = {m: 0 for m in modules}
    for op in trace.ops:
        if op.phase != "forward":
            continue
        ins = set(op.in_keys)
        for m in modules:
            if not _under(op.where.module, m):
                continue
            for k in op.in_keys:
                p = producer.get(k)
                if p is not None and p[2] and not _under(p[0], m) and k not in seen[m]:
                    seen[m].add(k)
                    out[m] += p[1]
        act = op.grad_enabled and any(t.requires_grad for t in op.inputs)
        for k, meta in zip(op.out_keys, op.outputs):
            if k and k not in ins:
                producer[k] = (op.where.module, _bytes(meta), act)
    return out


def inclusive(saved: dict[str, int]) -> dict[str, int]:
    """Per module, its own saved bytes plus its submodules'."""
    out: dict[str, int] = {}
    for path, nbytes in saved.items():
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            key = ".".join(parts[:i])
            out[key] = out.get(key, 0) + nbytes
    return out


def plan(saved: dict[str, int], inputs: dict[str, int]) -> tuple[list[str], int]:
    """(modules to checkpoint, predicted activation bytes kept at the peak) — ([], total) when none helps.

    A candidate set is all modules at one depth of the tree that would shrink (saved > input).
    Kept bytes: everything outside the set + the set's inputs + the biggest member, recomputed in backward.
    """
    total = sum(saved.values())
    incl = inclusive(saved)
    best: tuple[list[str], int] = ([], total)
    depths = sorted({p.count(".") for p in incl if "." in p})
    for d in depths:
        members = sorted((p for p in incl if p.count(".") == d and incl[p] > inputs.get(p, 0)),
                         key=path_key)
        # A module whose activations were all made by one child cannot be better than that child.
        if not members:
            continue
        kept = total - sum(incl[p] for p in members) + sum(inputs.get(p, 0) for p in members) \
            + max(incl[p] for p in members)
        if kept < best[1]:
            best = (members, kept)
    return best


def checkpoint_plan(trace: Trace, oom_by_module: dict[str, int] | None = None) -> tuple[list[str], int, int]:
    """(modules to checkpoint, saved activation bytes, bytes kept with them checkpointed) for this trace."""
    saved = saved_by_module(trace, oom_by_module)
    total = sum(saved.values())
    if not saved:
        return [], 0, 0
    candidates = [p for p in inclusive(saved) if "." in p]
    chosen, kept = plan(saved, input_bytes(trace, candidates))
    return chosen, total, kept


def checkpoint_estimate(trace: Trace, oom_by_module: dict[str, int] | None = None) -> tuple[int, int] | None:
    """(saved, kept) for the OOM rule's prediction; None when checkpointing would not lower the peak."""
    chosen, total, kept = checkpoint_plan(trace, oom_by_module)
    if not chosen or kept > 0.9 * total:
        return None
    return total, kept


def amp_factor(trace: Trace) -> float:
    """Share of the activation bytes AMP keeps: float32 outputs halve, integer ones (pool indices) do not."""
    floats = total = 0
    for op in trace.ops:
        if op.phase != "forward" or not op.grad_enabled or not any(m.requires_grad for m in op.inputs):
            continue
        ins = set(op.in_keys)
        for k, meta in zip(op.out_keys, op.outputs):
            if k and k not in ins:
                n = _bytes(meta)
                total += n
                floats += n if str(meta.dtype).replace("torch.", "") == "float32" else 0
    return 1 - floats / total / 2 if total else 0.5


_STATE = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "SparseAdam": 2,
          "RMSprop": 1, "Adagrad": 1, "ASGD": 1, "Rprop": 2, "LBFGS": 2}
_ADAM_LIKE = {"Adam", "AdamW", "NAdam", "RAdam", "Adamax"}


def optimizer_step_extra(opt: OptimizerSummary) -> int:
    """Bytes an optimizer step adds on top of parameters and gradients (see ``namespace.optimizer_summary``).

    State it creates on its first step (Adam: two moments), plus temporaries: the single-tensor
    implementations (the CPU default) make two of the largest parameter's size for Adam-like
    optimizers, one for others; the foreach ones (the CUDA default) one of all parameters.

    >>> optimizer_step_extra(OptimizerSummary(name="opt", type="Adam", param_bytes=100, largest=60, state_bytes=0))
    320
    """
    kind, param_bytes = opt.type, opt.param_bytes
    factor = _STATE.get(kind, 1 if kind != "SGD" or opt.momentum else 0)
    new_state = factor * param_bytes if not opt.state_bytes else 0
    if kind == "SGD":
        temps = 0
    else:
        foreach = opt.foreach
        if foreach is None:
            foreach = opt.device.startswith("cuda")
        temps = param_bytes if foreach else (2 if kind in _ADAM_LIKE else 1) * opt.largest
    return new_state + temps
