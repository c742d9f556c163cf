"""A loss that spiked and stayed finite, probed after the run: which batch, which layer, which line.

The loop watch records every iteration's loss anyway; after the run, :func:`probe_spike` reads that series
(``trace/spikes.py``: far above its recent trend) and, for the first spike, runs the loop's body again on two
batches, the spiking one and the one before it, from the weights the run ended with, with each module's output and
gradient norms measured (``capture/recorder/layer_norms.py``). The state before the spike is not kept (that would cost every
iteration of every loop): the probe compares the two batches under the same weights, which is what tells a batch
that makes the loss jump (its values far out of the others' range, its labels) from a moment of the training (the
learning rate, an unstable update). Then the state the run ended with is put back (weights, optimizer state, RNG,
the namespace's names and containers): the user's results are the plain run's.

Only a loop the cell writes over something that gives the same batches again is probed: a list, a tuple, a
tensor, a ``range``, ``enumerate``/``zip`` of those, a ``DataLoader`` that does not shuffle and has no workers.

>>> _reiterable([1, 2]), _reiterable(iter([1, 2])), _reiterable(range(3))
(True, False, True)
>>> _reiterable(torch.utils.data.TensorDataset(torch.zeros(2))), _reiterable(torch.utils.data.DataLoader([1], shuffle=True))
(True, False)
>>> _outside(ast.parse("for b in d:\\n    wandb.log({'loss': 1})\\n    y = torch.log(b)").body[0])[:33]
"the loop's body calls `wandb.log("
"""
from __future__ import annotations

import ast
import contextlib
import copy
import io
import itertools
import math
from typing import Any

import torch

from ..capture.recorder.layer_norms import LayerNorms
from ..trace.records import Trace
from ..trace.spikes import LayerJump, LossSpike, spike_points, trend
from ..util.loops import one_iteration, training_loop
from .snapshot import Bindings, take_if_it_fits

_CONTAINERS = (list, dict, set)
_CALLS = {"enumerate", "zip", "range", "list", "tuple", "reversed", "len"}
#: calls of a loop body that reach outside the process (a log, a checkpoint): a probe would do them again
_OUTSIDE = {"save", "save_pretrained", "save_state", "save_checkpoint", "log", "log_dict", "log_metrics", "add_scalar",
            "add_scalars", "add_histogram", "write", "writerow", "dump", "send", "put", "upload"}
_MATH = {"torch", "math", "np", "numpy", "F", "cmath", "jnp"}
_CONTEXT = 8  # batches before the spiking one read to describe it (their values' range)


def spike_of(trace: Trace) -> LossSpike | None:
    """The first spike of the run's loss series (None: none, or the run raised or went NaN/Inf: other findings)."""
    its = trace.iterations
    if trace.exception is not None or trace.timed_out or its.first_nonfinite is not None:
        return None
    if len({(s.file, s.line) for s in trace.optimizer_steps}) > 1:
        return None  # (steps called from several places: the series may join several loops, a new one starting high)
    points = spike_points(its.loss)
    if not points:
        return None
    i = points[0]
    med, mad = trend(its.loss, i)
    loss = its.loss[i]
    return LossSpike(iteration=i * its.stride, loss=loss, median=med, ratio=loss / med,
                     mads=(loss - med) / max(1.4826 * mad, 0.01 * med), spikes=len(points))


def probe_spike(trace: Trace, namespace: dict[str, Any], run_again: bool = True) -> Trace:
    """``trace`` with ``loss_spike`` set where its loss series spiked, probed where the loop can be run again
    (``run_again=False``: the run asked for no replay; never in a distributed run: its collectives have no peers)."""
    spike = spike_of(trace)
    if spike is None:
        return trace
    trace.loss_spike = spike
    dist = torch.distributed
    if not run_again or (dist.is_available() and dist.is_initialized()):
        spike.why_not = ("the run asked for no replay (`rollback=False`)" if not run_again else
                         "a distributed run: the loop's body would issue collectives no other rank joins")
        return trace
    try:
        spike.why_not = _probe(spike, trace, namespace)
    except Exception as exc:  # noqa: BLE001 - the probe is the doctor's: the spike is still said, unprobed
        spike.why_not = (f"the loop's body could not be run again on its own ({type(exc).__name__}: "
                         f"{str(exc)[:200]})")
    return trace


