"""``frozen_params_updated``: parameters frozen (``requires_grad=False``) that an optimizer step still changed.

torch's optimizers skip a parameter only when its ``.grad`` is None. A layer frozen after the optimizer was built
keeps a gradient of zeros when ``zero_grad(set_to_none=False)`` clears it, so the optimizer goes on updating it:
AdamW's weight decay shrinks it, momentum and Adam's moments from before the freeze keep moving it. Read from
``trace.frozen_updates`` (values sampled before and after each recorded step: only what really changed), placed
at the line that froze them (the cause), naming the step that moved them and the ``zero_grad`` that kept their
gradients. Silent when the frozen parameters are not in the optimizer, have no gradient (``set_to_none=True``, the
default), or the step leaves them as they were (plain SGD on a zero gradient).

>>> from backward_doctor.trace import Trace
>>> frozen_params_updated(Trace())
[]
>>> zero_grad_lines("opt.zero_grad(set_to_none=False)\\nmodel.zero_grad()")
[(1, 'opt.zero_grad')]
"""
from __future__ import annotations

import ast
import re

from ..findings import Finding, at, looped, source_line
from ...trace.frozen import FrozenUpdate
from ...trace.records import Trace, Where
from .flow import owner
from .params import _covers, freeze_lines


def zero_grad_lines(source: str) -> list[tuple[int, str]]:
    """``(line, callee)`` of each ``zero_grad(set_to_none=False)`` call in the cell (keyword or positional)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_grad"):
            continue
        flags = [k.value for k in node.keywords if k.arg == "set_to_none"] + list(node.args[:1])
        if any(isinstance(v, ast.Constant) and v.value is False for v in flags):
            found.append((node.lineno, ast.unparse(node.func)))
    return sorted(found)


def _freeze_place(trace: Trace, names: list[str], step_line: int | None) -> tuple[int, str, str] | None:
    """``(line, code, drop)`` for the cell's statement that froze these parameters (the last before the step's
    line when there are several), ``drop`` the statement that also drops their gradients."""
    found = [(line, paths) for line, paths, flag in freeze_lines(trace.source)
             if not flag and any(_covers(p, n) for p in paths for n in names)]
    if not found:
        return None
    earlier = [f for f in found if step_line is None or f[0] < step_line]
    line, paths = (earlier or found)[-1]
    code = source_line(trace, line)
    return line, code, _drop_grads(code, tensor=len(paths) > 1 or paths[0].endswith((".weight", ".bias")))


def _pct(change: float, scale: float) -> str:
    return f" ({100 * change / scale:.2g}% of their largest sampled value)" if scale > 0 else ""


def frozen_params_updated(trace: Trace) -> list[Finding]:
    """One finding per optimizer that changed frozen parameters: the first step that did, placed at the freeze."""
    # A gradient that is not zeros was computed before the freeze (frozen between backward() and step()): the
    # step applies it once, as the user's code asked. Zeros, or a parameter moved at two steps, is the drift.
    steps: dict[int, set[int]] = {}
    for u in trace.frozen_updates:
        steps.setdefault(u.key, set()).add(u.iteration)
    drift = [u for u in trace.frozen_updates if u.grad_zero or len(steps[u.key]) > 1]
    if not drift:
        return []
    names = {p.key: p.name for p in trace.params if p.key}
    out: list[Finding] = []
    for opt_id in dict.fromkeys(u.id for u in drift):
        ups = [u for u in drift if u.id == opt_id]
        out.append(_finding(trace, ups, names))
    return out


def _finding(trace: Trace, ups: list[FrozenUpdate], names: dict[int, str]) -> Finding:
    first = min(u.iteration for u in ups)
    now = [u for u in ups if u.iteration == first]
    u0 = now[0]
    params = list(dict.fromkeys(names.get(u.key, f"<parameter of {u.numel} values>") for u in now))
    shown = ", ".join(f"`{n}`" for n in params[:4]) + (" ..." if len(params) > 4 else "")
    module = owner(params) if all(not n.startswith("<") for n in params) else None
    change = max(u.max_change for u in now)
    scale = max(u.max_abs for u in now)
    moved, sampled = sum(u.moved for u in now), sum(u.sampled for u in now)
    iterations = sorted({u.iteration for u in ups})
    step_code = source_line(trace, u0.line, u0.file) or "optimizer.step()"
    step_at = f"line {u0.line}" if u0.file is None else f"`{u0.file.rsplit('/', 1)[-1]}:{u0.line}`"
    freeze = _freeze_place(trace, params, u0.cell_line if u0.cell_line is not None else u0.line) \
        if trace.source else None
    zeros = zero_grad_lines(trace.source)
    zeroed = all(u.grad_zero for u in now)
    if freeze is not None:
        where = Where(line=freeze[0], file=None, cell_line=freeze[0], module=module)
        since = f"since line {freeze[0]} (`{freeze[1]}`) froze them"
    else:
        where = Where(line=u0.line, file=u0.file, cell_line=u0.cell_line, module=module, function=u0.function)
        since = "(frozen)"
    later = [i for i in iterations if i != first]
    again = (f", and again at every recorded step after it (iteration{'s' if len(later) > 1 else ''} "
             f"{', '.join(map(str, later[:6]))}{' ...' if len(later) > 6 else ''})") if later else ""
    kept = (f"`{zeros[0][1]}(set_to_none=False)` (line {zeros[0][0]}) keeps their gradients as zeros"
            if zeros else "their gradients are kept as zeros, not None" if zeroed else "they still have a gradient")
    msg = (f"{shown} ({len(params)} tensor{'s' if len(params) > 1 else ''}) have requires_grad=False {since}, yet "
           f"`{step_code}` ({step_at}, {u0.optimizer}) still changed them at iteration {first}: {moved} of {sampled} "
           f"sampled values moved, by up to {change:.3g}{_pct(change, scale)}{again}. The frozen weights drift "
           f"instead of staying as they were. torch's optimizers skip a parameter only when its `.grad` is None: "
           f"{kept}, so weight decay, and momentum or Adam's moments gathered before the freeze, keep updating them. "
           "Let their gradients be None (`zero_grad()`, whose default is `set_to_none=True`), or build the optimizer "
           "from the trainable parameters only (`filter(lambda p: p.requires_grad, model.parameters())`), or remove "
           "them from its param group.")
    if zeros:
        line, callee = zeros[0]
        fix = f"{callee}()  # set_to_none=True: frozen parameters keep .grad None and the optimizer skips them"
        fix_line = line
    elif freeze is not None:
        fix = f"{freeze[1]}; {freeze[2]}  # no gradient: the optimizer skips them (no decay, no momentum)"
        fix_line = freeze[0]
    elif zeroed:  # (zeroed where the cell cannot show it: a library's loop, a hook of the user's module)
        fix = "optimizer.zero_grad(set_to_none=True)  # frozen parameters keep .grad None and the optimizer skips them"
        fix_line = None
    else:
        fix = f"torch.optim.{u0.optimizer}(filter(lambda p: p.requires_grad, model.parameters()), ...)"
        fix_line = None
    return at("frozen_params_updated", where, msg, severity="warning", title="Frozen parameters still updated",
              iteration=looped(trace, first),
              evidence={"parameters": params, "step_line": u0.line, "step_file": u0.file, "optimizer": u0.optimizer,
                        "iterations": iterations, "moved": moved, "sampled": sampled, "max_change": change,
                        "relative_change": change / scale if scale > 0 else None, "grad_zero": zeroed,
                        "zero_grad_line": zeros[0][0] if zeros else None,
                        "freeze_line": freeze[0] if freeze else None, "fix_line": fix_line, "fix_code": fix})


def _drop_grads(code: str, tensor: bool) -> str:
    """The statement that drops the gradients of what ``code`` froze: ``p.grad = None`` for a tensor (a loop's
    parameter), ``m.zero_grad(set_to_none=True)`` for a module.

    >>> _drop_grads("for p in enc.parameters(): p.requires_grad_(False)", True)
    'p.grad = None'
    >>> _drop_grads("model[0].requires_grad_(False)", False)
    'model[0].zero_grad(set_to_none=True)'
    """
    m = re.search(r"([\w.\[\]'\"]+)\.requires_grad", code)
    target = m.group(1) if m else "p"
    return f"{target}.grad = None" if tensor else f"{target}.zero_grad(set_to_none=True)"
