"""Reading the user's namespace: which tensors, modules and optimizers it holds, by name.

Used at the start of a run (to count what already exists and to remember names)
and at the end (to name modules by the variable that holds them, e.g.
``model.body.2.act``). Only names, ids and weak references leave this module.

>>> import torch
>>> ns = {"model": torch.nn.Sequential(torch.nn.Linear(2, 2))}
>>> module_paths(ns)[id(ns["model"][0])]
'model.0'
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from .recorder.stats import meta
from ..trace.parts import OptimizerSummary

_MAX_ITEMS = 64  # containers are looked into, but a list of 10k batches is not walked


def _children(name: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
    yield name, value
    if depth <= 0 or isinstance(value, (torch.Tensor, nn.Module, str, bytes)):
        return
    if isinstance(value, dict):
        for i, (k, v) in enumerate(value.items()):
            if i >= _MAX_ITEMS:
                break
            yield from _children(f"{name}[{k!r}]", v, depth - 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value[:_MAX_ITEMS]):
            yield from _children(f"{name}[{i}]", v, depth - 1)


def user_items(namespace: dict[str, Any], depth: int = 2) -> Iterator[tuple[str, Any]]:
    """(name, value) of the namespace's public variables and small containers in them."""
    for name, value in list(namespace.items()):
        if name.startswith("_") or isinstance(value, type) or callable(value) and not isinstance(value, nn.Module):
            continue
        yield from _children(name, value, depth)


def tensors(namespace: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in user_items(namespace):
        if isinstance(value, torch.Tensor):
            yield name, value


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """The first attributes of a plain object's ``__dict__``; none for an object without one or whose lookup
    raises (a proxy's ``__getattr__`` that raises for every name, a ``__dict__`` property): the user's objects are
    read, never allowed to fail the run.

    >>> class Proxy:
    ...     __slots__ = ()
    ...     def __getattr__(self, name): raise RuntimeError(name)
    >>> _attributes(Proxy())
    []
    """
    if type(value) in _NO_ATTRIBUTES:  # (a notebook's ``In`` holds a string per cell: most values are these)
        return []
    try:
        return list(vars(value).items())[:_MAX_ITEMS] if hasattr(value, "__dict__") else []
    except Exception:  # noqa: BLE001  (anything a user's __getattr__ or __dict__ raises)
        return []


_NO_ATTRIBUTES = {str, bytes, int, float, bool, complex, type(None), list, tuple, dict, set, frozenset}


def modules(namespace: dict[str, Any]) -> Iterator[tuple[str, nn.Module]]:
    """Top-level modules, including ones held as an attribute of a plain object."""
    for name, value in user_items(namespace, depth=1):
        if isinstance(value, nn.Module):
            yield name, value
        elif not isinstance(value, (torch.Tensor, torch.optim.Optimizer)):
            for attr, sub in _attributes(value):
                if isinstance(sub, nn.Module):
                    yield f"{name}.{attr}", sub


def optimizers(namespace: dict[str, Any]) -> Iterator[tuple[str, torch.optim.Optimizer]]:
    for name, value in user_items(namespace, depth=1):
        if isinstance(value, torch.optim.Optimizer):
            yield name, value


def held(namespace: dict[str, Any], classes: type | tuple[type, ...] = torch.optim.Optimizer
         ) -> Iterator[tuple[str, Any]]:
    """Instances of ``classes`` (optimizers unless told) bound to a name or in a small container, or held as an
    attribute of an object there (``runner.opt``, a module's ``self.opt``), as :func:`modules` finds modules;
    each once. What a rollback restores besides the modules.

    >>> class Runner: pass
    >>> r = Runner(); r.opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    >>> [name for name, _ in held({"runner": r, "opt": r.opt})]
    ['runner.opt']
    """
    seen: set[int] = set()
    for name, value in user_items(namespace, depth=1):
        if isinstance(value, classes):
            found = [(name, value)]
        elif not isinstance(value, torch.Tensor):
            found = [(f"{name}.{attr}", sub) for attr, sub in _attributes(value) if isinstance(sub, classes)]
        else:
            continue
        for item in found:
            if id(item[1]) not in seen:
                seen.add(id(item[1]))
                yield item


def module_paths(namespace: dict[str, Any]) -> dict[int, str]:
    """id(module) -> dotted path from the variable that holds it (first name wins)."""
    paths: dict[int, str] = {}
    for name, mod in modules(namespace):
        for sub_name, sub in mod.named_modules(remove_duplicate=False):
            paths.setdefault(id(sub), f"{name}.{sub_name}" if sub_name else name)
    return paths


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in list(opt.state.values()):
        if isinstance(state, dict):
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


def optimizer_summary(name: str, opt: torch.optim.Optimizer) -> OptimizerSummary:
    """Sizes that decide an optimizer step's memory: its parameters, its state, the largest tensor.

    >>> opt = torch.optim.Adam(nn.Linear(3, 2).parameters())
    >>> optimizer_summary("opt", opt).param_bytes, optimizer_summary("opt", opt).state_bytes
    (32, 0)
    """
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    return OptimizerSummary(name=name, type=type(opt).__name__, param_bytes=sum(sizes), largest=max(sizes, default=0),
                            state_bytes=sum(t.numel() * t.element_size() for t in optimizer_state_tensors(opt)),
                            momentum=bool(opt.defaults.get("momentum")), foreach=opt.defaults.get("foreach"),
                            device=str(params[0].device) if params else "cpu")


def describe_value(v: Any, depth: int = 0) -> str:
    """A loop variable in a few characters: numbers and short strings as written, a tensor by dtype and
    shape (a batch), a tuple/list of them one by one, anything else by type.

    >>> describe_value(20), describe_value(torch.zeros(12, 8)), describe_value((torch.zeros(2), 3))
    ('20', 'float32[12, 8]', '(float32[2], 3)')
    """
    if isinstance(v, torch.Tensor):
        if v.dim() == 0 and v.numel() == 1 and not v.requires_grad:
            return f"tensor({v.item():g})" if v.is_floating_point() else f"tensor({v.item()})"
        return meta(v).short()
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, (int, float)):
        return f"{v:g}" if isinstance(v, float) else str(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= 30 else repr(v[:27] + "...")
    if isinstance(v, (tuple, list)) and depth < 2:
        inner = ", ".join(describe_value(x, depth + 1) for x in list(v)[:4]) + (", ..." if len(v) > 4 else "")
        return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
    if isinstance(v, dict) and depth < 2:
        return "{" + ", ".join(f"{k}: {describe_value(x, depth + 1)}" for k, x in list(v.items())[:4]) + "}"
    return type(v).__name__


def loop_values(namespace: dict[str, Any], names: list[str]) -> str:
    """``i = 20, xb = float32[12, 8]`` for the loop variables bound in ``namespace`` (at most 200 chars)."""
    out = ", ".join(f"{n} = {describe_value(namespace[n])}" for n in names if n in namespace)
    return out if len(out) <= 200 else out[:197] + "..."

