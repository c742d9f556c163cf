"""The statement that keeps a graph, rewritten to keep none: the fix of a ``graph_leak`` as code.

A tensor stored for later (metrics, a log, a running total) needs its values, not the autograd graph that
made it: a number (``.item()``) for a scalar, ``.detach()`` for anything bigger (logits kept to compute an
accuracy later). The storing statement is rewritten where it stands, so the fix is the user's own line.

>>> detached_statement("self.seen.append(outputs.logits)", scalar=False)
'self.seen.append(outputs.logits.detach())'
>>> detached_statement("self.history.append(loss)  # for the plot", scalar=True)
'self.history.append(loss.item())'
>>> detached_statement("total += loss * 2", scalar=True)
'total += (loss * 2).item()'
>>> detached_statement("self.cache['h'] = h", scalar=False)
"self.cache['h'] = h.detach()"
>>> detached_statement("self.seen.extend(xs)", scalar=False) is None
True
"""
from __future__ import annotations

import ast

_ONE_ARG = {"append", "add", "appendleft", "put", "put_nowait"}


def _wrapped(code: str, expr: ast.expr, scalar: bool) -> str:
    text = ast.get_source_segment(code, expr) or ""
    simple = isinstance(expr, (ast.Name, ast.Attribute, ast.Subscript, ast.Call))
    return f"{text if simple else f'({text})'}.{'item' if scalar else 'detach'}()"


def detached_statement(code: str, scalar: bool) -> str | None:
    """``code`` (one statement, on one line) with the value it stores turned into a number (``scalar``) or a
    detached tensor; None when the statement is not one stores a single value (``extend``, a rebinding)."""
    code = code.split("  #")[0].split(" # ")[0].strip()
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1:
        return None
    node = tree.body[0]
    expr: ast.expr | None = None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) \
            and node.value.func.attr in _ONE_ARG and node.value.args and not node.value.keywords:
        expr = node.value.args[-1]
    elif isinstance(node, ast.AugAssign):
        expr = node.value
    elif isinstance(node, ast.Assign) and all(isinstance(t, (ast.Subscript, ast.Attribute)) for t in node.targets):
        expr = node.value
    if expr is None or expr.end_col_offset is None or node.lineno != expr.end_lineno \
            or isinstance(expr, (ast.List, ast.Dict, ast.Set, ast.Tuple, ast.Constant)):
        return None
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("detach", "item"):
        return None  # (already what the fix says: the graph comes from elsewhere)
    return code[:expr.col_offset] + _wrapped(code, expr, scalar) + code[expr.end_col_offset:]


__all__ = ["detached_statement"]
