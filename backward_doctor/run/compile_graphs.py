"""One compiled region compared with eager, op by op (the bisection behind ``compile_divergence``;
orchestrated by ``run/compile_replay.py``).

torch's own accuracy minifier compares a compiled graph with its eager run and shrinks it to the
smallest part that still differs. Here the region is one ``torch.compile``'d module called with the
inputs (and weights) it had in the step, and the question is the first op whose result differs:

1. the module's forward is traced to an aten graph (``make_fx`` on ``functional_call``, stack traces
   kept: every node knows the user's line);
2. the graph runs eagerly node by node (``torch.fx.Interpreter``), each node's output kept;
3. the same graph, with every intermediate made an output, is compiled by the backend the user's
   module was compiled with and run once: the compiled value of every node;
4. the first node whose values differ beyond tolerance (NaN where eager has none counts) is the op
   (a node a later op writes into is not compared: the compiled output is its final value).

Making every node an output can change how the backend fuses (its rounding): a difference that appears
only in the fused whole is reported as such, not forced onto an op. Nothing here touches dynamo's caches
(the backend is called directly on our graph), the user's module (``functional_call`` on copies of its
weights) or their tensors (the graph runs on clones).

>>> import torch
>>> result = compare_module(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, _eager_backend)
>>> result["op"], result["ops_compared"] > 0
('', True)
"""
from __future__ import annotations

import copy
import re
from typing import Any, Callable

import torch

from ..capture.workers.code_names import CodeNames
from ..capture.frames import UserFrames

_RTOL, _ATOL = 1e-3, 1e-5
_MAX_NODES = 3000
_STACK = re.compile(r'File "(.*)", line (\d+), in (.*)\n\s*(.*)')


def backend_of(compiled: Any) -> Callable[..., Any] | None:
    """The backend a ``torch.compile``'d module or function was compiled with (``compile_fx`` for inductor,
    ``aot_eager``'s compiler, a user's callable), as a ``(graph_module, example_inputs) -> callable``."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    fn = getattr(ctx, "callback", None)
    seen = set()
    while getattr(fn, "_torchdynamo_orig_backend", None) is not None and id(fn) not in seen:
        seen.add(id(fn))
        nxt = fn._torchdynamo_orig_backend
        if nxt is fn:
            break
        fn = nxt
    return fn if callable(fn) else None


def _eager_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    return gm.forward


def compare_module(module: torch.nn.Module, args: tuple, kwargs: dict, backend: Callable[..., Any],
                   state: dict[str, torch.Tensor] | None = None, frames: UserFrames | None = None) -> dict[str, Any]:
    """Compare ``module(*args, **kwargs)`` compiled by ``backend`` with eager, op by op (module doc).
    ``state``: the weights and buffers it had at that call (default: its current ones). Returns plain
    data: ``op`` ('' when none differs), its ``line``/``file``/``function``/``code``, ``detail``,
    ``max_diff``, ``dropped`` (a custom op before it the compiler may drop), ``stage``, ``ops_compared``,
    ``why_not``. The user's RNG is left as it was (every run here draws from a forked one, each from the same
    seed, so dropout draws the same mask eagerly and compiled: inductor's own random numbers are switched
    to torch's for it)."""
    with torch.random.fork_rng(devices=[]), _torch_random():
        return _compare(module, args, kwargs, backend, state, frames or UserFrames(cell_file="<cell>"))


def _torch_random() -> Any:
    """Inductor's ``fallback_random``: random ops run as torch's, so a seeded eager run and a compiled one draw
    the same numbers (a no-op context where inductor is not there)."""
    try:
        from torch._inductor import config

        return config.patch(fallback_random=True)
    except Exception:  # noqa: BLE001
        import contextlib

        return contextlib.nullcontext()


def _compare(module: torch.nn.Module, args: tuple, kwargs: dict, backend: Callable[..., Any],
             state: dict[str, torch.Tensor] | None, frames: UserFrames) -> dict[str, Any]:
    state = state if state is not None else {**dict(module.named_parameters()), **dict(module.named_buffers())}
    names = list(state)
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    out: dict[str, Any] = {"op": "", "ops_compared": 0, "why_not": "", "stage": "", "dropped": ""}

    def call(*flat: torch.Tensor) -> Any:
        call_args = list(args)
        for i, t in zip(tensors, flat[len(names):]):
            call_args[i] = t
        return torch.func.functional_call(module, dict(zip(names, flat[:len(names)])), tuple(call_args), kwargs)

    inputs = [state[n].detach() for n in names] + [args[i].detach() for i in tensors]
    try:
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(call, record_stack_traces=True)(*_clones(inputs))
    except Exception as exc:  # noqa: BLE001 - a region make_fx cannot trace: say so, compare nothing
        out["why_not"] = f"its forward could not be traced op by op ({type(exc).__name__}: {str(exc)[:160]})"
        return out
    written = _written(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
             and n.name not in written]
    if len(nodes) > _MAX_NODES:
        out["why_not"] = f"its graph has {len(nodes)} ops, more than the {_MAX_NODES} compared one by one"
        return out
    eager = _eager_values(gm, inputs)
    try:
        compiled = _compiled_values(gm, nodes, inputs, backend)
    except Exception as exc:  # noqa: BLE001
        out["why_not"] = f"the backend could not compile the region's graph ({type(exc).__name__}: {str(exc)[:160]})"
        return out
    out["ops_compared"] = len(nodes)
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    for node, value in zip(nodes, compiled):
        ref = eager.get(node.name)
        if ref is None or not isinstance(value, torch.Tensor) or _same(ref, value):
            continue
        out.update(_describe(node, ref, value, frames))
        if out["file"] is not None:
            out["function"] = CodeNames(module.modules()).qualname(out["file"], out["function"], out["line"])
        out["stage"] = "forward"
        out["dropped"] = _dropped_before(gm, order[node.name])
        return out
    out["stage"] = "backward" if _backward_differs(gm, inputs, len(names), backend) else ""
    if not out["stage"]:
        out["why_not"] = "every op of its forward and its gradients agree with eager at this call"
    return out


