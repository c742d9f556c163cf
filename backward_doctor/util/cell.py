"""Reading a cell with ``ast`` and editing its text without losing comments or layout.

A :class:`Cell` splits the source into one chunk of text per top-level statement
(comment lines go with the statement below them; ``a; b`` on one line becomes two
chunks) and finds the parts of a training step: the ``backward()`` call, the
``zero_grad()`` and ``step()`` calls, the names the cell reads and rebinds.

>>> c = Cell("opt.zero_grad()\\nloss = f(model(x), y)  # forward\\nloss.backward(); opt.step()\\n")
>>> c.backward_index(), c.loss_name(), [c.is_call(i, "zero_grad") for i in range(4)]
(2, 'loss', [True, False, False, False])
>>> c.chunks[2], c.chunks[3]
('loss.backward()\\n', 'opt.step()\\n')
"""
from __future__ import annotations

import ast
from typing import Iterable


class NotApplicable(Exception):
    """The fix cannot be applied to this cell; the message says why, in plain words."""


class Cell:
    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self.tree = ast.parse(source)
        except SyntaxError as exc:
            raise NotApplicable(f"the cell does not parse ({exc.msg} at line {exc.lineno}), "
                                "so it cannot be rewritten") from None
        self.stmts: list[ast.stmt] = list(self.tree.body)
        self._raw = source.encode("utf-8")
        starts = [0]
        for line in self._raw.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        self._line_starts = starts
        self.bounds = self._chunk_bounds()
        self.chunks = [self._chunk_text(i, []) for i in range(len(self.stmts))]

    # ------------------------------------------------------------------ text
    def offset(self, lineno: int, col: int) -> int:
        """Byte offset of (1-based line, byte column) in the source."""
        return self._line_starts[min(lineno - 1, len(self._line_starts) - 1)] + col

    def _chunk_bounds(self) -> list[tuple[int, int]]:
        n = len(self.stmts)
        if n == 0:
            return []
        cuts = [0]
        for prev, stmt in zip(self.stmts, self.stmts[1:]):
            if stmt.lineno == prev.end_lineno:  # `a; b` on one line
                cuts.append(self.offset(stmt.lineno, stmt.col_offset))
            else:
                cuts.append(self.offset(prev.end_lineno + 1, 0))
        cuts.append(len(self._raw))
        return [(cuts[i], cuts[i + 1]) for i in range(n)]

    def _chunk_text(self, i: int, edits: list[tuple[int, int, str]]) -> str:
        lo, hi = self.bounds[i]
        raw = self._raw[lo:hi]
        for start, end, text in sorted((e for e in edits if lo <= e[0] and e[1] <= hi), reverse=True):
            raw = raw[:start - lo] + text.encode("utf-8") + raw[end - lo:]
        text = raw.decode("utf-8").rstrip()
        if text.endswith(";"):
            text = text[:-1].rstrip()
        return text + "\n" if text else ""

    def kept(self, indices: Iterable[int]) -> str:
        r"""The statements ``indices`` as the user wrote them: a run of statements that shared a line
        (``a; b; c``) stays on its line, so a fix changes only the lines it must.

        >>> c = Cell("a = 1; b = 2; c = 3\nloss.backward(); opt.step()\n")
        >>> c.kept(range(3)), c.kept([4]), c.kept([2, 4])
        ('a = 1; b = 2; c = 3\n', 'opt.step()\n', 'c = 3\nopt.step()\n')
        """
        out: list[str] = []
        run: list[int] = []
        for i in list(indices) + [None]:  # type: ignore[list-item]
            if run and (i is None or i != run[-1] + 1):
                lo, hi = self.bounds[run[0]][0], self.bounds[run[-1]][1]
                text = self._raw[lo:hi].decode("utf-8").rstrip()
                if text.endswith(";"):  # the run ends before a statement on its line that is not kept
                    text = text[:-1].rstrip()
                out.append(text + "\n" if text else "")
                run = []
            if i is not None:
                run.append(i)
        return "".join(out)

    def edited(self, i: int, edits: list[tuple[int, int, str]]) -> str:
        """Chunk ``i`` with ``edits`` (absolute byte spans -> replacement text) applied."""
        return self._chunk_text(i, edits)

    def edited_span(self, lo: int, hi: int, edits: list[tuple[int, int, str]]) -> str:
        """Source bytes ``lo..hi`` with the edits that fall inside applied."""
        raw = self._raw[lo:hi]
        for start, end, text in sorted((e for e in edits if lo <= e[0] and e[1] <= hi), reverse=True):
            raw = raw[:start - lo] + text.encode("utf-8") + raw[end - lo:]
        return raw.decode("utf-8")

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset))

    def segment(self, node: ast.AST) -> str:
        lo, hi = self.span(node)
        return self._raw[lo:hi].decode("utf-8")

    # ------------------------------------------------------------------ structure
    def index_of(self, node: ast.AST) -> int:
        """Index of the top-level statement that contains ``node``."""
        for i, stmt in enumerate(self.stmts):
            if stmt.lineno <= node.lineno <= stmt.end_lineno and any(n is node for n in ast.walk(stmt)):
                return i
        raise LookupError("node not in cell")

    def index_at(self, offset: int) -> int:
        """Index of the top-level statement whose text holds byte ``offset`` (an edit's start).

        >>> Cell("a = 1\\nb = f(2)\\n").index_at(10)
        1
        """
        for i, (lo, hi) in enumerate(self.bounds):
            if lo <= offset < hi or (offset == hi and i == len(self.bounds) - 1):
                return i
        raise LookupError(f"offset {offset} is not in the cell")

    def backward_calls(self) -> list[ast.Call]:
        """``x.backward(...)`` and ``torch.autograd.backward(...)`` calls, in source order."""
        calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "backward"]
        return sorted(calls, key=lambda n: (n.lineno, n.col_offset))

    def backward_call(self) -> ast.Call:
        calls = self.backward_calls()
        if not calls:
            raise NotApplicable("the cell has no `.backward()` call, so there is no training step to rewrite")
        if len(calls) > 1:
            lines = ", ".join(str(c.lineno) for c in calls)
            raise NotApplicable(f"the cell calls backward more than once (lines {lines}); "
                                "only a cell with one backward can be rewritten automatically")
        call = calls[0]
        i = self.index_of(call)
        stmt = self.stmts[i]
        for node in ast.walk(stmt):
            if isinstance(node, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.Lambda)) and _contains(node, call):
                raise NotApplicable(f"the backward call at line {call.lineno} is inside a loop or a function; "
                                    "only a straight-line step (forward, loss, backward, step) can be rewritten")
        return call

    def backward_index(self) -> int:
        return self.index_of(self.backward_call())

    def backward_receiver(self) -> ast.expr | None:
        """``E`` in ``E.backward()`` (None for ``torch.autograd.backward(...)``)."""
        call = self.backward_call()
        func = call.func
        if _dotted(func) in ("torch.autograd.backward", "autograd.backward"):
            return None
        return func.value

    def loss_name(self) -> str | None:
        """The variable holding the loss: ``loss`` in ``loss.backward()`` or ``scaler.scale(loss).backward()``."""
        call = self.backward_call()
        if _dotted(call.func) in ("torch.autograd.backward", "autograd.backward"):
            arg = call.args[0] if call.args else None
        else:
            arg = call.func.value
        if isinstance(arg, ast.Call) and len(arg.args) == 1 and isinstance(arg.func, ast.Attribute) \
                and arg.func.attr == "scale":
            arg = arg.args[0]
        return arg.id if isinstance(arg, ast.Name) else None

    def is_call(self, i: int, attr: str) -> bool:
        """Statement ``i`` is a bare ``something.attr(...)`` call."""
        if i >= len(self.stmts):
            return False
        stmt = self.stmts[i]
        return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == attr)

    def calls_attr(self, i: int, attrs: Iterable[str]) -> list[ast.Call]:
        attrs = set(attrs)
        return [n for n in ast.walk(self.stmts[i]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in attrs]

    def loads(self, i: int) -> set[str]:
        return {n.id for n in ast.walk(self.stmts[i]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    def loads_in_order(self, i: int) -> list[str]:
        """Names statement ``i`` reads, in source order, each once."""
        nodes = sorted((n for n in ast.walk(self.stmts[i]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)),
                       key=lambda n: (n.lineno, n.col_offset))
        return list(dict.fromkeys(n.id for n in nodes))

    def stores(self, i: int) -> set[str]:
        return stored_names([self.stmts[i]])

    def all_names(self) -> set[str]:
        names = {n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name)}
        names |= {a.arg for a in ast.walk(self.tree) if isinstance(a, ast.arg)}
        return names | stored_names(self.stmts)

    def calls_module(self, i: int, namespace: dict) -> bool:
        """Statement ``i`` calls an ``nn.Module`` held by the namespace (``model(x)``, ``model.encoder(x)``)."""
        for node in ast.walk(self.stmts[i]):
            if isinstance(node, ast.Call) and _is_module(_resolve(node.func, namespace)):
                return True
        return False

    def forward_start(self, namespace: dict, upto: int) -> int | None:
        """The first statement (up to ``upto``) that calls a model from the namespace, if any."""
        return next((i for i in range(upto + 1) if self.calls_module(i, namespace)), None)

    def names_in(self, i: int, names: set[str]) -> list[ast.Name]:
        """Name nodes (load or store) of statement ``i`` whose id is in ``names``."""
        return [n for n in ast.walk(self.stmts[i]) if isinstance(n, ast.Name) and n.id in names]


def stored_names(stmts: list[ast.stmt]) -> set[str]:
    """Names these statements bind in the cell's namespace (not inside functions, classes, comprehensions)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            for d in node.decorator_list:
                visit(d)
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    out.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.NamedExpr):
            out.add(node.target.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out.update(node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for s in stmts:
        visit(s)
    return out


_UNRESOLVED = object()


def _resolve(node: ast.AST, namespace: dict) -> object:
    """The object a ``name`` / ``name.attr.attr`` expression refers to, without running any code."""
    import inspect

    if isinstance(node, ast.Name):
        return namespace.get(node.id, _UNRESOLVED)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, namespace)
        if base is _UNRESOLVED:
            return base
        modules = getattr(base, "_modules", None)
        if isinstance(modules, dict) and node.attr in modules:
            return modules[node.attr]
        try:
            value = inspect.getattr_static(base, node.attr)
        except AttributeError:
            return _UNRESOLVED
        return value if not isinstance(value, (property, staticmethod, classmethod)) else _UNRESOLVED
    return _UNRESOLVED


def resolve(node: ast.AST, namespace: dict) -> object:
    """The object a ``name`` / ``name.attr`` expression refers to in ``namespace``, read without running
    code (no properties); None when it cannot be told.

    >>> import types
    >>> resolve(ast.parse("a.b", mode="eval").body, {"a": types.SimpleNamespace(b=3)})
    3
    """
    value = _resolve(node, namespace)
    return None if value is _UNRESOLVED else value


def _is_module(obj: object) -> bool:
    try:
        import torch

        return isinstance(obj, torch.nn.Module)
    except ImportError:  # pragma: no cover
        return False


def _contains(outer: ast.AST, inner: ast.AST) -> bool:
    return any(n is inner for n in ast.walk(outer))


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_2``, ``base_3``... whichever is not taken (and reserve it)."""
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line if line.strip() else line for line in text.splitlines(True))


def check_compiles(code: str) -> None:
    try:
        compile(code, "<backward_doctor-rewrite>", "exec")
    except SyntaxError as exc:  # a bug of ours: say so rather than run broken code
        raise NotApplicable(f"internal error: the rewritten cell does not compile ({exc.msg} at line {exc.lineno}); "
                            "please report this cell to backward_doctor") from None
