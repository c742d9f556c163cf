"""``untied_weights``: weights a model declares tied that are two tensors in the step, each trained on its own.

A language model's output layer is often the transpose of its input embedding, one ``nn.Parameter`` held by two
modules (``config.tie_word_embeddings=True`` in Hugging Face, ``self.head.weight = self.embed.weight`` in a
model's ``__init__``). The tie lives in the modules' attributes only: ``to_empty()`` after a meta-device init,
a re-assigned parameter or ``load_state_dict(..., assign=True)`` gives one of them a tensor of its own, and
nothing raises. Both then get their own gradient and their own update: the output layer stops following what
the embedding learns, the model trains a second vocabulary-sized matrix, and a checkpoint holds two matrices
where the config promises one.

Read from ``trace.untied_weights`` (the declared ties that were separate tensors at the end of the step,
``capture/end/ties.py``) and ``trace.params`` (both stepped, in a model the step ran: trained apart). Placed at
the cell's line that broke the tie when the cell shows it (``to_empty(``, an assignment to one of the two, a
``load_state_dict(..., assign=True)``), else at the optimizer's step. Silent on a tied model, a model whose
config does not tie (``tie_word_embeddings=False``), and a pair that did not train in the step.

>>> from backward_doctor.trace import Trace
>>> untied_weights(Trace())
[]
>>> breaking_lines("with torch.device('meta'):\\n    m = Net()\\nm.to_empty(device='cpu')", ["m.head.weight"], "m")
[(3, 'to_empty')]
"""
from __future__ import annotations

import ast
import re

from ..findings import Finding, at, looped, placed, source_line
from ...trace.parts import OptimizerStep
from ...trace.records import Trace, Where
from ...trace.ties import UntiedWeights

_WHY = {
    "to_empty": "`to_empty()` gives every parameter new memory of its own, so the tie made when the model was built "
                "(on the meta device) is lost",
    "assign": "assigning a new parameter to one of them replaces it on that module only",
    "load": "`load_state_dict(..., assign=True)` puts a parameter of its own in place for each key of the "
            "checkpoint, the tied one's too",
}


def _code(name: str) -> str:
    """A parameter's dotted name as cell code: ``model.h.0.weight`` -> ``model.h[0].weight``.

    >>> _code("model.transformer.h.0.attn.weight")
    'model.transformer.h[0].attn.weight'
    """
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", name)


def _dotted(node: ast.expr) -> str:
    """An expression as a dotted name (``model.h[0].weight`` -> ``model.h.0.weight``)."""
    return re.sub(r"\[(\d+)\]", r".\1", ast.unparse(node))


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return bool(code)


