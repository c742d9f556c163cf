"""The loops of a cell's source: the outermost ones (where a finding's iteration is counted), every loop's
target names (an iteration's loop variables), and the training loop's body compiled to run once (the
replay of one iteration). Pure functions over source text.

>>> outer_loops("for i in range(3):\\n    for j in range(2):\\n        pass\\n")
((1, 3, ('i',)),)
"""
from __future__ import annotations

import ast
import functools
from typing import Any


@functools.lru_cache(maxsize=64)  # (asked at every iteration's end and by every finding: parse once)
def outer_loops(source: str) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """(first line, last line, target names) of each top-level loop of the cell (outermost only)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            names = tuple(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)) \
                if not isinstance(node, ast.While) else ()
            out.append((node.lineno, node.end_lineno or node.lineno, names))
    # Outermost: a loop inside another is dropped.
    return tuple(lp for lp in out if not any(o[0] < lp[0] and lp[1] <= o[1] for o in out if o != lp))


def loop_at(source: str, line: int) -> tuple[int, list[str]] | None:
    """(line of the outermost loop holding ``line``, its target names), or None.

    >>> loop_at("x = 1\\nfor i in range(3):\\n    y = i\\n", 3)
    (2, ['i'])
    >>> loop_at("x = 1\\n", 1) is None
    True
    """
    for first, last, names in outer_loops(source):
        if first <= line <= last:
            return first, list(names)
    return None


def loop_names(source: str) -> list[str]:
    """The target names of every ``for`` loop in the cell, nested ones too.

    >>> loop_names("for e in range(2):\\n    for i, (x, y) in enumerate(d):\\n        pass\\n")
    ['e', 'i', 'x', 'y']
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            names += [n.id for n in ast.walk(node.target) if isinstance(n, ast.Name) and n.id not in names]
    return names


@functools.lru_cache(maxsize=64)
def steps_in(source: str, loop_line: int) -> bool:
    """Whether the loop starting at ``loop_line`` calls ``x.step(...)`` in its body (a training loop, whose
    iterations are optimizer steps).

    >>> steps_in("for b in data:\\n    opt.step()\\n", 1), steps_in("for i in range(3):\\n    y = i\\n", 1)
    (True, False)
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node.lineno == loop_line
               and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"
                       for n in ast.walk(node)) for node in ast.walk(tree))


@functools.lru_cache(maxsize=64)
def always_steps(source: str, step_line: int) -> bool:
    """Whether the statement at ``step_line`` runs in every pass through the body of the loop around it: it
    sits in the loop's body itself, or only inside ``with`` blocks there (not under an ``if``, a ``try`` or
    an inner loop).

    >>> always_steps("for b in d:\\n    with ctx:\\n        opt.step()\\n", 3)
    True
    >>> always_steps("for i in d:\\n    if i % 2:\\n        opt.step()\\n", 3)
    False
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False

    def holds(stmts: list[ast.stmt]) -> bool:
        for stmt in stmts:
            if stmt.lineno == step_line and isinstance(stmt, ast.Expr):
                return True
            if isinstance(stmt, (ast.With, ast.AsyncWith)) and holds(stmt.body):
                return True
        return False
    return any(isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and holds(n.body) for n in ast.walk(tree))


def _steps(node: ast.AST) -> bool:
    """Whether ``node`` holds an ``x.step(...)`` or ``x.backward(...)`` call."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("step", "backward")
               for n in ast.walk(node))


def training_loop(source: str) -> ast.For | ast.While | None:
    """The innermost loop of the cell whose body steps an optimizer or calls ``backward()`` (None: none).

    >>> training_loop("for e in range(2):\\n    for x in d:\\n        opt.step()\\n").lineno
    2
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While)) and _steps(node):
            if best is None or (node.lineno >= best.lineno and (node.end_lineno or 0) <= (best.end_lineno or 0)):
                best = node
    return best


def _calls_next(tree: ast.AST) -> bool:
    """``next(...)`` is called somewhere in ``tree`` (code that fetches its own batch from an iterator)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "next" for n in ast.walk(tree))


def draws_from_iterators(source: str, namespace: dict[str, Any]) -> bool:
    """Whether running ``source`` again would take items from an iterator the user holds: a ``next(...)``, or a
    loop or comprehension over a name bound to an iterator (a generator, ``iter(loader)``; a DataLoader or a
    list is iterated afresh each time). A cell that does cannot be replayed without changing what the user's
    next cell gets. (A cell that does not parse: True, nothing is replayed.)

    >>> draws_from_iterators("xb = next(it)", {})
    True
    >>> draws_from_iterators("for b in batches:\\n    f(b)", {"batches": [1]})
    False
    >>> draws_from_iterators("for b in g:\\n    f(b)", {"g": (i for i in range(3))})
    True
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    if _calls_next(tree):
        return True
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.iter, ast.Name) \
                and hasattr(namespace.get(node.iter.id), "__next__"):
            return True
    return False


def one_iteration(source: str, filename: str) -> tuple[Any, list[str]] | None:
    """Code that runs the body of the cell's training loop once, on the cell's own line numbers (``break``
    and ``continue`` still work: it is a loop of one), and the loop's target names; None when there is no
    such loop or its body fetches its own batch (``next(...)``: a replay would consume the user's iterator).

    >>> code, names = one_iteration("for i in range(9):\\n    opt.step()\\n", "<cell>")
    >>> names
    ['i']
    """
    loop = training_loop(source)
    if loop is None or _calls_next(loop):
        return None
    once = ast.For(target=ast.Name(id="__backward_doctor_once", ctx=ast.Store()),
                   iter=ast.Tuple(elts=[ast.Constant(0)], ctx=ast.Load()), body=loop.body, orelse=[])
    ast.copy_location(once, loop)
    once.end_lineno, once.end_col_offset = loop.end_lineno, loop.end_col_offset
    for node in ast.walk(once):  # (the new nodes take the loop's position)
        if not hasattr(node, "lineno"):
            ast.copy_location(node, loop)
    tree = ast.fix_missing_locations(ast.Module(body=[once], type_ignores=[]))
    names = [] if isinstance(loop, ast.While) else \
        [n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)]
    return compile(tree, filename, "exec"), names
