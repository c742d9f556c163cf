"""Where a compiled region's backward parts from eager, op by op (``compile_graphs.py`` compares its forward; this
is asked when the forward agrees and the gradients do not: the inf/NaN gradients of a GradScaler that keeps
skipping, behind a finite loss).

The region's forward and backward are traced into one aten graph (``make_fx`` around ``torch.autograd.grad``),
the way AOTAutograd traces its joint graph: node meta preserved, and a hook on every autograd node that tells the
tracer which forward op's backward is running (``seq_nr``: a backward node carries the number of the forward
node whose gradient it computes). The graph then runs eagerly and compiled by the user's backend with every node
an output, as the forward comparison does; the first backward node whose values differ is named by its forward
op, whose stack trace is the user's line. AOTAutograd's hook-setting helper is private: where it is missing,
nothing is located (the finding says the backward differs, without a line).

>>> import torch
>>> from backward_doctor.run.compile_graphs import _eager_backend
>>> first_in_backward(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, _eager_backend) is None
True
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..capture.workers.code_names import CodeNames
from .compile_graphs import _clones, _compiled_values, _describe, _eager_values, _same, _torch_random, _written
from ..capture.frames import UserFrames


def _hooks() -> Callable[[list[Any]], None] | None:
    try:
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    except Exception:  # noqa: BLE001 - another torch: no backward located
        return None
    return setup_stacktrace_preservation_hooks


def first_in_backward(module: torch.nn.Module, args: tuple, kwargs: dict, backend: Callable[..., Any],
                      state: dict[str, torch.Tensor] | None = None, frames: UserFrames | None = None
                      ) -> dict[str, Any] | None:
    """The first op whose gradient differs compiled and eager, as ``compare_module``'s fields (``stage``
    ``"backward"``, ``detail`` saying it is the gradient), or None where none is found or nothing can be traced.
    The user's RNG is left as it was."""
    hooks = _hooks()
    if hooks is None:
        return None
    with torch.random.fork_rng(devices=[]), _torch_random():
        try:
            return _first(module, args, kwargs, backend, state, frames or UserFrames(cell_file="<cell>"), hooks)
        except Exception:  # noqa: BLE001 - a region this cannot trace or compile: no line, as before
            return None


def _first(module: torch.nn.Module, args: tuple, kwargs: dict, backend: Callable[..., Any],
           state: dict[str, torch.Tensor] | None, frames: UserFrames, hooks: Callable[[list[Any]], None]
           ) -> dict[str, Any] | None:
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    state = state if state is not None else {**dict(module.named_parameters()), **dict(module.named_buffers())}
    names = list(state)
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    weights = [k for k, n in enumerate(names) if state[n].is_floating_point()]

    def joint(*flat: torch.Tensor) -> Any:
        flat = list(flat)
        for k in weights:
            flat[k] = flat[k].requires_grad_(True)
        call_args = list(args)
        for i, t in zip(tensors, flat[len(names):]):
            call_args[i] = t
        with fx_traceback.preserve_node_meta():
            out = torch.func.functional_call(module, dict(zip(names, flat[:len(names)])), tuple(call_args), kwargs)
            outs = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            hooks([o.grad_fn for o in outs if o.grad_fn is not None])
            leaves = [flat[k] for k in weights]
            return torch.autograd.grad(sum(o.float().sum() for o in outs), leaves, allow_unused=True)

    inputs = [state[n].detach() for n in names] + [args[i].detach() for i in tensors]
    gm = make_fx(joint, record_stack_traces=True)(*_clones(inputs))
    written = _written(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
             and n.name not in written]
    forward = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.meta.get("autograd_backward") and "seq_nr" in n.meta:
            forward.setdefault(n.meta["seq_nr"], n)
    eager = _eager_values(gm, inputs)
    compiled = _compiled_values(gm, nodes, inputs, backend)
    for node, value in zip(nodes, compiled):
        ref = eager.get(node.name)
        if ref is None or not isinstance(value, torch.Tensor) or _same(ref, value):
            continue
        if not node.meta.get("autograd_backward"):
            return None  # (the forward differs in this whole graph: compare_module's answer stands)
        fwd = forward.get(node.meta.get("seq_nr"))
        if fwd is None:
            return None
        out = _describe(fwd, ref, value, frames)
        out["detail"] = f"its gradient ({node.target} in its backward): {out['detail']}"
        if out["file"] is not None:
            out["function"] = CodeNames(module.modules()).qualname(out["file"], out["function"], out["line"])
        out["stage"] = "backward"
        return out
    return None


__all__ = ["first_in_backward"]
