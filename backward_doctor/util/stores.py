"""Finding the line that stored a value: ``history.append(loss)``, ``total += loss``, ``self.cache = h``.

Pure ``ast`` work over source text, used to point a graph leak at the statement
that keeps the tensor (not at the op that made it).

>>> store_line("total = 0\\nfor b in data:\\n    total += loss(b)", ["total"])
3
>>> store_line("m['train'].append(x)", ["m"])
1
"""
from __future__ import annotations

import ast
import functools
import linecache

_STORE_METHODS = {"append", "extend", "insert", "add", "update", "setdefault", "appendleft"}


def _path(expr: ast.AST) -> list[str]:
    """``self.feats[0].x`` -> ["self", "feats"] ... down to the base name (outermost first)."""
    names: list[str] = []
    while True:
        if isinstance(expr, ast.Subscript):
            expr = expr.value
            names.clear()  # what follows a subscript is inside the container
        elif isinstance(expr, ast.Attribute):
            names.insert(0, expr.attr)
            expr = expr.value
        elif isinstance(expr, ast.Name):
            return [expr.id] + names
        else:
            return []


def _starts(path: list[str], target: list[str]) -> bool:
    return path[:len(target)] == target


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


_EMPTY = {"list", "dict", "set", "tuple", "deque", "defaultdict", "OrderedDict", "collections"}


def _fresh(value: ast.AST) -> bool:
    """An empty container being made (``{"loss": []}``, ``list()``): set-up, wherever it is written, not a store
    of the step's values."""
    return isinstance(value, (ast.List, ast.Dict, ast.Set, ast.Tuple, ast.Call)) and \
        all(n.id in _EMPTY for n in ast.walk(value) if isinstance(n, ast.Name))


def store_line_in(tree: ast.AST, target: list[str], first: int = 0, last: int = 10**9) -> int | None:
    """First line in [first, last] that stores into ``target`` (a dotted path like ["self", "cache"]).

    Stores in ``__init__`` are set-up, not the step: they are skipped, and so is an empty container made
    anywhere else (``if not hasattr(self, "log"): self.log = []``).

    >>> store_line("if first:\\n    self.log = {'loss': []}\\nself.log['loss'].append(loss)", ["self", "log"])
    3
    """
    found: list[int] = []
    init = [(n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if not first <= line <= last or any(lo <= line <= hi for lo, hi in init):
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _STORE_METHODS and _starts(_path(node.func.value), target):
            found.append(line)
        elif isinstance(node, ast.AugAssign) and _starts(_path(node.target), target):
            found.append(line)
        elif isinstance(node, ast.Assign) and not _fresh(node.value):
            for t in node.targets:
                p = _path(t)
                if not _starts(p, target):
                    continue
                plain_rebind = isinstance(t, ast.Name) and len(target) == 1
                # `x = x + loss` keeps the old x in the new graph; `x = loss` alone does not leak.
                if not plain_rebind or _mentions(node.value, target[0]):
                    found.append(line)
    return min(found) if found else None


def store_line(source: str, target: list[str]) -> int | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    return store_line_in(tree, target)


@functools.lru_cache(maxsize=64)
def _parsed(filename: str) -> ast.AST | None:
    text = "".join(linecache.getlines(filename))
    try:
        return ast.parse(text) if text else None
    except SyntaxError:
        return None


def store_line_in_file(filename: str, target: list[str], first: int = 0) -> int | None:
    """Like :func:`store_line`, in a source file (``first``: first line of the function or class)."""
    tree = _parsed(filename)
    if tree is None:
        return None
    last = 10**9
    if first:
        fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                   and first in [n.lineno] + [d.lineno for d in n.decorator_list]), None)
        last = getattr(fn, "end_lineno", last) or last
    return store_line_in(tree, target, first, last)


def function_at(filename: str, line: int) -> str | None:
    """The qualified name of the innermost function holding ``line`` in a source file (``Lit.training_step``).

    >>> import linecache
    >>> linecache.cache["<doc>"] = (0, None, ["class Lit:\\n", "    def step(self):\\n", "        x = 1\\n"], "<doc>")
    >>> function_at("<doc>", 3)
    'Lit.step'
    """
    tree = _parsed(filename)
    if tree is None:
        return None
    best: list[str] | None = None

    def visit(node: ast.AST, names: list[str]) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and child.lineno <= line <= (child.end_lineno or child.lineno):
                inner = names + [child.name]
                if not isinstance(child, ast.ClassDef):
                    best = inner
                visit(child, inner)
    visit(tree, [])
    return ".".join(best) if best else None


def class_line(filename: str, name: str, inside: int) -> int | None:
    """The line of the ``class name`` statement of a source file whose body holds line ``inside`` (a class
    defined in a notebook cell, found from its methods' first lines).

    >>> import linecache
    >>> linecache.cache["<doc2>"] = (0, None, ["x = 1\\n", "class Lit:\\n", "    def f(self):\\n", "        pass\\n"], "<doc2>")
    >>> class_line("<doc2>", "Lit", 3)
    2
    """
    tree = _parsed(filename)
    if tree is None:
        return None
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name
             and n.lineno <= inside <= (n.end_lineno or n.lineno)]
    return max(lines) if lines else None