def _written(gm: torch.fx.GraphModule) -> set[str]:
    """Nodes a later op writes into (``relu_``, ``add_``, an ``out=``): their value as an output of the compiled
    graph is the final one, not the one eager had at that node, so they are not compared (the op that
    wrote into them is)."""
    written = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
                written.add(value.name)
    return written


def _clones(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in inputs]


def _eager_values(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every node's output as the graph runs eagerly (kept at once: a later in-place op must not change it)."""
    values: dict[str, torch.Tensor] = {}

    class _Keep(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            r = super().run_node(n)
            if isinstance(r, torch.Tensor):
                values[n.name] = r.detach().clone()
            return r

    torch.manual_seed(0)
    with torch.no_grad():
        _Keep(gm).run(*_clones(inputs))
    return values


def _compiled_values(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], inputs: list[torch.Tensor],
                     backend: Callable[..., Any]) -> list[Any]:
    """The same graph with every node an output, compiled by ``backend``: each node's compiled value."""
    every = copy.deepcopy(gm)
    keep = {n.name for n in nodes}
    outs = [n for n in every.graph.nodes if n.name in keep]
    every.graph.erase_node(next(n for n in every.graph.nodes if n.op == "output"))
    every.graph.output(tuple(outs))
    every.recompile()
    with torch.no_grad():
        fn = backend(every, _clones(inputs))
        torch.manual_seed(0)
        result = fn(*_clones(inputs))
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=_RTOL, atol=_ATOL, equal_nan=True))


def _describe(node: torch.fx.Node, eager: torch.Tensor, compiled: torch.Tensor, frames: UserFrames) -> dict[str, Any]:
    """The op, its user line (the innermost user frame of the node's stack trace) and the two values."""
    where: dict[str, Any] = {"op": str(node.target), "line": None, "file": None, "function": "", "code": ""}
    for m in reversed(list(_STACK.finditer(node.meta.get("stack_trace") or ""))):
        if frames.is_user(m.group(1)):
            where.update(line=int(m.group(2)), file=m.group(1), function=m.group(3), code=m.group(4).strip())
            break
    where["detail"], where["max_diff"] = _values(eager, compiled)
    return where


def _values(eager: torch.Tensor, compiled: torch.Tensor) -> tuple[str, float | None]:
    if not eager.is_floating_point() or eager.shape != compiled.shape:
        return f"eager {list(eager.shape)} {eager.dtype}, compiled {list(compiled.shape)} {compiled.dtype}", None
    bad_c, bad_e = int((~compiled.isfinite()).sum()), int((~eager.isfinite()).sum())
    n = eager.numel()
    if bad_c != bad_e:
        return (f"compiled: {bad_c} of {n} values NaN/Inf; eager: {bad_e}"), None
    both = eager.isfinite() & compiled.isfinite()
    diff = float((eager[both].double() - compiled[both].double()).abs().max()) if both.any() else 0.0
    scale = float(eager[both].abs().max()) if both.any() else 0.0
    return f"largest difference {diff:.3g} (eager max |x| {scale:.3g})", diff


def _dropped_before(gm: torch.fx.GraphModule, upto: int) -> str:
    """A custom op before node ``upto`` that returns nothing and declares no argument it mutates: a
    compiler takes it for pure, with no result anyone uses, and removes it (its in-place writes with it)."""
    for k, n in enumerate(gm.graph.nodes):
        if k >= upto:
            break
        target = n.target
        schema = getattr(target, "_schema", None)
        if n.op != "call_function" or schema is None or target.namespace in ("aten", "prims", "_c10d_functional"):
            continue
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not schema.returns and not mutates:
            return str(target).rsplit(".", 1)[0]
    return ""


def _tupled(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose output is a tuple (what a backend called on a graph directly requires)."""
    every = copy.deepcopy(gm)
    out = next(n for n in every.graph.nodes if n.op == "output")
    if not isinstance(out.args[0], (tuple, list)):
        value = out.args[0]
        every.graph.erase_node(out)
        every.graph.output((value,))
        every.recompile()
    return every


def _backward_differs(gm: torch.fx.GraphModule, inputs: list[torch.Tensor], n_weights: int,
                      backend: Callable[..., Any]) -> bool:
    """The region's weight gradients (for the sum of its outputs), compiled vs eager."""
    def grads(make: Callable[[list[torch.Tensor]], Callable[..., Any]]) -> list[torch.Tensor | None]:
        xs = [t.clone().requires_grad_(t.is_floating_point() and k < n_weights) for k, t in enumerate(inputs)]
        fn = make(xs)  # (compiled for inputs that require grad: else the backend makes an inference graph)
        torch.manual_seed(0)
        out = fn(*xs)
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return []
        leaves = [x for x in xs if x.requires_grad]
        return list(torch.autograd.grad(sum(o.float().sum() for o in outs), leaves, allow_unused=True))

    try:
        eager = grads(lambda xs: gm)
        compiled = grads(lambda xs: backend(_tupled(gm), xs))
    except Exception:  # noqa: BLE001 - a backward that cannot be run here: no verdict on it
        return False
    return any((a is None) != (b is None) or (a is not None and not _same(a, b)) for a, b in zip(eager, compiled))


__all__ = ["backend_of", "compare_module"]