def _reiterable(value: Any) -> bool:
    """Whether iterating ``value`` again gives the same items, drawing nothing from a user's iterator."""
    if isinstance(value, (list, tuple, range, torch.Tensor, str, dict)):
        return True
    data = torch.utils.data
    if isinstance(value, data.Dataset) and not isinstance(value, data.IterableDataset) and hasattr(value, "__len__"):
        return True  # (a map-style dataset iterates by index: the same items again)
    if type(value) is torch.utils.data.DataLoader:  # (a library's subclass keeps state of its own as it iterates)
        sampler = getattr(value.batch_sampler, "sampler", value.sampler)
        return value.num_workers == 0 and isinstance(sampler, torch.utils.data.SequentialSampler)
    return False


def _iterable_why(node: ast.expr, ns: dict[str, Any]) -> str:
    """Why the loop's iterable cannot be iterated again to the same batches ('' when it can)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _CALLS):
            return f"the loop iterates `{ast.unparse(node)}`, a call the probe does not run again"
        if isinstance(n, ast.Name) and n.id not in _CALLS:
            value = ns.get(n.id)
            if type(value) is torch.utils.data.DataLoader and not _reiterable(value):
                return (f"`{n.id}` shuffles or loads in worker processes: the batch of that iteration cannot be "
                        "drawn again")
            if isinstance(value, torch.utils.data.DataLoader) and type(value) is not torch.utils.data.DataLoader:
                return (f"`{n.id}` is a {type(value).__name__}, a library's DataLoader that keeps state of its own as "
                        "it iterates: the probe does not iterate it again")
    for n in ast.walk(node):  # the outermost values the expression reads must give their items again
        if isinstance(n, ast.Name) and n.id not in _CALLS and n.id in ns and not isinstance(ns[n.id], (int, float)) \
                and not _reiterable(ns[n.id]):
            return f"`{n.id}` is not a sequence the probe can iterate again (a generator or an iterator)"
    return ""


def _outside(loop: ast.For) -> str:
    """Why the loop's body is not run again: it logs or saves (a dashboard's point, a file written twice)."""
    for n in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _OUTSIDE and not (
                n.func.attr == "log" and (not n.args or ast.unparse(n.func.value) in _MATH)):  # (``torch.log(x)``)
            return (f"the loop's body calls `{ast.unparse(n.func)}(...)` (line {n.lineno}), which a probe would do "
                    "again outside the notebook (a logged point, a file written)")
    return ""


def _probe(spike: LossSpike, trace: Trace, namespace: dict[str, Any]) -> str:
    its = trace.iterations
    if its.library:
        return f"the {its.library} loop draws its own batches: the probe runs only a loop the cell writes"
    if any(b > 1 for b in its.backwards):
        return "the loop accumulates gradients over several batches per step: its batches are not one per iteration"
    loop = training_loop(trace.source)
    found = one_iteration(trace.source, trace.cell_file) if isinstance(loop, ast.For) else None
    if loop is None or found is None or not isinstance(loop, ast.For):
        return "the cell has no `for` loop over its batches whose body can be run again"
    spike.loop_line, spike.source = loop.lineno, ast.unparse(loop.iter)
    why = _iterable_why(loop.iter, namespace) or _outside(loop)
    if why:
        return why
    code, names = found
    end, why = take_if_it_fits(namespace, source=trace.source)
    if end is None:
        return why
    left = Bindings(namespace)
    try:
        items, index, why = _batches(loop, trace, namespace, spike.iteration)
        if why:
            return why
        spike.batch, spike.baseline = index, index - 1 if index > 0 else index + 1
        if spike.baseline not in items:
            return "the loop's iterable has one batch: there is none to compare the spiking one with"
        _describe(spike, items, names, loop.target, namespace)
        spike.fetch = _fetch(loop.iter, namespace, index)
        base = _run_body(code, loop.target, items[spike.baseline], namespace, trace.cell_file, end)
        hit = _run_body(code, loop.target, items[index], namespace, trace.cell_file, end)
    finally:
        end.restore(namespace)
        left.restore(namespace)
    trace.notes.append(f"The loss spiked in iteration {spike.iteration}: after the run, the loop's body was run twice "
                       f"more, on batch {spike.batch} and batch {spike.baseline}, from the weights the run ended with, "
                       "which were then put back (weights, optimizer state, RNG, the notebook's names); what the body "
                       "did outside the model and the optimizer (printing, which was hidden) happened again")
    spike.replay_loss = hit.losses[-1] if hit.losses else None
    spike.baseline_loss = base.losses[-1] if base.losses else None
    _compare(spike, hit, base)
    return ""


def _batches(loop: ast.For, trace: Trace, namespace: dict[str, Any], k: int) -> tuple[dict[int, Any], int, str]:
    """The items of the loop's iterable around the spiking one, by index (``_CONTEXT`` before it, one after), the
    spiking one's index (iteration ``k`` counted across the passes of an outer loop), and why not ('')."""
    ns = {n: (copy.copy(v) if type(v) in _CONTAINERS else v) for n, v in namespace.items()}
    expr = compile(ast.Expression(body=loop.iter), trace.cell_file, "eval")
    index = k
    if _nested(trace.source, loop):  # (an epoch loop around it: the iterable is passed through once per epoch)
        size = _length(loop.iter, ns, trace.cell_file)
        if size is None:
            return {}, k, "the loop runs inside another one over an iterable with no length"
        if size == 0:
            return {}, k, "the loop's iterable is empty now"
        index = k % size
    first = max(0, index - _CONTEXT)
    items = dict(enumerate(itertools.islice(eval(expr, ns), first, index + 2), start=first))  # noqa: S307
    if index not in items:
        return {}, index, f"the loop's iterable has no item {index} now"
    return items, index, ""


