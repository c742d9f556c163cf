"""A training loop a library runs for the cell (``trainer.train()``, ``trainer.fit(model, loader)``): which
library and which call of the cell, where the loop is (epoch, batch) read without changing anything, and
where the learning rate it trains with was set.

The doctor counts a library loop's iterations as it counts a cell's loop (optimizer steps, ``loop/hooks.py``);
what the library knows on top, its epoch and batch, is read from its public attributes (plain properties: no
call that moves the loop). Libraries are recognised by their classes' modules, never imported here.

>>> class Trainer:  # stands in for transformers.Trainer (recognised by its module)
...     def train(self): pass
>>> Trainer.__module__ = "transformers.trainer"
>>> loop = find_library_loop({"trainer": Trainer()}, "x = 1\\ntrainer.train()\\n")
>>> loop.library, loop.call, loop.line
('transformers', 'trainer.train()', 2)
"""
from __future__ import annotations

import ast
import linecache
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ...trace.parts import LrSetting
from ...trace.records import Trace
from ...util.process import doctors_own

#: (library, the module its Trainer class lives in, the methods that run its loop)
_LIBRARIES = (("transformers", "transformers.trainer", ("train",)),
              ("lightning", "pytorch_lightning.trainer.trainer", ("fit",)),
              ("lightning", "lightning.pytorch.trainer.trainer", ("fit",)))


@dataclass
class LibraryLoop:
    """The cell's call that runs a library's training loop, and the object that runs it (weakly held)."""

    library: str
    call: str   # the call as the cell writes it: ``trainer.train()``
    line: int   # its line in the cell
    ref: Callable[[], Any]
    model: str | None = None  # the name the call passes its model by (``fit(model, loader)``, ``fit(model=m)``)

    def position(self) -> str:
        """Where the library's loop is now: ``epoch 0, batch 3`` ('' when it cannot tell)."""
        obj = self.ref()
        if obj is None:
            return ""
        try:
            if self.library == "lightning":
                return f"epoch {int(obj.current_epoch)}, batch {int(obj.fit_loop.epoch_loop.batch_idx)}"
            epoch = getattr(getattr(obj, "state", None), "epoch", None)  # transformers: epochs done, a float
            return f"epoch {int(epoch)}" if isinstance(epoch, (int, float)) else ""
        except Exception as exc:  # a library version that names them otherwise: no position, nothing fails
            if not doctors_own(exc):  # (a signal handler's exception: the user's, it goes on)
                raise
            return ""


def _kind(obj: Any) -> tuple[str, tuple[str, ...]] | None:
    for cls in type(obj).__mro__:
        for library, module, methods in _LIBRARIES:
            if cls.__module__ == module and cls.__name__ == "Trainer":
                return library, methods
    return None


def library_of(obj: Any) -> str | None:
    """``"transformers"`` or ``"lightning"`` for a library's ``Trainer`` (a subclass of one too), else None.

    >>> library_of(object()) is None
    True
    """
    kind = _kind(obj)
    return kind[0] if kind is not None else None


def find_library_loop(namespace: dict[str, Any], source: str) -> LibraryLoop | None:
    """The first call in ``source`` of a library trainer's loop method on a variable of ``namespace``."""
    if "." not in source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            continue
        obj = namespace.get(node.func.value.id)
        kind = _kind(obj) if obj is not None else None
        if kind is None or node.func.attr not in kind[1]:
            continue
        try:
            ref = weakref.ref(obj)
        except TypeError:
            ref = (lambda o: lambda: o)(obj)  # (not weakly referable: kept for the run, as the namespace does)
        given = [a for a in node.args[:1]] + [k.value for k in node.keywords if k.arg == "model"]
        model = given[0].id if given and isinstance(given[0], ast.Name) else None
        return LibraryLoop(kind[0], ast.get_source_segment(source, node) or f"{node.func.value.id}.{node.func.attr}()",
                           node.lineno, ref, model)
    return None


# ----------------------------------------------------------------------------- where the learning rate was set
_LR_TEXT = re.compile(r"\b(learning_rate|lr)\s*=")


