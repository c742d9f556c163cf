"""``grad_accumulation``: gradient accumulation written wrong (nothing raises; training just follows
other gradients than the user meant).

Read from ``trace.accumulation`` (``capture/watches/accumulation.py``): the pattern is several ``backward()``
calls from one call site feeding one optimizer step (a loop in the cell, Accelerate's ``accumulate()``,
``Trainer``'s ``gradient_accumulation_steps``, Lightning's ``accumulate_grad_batches``). Checked, most
specific first:

* ``zero_grad()`` between the micro-batches of one step: the earlier micro-batches' gradients are
  thrown away (Accelerate's ``accumulate()`` holds back ``optimizer.zero_grad()`` but not
  ``model.zero_grad()``);
* the tail of an epoch (fewer than k micro-batches) never stepped nor zeroed, leaking into the next epoch's first
  step (``accum_tail.py``: not a loss divided by the wrong number);
* the loss not divided by the number of micro-batches: the step's gradient is k times one full batch's;
* the loss divided twice, by the user and again by the library that calls ``backward()`` (``accum_twice.py``):
  the step's gradient is 1/k of one full batch's;
* ``optimizer.step()`` after every micro-batch while the loss is divided for accumulation;
* ``clip_grad_norm_`` after every micro-batch rather than once before the step (``clipping.py``);
* whatever else made the measured check disagree (the step's gradient against one full batch's).

Silent on correct accumulation, on one ``backward()`` per step, and on several ``backward()`` calls
from different lines (a GAN discriminator's real and fake losses, L-BFGS's closure).

>>> from backward_doctor.trace import Trace
>>> grad_accumulation(Trace())
[]
"""
from __future__ import annotations

import ast
import linecache
import re

from ..findings import Finding, at, code_at, looped, placed
from .accum_tail import modulo_guard, tail_leak
from .accum_twice import divided_twice
from .clipping import clip_per_micro_batch
from ...trace.accumulation import Accumulation, AccumulationCheck, StepWindow
from ...trace.records import Trace, Where

_TITLE = "Gradient accumulation written wrong"


def _source(trace: Trace, file: str | None) -> str:
    return trace.source if file is None else "".join(linecache.getlines(file))


def _accumulating(acc: Accumulation) -> list[StepWindow]:
    """Windows where one call site ran backward() several times for one step."""
    return [w for w in acc.windows if w.backward >= 2 and len(w.calls) >= 2 and len({c.site for c in w.calls}) == 1]


def _measured(check: AccumulationCheck | None) -> str:
    if check is None or check.factor is None:
        return ""
    return (f" Measured in iteration {check.iteration} ({check.micro_batches} micro-batches): the gradient the "
            f"step used is {check.factor:.2f}x the gradient one full batch of the same micro-batches gives "
            f"(relative difference {check.rel_diff:.2f}).")


def _check_evidence(check: AccumulationCheck | None) -> dict:
    if check is None:
        return {}
    return {"check": {"iteration": check.iteration, "micro_batches": check.micro_batches, "factor": check.factor,
                      "rel_diff": check.rel_diff, "sum_rel_diff": check.sum_rel_diff, "divisor": check.divisor,
                      "why_not": check.why_not}}


def _library(trace: Trace, w: StepWindow) -> str:
    """Which library runs the accumulation: "accelerate", "trainer", "lightning" or ''."""
    if w.accumulate > 1 or any(s.split("=")[0].endswith(".gradient_accumulation_steps") and "args." not in s
                               for s in trace.accumulation.settings):
        return "accelerate"
    if any("args.gradient_accumulation_steps" in s for s in trace.accumulation.settings):
        return "trainer"
    if any("accumulate_grad_batches" in s for s in trace.accumulation.settings):
        return "lightning"
    # a Trainer the namespace does not hold (a ``DoctorCallback`` in a script): its loop still says so
    return "trainer" if trace.iterations.library == "transformers" else ""


def _divides_by(source: str, name: str | None, d: float) -> bool:
    """The guard's ``N`` is what the loss was divided by: the number ``d`` itself, or a name the source divides
    by (``loss / accum_steps`` beside ``% accum_steps``)."""
    if name is None:
        return False
    try:
        return abs(float(name) - d) < 1e-6
    except ValueError:
        return re.search(r"/\s*\(?\s*" + re.escape(name) + r"\b", source) is not None


