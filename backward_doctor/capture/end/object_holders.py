"""Tensors a plain object of the namespace keeps in its attributes: a ``Trainer`` subclass's ``self.seen``.

A library's trainer is no module, so :mod:`step_state`'s walk over modules never looks into it; yet the
user's ``compute_loss`` override is where metrics get kept (``self.seen.append(outputs.logits)``), and a
tensor kept there with its graph keeps every step's activations alive. This looks one level into each such
object's public attributes (a tensor, or a list/dict/tuple of them), as the module walk does for a module's.
Only names and the class leave here: where the storing statement is, is read from the class's source only
for a holder that turns out to keep a graph.

>>> import torch
>>> class Runner:
...     def __init__(self):
...         self.seen = [torch.ones(2, requires_grad=True) * 2]
>>> [(path, store["target"]) for path, _, store in object_tensors({"runner": Runner()})]
[('runner.seen[0]', ['self', 'seen'])]
"""
from __future__ import annotations

import types
from typing import Any, Iterator

import torch
from torch import nn

from .. import namespace as ns_mod

_HOLDS = (torch.Tensor, dict, list, tuple)
_SKIP = (torch.Tensor, nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader, torch.utils.data.Dataset)


def object_tensors(namespace: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """(path, tensor, where it is stored) for tensors in the public attributes of the namespace's plain objects
    (not modules, optimizers, loaders or datasets, which hold tensors by design): ``trainer.seen[3]``; the third
    item is :func:`step_state._holders`' ``{"cls", "target": ["self", attr], "object", "contained"}``."""
    for name, value in ns_mod.user_items(namespace, depth=0):
        try:  # (an object whose ``__dict__`` is not a plain one, a ``__getattr__`` that raises: nothing read from it)
            found = list(_held(name, value))
        except Exception:  # noqa: BLE001
            continue
        yield from found


def _held(name: str, value: Any) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """The tensors of one object's public attributes, a list/dict two levels deep (:func:`object_tensors`)."""
    if isinstance(value, _SKIP) or isinstance(value, (dict, list, tuple, str, bytes, int, float, types.ModuleType)) \
            or not hasattr(value, "__dict__"):
        return
    attrs = [(a, v) for a, v in list(vars(value).items())[:256] if a[0] != "_" and isinstance(v, _HOLDS)
             and not isinstance(v, nn.Parameter)]
    for attr, held in attrs:
        for path, item in ns_mod._children(f"{name}.{attr}", held, 2):  # (a dict of lists: `self.log["loss"]`)
            if isinstance(item, torch.Tensor):
                yield path, item, {"cls": type(value), "target": ["self", attr], "object": name, "contained": True}


__all__ = ["object_tensors"]