def breaking_lines(source: str, names: list[str], model: str) -> list[tuple[int, str]]:
    """``(line, how)`` of each statement of the cell that can break a tie of ``model`` (the variable that holds
    it) between ``names``: ``to_empty`` on the model, an ``assign``ment to one of the names, a ``load`` with
    ``assign=True``; in order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    root = model.split(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = _dotted(node.func.value).split(".", 1)[0]
            if node.func.attr == "to_empty" and owner == root:
                found.append((node.lineno, "to_empty"))
            elif node.func.attr == "load_state_dict" and owner == root and any(
                    k.arg == "assign" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords):
                found.append((node.lineno, "load"))
        elif isinstance(node, ast.Assign) and any(_dotted(t) in names for t in node.targets
                                                  if isinstance(t, (ast.Attribute, ast.Subscript))):
            found.append((node.lineno, "assign"))
    return sorted(set(found))


def untied_weights(trace: Trace) -> list[Finding]:
    """One finding per model whose declared ties are separate tensors that both trained in the step."""
    by_name = {p.name: p for p in trace.params}
    by_key = {p.key: p for p in trace.params if p.key}

    def info(name: str, key: int, other: int):
        # (by name; by storage key where the two have memories of their own: over one memory, one key is both)
        return by_name.get(name) or (by_key.get(key) if key != other else None)

    pairs = [(u, info(u.target, u.target_key, u.source_key), info(u.source, u.source_key, u.target_key))
             for u in trace.untied_weights]
    # (stepped, and given a gradient or in a model the step ran: a parameter the cell made after the namespace
    # scan is hooked only when its optimizer first steps, and its first gradient can go unseen)
    trained = lambda p: p is not None and p.stepped and (p.got_grad or p.in_run_model)  # noqa: E731
    apart = [u for u, a, b in pairs if trained(a) and trained(b)]
    params = {u.target: a for u, a, _ in pairs if a}
    steps = trace.optimizer_steps
    if not apart or not steps:
        return []
    out = []
    for model in dict.fromkeys(u.model for u in apart):
        out.append(_finding(trace, [u for u in apart if u.model == model], steps[0], params))
    return out


def _finding(trace: Trace, pairs: list[UntiedWeights], step: OptimizerStep, params: dict) -> Finding:
    u = pairs[0]
    step_line = step.cell_line if step.cell_line is not None else step.line
    names = [n for p in pairs for n in (p.target, p.source)]
    found = breaking_lines(trace.source, names, u.model) if trace.source else []
    before = [f for f in found if step_line is None or f[0] < step_line]
    brk = (before or found)[-1] if found else None
    shown = "; ".join(f"`{_code(p.target)}` and `{_code(p.source)}`" for p in pairs[:3]) + (
        f" (and {len(pairs) - 3} more pairs)" if len(pairs) > 3 else "")
    if u.declared.startswith("config."):
        declared = f"`{u.cls}` with `{u.declared}` ties them"
    else:
        declared = f"`{u.cls}.__init__` ties them: `{u.declared}`"
    step_code = source_line(trace, step.line, step.file) or "optimizer.step()"
    step_at = f"line {step.line}" if step.file is None else f"`{step.file.rsplit('/', 1)[-1]}:{step.line}`"
    extra = sum(params[p.target].numel for p in pairs)
    tie = f"{_code(u.model)}.tie_weights()" if u.tie_weights else "; ".join(
        f"{_code(p.target)} = {_code(p.source)}" for p in pairs)
    if brk is not None:
        line, how = brk
        code = source_line(trace, line)
        whole = _parses(code)  # (a statement over several lines: its first line is not code to repeat)
        broke = f"Line {line} (`{code}`{'' if whole else ' ...'}) made them two: {_WHY[how]}."
        where = Where(line=line, file=None, cell_line=line, module=u.model)
        # (a new tensor given to the tied one itself: the line goes, the tie takes its place; anything else,
        # the weights it put in place are wanted: the tie comes after it)
        own = how == "assign" and code.split("=", 1)[0].strip() in {_code(p.target) for p in pairs}
        fix = (f"{tie}  # instead of line {line}: one tensor again" if own else
               f"{code}; {tie}  # tie again after it, before the optimizer is built" if whole else
               f"{tie}  # after line {line}'s statement, before the optimizer is built")
        fix_line, iteration = line, None
    else:
        broke = ("Something after the model was built gave one of them a tensor of its own (`to_empty()` after a "
                 "meta-device init, a re-assigned parameter, `load_state_dict(..., assign=True)`).")
        where = placed(step)
        where = Where(line=where.line, file=where.file, cell_line=where.cell_line, module=u.model,
                      function=where.function)
        fix = f"{tie}  # after the model is loaded or materialised, before the optimizer is built"
        fix_line, iteration = None, looped(trace, 0)
    if all(p.target_key == p.source_key for p in pairs):  # two parameters over one memory
        two = "two parameters over one memory, each trained on its own"
        harm = ("Each gets only its own part of the gradient, and the optimizer updates the shared values twice "
                "per step, with two sets of moments and weight decay applied twice: not what one tied matrix "
                "learns.")
    else:
        two = "two separate tensors, each trained on its own"
        follows = ("The output layer no longer follows what the embedding learns" if u.declared.startswith("config.")
                   or "embed" in u.source.rsplit(".", 2)[-2] else
                   f"`{_code(u.target)}` no longer follows what `{_code(u.source)}` learns")
        harm = (f"{follows}, the model trains {extra:,} values it was built to share, and a checkpoint saved now "
                "holds two different matrices where the model declares one.")
    msg = (f"{shown} are meant to be one tensor ({declared}), but in this step they are {two}: "
           f"`{step_code}` ({step_at}, {step.optimizer}) updated each apart. {broke} {harm} Tie them "
           f"again with `{tie}` once the weights are in place, and build the optimizer after it (an optimizer "
           "built before holds the separate parameter).")
    return at("untied_weights", where, msg, severity="warning", title="Tied weights trained apart",
              iteration=iteration,
              evidence={"parameters": names, "model": u.model, "class": u.cls, "declared": u.declared,
                        "declared_file": u.file, "declared_line": u.line, "break_line": brk[0] if brk else None,
                        "break": brk[1] if brk else None, "step_line": step.line, "optimizer": step.optimizer,
                        "fix_line": fix_line, "fix_code": fix})