def _lr_in_line(text: str, values: set[float], keywords: tuple[str, ...]) -> tuple[str, bool] | None:
    """(keyword, whether its value is a literal equal to one of ``values``) for the first ``lr=`` /
    ``learning_rate=`` keyword or assignment in a statement's text."""
    text = text.strip()
    try:
        tree = ast.parse(text + " pass" if text.endswith(":") else text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        pairs = [(k.arg, k.value) for k in node.keywords] if isinstance(node, ast.Call) else \
            [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else \
            [(a.arg, d) for a, d in zip(node.args.args[::-1], node.args.defaults[::-1])] \
            if isinstance(node, ast.FunctionDef) else []
        for name, value in pairs:
            if name in keywords:
                literal = isinstance(value, ast.Constant) and isinstance(value.value, (int, float))
                return name, literal and any(abs(float(value.value) - v) <= 1e-9 * max(1.0, abs(v)) for v in values)
    return None


def _balance(line: str) -> int:
    return line.count("(") + line.count("[") + line.count("{") - line.count(")") - line.count("]") - line.count("}")


def _statements(lines: list[str]) -> Iterable[tuple[int, str]]:
    """(1-based line, statement text) for each line that mentions a learning-rate keyword: the statement
    it belongs to, opened backwards (``args = TrainingArguments(`` above ``    learning_rate=5e5,``) and
    closed forwards (bounded: 30 lines each way)."""
    for i, line in enumerate(lines):
        if not _LR_TEXT.search(line):
            continue
        start, depth = i, 0
        for k in range(i - 1, max(-1, i - 31), -1):
            depth += _balance(lines[k])
            if depth > 0:  # this line opens the brackets line i sits in
                start = k
                break
        text, depth, j = "", 0, start
        while j < len(lines) and j <= i + 30:
            text += lines[j]
            depth += _balance(lines[j])
            if j >= i and depth <= 0:
                break
            j += 1
        yield i + 1, text


def _one_line(text: str) -> str:
    """A statement on one line, comments dropped, at most 160 characters."""
    return " ".join(" ".join(re.sub(r"\s*#[^'\"]*$", "", line) for line in text.splitlines()).split())[:160]


def find_lr_setting(values: set[float], sources: Iterable[tuple[str | None, list[str]]],
                    prefer: tuple[str | None, int, int] | None = None, keywords: tuple[str, ...] = ("lr",),
                    anchors: tuple[str, ...] = ()) -> LrSetting | None:
    """Where the learning rate was set: the last statement of the user's sources that passes one of ``values``
    as a literal keyword of ``keywords`` (``lr=``; ``learning_rate=`` for ``TrainingArguments``) and names one
    of ``anchors`` (what builds this loop's optimizer: ``SGD(``, ``TrainingArguments(``, the LightningModule's
    class: a cell about another model does not count); else, within ``prefer`` ((file, first, last line): a
    ``configure_optimizers``), the line that passes the learning rate.

    >>> cells = [(None, ["opt = SGD(params, lr=0.1)\\n"]), ("/t/2.py", ["args = TA(out, learning_rate=5e5)\\n"])]
    >>> s = find_lr_setting({500000.0}, cells, keywords=("learning_rate",), anchors=("TA(",))
    >>> s.file, s.line, s.code, s.keyword
    ('/t/2.py', 1, 'args = TA(out, learning_rate=5e5)', 'learning_rate')
    """
    found: LrSetting | None = None
    fallback: LrSetting | None = None
    for file, lines in sources:
        for line, text in _statements(lines):
            inside = prefer is not None and file == prefer[0]  # (the LightningModule's own code)
            if anchors and not inside and not any(a in text for a in anchors):
                continue
            got = _lr_in_line(text, values, keywords)
            if got is None:
                continue
            setting = LrSetting(value=max(values) if values else None, file=file, line=line,
                                code=_one_line(text), keyword=got[0])
            if got[1]:
                found = setting
            elif inside and prefer[1] <= line <= prefer[2]:
                fallback = fallback or setting
    return found or fallback


def user_sources(is_user: Callable[[str], bool], ran: Iterable[str], cell: str = ""
                 ) -> list[tuple[str | None, list[str]]]:
    """The user's sources: the cells IPython has run (``linecache`` entries it keeps for good, oldest
    first), the user's files whose code ran in this step (``ran``), and the cell that ran (``(None, cell)``)
    last."""
    ran = set(ran)
    out: list[tuple[str | None, list[str]]] = []
    for name, entry in list(linecache.cache.items()):
        if len(entry) == 4 and (entry[1] is None or name in ran) and is_user(name):
            out.append((name, list(entry[2])))
    for name in sorted(ran - {n for n, _ in out}):  # a file linecache has not read yet
        lines = linecache.getlines(name)
        if lines and is_user(name):
            out.append((name, lines))
    if cell:
        out.append((None, cell.splitlines(keepends=True)))
    return out


def locate_lr(trace: Trace, namespace: dict[str, Any], is_user: Callable[[str], bool]) -> LrSetting | None:
    """Where the learning rate the loop began with was set (``Iterations.lr_set``)."""
    its = trace.iterations
    values = {v for v in (its.base_lr, its.lr[0] if its.lr else None) if v}
    if not values:
        return None
    ran = {op.where.file for op in trace.ops if op.where.file}
    found_span = configure_optimizers_span(namespace)
    span = found_span[1:] if found_span is not None else None
    if span is not None:
        ran.add(span[0])
    keywords = ("learning_rate",) if its.library == "transformers" else ("lr",)
    anchors = {f"{s.optimizer}(" for s in trace.optimizer_steps} | \
        ({"TrainingArguments("} if its.library == "transformers" else set()) | \
        ({f"{found_span[0]}("} if found_span is not None else set())
    found = find_lr_setting(values, user_sources(is_user, ran, trace.source), span, keywords, tuple(sorted(anchors)))
    if found is not None:
        found.value = its.base_lr or found.value
    return found


def configure_optimizers_span(namespace: dict[str, Any]) -> tuple[str, str, int, int] | None:
    """(class name, file, first line, last line) of a LightningModule's ``configure_optimizers`` in the
    namespace: from its code object, which a class defined in a notebook cell still has (``inspect`` cannot
    find such a class)."""
    from .. import namespace as ns_mod

    for _, mod in ns_mod.modules(namespace):
        fn = getattr(type(mod), "configure_optimizers", None)
        code = getattr(fn, "__code__", None)
        if code is None or "lightning" in (getattr(fn, "__module__", "") or ""):
            continue
        last = max((ln for _, _, ln in code.co_lines() if ln is not None), default=code.co_firstlineno)
        return type(mod).__name__, code.co_filename, code.co_firstlineno, last
    return None


__all__ = ["LibraryLoop", "configure_optimizers_span", "find_library_loop", "find_lr_setting", "locate_lr",
           "user_sources"]
