"""Where NaN/Inf was born, when it reached the loss, a gradient or a parameter.

A non-finite value that never reaches those (the ``-inf`` of an attention mask
that softmax turns into zeros) is intended, not a bug, and is not reported.

>>> from backward_doctor.trace import Trace
>>> nonfinite(Trace())
[]
"""
from __future__ import annotations

from ..arg_names import input_labels
from ..findings import Finding, at, forward_where, source_line
from ..trends import history_before, lr_change, nan_pattern
from .amp import low_precision, low_precision_origin
from .learning_rate import diverged_from_start
from ...trace.queries import recorded_nothing
from ...trace.records import NonFiniteEvent, Trace, Where

_EXPLAIN = {
    "log": ("`log` of zero or a negative number gives -inf/NaN",
            "clamp the input (`torch.log(x.clamp_min(1e-8))`) or use a fused, stable op "
            "(`F.log_softmax`, `F.cross_entropy`, `F.binary_cross_entropy_with_logits`)"),
    "div": ("dividing by zero gives inf (and 0/0 gives NaN)",
            "add an epsilon to the denominator (`x / (d + 1e-8)`) or mask the zero entries"),
    "exp": ("`exp` overflows to inf for inputs above ~88 in float32",
            "subtract the maximum first (`torch.softmax`, `torch.logsumexp`) or clamp the input"),
    "sqrt": ("`sqrt` is fine at 0 but its gradient 1/(2*sqrt(x)) is infinite there",
             "add an epsilon inside (`torch.sqrt(x + 1e-12)`) or use `torch.linalg.vector_norm`"),
    "pow": ("a power of zero or of a negative number can produce inf/NaN",
            "clamp the base or add an epsilon"),
    "rsqrt": ("`rsqrt` of zero is inf", "add an epsilon (`torch.rsqrt(x + 1e-6)`)"),
    "masked_fill": ("a `-inf` mask is fine until a whole row is masked: softmax over nothing but `-inf` "
                    "is 0/0 = NaN",
                    "make sure every row keeps at least one unmasked position (never mask the diagonal of a "
                    "causal mask; for fully padded rows, zero the attention after the softmax)"),
}


#: where the backward of an op fails for another reason than its forward would
_EXPLAIN_BACKWARD = {
    "log": ("the gradient of `log`, 1/x, is infinite at 0 and overflows for tiny x",
            "clamp the input away from 0 (`torch.log(x.clamp_min(1e-8))`) or use a fused, stable op "
            "(`F.log_softmax`, `F.cross_entropy`)"),
}


def _explain(op: str | None, phase: str = "forward") -> tuple[str, str]:
    base = (op or "").split("::")[-1].rstrip("_")
    for key, value in (_EXPLAIN_BACKWARD.items() if phase == "backward" else ()):
        if base == key:
            return value
    for key, value in _EXPLAIN.items():
        if base.startswith(key) or base == key:
            return value
    return ("this op produced NaN/Inf from finite inputs",
            "check its inputs' range (see the statistics) and add clamping or an epsilon")


def _without_origin(trace: Trace) -> list[Finding]:
    """First tier only (no rollback, so no detailed replay; or a replay that stayed finite): say that NaN/Inf
    happened and where it showed."""
    if trace.needs_detail not in ("nonfinite", "nonfinite:not_reproduced"):
        return _never_ok(trace)
    hint = trace.nonfinite_hint
    reached = [k for k, v in trace.nonfinite_reached.items() if v] or ["loss"]
    where = Where(line=hint.line, file=hint.file, cell_line=hint.line) if hint is not None else Where()
    msg = (f"NaN/Inf reached the {', '.join(reached)}"
           f"{' (first seen in a scalar at line ' + str(where.line) + ')' if where.line else ''}. "
           + ("The cheap first pass does not check every op, and without a rollback snapshot the step could not "
              "be replayed to find the op that made it: run the cell again with rollback on (the default) to get "
              "the origin." if trace.needs_detail == "nonfinite" else
              "The cheap first pass does not check every op, and replayed from the state saved before it the step "
              "stayed finite: it depends on something the replay did not restore (a counter, the next batch of an "
              "iterator, a library's own state). Run the cell once more under the doctor with its state as it "
              "was, or on the CPU, where every op is checked in the one run."))
    return [at("nonfinite", where, msg, title="NaN/Inf in this step (origin not located)",
               evidence={"reached": reached, "located": False})]


