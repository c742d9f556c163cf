"""The fix of a ``loss_on_probabilities`` finding as code: the user's own line, rewritten.

Located with ``ast`` on the one line the finding names (text edits by column span, as the fixes do); a line
that does not parse alone (part of a longer statement) or holds no call to rewrite gets the module's
replacement when the softmax is a module of an ``nn.Sequential`` (``model[2] = nn.Identity()``), else nothing:
the message still says what to change.

>>> prob_line_fix("probs = F.softmax(model(x), dim=-1)", "double_softmax")
'probs = model(x)  # logits: the loss applies log_softmax itself'
>>> prob_line_fix("return self.fc(h).softmax(dim=1)", "nll_on_probabilities")
'return self.fc(h).log_softmax(dim=1)'
>>> loss_line_fix("loss = nn.NLLLoss()(out, y)", "nll_on_logits")
'loss = nn.CrossEntropyLoss()(out, y)'
"""
from __future__ import annotations

import ast

_PROB_NAMES = {"softmax", "sigmoid", "Softmax", "Sigmoid"}
_COMMENT = {"double_softmax": "  # logits: the loss applies log_softmax itself",
            "double_sigmoid": "  # logits: the loss applies the sigmoid itself"}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _is_dim(node: ast.expr) -> bool:
    """An argument that is a dimension (``-1``, ``1``), not a tensor: ``x.softmax(-1)``."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def _prob_call(tree: ast.AST) -> tuple[ast.Call, ast.expr | None] | None:
    """The outermost call applying softmax/sigmoid on the line, and the expression it applies them to
    (None when it is a module's call with no input to name)."""
    for node in ast.walk(tree):  # breadth first: the outermost call comes first
        if not isinstance(node, ast.Call):
            continue
        inner = node.func
        if isinstance(inner, ast.Call) and _name(inner.func) in ("Softmax", "Sigmoid") and node.args:
            return node, node.args[0]  # nn.Softmax(dim=1)(x)
        if _name(inner) not in ("softmax", "sigmoid"):
            continue
        if isinstance(inner, ast.Attribute) and (not node.args or _is_dim(node.args[0])):
            return node, inner.value  # x.softmax(-1), x.sigmoid()
        if node.args:
            return node, node.args[0]  # F.softmax(x, dim=-1), torch.sigmoid(x), self.softmax(x)
    return None


def _span(line: str, node: ast.expr) -> tuple[int, int]:
    # (the line is parsed alone: one line, so columns index it directly; ast columns count UTF-8 bytes)
    raw = line.encode()
    start = len(raw[:node.col_offset].decode(errors="ignore"))
    end = len(raw[:node.end_col_offset].decode(errors="ignore"))
    return start, end


def _parse(code: str) -> ast.AST | None:
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def _module_code(module: str | None, problem: str) -> str:
    """``model[2] = nn.Identity()`` for the softmax module of a Sequential (``model.2``); '' for anything else."""
    if not module or "." not in module:
        return ""
    parts = module.split(".")
    target = parts[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts[1:])
    if problem == "nll_on_probabilities":
        return f"{target} = nn.LogSoftmax(dim=1)  # the softmax's dim"
    return f"{target} = nn.Identity()" + _COMMENT.get(problem, "")


def prob_line_fix(code: str, problem: str, module: str | None = None) -> str:
    """``code`` (the line that applies softmax/sigmoid) without it (``double_softmax``, ``double_sigmoid``), or
    with ``log_softmax`` instead (``nll_on_probabilities``); '' when the line shows no such call.

    >>> prob_line_fix("out = model(x)", "double_softmax", "model.2")
    'model[2] = nn.Identity()  # logits: the loss applies log_softmax itself'
    >>> prob_line_fix("x = (", "double_softmax")
    ''
    """
    tree = _parse(code)
    found = _prob_call(tree) if tree is not None else None
    if found is None:
        return _module_code(module, problem)
    call, arg = found
    if problem == "nll_on_probabilities":
        func = call.func.func if isinstance(call.func, ast.Call) else call.func
        name = _name(func) or ""
        if name not in ("softmax", "Softmax"):
            return ""  # a sigmoid before nll_loss: no one-line rewrite says what was meant
        start, end = _span(code, func)
        head = code[start:end]
        new = head[:len(head) - len(name)] + ("log_softmax" if name == "softmax" else "LogSoftmax")
        return code[:start] + new + code[end:]
    if arg is None:
        return ""
    start, end = _span(code, call)
    a_start, a_end = _span(code, arg)
    return code[:start] + code[a_start:a_end] + code[end:] + _COMMENT.get(problem, "")


def loss_line_fix(code: str, problem: str) -> str:
    """The loss line with the loss that fits raw logits; when the line names no loss (``criterion(out, y)``),
    the criterion to build instead.

    >>> loss_line_fix("loss = F.binary_cross_entropy(out, y)", "bce_on_logits")
    'loss = F.binary_cross_entropy_with_logits(out, y)'
    >>> loss_line_fix("loss = criterion(out, y)", "nll_on_logits")
    'criterion = nn.CrossEntropyLoss()  # instead of nn.NLLLoss(): it applies log_softmax itself'
    """
    if problem == "nll_on_logits":
        swaps = [("nll_loss(", "cross_entropy("), ("NLLLoss(", "CrossEntropyLoss(")]
        fallback = "criterion = nn.CrossEntropyLoss()  # instead of nn.NLLLoss(): it applies log_softmax itself"
    else:
        swaps = [("binary_cross_entropy(", "binary_cross_entropy_with_logits("), ("BCELoss(", "BCEWithLogitsLoss(")]
        fallback = "criterion = nn.BCEWithLogitsLoss()  # instead of nn.BCELoss(): it applies the sigmoid itself"
    for old, new in swaps:
        if old in code:
            return code.replace(old, new)
    return fallback


__all__ = ["loss_line_fix", "prob_line_fix"]
