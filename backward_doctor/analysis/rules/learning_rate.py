"""A training loop that diverged from its very first steps: the learning rate, not the op that overflowed.

The loss goes 5.5 -> 1.9e12 after one optimizer step, then NaN: every update overshoots, the weights blow up
and some op (a LayerNorm, a softmax) is the first to overflow. That op is a consequence; an epsilon there
would not help. The cause is the size of the update: the learning rate (a ``5e5`` typed for ``5e-5``), or a
large one with no warm-up and no clipping. The finding says the value, where it was set when the user's
sources tell (``Iterations.lr_set``: the ``TrainingArguments(learning_rate=...)`` line, the ``lr=`` of the
optimizer's construction, a ``configure_optimizers``), and the fix as code.

>>> typo_fix("args = TrainingArguments(out, learning_rate=5e5)", 5e5)
'5e-5'
>>> typo_fix("opt = SGD(params, lr=0.5)", 0.5) is None
True
"""
from __future__ import annotations

import re
from typing import Any

from ..findings import Finding, at
from ...trace.records import Trace, Where
from ...util.loops import loop_at

_EXPONENT = re.compile(r"\b(learning_rate|lr)\s*=\s*(\d+(?:\.\d+)?)[eE]\+?(\d+)\b")
#: usual starting points, by optimizer class (what the message suggests when it cannot see a typo)
_USUAL = {"SGD": "1e-3 to 1e-1", "Adam": "1e-5 to 1e-3", "AdamW": "1e-5 to 1e-3"}


def typo_fix(code: str, value: float | None) -> str | None:
    """The literal the user probably meant when ``code`` writes the learning rate with a positive exponent
    (``5e5`` for ``5e-5``): None when it does not."""
    m = _EXPONENT.search(code)
    if m is None or value is None or value < 1:
        return None
    return f"{m.group(2)}e-{m.group(3)}"


def _fix(trace: Trace, value: float | None, code: str, keyword: str) -> str:
    its = trace.iterations
    meant = typo_fix(code, value)
    optimizer = trace.optimizer_steps[-1].optimizer if trace.optimizer_steps else ""
    usual = _USUAL.get(optimizer, "1e-5 to 1e-3 for Adam/AdamW, 1e-3 to 1e-1 for SGD")
    if meant:
        lower = (f"write `{keyword or 'lr'}={meant}`: the exponent's minus sign is missing, so the rate is "
                 f"{value:,.0f} instead of {float(meant):g}")
    else:
        lower = f"lower the learning rate ({usual} is usual{' for ' + optimizer if optimizer in _USUAL else ''})"
    if its.library == "transformers":
        guard = ("warm up and clip: `TrainingArguments(..., learning_rate=" + (meant or "5e-5")
                 + ", warmup_steps=100, max_grad_norm=1.0)`")
    elif its.library == "lightning":
        guard = ("warm up (a `LinearLR` scheduler returned from `configure_optimizers`) and clip: "
                 "`Trainer(..., gradient_clip_val=1.0)`")
    else:
        guard = ("warm up (`torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=100)`) and "
                 "clip (`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before `optimizer.step()`)")
    return f"{lower}; for a large rate, {guard}"


def diverged_from_start(trace: Trace, f: Finding, pattern: dict[str, Any], k: int) -> Finding:
    """The root cause of NaN/Inf first seen in iteration ``k`` of a loop whose loss grew from its first
    steps (``trends.early_divergence``): the learning rate; ``f`` (the op that overflowed) is its consequence."""
    its = trace.iterations
    setting = its.lr_set
    value = its.base_lr if its.base_lr is not None else (setting.value if setting else None)
    shown = f"{value:.3g}" if value is not None else "the learning rate"
    code, keyword = (setting.code, setting.keyword) if setting else ("", "")
    if setting is not None and setting.line:
        where = Where(line=setting.line, file=setting.file, cell_line=setting.line if setting.file is None else None)
    else:  # not found: the cell's call of the library's loop, else the cell's optimizer step (the update)
        steps = [s for s in trace.optimizer_steps if s.cell_line is not None]
        line = its.library_line if its.library else steps[0].cell_line if steps else f.cell_line
        where = Where(line=line, cell_line=line) if line is not None else Where(line=f.line, file=f.file)
    set_at = f", set by `{code}`," if code else ""
    steps = f"{pattern['after']} optimizer steps" if pattern["after"] != 1 else "optimizer step"
    consequence = "the op that made the first NaN/Inf" + (f", `{f.op}`" if f.op else "") + \
        (f" in `{f.module}`," if f.module else f" at line {f.line}," if f.op and f.line is not None else "")
    msg = (f"The learning rate {shown}{set_at} is far too high: the loss went from {pattern['from']:.3g} to "
           f"{pattern['to']:.3g} in the first {steps}, and was NaN/Inf "
           f"in iteration {k}. Each update overshoots, the weights blow up until an op overflows; {consequence} is a "
           f"consequence, not the cause (no epsilon or clamp there helps). Fix: {_fix(trace, value, code, keyword)}.")
    evidence = {**f.evidence, "pattern": "divergence", "early": True, "learning_rate": value,
                "consequence": {"op": f.op, "line": f.line, "file": f.file}}
    evidence.pop("op_index", None)  # (the cause is the first step, not the op that overflowed)
    if its.library:
        evidence["loop_call"], evidence["loop_line"] = its.library_call, its.library_line
    else:
        loop = loop_at(trace.source, f.cell_line) if f.cell_line is not None else None
        if loop is not None:
            evidence["loop_line"] = loop[0]
    if setting is not None:
        evidence["lr_set"] = {"file": setting.file, "line": setting.line, "code": setting.code}
    return at("nonfinite", where, msg, title="The learning rate is too high: the loss diverged from the first steps",
              iteration=0, evidence=evidence, function=None)


__all__ = ["diverged_from_start", "typo_fix"]