def _never_ok(trace: Trace) -> list[Finding]:
    """NaN/Inf the run's checks saw (in a loss or the gradients at a step, or in the parameters and gradients the
    run left) with no op named as its origin: still a problem, never an OK (the notes say why it was not located)."""
    its = trace.iterations
    reached = [k for k, v in trace.nonfinite_reached.items() if v]
    if its.first_nonfinite is None and not reached:
        return []
    where = _loop_line(trace)
    seen = ([f"its {'loss' if its.first_nonfinite_in == 'loss' else 'gradients'} in iteration {its.first_nonfinite}"]
            if its.first_nonfinite is not None else []) + [f"the {r} at the end" for r in reached]
    msg = (f"NaN/Inf appeared in this run ({', '.join(seen)}), and no op recorded made it: it appeared where the "
           "recorder was off (a sampled loop, always on), or it could not be replayed (see the notes). The training "
           "state is no longer finite: run the cell again under `%%backward_doctor --every-iteration` "
           "(`every_iteration=True`) to record every op and find the one that made it.")
    return [at("nonfinite", where, msg, title="NaN/Inf in this run (origin not located)", iteration=its.first_nonfinite,
               evidence={"reached": reached, "located": False, "first_in": its.first_nonfinite_in})]


def _loop_line(trace: Trace) -> Where:
    """The cell's line to show for a loop-wide finding: its first ``backward()``, else the library call."""
    calls = []
    try:
        from ...util.cell import Cell
        calls = Cell(trace.source).backward_calls()
    except Exception:  # a cell we cannot parse: no line to point at
        pass
    line = calls[0].lineno if calls else trace.iterations.library_line
    return Where(line=line, cell_line=line)


def _unrecorded_first(trace: Trace) -> list[Finding]:
    """The loop watch saw NaN/Inf first in an iteration the recorder did not record, and no replay located
    its op (the notes say why): the iteration, and what went non-finite."""
    its = trace.iterations
    k = its.first_nonfinite
    what = "its loss" if its.first_nonfinite_in == "loss" else "its gradients (the loss was finite)"
    msg = (f"NaN/Inf first appeared in iteration {k} of the loop, in {what}. That iteration ran with the "
           "recorder off (a long loop is sampled) and could not be replayed in detail (see the notes). Run the "
           "cell again with `every_iteration=True` (`%%backward_doctor --every-iteration`) to find the op.")
    return [at("nonfinite", _loop_line(trace), msg, title=f"NaN/Inf first in iteration {k}",
               iteration=k, evidence={"located": False, "first_in": its.first_nonfinite_in})]


def _lr_set_in(trace: Trace, iteration: int | None) -> dict | None:
    """The learning-rate change the cell made in ``iteration`` itself (``trends.lr_change``), if any: what an
    optimizer step that wrote NaN/Inf from finite gradients is blamed on."""
    change = lr_change(trace.iterations, iteration, trace.source) if iteration is not None else None
    return change if change is not None and change["iteration"] == iteration else None


