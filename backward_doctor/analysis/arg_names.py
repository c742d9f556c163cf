"""Names for the tensors an op took, as a finding shows their statistics: the expressions of the source line
where the line says which argument went where, else the op's roles (a loss's prediction and target), else the
argument's position. The name of a namespace variable the capture saw holding NaN/Inf always wins at its own
place.

>>> input_labels("loss = F.mse_loss(pred, yb)", "aten::mse_loss", 2, "yb", 1)
['`pred`', '`yb`']
>>> input_labels("loss = F.mse_loss(*pair)", "aten::mse_loss", 2, "yb", 1)
['the prediction', '`yb`']
>>> input_labels("h = x / d", "aten::div", 2, None, None), input_labels("y = f(x)", "aten::addmm", 3, None, None)
(['`x`', '`d`'], ['argument 1', 'argument 2', 'argument 3'])
"""
from __future__ import annotations

import ast
import re

#: aten ops (their base name) whose two tensors are a prediction and a target, in that order (``F.*_loss``)
_LOSSES = frozenset({
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "nll_loss", "nll_loss_nd", "nll_loss2d", "kl_div", "soft_margin_loss",
    "multilabel_margin_loss", "multi_margin_loss", "poisson_nll_loss", "cross_entropy_loss", "hinge_embedding_loss"})

#: aten op -> the operator that spells it in Python (``a / b`` runs ``aten::div``)
_OPERATORS: dict[str, type] = {"add": ast.Add, "sub": ast.Sub, "rsub": ast.Sub, "mul": ast.Mult, "div": ast.Div,
                               "true_divide": ast.Div, "floor_divide": ast.FloorDiv, "pow": ast.Pow,
                               "matmul": ast.MatMult, "mm": ast.MatMult, "bmm": ast.MatMult, "remainder": ast.Mod}

#: names that stand for a library, not a tensor, before a call's dot (``torch.div(a, b)``, not ``a.div(b)``)
_LIBRARIES = frozenset({"torch", "F", "nn", "functional", "np", "math"})

_LONGEST = 40  # an expression longer than this is not a name a reader scans for


def _parse(code: str) -> ast.AST | None:
    """The line as a statement; a line that opens a block (``for x in f(a, b):``) gets a body to parse."""
    for text in (code, code + "\n    pass"):
        try:
            return ast.parse(text)
        except SyntaxError:
            continue
    return None


def _called(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _arguments(node: ast.Call, n: int) -> list[ast.expr] | None:
    """The ``n`` tensors a call passed, in order: its positional arguments, or the object a method was called
    on and then those (``a.div(b)``). None when it cannot be told (``*args``, a count that differs)."""
    if any(isinstance(a, ast.Starred) for a in node.args):
        return None
    if len(node.args) == n:
        return list(node.args)
    f = node.func
    if (len(node.args) + 1 == n and isinstance(f, ast.Attribute)
            and not (isinstance(f.value, ast.Name) and f.value.id in _LIBRARIES)):
        return [f.value, *node.args]
    return None


def _from_source(code: str, base: str, n: int) -> tuple[list[str] | None, bool]:
    """The expressions the line passed to the op, and whether they came from a call or operator of the op's own
    name (rather than the one call on the line that took ``n`` arguments, which may have handed them on)."""
    tree = _parse(code)
    if tree is None:
        return None, False
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]
    named = [args for c in calls if (_called(c) or "").strip("_") == base and (args := _arguments(c, n))]
    if not named and base in _OPERATORS and n == 2:
        kind = _OPERATORS[base]
        named = [[b.left, b.right] for b in ast.walk(tree) if isinstance(b, ast.BinOp) and isinstance(b.op, kind)]
        named += [[a.target, a.value] for a in ast.walk(tree) if isinstance(a, ast.AugAssign) and isinstance(a.op, kind)]
    if len(named) == 1:
        return [ast.unparse(a) for a in named[0]], True
    if named:  # the op twice on one line: which of them it was is not known
        return None, False
    counted = [args for c in calls if not c.keywords and (args := _arguments(c, n))]
    return ([ast.unparse(a) for a in counted[0]], False) if len(counted) == 1 else (None, False)


def input_labels(code: str, op: str | None, n: int, variable: str | None, bad: int | None) -> list[str]:
    """One label per tensor input of ``op`` (``n`` of them) at the source line ``code``: an expression of the
    line in backticks, else a role or a position in words. ``variable``: the namespace name of the input that
    held NaN/Inf, ``bad`` its position (None: unknown)."""
    base = (op or "").split("::")[-1].split(".")[0].strip("_")
    names, own = _from_source(code, base, n) if code and n else (None, False)
    if names is not None and variable and bad is not None and bad < n:
        # The capture saw which input was the bad variable: a line that puts it elsewhere named other tensors
        # (a helper that rearranged its arguments), and a guess by count must at least mention it there.
        if (variable in names and names[bad] != variable) or (not own and not re.search(rf"\b{re.escape(variable)}\b", names[bad])):
            names = None
    labels: list[str | None] = [None] * n
    if names is not None:
        labels = [f"`{t}`" if len(t) <= _LONGEST else None for t in names]
    if variable and bad is not None and bad < n:
        labels[bad] = f"`{variable}`"
    roles = ("the prediction", "the target") if base in _LOSSES and n == 2 else ()
    return [lab or (roles[i] if roles else "the input" if n == 1 else f"argument {i + 1}")
            for i, lab in enumerate(labels)]
