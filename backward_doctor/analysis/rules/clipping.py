"""``grad_accumulation``, clipping per micro-batch: ``clip_grad_norm_`` between the ``backward()`` calls of
one optimizer step, where it belongs once, right before the step.

Each clip rescales the running sum of the micro-batches so far: the first micro-batches are clipped again
and again, and the step's gradient is not the clipped gradient of the whole batch (the directions of the
later micro-batches weigh more than the earlier ones'). When the norm stays under ``max_norm`` nothing
changes in that run, and the bug waits for the first large gradient: a warning, at the clip's line (read
from ``trace.precision.clips``: each clip with the run's ``backward()`` count before it); an error when the
measured accumulation check says the clips changed the step's gradient (``accumulation.py`` adds it).

>>> from backward_doctor.trace import Trace
>>> clip_per_micro_batch(Trace())
[]
"""
from __future__ import annotations

from ..findings import Finding, at, code_at, looped, placed
from ...trace.precision import ClipCall
from ...trace.records import Trace


def per_micro_batch(clips: list[ClipCall]) -> list[ClipCall]:
    """The clips of the first optimizer step (iteration) clipped at two or more ``backward()`` counts.

    >>> per_micro_batch([ClipCall(0, backward=1), ClipCall(0, backward=2), ClipCall(1, backward=3)])
    [ClipCall(iteration=0, scaled=False, scale=None, stage='', max_norm=None, line=None, file=None, cell_line=None, function=None, scaled_by='', backward=1), ClipCall(iteration=0, scaled=False, scale=None, stage='', max_norm=None, line=None, file=None, cell_line=None, function=None, scaled_by='', backward=2)]
    >>> per_micro_batch([ClipCall(0, backward=1), ClipCall(0, backward=1)])  # two parameter groups, one sum
    []
    """
    by_iteration: dict[int, list[ClipCall]] = {}
    for c in clips:
        if c.backward >= 0:
            by_iteration.setdefault(c.iteration, []).append(c)
    for _, cs in sorted(by_iteration.items()):
        if len({c.backward for c in cs}) >= 2:
            return cs
    return []


def clip_per_micro_batch(trace: Trace) -> list[Finding]:
    """``clip_grad_norm_`` run between the micro-batches of an optimizer step that accumulates them."""
    clips = per_micro_batch(trace.precision.clips)
    if not clips:
        return []
    it = clips[0].iteration
    window = next((w for w in trace.accumulation.windows if w.iteration == it and w.backward >= 2), None)
    if window is None:
        return []  # (no step fed by several backward() calls: two models' clips, a trailing window)
    k, times = window.backward, len({c.backward for c in clips})
    clip = clips[0]
    clip_code = code_at(trace, clip.line, clip.file) or "torch.nn.utils.clip_grad_norm_(...)"
    step_code = code_at(trace, window.line, window.file) or "optimizer.step()"
    fix = f"{clip_code.strip()}  # once per optimizer step, on the whole sum\n{step_code.strip()}"
    msg = (f"`{clip_code.strip()}` (line {clip.line}) clipped the gradients {times} times within one optimizer step "
           f"of {k} micro-batches (after each `backward()`): each clip rescales the sum so far, so the first "
           "micro-batches are clipped again and again and the step's gradient is not the clipped gradient of the "
           "whole batch. Nothing raises, and while the norm stays under max_norm nothing changes, until the first "
           f"large gradient. Clip once, right before `{step_code.strip()}`.")
    return [at("grad_accumulation", placed(clip), msg, title="Gradients clipped per micro-batch", severity="warning",
               iteration=looped(trace, it),
               evidence={"problem": "clip_per_micro_batch", "micro_batches": k, "clips": times,
                         "max_norm": clip.max_norm, "step_line": window.line, "fix_code": fix})]


__all__ = ["clip_per_micro_batch", "per_micro_batch"]