def _with_history(trace: Trace, found: list[Finding]) -> list[Finding]:
    """Add the loss/gradient-norm history before the first NaN/Inf; a divergence that began when the cell
    raised the learning rate makes that line the root cause."""
    its = trace.iterations
    k = its.first_nonfinite
    if k is None or not found or (not its.loss and not its.grad_norm):
        return found
    f = found[0]
    f.evidence["history"] = history_before(its, k)
    pattern = nan_pattern(its, k)
    if pattern is None:
        return found
    f.evidence["pattern"] = pattern["pattern"]
    series = "gradient norm" if pattern["series"] == "grad_norm" else "loss"
    step_op = f.evidence.get("phase") == "optimizer" and trace.op(f.evidence.get("op_index")) is not None
    if step_op and pattern["pattern"] == "jump":  # the optimizer step itself wrote the first NaN/Inf
        it = trace.iterations.iteration_of(f.evidence["op_index"])
        change = _lr_set_in(trace, it)
        if change is not None and change["line"]:
            f.message = (f"The learning rate set to {change['to']:.3g} (from {change['from']:.3g}) at line "
                         f"{change['line']} in iteration {it} made that iteration's optimizer step write NaN/Inf "
                         f"into the weights, from finite gradients (norm {pattern['to']:.3g}). " + f.message)
            f.line = f.cell_line = change["line"]
            f.file = f.module = None
            f.title = f"The optimizer step of iteration {it} made the weights NaN/Inf"
            f.evidence["lr_change"] = change
        return found
    if pattern["pattern"] == "jump":
        source = "" if trace.nonfinite_reproduced is False else "from this iteration's data or op, "
        f.message += (f" Before iteration {k} the {series} was steady (about {pattern['from']:.3g}; "
                      f"{pattern['to']:.3g} in the iteration before): NaN/Inf came at once, {source}not from a "
                      "slow divergence.")
        return found
    if pattern.get("early"):  # diverged from the first steps: the learning rate
        return [diverged_from_start(trace, f, pattern, k)] + found[1:]
    start = pattern["start"]
    shown = (f"`{f.op}` at line {f.line} made the first NaN/Inf" if f.op and f.line is not None
             else "the first NaN/Inf")
    f.message += (f" Before it the training diverged: the {series} grew from about {pattern['from']:.3g} to "
                  f"{pattern['to']:.3g}, from iteration {start} on; the NaN/Inf is where that growth overflowed.")
    change = lr_change(its, start, trace.source)
    if change is None or change["to"] < change["from"]:
        f.message += (" Lower the learning rate or clip the gradients (`torch.nn.utils.clip_grad_norm_(model."
                      "parameters(), 1.0)` before `optimizer.step()`).")
        return found
    line = change["line"]
    code = source_line(trace, line, None) if line else ""
    lead = (f"The learning rate was raised from {change['from']:.3g} to {change['to']:.3g} in iteration "
            f"{change['iteration']}{' at line ' + str(line) + ' (`' + code.strip() + '`)' if line else ''}, and "
            f"the {series} grew from then on (about {pattern['from']:.3g} before, {pattern['to']:.3g} just "
            f"before the first NaN/Inf in iteration {k}): the training diverged.")
    cause = at("nonfinite", Where(line=line, cell_line=line) if line else
               Where(line=f.line, file=f.file, cell_line=f.cell_line, module=f.module),
               f"{lead} Keep the learning rate lower, raise it gradually (warm-up), or clip the gradients "
               f"(`torch.nn.utils.clip_grad_norm_`). In iteration {k}, {shown}: a consequence, not the cause.",
               title="The training diverged after the learning rate was raised",
               iteration=change["iteration"], evidence={**f.evidence, "lr_change": change})
    return [cause] + found[1:]


def nonfinite(trace: Trace) -> list[Finding]:
    """Report the first origin whose NaN/Inf reached the loss, a gradient or a parameter (with the loop's
    history before it)."""
    return _said_reproduced(trace, _with_history(trace, _nonfinite(trace)))


def _said_reproduced(trace: Trace, found: list[Finding]) -> list[Finding]:
    """A replay from the saved state made the NaN/Inf again (``trace.nonfinite_reproduced``): the first finding
    says it is deterministic. Not where the replay began with NaN/Inf weights already (it could not but make it
    again: that says nothing of chance)."""
    ev = next((e for e in trace.nonfinite if e.is_origin and e.reached), None)
    if trace.nonfinite_reproduced is not True or not found or ev is None or ev.kind == "weights":
        return found
    its, f = trace.iterations, found[0]
    if its.replayed is not None:
        what = f"iteration {its.replayed}" if its.steps > 1 else "the step"
        f.message += (f" Replayed from the same weights, optimizer state, batch and random state, {what} made "
                      "NaN/Inf again: it is deterministic, this data and these weights, not chance.")
    else:
        f.message += (" Run again from the state saved before the cell (weights, optimizer state, random state), "
                      "it made NaN/Inf again: it is deterministic, this data and these weights, not chance.")
    f.evidence["reproduced"] = True
    return found


#: what a NaN/Inf its replay did not make again comes from (``_transient``)
_TRANSIENT_CAUSES = (
    "the NaN/Inf is transient, not made by this data or these weights. Likely causes: the hardware (a faulty GPU "
    "or its memory), a nondeterministic kernel (atomic adds in `index_add_`/`scatter_add_`, some cuDNN "
    "algorithms), a race (another thread or CUDA stream writing a tensor the step reads), or state the replay does "
    "not restore (a counter or global your code keeps, a library's own state).")


