"""Parameters that cannot train: frozen and never unfrozen, or no longer the ones the optimizer holds.

* ``left_frozen``: the loss has no graph because every weight it read was frozen, and the cell
  froze them (``for p in D.parameters(): p.requires_grad_(False)`` for a generator step, never
  undone before the discriminator's). The line is the statement that froze them, found in the
  cell's source; ``requires_grad_`` runs no op.
* ``orphan_params``: a parametrization (``weight_norm``, ``register_parametrization``) or a new
  layer/model put in place after the optimizer was built. The optimizer steps tensors no module
  uses (they never get a gradient) and never sees the new ones (they get gradients nobody applies).

>>> from backward_doctor.trace import Trace
>>> left_frozen(Trace()) + orphan_params(Trace())
[]
>>> freeze_lines("for p in D.parameters():\\n    p.requires_grad_(False)")
[(2, ['p', 'D'], False)]
"""
from __future__ import annotations

import ast
import re

from ..findings import Finding, at, source_line
from ...trace.records import ParamInfo, Trace, Where
from .flow import graph_ops, loss_op, owner

_PARAMETRIZE = re.compile(r"parametriz|weight_norm|spectral_norm|orthogonal", re.I)


def _dotted(node: ast.AST | None) -> str | None:
    """``model.disc`` for ``model.disc``, ``model.disc.parameters()`` and ``model.disc[0]`` -> ``model.disc.0``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return _dotted(node.func.value)  # D.parameters() -> D
    if isinstance(node, ast.Subscript):
        base = _dotted(node.value)
        key = node.slice
        if base and isinstance(key, ast.Constant) and isinstance(key.value, (int, str)):
            return f"{base}.{key.value}"
        return base
    return None


def _paths(nodes: list[ast.AST]) -> list[str]:
    out: list[str] = []
    for n in nodes:
        items = n.elts if isinstance(n, (ast.List, ast.Tuple)) else [n]
        out.extend(p for p in (_dotted(i) for i in items) if p)
    return out


def _flag(call: ast.Call, default: bool | None) -> bool | None:
    for a in list(call.args) + [k.value for k in call.keywords]:
        if isinstance(a, ast.Constant) and isinstance(a.value, bool):
            return a.value
    return default


def freeze_lines(source: str) -> list[tuple[int, list[str], bool]]:
    """``(line, paths, requires_grad)`` for each statement of the cell that sets ``requires_grad``.

    ``paths`` are what it applies to: the tensor or module it is called on, the arguments of a
    helper (``set_requires_grad([D], False)``) and, inside ``for p in D.parameters():``, ``D``.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[tuple[int, list[str], bool]] = []

    def visit(node: ast.AST, loops: list[str]) -> None:
        if isinstance(node, (ast.For, ast.AsyncFor)):
            loops = loops + _paths([node.iter])
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "requires_grad_":
                flag = _flag(node, True)
                found.append((node.lineno, _paths([node.func.value]) + loops, bool(flag)))
            elif "requires_grad" in name or "freeze" in name.lower():
                # set_requires_grad(nets, False) (CycleGAN), freeze(D) / unfreeze(D)
                flag = _flag(node, "unfreeze" in name.lower() or "freeze" not in name.lower())
                found.append((node.lineno, _paths(list(node.args)) + loops, bool(flag)))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, bool):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == "requires_grad":
                    found.append((node.lineno, _paths([t.value]) + loops, node.value.value))
        for child in ast.iter_child_nodes(node):
            visit(child, loops)

    visit(tree, [])
    return sorted(found)


def _covers(path: str, name: str) -> bool:
    return name == path or name.startswith(path + ".")


def _frozen_reads(trace: Trace) -> tuple[list[str], int | None]:
    """Parameters the failing loss read, below any cut, when every one of them was frozen: their names
    and the first op that read one. ``([], None)`` when some parameter it read could train."""
    names = {p.key: p.name for p in trace.params if p.key}
    frozen: list[str] = []
    first = None
    for i in sorted(graph_ops(trace, loss_op(trace), cuts=True)):
        op = trace.op(i)
        for k, m in zip(op.in_keys, op.inputs) if op is not None else ():
            if k not in names:
                continue
            if m.requires_grad:  # a weight that could train (no_grad or a cut stopped it): not this rule
                return [], None
            if names[k] not in frozen:
                frozen.append(names[k])
                first = first if first is not None else op
    return frozen, (first.index if first is not None else None)


