"""What a training loop's per-iteration series say (``Trace.iterations``): pure functions, no rule.

- :func:`history_before`: the loss, gradient norm and learning rate over the iterations before one;
- :func:`nan_pattern`: a **divergence** (the gradient norm, else the loss, grew for iterations before the
  first NaN) or a **jump** (steady, then NaN at once: a bad batch or a bad op);
- :func:`lr_change`: the iteration at which the learning rate changed, and the cell line that changed it;
- :func:`memory_growth`: live bytes growing iteration after iteration (bytes per iteration, and the
  iteration at which a device of a given size would be full at that rate).

>>> from backward_doctor.trace.parts import Iterations
>>> steady = Iterations(steps=12, grad_norm=[1.0] * 10 + [None] * 2, lr=[0.1] * 12)
>>> growing = Iterations(steps=12, grad_norm=[1.0] * 6 + [3.0, 9.0, 27.0, 81.0] + [None] * 2)
>>> nan_pattern(steady, 10)["pattern"], nan_pattern(growing, 10)["pattern"], nan_pattern(growing, 10)["start"]
('jump', 'divergence', 6)
"""
from __future__ import annotations

import ast
import statistics
from typing import Any

from ..trace.parts import Iterations


def history_before(its: Iterations, k: int, points: int = 64) -> dict[str, list]:
    """The series' points for the iterations up to ``k`` (its own included), at most ``points`` of them."""
    end = min(max(len(its.loss), len(its.grad_norm)), k // max(1, its.stride) + 1)
    lo = max(0, end - points)
    return {"iterations": [i * its.stride for i in range(lo, end)], "loss": its.loss[lo:end],
            "grad_norm": its.grad_norm[lo:end], "lr": its.lr[lo:end]}


def _finite_prefix(values: list[float | None]) -> list[float]:
    out = []
    for v in values:
        if v is None:
            break
        out.append(float(v))
    return out


def nan_pattern(its: Iterations, k: int) -> dict[str, Any] | None:
    """``{"pattern": "divergence" | "jump", "series", "start", "from", "to"}`` for NaN/Inf first seen in
    iteration ``k``; None with too little history (fewer than 8 finite points before it).

    A divergence: the last finite value is at least 10x the series' typical value (its median over the
    first half of the history) and rose over the points before it; ``start`` is the first iteration from
    which the series stays above twice the typical value.
    """
    hist = history_before(its, k, points=256)
    for name in ("grad_norm", "loss"):
        values = _finite_prefix(hist[name])
        if len(values) >= 8:
            break
    else:
        return early_divergence(its, k)
    iters = hist["iterations"][:len(values)]
    typical = statistics.median(values[: max(4, len(values) // 2)])
    last = values[-1]
    out = {"series": name, "from": typical, "to": last}
    if typical > 0 and last >= 10 * typical and values[-1] >= max(values[-4:-1]):
        start = len(values) - 1
        while start > 0 and values[start - 1] > 2 * typical:
            start -= 1
        return {**out, "pattern": "divergence", "start": iters[start]}
    return {**out, "pattern": "jump", "start": k}


def early_divergence(its: Iterations, k: int) -> dict[str, Any] | None:
    """A loop that diverged from its first steps (NaN/Inf first seen in iteration ``k``, fewer than 8 finite
    points before it): the loss grew at least 100x over its first value, its last finite value the highest
    (``{"pattern": "divergence", "series": "loss", "start": 0, "early": True, "from", "to", "after"}``,
    ``after``: the iteration of the last finite value). Such a start is the update size: the learning rate.

    >>> early_divergence(Iterations(steps=3, loss=[5.5, 1.9e12, None]), 2)["to"]
    1900000000000.0
    >>> early_divergence(Iterations(steps=3, loss=[5.5, 5.2, None]), 2) is None
    True
    """
    values = _finite_prefix(history_before(its, k, points=16)["loss"])
    if len(values) < 2 or values[0] <= 0 or values[-1] < 100 * values[0] or values[-1] < max(values):
        return None
    return {"pattern": "divergence", "series": "loss", "start": 0, "early": True, "from": values[0],
            "to": values[-1], "after": (len(values) - 1) * its.stride}


def lr_change(its: Iterations, before: int, source: str = "") -> dict[str, Any] | None:
    """The last change of the learning rate by more than 1.5x at or before iteration ``before``:
    ``{"iteration", "from", "to", "line"}`` (``line``: the cell line assigning a ``["lr"]``, if any).

    >>> its = Iterations(lr=[0.1, 0.1, 1.0, 1.0])
    >>> lr_change(its, 3, "for g in opt.param_groups:\\n    g['lr'] = 1.0\\n")
    {'iteration': 2, 'from': 0.1, 'to': 1.0, 'line': 2}
    """
    lrs = its.lr[: before // max(1, its.stride) + 1]
    for i in range(len(lrs) - 1, 0, -1):
        a, b = lrs[i - 1], lrs[i]
        if a and b and max(a, b) / min(a, b) > 1.5:
            return {"iteration": i * its.stride, "from": a, "to": b, "line": lr_line(source)}
    return None


def lr_line(source: str) -> int | None:
    """The first cell line that assigns a learning rate (``g["lr"] = ...``, ``g["lr"] *= ...``).

    >>> lr_line("x = 1\\nopt.param_groups[0]['lr'] *= 10\\n")
    2
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == "lr":
                return node.lineno
    return None


def memory_growth(its: Iterations, limit: int | None = None) -> dict[str, Any] | None:
    """Live bytes that grow with the iterations: ``{"per_iteration", "from", "to", "first", "last",
    "full_at"}`` (``full_at``: the iteration at which ``limit`` bytes would be reached at that rate), or
    None when live memory is steady. Iterations 0 and 1 are left out (gradients and optimizer state are
    created there); growth must show in most steps of the rest and add up to more than 64 KiB.

    >>> its = Iterations(steps=40, live_bytes=[1000] * 2 + [1000 + 4096 * i for i in range(38)])
    >>> g = memory_growth(its, limit=10 ** 7)
    >>> g["per_iteration"], g["full_at"]
    (4096, 2443)
    """
    pts = [(i * its.stride, b) for i, b in enumerate(its.live_bytes) if b >= 0 and i * its.stride >= 2]
    if len(pts) < 8:
        return None
    ups = sum(1 for (_, a), (_, b) in zip(pts, pts[1:]) if b > a)
    (i0, b0), (i1, b1) = pts[0], pts[-1]
    if b1 - b0 <= 64 * 1024 or ups < 0.6 * (len(pts) - 1):
        return None
    per = (b1 - b0) // max(1, i1 - i0)
    full = i1 + (limit - b1) // per if limit and per > 0 and limit > b1 else None
    return {"per_iteration": per, "from": b0, "to": b1, "first": i0, "last": i1, "full_at": full}


__all__ = ["history_before", "nan_pattern", "early_divergence", "lr_change", "lr_line", "memory_growth"]