def _transient(trace: Trace) -> list[Finding]:
    """NaN/Inf the run saw, which its replay from the saved state did not make again (``trace.nonfinite_reproduced``
    False): transient. No op is named: the replay saw none make it; the line is where the run saw it."""
    its, hint = trace.iterations, trace.nonfinite_hint
    k = its.first_nonfinite
    reached = [r for r, v in trace.nonfinite_reached.items() if v]
    where = (Where(line=hint.line, file=hint.file, cell_line=hint.line) if hint is not None and hint.line
             else _loop_line(trace))
    in_loop = k is not None and its.steps > 1
    what = "its loss" if its.first_nonfinite_in == "loss" else "its gradients" if its.first_nonfinite_in else ""
    seen = (f"NaN/Inf first appeared in iteration {k} of the loop" if in_loop else "NaN/Inf appeared in this step") \
        + (f", in {what}" if what else "") + (f", and reached the {', '.join(reached)}" if reached else "")
    if trace.needs_detail == "nonfinite:not_reproduced":  # (the first tier's replay: the whole cell, run_step)
        again = ("The cell was run again from the state saved before it (weights, optimizer state, random state), "
                 "with every op checked, and it stayed finite: ")
        advice = ("Run the cell once more under the doctor, or on the CPU, where every op is checked in the one "
                  "run.")
    else:
        again = (f"{'That iteration' if in_loop else 'The step'} was replayed from the same weights, optimizer "
                 "state, batch and random state, with every op checked, and it stayed finite: ")
        advice = ("Run the cell again with `every_iteration=True` (`%%backward_doctor --every-iteration`), which "
                  "checks every op as it runs, to catch it when it happens.")
    shown = (f" No op can be named as its origin: line {where.line} is where the run saw it, not where it was born."
             if where.line is not None else " No op can be named as its origin.")
    msg = (f"{seen}. {again}{_TRANSIENT_CAUSES}{shown} {advice} If it comes and goes between runs, "
           "`torch.use_deterministic_algorithms(True)` or another device tells the kernel from the hardware.")
    return [at("nonfinite", where, msg, title="Transient NaN/Inf (its replay did not make it again)",
               iteration=k if in_loop else None,
               evidence={"reached": reached, "located": False, "reproduced": False, "first_in": its.first_nonfinite_in})]


