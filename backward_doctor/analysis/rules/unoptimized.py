"""``orphan_params`` for a module no optimizer holds: a head, a resized embedding or an adapter put on the model
after the optimizer was built.

An optimizer holds the parameters it was given when it was built (``AdamW(model.parameters())`` reads the model
once). ``model.head = nn.Linear(...)``, ``model.add_module(...)``, ``resize_token_embeddings(...)`` or
``get_peft_model(...)`` afterwards gives the model parameters that get a gradient at every ``backward()`` and are
in none of its param groups: they never change, and nothing raises. Read from ``trace.unoptimized`` (modules of a
model an optimizer trains that no optimizer of the run or the namespace holds, ``capture/watches/orphans.py``) and
``trace.params`` (they got a gradient in the step and were not stepped). Placed at the cell's statement that put
the module in place when the cell shows it, else at the optimizer's construction in the cell, else at its step.

Without such a statement, a module left out is named only when it is the smaller part of the model (a head, an
adapter: the optimizer was given the rest) and a whole module: an optimizer given only a head while the backbone
is left trainable (a linear probe) is the user's choice, and says nothing. Silent on a module built before the
optimizer, a frozen one (``requires_grad=False``: no gradient), one a second optimizer holds (a GAN's two), PEFT's
adapters when the optimizer is built after ``get_peft_model``, and a Trainer's own optimizer (built after the model).

>>> from backward_doctor.trace import Trace
>>> unoptimized_params(Trace())
[]
>>> creating_lines("opt = AdamW(model.parameters())\\nmodel.head = nn.Linear(4, 2)", "model.head", "model")
[(2, 'assign')]
>>> creating_lines("model = get_peft_model(base, cfg)", "model.base_model.model.fc.lora_A", "model")
[(1, 'peft')]
"""
from __future__ import annotations

import ast
import re

from ..findings import Finding, at, looped, source_line
from ...trace.orphans import UnoptimizedModule
from ...trace.records import ParamInfo, Trace, Where
from .params import _covers, _dotted, orphans

_PEFT = {"get_peft_model", "inject_adapter_in_model", "add_adapter", "prepare_model_for_kbit_training"}
_ADD = {"add_module", "register_module", "register_parameter"}


def _code(name: str) -> str:
    """A dotted name as cell code (``model.layers.0.lora_A`` -> ``model.layers[0].lora_A``)."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", name)


def creating_lines(source: str, module: str, model: str) -> list[tuple[int, str]]:
    """``(line, how)`` of each statement of the cell that can have put ``module`` (a dotted name under the variable
    ``model``) in place: an ``assign``ment to it or to a module above or below it (``setattr`` too), an ``add`` of
    it (``add_module``, ``register_module``, ``register_parameter``), a ``resize`` of the model's token embeddings,
    a ``peft`` adapter put on the model; in order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    root = model.split(".", 1)[0]
    related = lambda path: bool(path) and (_covers(path, module) or _covers(module, path))  # noqa: E731
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            paths = [_dotted(t) for t in node.targets if isinstance(t, (ast.Attribute, ast.Subscript))]
            if any(p and related(p) for p in paths):
                found.append((node.lineno, "assign"))
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        on = _dotted(node.func.value) if isinstance(node.func, ast.Attribute) else None
        first = node.args[1] if len(node.args) > 1 and fn == "setattr" else node.args[0] if node.args else None
        named = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
        if fn == "setattr" and node.args and named and related(f"{_dotted(node.args[0])}.{named}"):
            found.append((node.lineno, "assign"))
        elif fn in _ADD and on and named and related(f"{on}.{named}"):
            found.append((node.lineno, "add"))
        elif fn == "resize_token_embeddings" and on and on.split(".", 1)[0] == root:
            found.append((node.lineno, "resize"))
        elif fn in _PEFT:
            args = [_dotted(a) for a in node.args] + ([on] if on else [])
            parent = _assigned_to(tree, node)
            if root in {a.split(".", 1)[0] for a in args if a} | ({parent} if parent else set()):
                found.append((node.lineno, "peft"))
    return sorted(set(found))


def _assigned_to(tree: ast.AST, call: ast.Call) -> str | None:
    """The name a call's result is bound to (``model = get_peft_model(...)`` -> ``model``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.value is call and isinstance(node.targets[0], ast.Name):
            return node.targets[0].id
    return None


def built_line(source: str, optimizer: str) -> int | None:
    """The cell line that builds the optimizer bound to ``optimizer`` (``opt = torch.optim.AdamW(...)``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Call) and any(_dotted(t) == optimizer for t in node.targets)]
    return min(lines) if lines else None


