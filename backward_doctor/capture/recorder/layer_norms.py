"""What one probe run of a loop's body measures, module by module, for the loss-spike probe
(``run/spike_replay.py``): each module's output norm (a global forward hook), each parameter's gradient norm as
autograd accumulates it (post-accumulate-grad hooks), the loss each ``backward()`` starts from
(``torch.autograd.backward`` wrapped), and the cell line that called each module.

It is used only after the run, on a copy of the namespace whose state is put back afterwards: never in the user's
run. Everything installed is removed when the ``with`` block ends, even on an exception.

>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> with LayerNorms({"model": m}, "<cell>") as probe:
...     torch.autograd.backward(m(torch.ones(1, 2)).sum())
>>> sorted(probe.activation), probe.losses == [probe.losses[0]], "model.0" in probe.grad
(['model', 'model.0'], True, True)
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch

_MAX_MODULES = 4096  # (a model larger than this is measured in its first modules only)


def _norm(t: Any) -> float | None:
    """The L2 norm of a floating tensor's values, as a float (None: not one)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    with torch.no_grad():
        return float(torch.linalg.vector_norm(t.detach().float()))


class LayerNorms:
    """The measures of one run of the body: ``activation[name]`` and ``grad[name]`` (L2 norms, summed in squares
    over a module's calls and its own parameters), ``order`` (modules in the order of their first call),
    ``lines[name]`` (the innermost frame of ``cell_file`` at its first call), ``losses`` (each ``backward()``'s
    one-element root, finite or not)."""

    def __init__(self, namespace: dict[str, Any], cell_file: str) -> None:
        self.cell_file = cell_file
        self.names: dict[int, str] = {}
        self.classes: dict[str, str] = {}
        self.leaves: set[str] = set()
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        for var, value in list(namespace.items()):
            if isinstance(value, torch.nn.Module) and not var.startswith("_"):
                for name, mod in value.named_modules(prefix=var):
                    if id(mod) in self.names or len(self.names) >= _MAX_MODULES:
                        continue
                    self.names[id(mod)] = name
                    self.classes[name] = type(mod).__name__
                    if not any(True for _ in mod.children()):
                        self.leaves.add(name)
                    self._params += [(name, p) for p in mod.parameters(recurse=False) if p.requires_grad]
        self.activation: dict[str, float] = {}
        self.grad: dict[str, float] = {}
        self.order: list[str] = []
        self.lines: dict[str, int] = {}
        self.losses: list[float] = []
        self._handles: list[Any] = []
        self._backward: Any = None

    # ---------------------------------------------------------------- hooks
    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        outs = output if isinstance(output, (tuple, list)) else (output,)
        norms = [n for n in (_norm(o) for o in outs) if n is not None]
        if not norms:
            return
        if name not in self.activation:
            self.order.append(name)
            self.activation[name] = 0.0
            line = self._cell_line()
            if line is not None:
                self.lines[name] = line
        self.activation[name] = math.hypot(self.activation[name], math.sqrt(sum(n * n for n in norms)))

    def _cell_line(self) -> int | None:
        frame = sys._getframe(2)
        try:
            while frame is not None:
                if frame.f_code.co_filename == self.cell_file:
                    return frame.f_lineno
                frame = frame.f_back
            return None
        finally:
            del frame

    def _accumulated(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            n = _norm(p.grad)
            if n is not None and math.isfinite(n):
                self.grad[name] = math.hypot(self.grad.get(name, 0.0), n)
        return hook

    # ---------------------------------------------------------------- install / remove
    def __enter__(self) -> "LayerNorms":
        try:
            self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._forward))
            for name, p in self._params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated(name)))
            real = self._backward = torch.autograd.backward
            losses = self.losses

            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                root = tensors[0] if isinstance(tensors, (tuple, list)) and len(tensors) == 1 else tensors
                if isinstance(root, torch.Tensor) and root.numel() == 1 and root.is_floating_point():
                    with torch.no_grad():
                        losses.append(float(root.detach()))
                return real(tensors, *args, **kwargs)

            torch.autograd.backward = backward
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._backward is not None:
            torch.autograd.backward = self._backward
            self._backward = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


__all__ = ["LayerNorms"]