def _nonfinite(trace: Trace) -> list[Finding]:
    if trace.nonfinite_reproduced is False:  # (a replay from the saved state stayed finite: no op is named)
        return _transient(trace)
    origins: list[NonFiniteEvent] = [e for e in trace.nonfinite if e.is_origin and e.reached]
    its = trace.iterations
    if its.first_nonfinite is not None and its.replayed is None and (  # (a sampled loop's unrecorded iteration)
            its.first_nonfinite not in its.recorded if its.recorded else recorded_nothing(trace)):  # (always on's)
        return _unrecorded_first(trace)
    if not origins:
        return _without_origin(trace)
    ev = origins[0]
    reached = [k for k, v in trace.nonfinite_reached.items() if v]
    rec = trace.op(ev.index)
    where = forward_where(trace, rec) if rec is not None else ev.where
    code = source_line(trace, where.line, where.file)
    # Each input's statistics after its name: two tensors' numbers under one name read as that tensor's
    # (`F.mse_loss(pred, yb)` with NaN in `yb` showed the prediction's too; issue 47, item 7).
    bad = next((i for i, m in enumerate(ev.inputs) if m.stats and m.stats.nan + m.stats.posinf + m.stats.neginf),
               None)
    labels = input_labels(code, ev.op, len(ev.inputs), ev.variable, bad)
    evidence = {"output": ev.output.stats.text() if ev.output and ev.output.stats else "",
                "inputs": [f"{lab}: {m.short()} {m.stats.text() if m.stats else ''}" for lab, m in zip(labels, ev.inputs)],
                "input_names": [lab.strip("`") for lab in labels],
                "phase": ev.phase, "reached": reached, "op": ev.op, "op_index": ev.index}
    # Weights already bad when a recorded iteration began went bad in the unrecorded ones before it (a
    # bad *input* is that iteration's own batch).
    gap = trace.iterations.unrecorded_before(ev.index) if ev.kind == "weights" else None
    if gap is not None:  # it went bad in iterations of the loop that ran with the recorder off
        it = trace.iterations.iteration_of(ev.index)
        what = "The model's weights"
        evidence.update(iteration=it, unrecorded=list(gap))
        del evidence["op_index"]  # (the root cause is in the unrecorded iterations, not in iteration `it`)
        msg = (f"{what} already held NaN/Inf when iteration {it} of the loop began "
               f"({'; '.join(evidence['inputs'])}); every output is NaN from line {where.line} (`{code}`) on. "
               f"It happened in iterations {gap[0]}-{gap[1]}, which ran with the recorder off (a long loop is "
               "sampled: iterations 0, 1, 2 and each power of two are recorded op by op). Run the cell again "
               "with `every_iteration=True` (`%%backward_doctor --every-iteration`) to find the op that made it.")
        return [at("nonfinite", where, msg, op=ev.op, title=f"NaN/Inf appeared in iterations {gap[0]}-{gap[1]}",
                   evidence=evidence)]
    if ev.kind == "weights" and trace.iterations.replayed:
        k = trace.iterations.replayed
        step = trace.optimizer_steps[0] if trace.optimizer_steps else None
        where = Where(line=step.line, file=step.file, cell_line=step.cell_line) if step else where
        norms = trace.iterations.grad_norm
        prev = norms[(k - 1) // trace.iterations.stride] if (k - 1) // trace.iterations.stride < len(norms) else None
        msg = (f"The weights were already NaN/Inf when iteration {k} began ({'; '.join(evidence['inputs'])}), "
               f"yet every earlier loss and gradient was finite (gradient norm "
               f"{'%.3g' % prev if prev is not None else 'unknown'} in iteration {k - 1}): the optimizer step of "
               f"iteration {k - 1} wrote them. An update that overflows comes from a learning rate far too high "
               "for these gradients, or from optimizer state that overflowed (Adam's second moment in float16): "
               "lower the learning rate, clip the gradients, keep optimizer state in float32.")
        change = _lr_set_in(trace, k - 1)
        if change is not None:
            if change["line"]:
                where = Where(line=change["line"], cell_line=change["line"])
            msg += (f" Here the learning rate had just been set to {change['to']:.3g} (from {change['from']:.3g})"
                    f"{' at line ' + str(change['line']) if change['line'] else ''}.")
            evidence["lr_change"] = change
        return [at("nonfinite", where, msg, op=ev.op, title=f"The optimizer step of iteration {k - 1} made the "
                   "weights NaN/Inf", iteration=k - 1, evidence=evidence)]
    if ev.kind == "weights":
        msg = (f"The model's weights already contained NaN/Inf when this step started "
               f"({'; '.join(evidence['inputs'])}), so every output is NaN from line {where.line} (`{code}`) on. "
               "An earlier step put them there: the data is not to blame. Reload a good checkpoint or "
               "re-initialise, then find the first bad step by running it under the doctor.")
        return [at("nonfinite", where, msg, op=ev.op, title="Weights are already NaN/Inf", evidence=evidence)]
    if ev.kind == "input":
        name = f"`{ev.variable}`" if ev.variable else "an input tensor"
        msg = (f"{name} already contained NaN/Inf before the step touched it "
               f"({'; '.join(evidence['inputs'])}). It first entered the computation at line {where.line} "
               f"(`{code}`) and spread to the {', '.join(reached)}. The data is the problem, not the model: "
               "check the data pipeline (`torch.isfinite(x).all()` on each batch) and clean or skip bad samples.")
        return [at("nonfinite", where, msg, op=ev.op, title="Non-finite values in the input data",
                   evidence={**evidence, "variable": ev.variable})]
    fwd_op = ev.fwd_op if ev.phase == "backward" else ev.op
    why, fix = _explain(fwd_op, ev.phase)
    if ev.phase == "backward":
        lead = (f"The forward pass was finite, but the backward of `{fwd_op}` at line {where.line} (`{code}`) "
                f"produced NaN/Inf in `{ev.op}` ({evidence['output']})")
    else:
        lead = (f"`{ev.op}` at line {where.line} (`{code}`) turned finite inputs into NaN/Inf "
                f"({evidence['output']})")
    msg = (f"{lead}, and it reached the {', '.join(reached)}: {why}. Fix: {fix}. "
           "Later NaNs (loss, gradients, weights) are consequences of this one.")
    low = low_precision([m.dtype for m in ([ev.output] if ev.output else []) + list(ev.inputs)])
    if low is not None:  # (mixed precision: the family's own words, rules/amp.py)
        msg += " " + low_precision_origin(low, ev.phase)
        evidence["dtype"] = low
    return [at("nonfinite", where, msg, op=fwd_op, title="NaN/Inf created here", evidence=evidence)]