def unoptimized_params(trace: Trace) -> list[Finding]:
    """One finding per optimizer: the modules of its model no optimizer holds that got a gradient in the step."""
    if not trace.optimizer_steps or not trace.unoptimized:
        return []
    by_name = {p.name: p for p in trace.params}
    by_key = {p.key: p for p in trace.params if p.key}
    replaced = {p.name for p in orphans(trace)[1]}  # (a layer replaced in place: orphan_params says it already)
    left: list[tuple[UnoptimizedModule, list[ParamInfo]]] = []
    for u in trace.unoptimized:
        found = [by_name.get(n) or by_key.get(k) for n, k in zip(u.params, u.keys)]
        if not any(found) and u.grads:
            # (none the capture hooked: put directly on a module it had registered already; the `.grad` they
            # held at the end says they got one, as no optimizer's zero_grad() clears theirs)
            found = [ParamInfo(name=n, key=k, requires_grad=True, got_grad=True, stepped=False,
                               numel=u.numel if i == 0 else 0) for i, (n, k) in enumerate(zip(u.params, u.keys))]
        infos = [p for p in found if p is not None and p.requires_grad and p.got_grad and not p.stepped
                 and p.name not in replaced]
        if infos:
            left.append((u, infos))
    out = []
    for opt_id in dict.fromkeys(u.optimizer_id for u, _ in left):
        finding = _finding(trace, [(u, ps) for u, ps in left if u.optimizer_id == opt_id])
        if finding is not None:
            out.append(finding)
    return out


def _finding(trace: Trace, mods: list[tuple[UnoptimizedModule, list[ParamInfo]]]) -> Finding | None:
    u = mods[0][0]
    steps = [s for s in trace.optimizer_steps if s.id == u.optimizer_id] or trace.optimizer_steps
    step = steps[0]
    step_line = step.cell_line if step.cell_line is not None else step.line
    opt = u.optimizer if re.fullmatch(r"[A-Za-z_][\w.]*", u.optimizer or "") else ""
    built = built_line(trace.source, opt) if opt and trace.source else None
    made = []
    for m, _ in mods:
        found = [f for f in creating_lines(trace.source, m.module, m.model) if step_line is None or f[0] < step_line] \
            if trace.source else []
        made.extend(found)
    late = sorted({f for f in made if built is None or f[0] > built})
    numel = sum(p.numel for _, ps in mods for p in ps)
    if not late and not u.replaced:
        # (no sign it came later: a module left out is named only when it is a whole module and the smaller part)
        if any(m.cls == "Parameter" for m, _ in mods) or numel >= u.held:
            return None
    names = [p.name for _, ps in mods for p in ps]
    shown_mods = [m.module for m, _ in mods]
    what = (f"`{_code(shown_mods[0])}`" if len(mods) == 1 else
            ", ".join(f"`{_code(m)}`" for m in shown_mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else ""))
    opt_say = f"`{opt}`" if opt else f"the {u.optimizer_cls} optimizer"
    n = len(names)
    params = f"{'its' if len(mods) == 1 else 'their'} {n} parameter tensor{'s' if n > 1 else ''} ({numel:,} values)"
    step_code = source_line(trace, step.line, step.file) or "optimizer.step()"
    module = shown_mods[0] if len(mods) == 1 else u.model
    if late:
        line, how = late[-1]
        code = source_line(trace, line)
        where = Where(line=line, file=None, cell_line=line, module=module)
        since = {"peft": "put the adapters on the model", "resize": "gave the model new token embeddings"}.get(
            how, "put it on the model")
        head = (f"{what} {'was' if len(mods) == 1 else 'were'} created after {opt_say} was built: line {line} "
                f"(`{code}`) {since}" + (f" after line {built} built the optimizer" if built is not None else
                                          ", and the optimizer was built before this cell"))
    else:
        line, how = None, None
        where = (Where(line=built, file=None, cell_line=built, module=module) if built is not None else
                 Where(line=step.line, file=step.file, cell_line=step.cell_line, module=module, function=step.function))
        head = (f"{what} {'is' if len(mods) == 1 else 'are'} in none of {opt_say}'s param groups, while it holds the "
                f"rest of `{u.model}` ({u.held:,} values)" + (
                    f", and {u.replaced} parameter{'s' if u.replaced > 1 else ''} no module uses any more: the model "
                    "changed after the optimizer was built" if u.replaced else
                    ": added to the model after the optimizer was built (a new head, an adapter, resized embeddings), "
                    "or left out of it"))
    target = opt or "optimizer"
    if len(mods) == 1 and mods[0][0].cls != "Parameter":
        fix = f'{target}.add_param_group({{"params": {_code(module)}.parameters()}})'
    elif len(mods) == 1:
        fix = f'{target}.add_param_group({{"params": [{_code(module)}]}})'
    else:
        fix = (f'{target}.add_param_group({{"params": [p for p in {_code(u.model)}.parameters() if p.requires_grad '
               f'and not any(p is q for g in {target}.param_groups for q in g["params"])]}})')
    fix += "  # or build the optimizer after the model is complete"
    msg = (f"{head}. {params[0].upper() + params[1:]} get gradients at every `backward()` but are in none of "
           f"{opt_say}'s param groups, so `{step_code}` never changes them: they stay as they were initialised "
           f"while the rest of the model trains around them. An optimizer holds the parameters it was given when it "
           f"was built. Build it after the model is complete"
           + (" (after `get_peft_model`)" if how == "peft" else "") + f", or add them: `{fix.split('  #')[0]}`.")
    return at("orphan_params", where, msg, severity="error" if late or u.replaced else "warning", title="Module the optimizer never sees",
              iteration=looped(trace, 0),
              evidence={"not_stepped": names, "modules": shown_mods, "model": u.model, "optimizer": u.optimizer,
                        "optimizer_class": u.optimizer_cls, "values": numel, "held": u.held, "replaced": u.replaced,
                        "created_line": line, "created": how, "built_line": built, "step_line": step.line,
                        "fix_line": line, "fix_code": fix})