def _length(node: ast.expr, ns: dict[str, Any], cell_file: str) -> int | None:
    """How many items the loop's iterable gives (``enumerate``/``reversed``/``list``/``tuple`` of one, the shortest
    of a ``zip``), without iterating it; None: no length."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("enumerate", "reversed",
                                                                                             "list", "tuple", "zip"):
        sizes = [_length(a, ns, cell_file) for a in node.args[:1 if node.func.id != "zip" else None]]
        return None if not sizes or None in sizes else min(sizes)  # type: ignore[type-var]
    try:
        return len(eval(compile(ast.Expression(body=node), cell_file, "eval"), ns))  # noqa: S307 - checked
    except TypeError:
        return None


def _fetch(node: ast.expr, ns: dict[str, Any], index: int) -> str:
    """Code that gives batch ``index`` of the loop's iterable back: ``batches[25]`` for a sequence the loop iterates
    (or enumerates), else ``next(itertools.islice(..., 25, None))``."""
    inner = node.args[0] if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        node.func.id == "enumerate" and len(node.args) == 1 else node
    text = ast.unparse(inner)
    if isinstance(inner, ast.Name) and isinstance(ns.get(inner.id), (list, tuple, torch.Tensor)):
        return f"{text}[{index}]"
    return f"next(itertools.islice({text}, {index}, None))"


def _nested(source: str, loop: ast.For) -> bool:
    """Whether the training loop sits inside another loop of the cell (an epoch loop)."""
    tree = ast.parse(source)
    return any(isinstance(n, (ast.For, ast.While)) and n is not loop and n.lineno < loop.lineno
               and (n.end_lineno or 0) >= (loop.end_lineno or 0) for n in ast.walk(tree))


def _bind(target: ast.expr, item: Any, ns: dict[str, Any]) -> None:
    """Assign ``item`` to the loop's target in ``ns`` as the ``for`` statement does."""
    ns["__backward_doctor_item"] = item
    exec(compile(ast.fix_missing_locations(ast.Module(body=[ast.Assign(  # noqa: S102 - the cell's own target
        targets=[target], value=ast.Name(id="__backward_doctor_item", ctx=ast.Load()))], type_ignores=[])),
        "<probe>", "exec"), ns)
    del ns["__backward_doctor_item"]


