"""Before/after numbers of a fix: peak memory, step time, loss, and how far the gradients moved.

Gradients are photographed (CPU copies, outside the capture's accounting) when the
first optimizer step of the run begins, which is when they are final; a step with
no optimizer is photographed at its end.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.optim.optimizer as _optim
from torch.nn.modules import module as _nn_module

from ..capture import namespace as ns_mod
from ..trace.records import Trace


def _cpu(t: torch.Tensor) -> torch.Tensor:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return t.detach().to("cpu", copy=True)


class GradProbe:
    """Context manager: ``grads`` maps id(parameter) -> CPU copy of its gradient (None: no gradient)."""

    def __init__(self, namespace: dict[str, Any], enabled: bool = True) -> None:
        self.namespace = namespace
        self.enabled = enabled
        self.grads: dict[int, torch.Tensor | None] = {}
        self._handle = None

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in self.grads:
                    self.grads[id(p)] = None if p.grad is None else _cpu(p.grad)

    def __enter__(self) -> "GradProbe":
        if self.enabled:
            self._handle = _optim.register_optimizer_step_pre_hook(self._pre_step)
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.enabled and not self.grads and exc[0] is None:
            for _, mod in ns_mod.modules(self.namespace):
                for p in mod.parameters():
                    if p.requires_grad and id(p) not in self.grads:
                        self.grads[id(p)] = None if p.grad is None else _cpu(p.grad)
        return False


def grad_max_rel_err(before: dict[int, torch.Tensor | None], after: dict[int, torch.Tensor | None]) -> float | None:
    """Largest ``max|after - before| / max|before|`` over the parameters both runs have a gradient for."""
    common = [k for k in before if k in after]
    if not common or all(before[k] is None and after[k] is None for k in common):
        return None
    worst = 0.0
    for k in common:
        a, b = after[k], before[k]
        if a is None or b is None:
            if (a is None) != (b is None):
                worst = max(worst, 1.0)
            continue
        if a.shape != b.shape:
            return None
        a, b = a.double(), b.double()
        scale = float(b.abs().max()) if b.numel() else 0.0
        diff = float((a - b).abs().max()) if b.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def loss_value(namespace: dict[str, Any], name: str | None) -> float | None:
    value = namespace.get(name) if name else None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def run_numbers(trace: Trace | None, loss: float | None) -> dict[str, Any]:
    if trace is None:
        return {"peak_bytes": None, "peak_by_category": {}, "step_s": None, "loss": loss, "completed": False,
                "exception": None}
    mem = trace.memory
    return {"peak_bytes": mem.peak_bytes, "peak_by_category": dict(mem.peak_by_category),
            "step_s": round(trace.duration_s, 6), "loss": loss, **_op_time(trace),
            "completed": trace.exception is None
            and not trace.timed_out, "exception": trace.exception.summary().split("\n")[0][:300]
            if trace.exception else None}


def _op_time(trace: Trace, keep: int = 24) -> dict[str, Any]:
    """The ops that took the most time inside them: name -> [calls, microseconds] (the profiler's markers left
    out). What says whether a fix made an op slower per call (bfloat16 on a CPU), apart from the work it adds."""
    totals = sorted(((name, c, us) for name, (c, us) in trace.op_totals.items() if not name.startswith("profiler::")),
                    key=lambda t: -t[2])
    return {"op_time": {name: [int(c), round(us, 1)] for name, c, us in totals[:keep]}}


class FixCancelled(BaseException):
    """Raised inside a run when the user asked to stop (a BaseException: a cell's ``except Exception`` lets it by)."""


class FixProgress:
    """Progress and cancel checks while a cell runs: at each call of a top-level model, before each optimizer step.

    ``expected``: how many top-level model calls the run should make (for the fraction).
    """

    def __init__(self, namespace: dict[str, Any], cell_names: set[str], lo: float, hi: float, text: str,
                 progress: Callable[[float, str], None] | None, cancel: Callable[[], bool] | None,
                 expected: int = 1) -> None:
        self.roots = {id(m) for name, m in ns_mod.modules(namespace) if name.split(".")[0] in cell_names}
        self.lo, self.hi, self.text = lo, hi, text
        self.progress, self.cancel = progress, cancel
        self.expected = max(1, expected)
        self.calls = 0
        self._handles: list[Any] = []

    def _check(self) -> None:
        if self.cancel is not None and self.cancel():
            raise FixCancelled("cancelled by the user")

    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) not in self.roots:
            return
        self._check()
        if self.progress is not None:
            frac = self.lo + (self.hi - self.lo) * min(self.calls, self.expected) / self.expected
            part = f" ({self.calls + 1}/{self.expected})" if self.expected > 1 else ""
            self.progress(frac, f"{self.text}{part}")
        self.calls += 1

    def _step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._check()

    def __enter__(self) -> "FixProgress":
        if self.progress is not None or self.cancel is not None:
            self._handles = [_nn_module.register_module_forward_pre_hook(self._forward),
                             _optim.register_optimizer_step_pre_hook(self._step)]
        return self

    def __exit__(self, *exc: Any) -> bool:
        for h in self._handles:
            h.remove()
        self._handles = []
        return False