def left_frozen(trace: Trace) -> list[Finding]:
    """The loss read only frozen weights, and this cell froze them: point at the freeze."""
    exc = trace.exception
    if exc is None or "does not require grad and does not have a grad_fn" not in exc.message:
        return []
    frozen, first = _frozen_reads(trace)
    reader = trace.op(first)
    if not frozen or reader is None:
        return []
    read_line = reader.where.cell_line or reader.where.line  # the cell's call of the frozen module
    freezes = [(line, paths) for line, paths, flag in freeze_lines(trace.source)
               if not flag and any(_covers(p, n) for p in paths for n in frozen)]
    module = owner(frozen)
    shown = f"{len(frozen)} tensors: {', '.join(frozen[:4])}{' ...' if len(frozen) > 4 else ''}"
    unfreeze = f"for p in {module}.parameters(): p.requires_grad_(True)" if module else "p.requires_grad_(True)"
    if freezes:
        earlier = [f for f in freezes if read_line is None or f[0] < read_line]
        line = (earlier or freezes)[-1][0]
        code = source_line(trace, line)
        how = (f"Line {line} (`{code}`) froze {module or 'these weights'} (requires_grad=False), and nothing "
               f"unfroze it before line {read_line} used it again")
        where = Where(line=line, file=None, cell_line=line, module=module)
    else:  # frozen before this cell ran: point at where the loss used the frozen module
        used = {k for op in trace.ops if op.phase == "forward" for k in op.in_keys}
        if not any(p.requires_grad for p in trace.params if p.key in used):
            return []  # nothing in the step could train: no_grad_path's "all parameters frozen" says it
        w = reader.where
        where = Where(line=read_line, file=None if w.cell_line else w.file, cell_line=w.cell_line, module=module)
        code = source_line(trace, where.line, where.file)
        how = (f"{module or 'The module'} was frozen (requires_grad=False) before this cell ran, and line "
               f"{read_line} (`{code}`) used it")
    msg = (f"{how}: every weight the loss read ({shown}) was frozen, and its other inputs were detached or "
           "never required grad, so the loss has no graph. Freezing a model for another model's step (a "
           f"discriminator during the generator's) is right; unfreeze it before its own step: `{unfreeze}`.")
    return [at("no_grad_path", where, msg, title="Weights left frozen",
               evidence={"cut": "frozen", "parameters": frozen, "code": code, "read_line": read_line})]


def orphans(trace: Trace) -> tuple[list[ParamInfo], list[ParamInfo]]:
    """(stepped tensors no module holds that got no gradient, tensors that got one but were not stepped),
    when both exist and at least one size matches: the second replaced the first after the optimizer
    was built. ``([], [])`` otherwise."""
    if not trace.optimizer_steps:
        return [], []
    old = [p for p in trace.params if p.stepped and p.requires_grad and not p.got_grad and p.name.startswith("<")]
    new = [p for p in trace.params if p.got_grad and not p.stepped and p.requires_grad]
    if not old or not new or not {p.numel for p in old} & {p.numel for p in new}:
        return [], []
    return old, new


def _replaced_at(trace: Trace, names: list[str]) -> int | None:
    """The cell line that put the new parameters' module in place: a store into its path
    (``model[0] = weight_norm(model[0])``, ``model.fc = nn.Linear(...)``) or a parametrization call on it."""
    try:
        tree = ast.parse(trace.source)
    except SyntaxError:
        return None
    lines = []
    for node in ast.walk(tree):
        paths: list[str] = []
        if isinstance(node, ast.Assign):
            paths = _paths(list(node.targets))
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            paths = _paths(list(node.args)) if _PARAMETRIZE.search(fn) else []
        if any(_covers(p, n) for p in paths for n in names):
            lines.append(node.lineno)
    return min(lines) if lines else None


def orphan_params(trace: Trace) -> list[Finding]:
    """The optimizer holds parameters no module uses; the module's new parameters are never stepped."""
    old, new = orphans(trace)
    if not old:
        return []
    names = [p.name for p in new]
    module = owner([n.split(".parametrizations.")[0] + ".x" for n in names])
    step = trace.optimizer_steps[0]
    line = _replaced_at(trace, names)
    if line is not None:
        where = Where(line=line, file=None, cell_line=line, module=module)
    else:
        where = Where(line=step.line, file=step.file, cell_line=step.cell_line, module=module)
    code = source_line(trace, where.line, where.file)
    step_code = source_line(trace, step.line, step.file) or "optimizer.step()"
    how = (f"line {line} (`{code}`) replaced them after the optimizer was built"
           if line is not None else "they were replaced (a parametrization such as `weight_norm`, a new layer or a "
           "re-created model) after the optimizer was built")
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    msg = (f"`{step_code}` updates {len(old)} parameter tensor(s) that no module uses any more "
           f"({', '.join(p.name for p in old[:4])}), so they never get a gradient, while the {len(new)} tensor(s) the "
           f"model now trains with ({shown}) got gradients that no optimizer applies: {how}. The step changes "
           "nothing. Build the optimizer after registering parametrizations or replacing layers (or add the new "
           "ones: `opt.add_param_group({'params': [...]})`).")
    return [at("orphan_params", where, msg, title="Optimizer holds replaced parameters",
               evidence={"orphaned": [p.name for p in old], "not_stepped": names,
                         "step_line": step.line, "values": sum(p.numel for p in old)})]