def _run_body(code: Any, target: ast.expr, item: Any, namespace: dict[str, Any], cell_file: str,
              end: Any) -> LayerNorms:
    """The loop's body run once on ``item`` from the end state, in a copy of the namespace, measured."""
    end.restore(namespace)
    ns = {n: (copy.copy(v) if type(v) in _CONTAINERS else v) for n, v in namespace.items()}
    _bind(target, item, ns)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            LayerNorms(ns, cell_file) as measured:
        exec(code, ns)  # noqa: S102 - the cell's own loop body
    return measured


def _leaves(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (list, tuple)):
        return [t for v in values[:64] for t in _leaves(v)]
    return []


def _peak(values: Any) -> float | None:
    """The largest absolute finite value of the floating tensors in ``values`` (None: none)."""
    ts = [t for t in _leaves(values) if t.is_floating_point() and t.numel()]
    if not ts:
        return None
    with torch.no_grad():
        return max(float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) for t in ts)


def _describe(spike: LossSpike, items: dict[int, Any], names: list[str], target: ast.expr,
              namespace: dict[str, Any]) -> None:
    """The spiking batch's values against the others': each loop variable's largest absolute value."""
    per: dict[str, dict[int, float]] = {}
    for i, item in items.items():
        ns: dict[str, Any] = {}
        _bind(target, item, ns)
        for n in names:
            peak = _peak(ns.get(n))
            if peak is not None:
                per.setdefault(n, {})[i] = peak
    worst, words = 0.0, []
    for n, peaks in per.items():
        mine = peaks.get(spike.batch)
        others = [v for i, v in peaks.items() if i != spike.batch]
        if mine is None or not others:
            continue
        top = max(others)
        times = mine / top if top > 0 else math.inf
        if times >= 10 and times > worst:
            worst = times
            spike.out_of_range = n
            words = [f"`{n}` holds values up to {mine:.3g} in absolute value, the {len(others)} other batches read "
                     f"at most {top:.3g} ({times:,.0f}x){_rows(items[spike.batch], target, n, top)}"]
    spike.described = words[0] if words else \
        "its values are in the range of the other batches (look at its labels or its content)"


def _rows(item: Any, target: ast.expr, name: str, top: float) -> str:
    """Which samples (rows) of the loop variable ``name`` hold the values out of the others' range: ``, in rows 3, 7``
    or ``, in all 16 rows`` ('' when it is not one tensor with rows)."""
    ns: dict[str, Any] = {}
    _bind(target, item, ns)
    t = ns.get(name)
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or not t.is_floating_point() or not len(t):
        return ""
    with torch.no_grad():
        rows = (t.detach().abs().nan_to_num(0.0, 0.0, 0.0).reshape(len(t), -1).amax(1) > 10 * top).nonzero()
    rows = [int(r) for r in rows.flatten()]
    if len(rows) == len(t):
        return f", in all {len(t)} of its samples (dimension 0)"
    shown = ", ".join(str(r) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
    return f", in sample{'s' if len(rows) > 1 else ''} {shown} of its {len(t)} (dimension 0)" if rows else ""


def _compare(spike: LossSpike, hit: LayerNorms, base: LayerNorms) -> None:
    """The layers whose activations or gradients grew against the baseline batch; the one that explains it."""
    leaves = [n for n in hit.order if n in hit.leaves] or list(hit.order)
    layers = [LayerJump(module=n, cls=hit.classes.get(n, ""), activation=hit.activation.get(n, 0.0),
                        activation_before=base.activation.get(n, 0.0), grad=hit.grad.get(n, 0.0),
                        grad_before=base.grad.get(n, 0.0), line=hit.lines.get(n)) for n in leaves]
    spike.layers = layers[:64]

    def grew(now: float, before: float) -> float:
        return now / before if before > 0 else (math.inf if now > 0 else 1.0)

    acts = [(grew(j.activation, j.activation_before), j) for j in layers]
    top = max((r for r, _ in acts), default=1.0)
    if top >= 5:  # the first layer whose output grew near the most: where the jump entered the model
        spike.jump = next(j for r, j in acts if r >= max(5.0, top / 4))
        spike.jumped = "activations"
        return
    grads = [(grew(j.grad, j.grad_before), j) for j in layers if j.grad > 0]
    r, j = max(grads, key=lambda rj: rj[0], default=(1.0, None))
    if j is not None and r >= 2:
        spike.jump, spike.jumped = j, "gradients"


__all__ = ["probe_spike", "spike_of"]