def _divided(code: str, n: str) -> str | None:
    """The backward() call of ``code`` with its loss divided by ``n``: ``loss.backward()`` ->
    ``(loss / n).backward()``, ``self.manual_backward(loss)`` -> ``self.manual_backward(loss / n)``."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return None
    for call in ast.walk(tree):
        func = call.func if isinstance(call, ast.Call) else None
        if not isinstance(func, ast.Attribute) or func.attr not in ("backward", "manual_backward"):
            continue
        owner = ast.unparse(func.value)
        if call.args and (func.attr == "manual_backward" or owner in ("torch.autograd", "autograd", "accelerator")):
            call.args[0] = ast.BinOp(call.args[0], ast.Div(), ast.Name(n))  # the loss is its first argument
        else:
            func.value = ast.BinOp(func.value, ast.Div(), ast.Name(n))     # ``loss.backward()``
        return ast.unparse(tree)
    return None


def _one_line(fix: str) -> str:
    """A two- or three-line fix as one valid line (``if c: a; b``)."""
    head, _, body = fix.partition("\n")
    if head.endswith(":"):
        return head + " " + "; ".join(x.strip() for x in body.splitlines())
    return "; ".join(x.strip() for x in fix.splitlines())


def _zero_fix(source: str, zero_line: int | None, step_line: int | None, step: str, zero: str) -> tuple[str, str]:
    """Where ``zero_grad()`` belongs: under the accumulation guard with the step, or out of the micro-batch
    loop (before it); returns the fix as code and the advice that says it."""
    _, guard = modulo_guard(source, zero_line)
    if guard is not None:
        fix = f"if {ast.unparse(guard.test)}:\n    {step}\n    {zero}"
        return fix, f"Zero the gradients once per optimizer step, right after it: `{_one_line(fix)}`"
    try:
        loops = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.For, ast.While)) and zero_line
                 and n.lineno <= zero_line <= (n.end_lineno or n.lineno)]
    except SyntaxError:
        loops = []
    inner = max(loops, key=lambda n: n.lineno, default=None)
    if inner is not None and step_line is not None and not inner.lineno <= step_line <= (inner.end_lineno or 0):
        head = source.splitlines()[inner.lineno - 1].strip()
        fix = f"{zero}  # once per optimizer step, before the micro-batch loop\n{head}\n    ..."
        return fix, f"Zero the gradients once per optimizer step: call `{zero}` before `{head}`, not inside it"
    fix = f"{step}\n{zero}"
    return fix, f"Zero the gradients once per optimizer step, right after it: `{_one_line(fix)}`"


def _usual(acc: Accumulation) -> int:
    """The number of backward() calls most steps took (0: none took two or more)."""
    counts = [(c, n) for n, c in enumerate(acc.per_step) if n >= 2 and c]
    return max(counts)[1] if counts else 0


# ---------------------------------------------------------------- zero_grad() between micro-batches
def _zeroed_inside(trace: Trace) -> list[Finding]:
    acc = trace.accumulation
    usual = _usual(acc)
    for w in _accumulating(acc):
        zeros = [z for z in w.zero_grads if z.stepped and 0 < z.after]
        if not zeros:
            continue
        if w.backward > usual >= 2 and w.backward - max(z.after for z in zeros) == usual:
            continue  # a full step's micro-batches after it: an epoch's tail dropped (zero_grad() before each epoch)
        z = zeros[0]
        k = w.backward
        lost = min(k, max(x.after for x in zeros))  # the last zero_grad before the step decides
        what = f"`{code_at(trace, z.line, z.file) or z.type + '.zero_grad()'}`"
        if _library(trace, w) == "accelerate" and z.target == "module":
            fix = "optimizer.zero_grad()"
            advice = ("Call `optimizer.zero_grad()` instead (the optimizer `accelerator.prepare` returned): it "
                      "zeroes only when the step is taken")
            why = (f"{what} runs on every micro-batch. Inside `accelerator.accumulate()`, Accelerate holds back "
                   "`optimizer.zero_grad()` (the optimizer `accelerator.prepare` returned) until the step is taken, "
                   "but `model.zero_grad()` is a plain module call it cannot hold back")
        else:
            step = code_at(trace, w.line, w.file) or "optimizer.step()"
            zero = code_at(trace, z.line, z.file) or "optimizer.zero_grad()"
            why = f"{what} runs between the micro-batches that feed one `{step}`"
            fix, advice = _zero_fix(_source(trace, z.file), z.line, w.line if w.file == z.file else None, step, zero)
        msg = (f"{why}: each call throws away the gradients the micro-batches before it accumulated, so the "
               f"step uses {'none of the' if lost >= k else f'{k - lost} of the'} {k} micro-batches' gradients "
               f"({lost} thrown away) - gradient accumulation that does not accumulate.{_measured(acc.check)} "
               f"{advice}.")
        where = placed(z)
        return [at("grad_accumulation", where, msg, title=_TITLE, iteration=looped(trace, w.iteration),
                   evidence={"problem": "zero_grad_inside", "micro_batches": k, "thrown_away": lost,
                             "target": z.target, "fix_code": fix, **_check_evidence(acc.check)})]
    return []


# ---------------------------------------------------------------- the loss not divided
_SCALING = ("aten::div", "aten::mul", "aten::div_", "aten::mul_", "aten::_to_copy", "aten::clone", "aten::alias")


_CALLS_BACKWARD = re.compile(r"\b(?:manual_)?backward\s*\(")


def _loss_place(trace: Trace, w: StepWindow) -> Where:
    """Where to fix the scaling: the backward() call, or (when backward() ran in a library called from the
    user's line, ``trainer.train()``) the user's own function that computed the loss (a Trainer's
    ``compute_loss``, in a file or in the cell itself): the forward op behind backward()'s first node,
    followed back through the library's scalings (``loss / 1``)."""
    c = w.calls[0]
    where = placed(c)
    code = code_at(trace, c.line, c.file)
    if _CALLS_BACKWARD.search(code) or (c.file is not None and not code):
        return where  # the user's own backward() call (or a file line not kept): the fix divides its loss there
    root = next((op for op in trace.ops if op.phase == "backward" and op.fwd_index is not None), None)
    fwd = trace.op(root.fwd_index) if root is not None else None
    for _ in range(8):
        if fwd is None:
            break
        # Another user frame than the library call's: a file of the user's, or a function the cell defines
        # (its ops have ``file`` None like the call's line, but their own function)
        if fwd.where.line is not None and (fwd.where.file, fwd.where.function) != (c.file, c.function):
            return fwd.where
        if fwd.op not in _SCALING or not fwd.in_keys:
            break
        key = fwd.in_keys[0]
        fwd = next((op for op in reversed(trace.ops[:fwd.index]) if op.phase == "forward" and key in op.out_keys), None)
    return where


def _not_divided(trace: Trace) -> list[Finding]:
    acc = trace.accumulation
    usual = _usual(acc)
    for w in _accumulating(acc):
        k = w.backward
        d = min(c.divisor for c in w.calls)
        if d >= 0.75 * k or min(c.library_divisor for c in w.calls) >= 0.75 * k:
            continue  # (divided for accumulation, by the user or by the library that called backward())
        if k > usual >= 2 and abs(d - usual) < 1e-6:
            continue  # divided by what most steps took: this step took more (a tail leaked into it, accum_tail.py)
        where = _loss_place(trace, w)
        code = code_at(trace, w.calls[0].line, w.calls[0].file)
        lib = _library(trace, w)
        scaled = f"divided by {d:g}, not by {k}" if d > 1.01 else f"not divided by {k}"
        if lib == "accelerate":
            fix = "accelerator.backward(loss)"
            how = ("`accelerator.backward(loss)` instead of `loss.backward()`: it divides the loss by "
                   "`gradient_accumulation_steps`")
        elif lib == "trainer":
            fix = "trainer.loss_is_scaled_for_ga = False"
            how = ("the Trainer left the loss undivided: the model's `forward` takes `**kwargs`, so the Trainer "
                   "expects its loss to be normalised by `num_items_in_batch` over the whole accumulated batch, "
                   "but this loss is a per-batch mean. Tell the Trainer it is one: `trainer.loss_is_scaled_for_ga = "
                   "False` (transformers 5; before: `trainer.model_accepts_loss_kwargs = False`), or divide by "
                   "`num_items_in_batch` in `compute_loss`")
        else:
            name, _ = modulo_guard(_source(trace, w.calls[0].file), w.calls[0].line)
            fix = _divided(code, name or str(k)) or f"(loss / {name or k}).backward()"
            how = f"divide each micro-batch's loss by the number of micro-batches: `{fix}`"
        msg = (f"{k} backward() calls feed each optimizer step (gradient accumulation over {k} micro-batches), "
               f"but each micro-batch's loss reaches backward() {scaled}: the gradients add up "
               f"to {k / d:.3g}x the gradient of one full batch, as if the learning rate were {k / d:.3g}x larger "
               f"(and gradient clipping, weight decay and the logged loss see it too).{_measured(acc.check)} "
               f"Fix: {how}.")
        return [at("grad_accumulation", where, msg, title=_TITLE, severity="warning",
                   iteration=looped(trace, w.iteration),
                   evidence={"problem": "loss_not_divided", "micro_batches": k, "divisor": d, "library": lib,
                             "fix_code": fix, **_check_evidence(acc.check)})]
    return []


# ---------------------------------------------------------------- a step after every micro-batch
def _step_every_micro_batch(trace: Trace) -> list[Finding]:
    acc = trace.accumulation
    singles = [w for w in acc.windows if w.backward == 1 and w.calls]
    if len(singles) < 2:
        return []
    off_sync = [w for w in singles if w.sync is False]
    w = off_sync[0] if off_sync else singles[0]
    d = w.calls[0].divisor
    step = code_at(trace, w.line, w.file) or "optimizer.step()"
    if off_sync:
        k = w.accumulate
        msg = (f"`{step}` ran on a micro-batch Accelerate's `accumulate()` holds back (gradient_accumulation_steps"
               f"={k}: it was not the step to take), so the optimizer stepped after every micro-batch with 1/{k} of "
               "the gradient: it is not the optimizer `accelerator.prepare` returned. Pass it through "
               "`accelerator.prepare(model, optimizer, loader)` and step the one it returns.")
        fix = "model, optimizer, loader = accelerator.prepare(model, optimizer, loader)"
    else:
        if d < 2 or any(abs(x.calls[0].divisor - d) > 1e-6 for x in singles):
            return []
        source = _source(trace, w.file)
        name, guard = modulo_guard(source, w.line)
        if guard is None or (w.line is not None and guard.lineno <= w.line <= (guard.end_lineno or guard.lineno)):
            return []  # no accumulation guard in the loop, or the step is under it
        if not _divides_by(source, name, d):
            return []  # a guard for something else (``if step % 100 == 0: print(...)``), a loss scaled for its own sake
        zeros = [ln.split("#")[0].strip() for ln in source.splitlines() if ".zero_grad(" in ln]
        zero = zeros[0] if zeros else "optimizer.zero_grad()"
        fix = f"if {ast.unparse(guard.test)}:\n    {step}\n    {zero}"
        msg = (f"Each micro-batch's loss is divided by {d:g} for accumulation (`{name}`), but `{step}` runs after "
               f"every backward(), outside `if {ast.unparse(guard.test)}:`: {len(singles)}+ steps each with 1/{d:g} "
               f"of one micro-batch's gradient, instead of one step with the whole batch's - the learning rate is "
               f"in effect {d:g}x smaller and every step follows a single micro-batch. Step (and zero the gradients) "
               f"only when the micro-batches are complete: `{_one_line(fix)}`.")
        k = int(round(d))
    where = placed(w)
    return [at("grad_accumulation", where, msg, title=_TITLE, iteration=looped(trace, w.iteration),
               evidence={"problem": "step_every_micro_batch", "micro_batches": k, "divisor": d, "fix_code": fix})]


# ---------------------------------------------------------------- the measured check, anything else
def _check_disagrees(trace: Trace) -> list[Finding]:
    check = trace.accumulation.check
    if check is None or check.sum_rel_diff is None or check.sum_rel_diff < 0.1:
        return []  # (a loss divided by the wrong number is _not_divided's; this is what happened to .grad)
    # Only micro-batches of one call site are accumulation: backward() calls from different lines that feed
    # one step are different losses (an adversarial step's input gradient thrown away by a zero_grad(), a
    # multi-task sum), whose gradients no "one full batch" equals.
    w = next((x for x in _accumulating(trace.accumulation) if x.iteration == check.iteration), None)
    if w is None:
        return []
    where = placed(w)
    msg = (f"The gradient `{code_at(trace, w.line, w.file) or 'optimizer.step()'}` used is not the sum of what its "
           f"{check.micro_batches} micro-batches' backward() calls added to `.grad`.{_measured(check)} Something "
           "changed the gradients between the micro-batches (clipping or rescaling them before the last one, a "
           "hook, `p.grad = None`): do that once, after the last micro-batch and before the step.")
    return [at("grad_accumulation", where, msg, title=_TITLE, severity="warning", iteration=looped(trace, w.iteration),
               evidence={"problem": "check_disagrees", **_check_evidence(check)})]


def grad_accumulation(trace: Trace) -> list[Finding]:
    """Gradient accumulation written wrong (see the module docstring); the first problem found."""
    if not trace.accumulation.windows:
        return []
    for check in (_zeroed_inside, tail_leak, _not_divided, _divided_twice, _step_every_micro_batch, _clipped_per_micro_batch,
                  _check_disagrees):
        found = check(trace)
        if found:
            return found
    return []


def _divided_twice(trace: Trace) -> list[Finding]:
    return divided_twice(trace, _accumulating(trace.accumulation))


def _clipped_per_micro_batch(trace: Trace) -> list[Finding]:
    """``clipping.py``'s finding, with the measured check when it ran (the clips changed the step's gradient)."""
    found = clip_per_micro_batch(trace)
    check = trace.accumulation.check
    if found and check is not None and check.factor is not None and check.sum_rel_diff > 1e-3:
        f = found[0]
        f.message += (f" Measured in iteration {check.iteration}: the gradient the step used differs from the sum of "
                      f"its {check.micro_batches} micro-batches' by {check.sum_rel_diff:.2f} (relative), so the "
                      "clips did change it in this run.")
        f.evidence.update(_check_evidence(check))
        f.severity = "error"
    return found


__all__ = ["grad_accumulation"]
