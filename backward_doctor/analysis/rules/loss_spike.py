"""``loss_spike``: the loss jumped far above its recent trend in one iteration and stayed finite (a warning).

Read from ``trace.loss_spike`` (``trace/spikes.py``: decided after the run from the loop watch's loss series;
``run/spike_replay.py``: the spiking batch and the one before it run again through the loop's body from the weights
the run ended with, each module's output and gradient norms measured). The finding names the iteration, the batch
(its index in what the loop iterates, and what is odd about it: values far out of the other batches' range), the
layer whose activations (or gradients) grew most against the batch before it and the cell line that called it,
with the fix as code: look at the batch, skip batches whose loss jumps, clip the gradients. Where the batch is
ordinary under those weights, the spike came from the training at that moment: clip, lower the learning rate.

>>> from backward_doctor.trace import Trace
>>> loss_spike(Trace())
[]
"""
from __future__ import annotations

from ..findings import Finding, at, source_line
from ...trace.records import Trace, Where
from ...trace.spikes import LossSpike


def _batch_is_odd(s: LossSpike) -> bool:
    """The probe found the spiking batch itself odd: its values, its layers' output, or its loss again."""
    return bool(s.out_of_range) or s.jumped == "activations" or bool(s.reproduced)


def _fix(s: LossSpike, odd: bool) -> str:
    if odd and s.batch is not None and s.source:
        look = f"look at `{s.fetch}`" if s.fetch else f"look at batch {s.batch} of `{s.source}`"
        return (f"{look} and fix or drop it in the data; in the loop, skip a batch whose loss jumps before its "
                "`backward()` and bound what one batch can do to the weights (`clip_grad_norm_`), as below")
    return (f"bound the update one step can make (`clip_grad_norm_`, as below) and lower the learning rate or warm "
            "it up (`torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=100)`)")


def loss_spike(trace: Trace) -> list[Finding]:
    """One warning for the run's first loss spike (and how many points spiked)."""
    s = trace.loss_spike
    if s is None or trace.exception is not None:
        return []
    jump = s.jump
    head = (f"The loss jumped to {s.loss:.3g} in iteration {s.iteration}, {s.ratio:.3g}x the median of the iterations "
            f"before it ({s.median:.3g}; {s.mads:.0f} median absolute deviations above it), and stayed finite"
            + (f" ({s.spikes} iterations spiked, this is the first)" if s.spikes > 1 else "") + ".")
    odd = _batch_is_odd(s)
    if s.why_not:
        body = f" It was not probed: {s.why_not}."
    else:
        losses = "" if s.replay_loss is None or s.baseline_loss is None else \
            f" (their losses {s.replay_loss:.3g} and {s.baseline_loss:.3g})"
        body = (f" Batch {s.batch} of `{s.source}` and batch {s.baseline} were run again through the loop's body from "
                f"the weights the run ended with{losses}"
                + (f"; batch {s.batch} makes the loss jump again under the same weights" if s.reproduced else "")
                + f". Batch {s.batch}: {s.described}.")
        if jump is not None:
            now, before = (jump.activation, jump.activation_before) if s.jumped == "activations" else \
                (jump.grad, jump.grad_before)
            times = f"{now / before:,.0f}x" if before > 0 else "from zero"
            body += (f" The {'output' if s.jumped == 'activations' else 'gradients'} of `{jump.module}`"
                     f"{f' ({jump.cls})' if jump.cls else ''} grew {times} against batch {s.baseline} "
                     f"({now:.3g} vs {before:.3g})"
                     + (", the first layer where the jump shows" if s.jumped == "activations" else "") + ".")
        if not odd:
            body += (f" Batch {s.batch} is ordinary under those weights: the spike came from the training at that "
                     "moment (an update too large for the weights then: the learning rate, no clipping).")
    where = _where(trace, s)
    evidence = {"iteration": s.iteration, "loss": s.loss, "median": s.median, "ratio": s.ratio, "mads": s.mads,
                "spikes": s.spikes, "batch": s.batch, "baseline": s.baseline, "probed": not s.why_not,
                "batch_is_odd": odd if not s.why_not else None, "jumped": s.jumped}
    if s.loop_line is not None:
        evidence["loop_line"] = s.loop_line
    if jump is not None:
        evidence["layer"] = jump.module
    evidence["fix_code"] = _fix_code(trace, s, odd and not s.why_not)
    fix = _fix(s, odd and not s.why_not)
    if s.why_not:  # (the batch is unknown: look at it first, then bound the update)
        fix = (f"check the batch of iteration {s.iteration} (print the loop's batch when `loss.item()` is far above "
               "the recent losses, e.g. `if loss.item() > 5 * recent_median: print(...)`); " + fix)
    msg = f"{head}{body} Fix: {fix}"
    title = (f"Loss spike in iteration {s.iteration}: batch {s.batch} is out of range" if s.out_of_range and not s.why_not
             else f"Loss spike in iteration {s.iteration}")
    return [at("loss_spike", where, msg, title=title, severity="warning", iteration=s.iteration, evidence=evidence,
               module_type=jump.cls if jump is not None else "",
               function=None)]


def _fix_code(trace: Trace, s: LossSpike, odd: bool) -> str:
    """The loop's end as code: a batch whose loss jumps skipped (when the batch is the cause), the update clipped.

    >>> print(_fix_code(Trace(), LossSpike(iteration=3, loss=9.0, median=1.0, ratio=9.0, mads=20.0), odd=False), end="")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # one step moves the weights this far at most
    optimizer.step()
    """
    model = s.jump.module.split(".")[0] if s.jump is not None else "model"
    steps = [st.cell_line for st in trace.optimizer_steps if st.cell_line is not None]
    step = source_line(trace, steps[0]) if steps else ""
    step = step if step.endswith(".step()") else "optimizer.step()"
    skip = ("if len(recent) >= 20 and loss.item() > 5 * statistics.median(recent):  # recent = [] before the loop\n"
            f"    continue  # a batch whose loss jumps: skipped (look at `{s.fetch or 'it'}`)\n"
            "recent = (recent + [loss.item()])[-20:]\n") if odd else ""
    return (f"{skip}loss.backward()\n"
            f"torch.nn.utils.clip_grad_norm_({model}.parameters(), max_norm=1.0)  # one step moves the weights this "
            f"far at most\n{step}\n")


def _where(trace: Trace, s: LossSpike) -> Where:
    """The cell line that called the layer that jumped; else the loop's ``for`` line (where the batches come from);
    else the cell's optimizer step."""
    line = s.jump.line if s.jump is not None and s.jump.line is not None else s.loop_line
    if line is None:
        steps = [st.cell_line for st in trace.optimizer_steps if st.cell_line is not None]
        line = steps[0] if steps else None
    if line is None:
        return Where()
    module = s.jump.module if s.jump is not None else None
    return Where(line=line, cell_line=line, module=module)


__all__ = ["loss_spike"]
