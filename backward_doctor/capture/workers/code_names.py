"""Class-qualified names for frames that only carry a file, a function name and a line: a worker's stacks
written by faulthandler, the stack traces an FX graph keeps per node. ``forward`` at line 12 of a file
holding two modules becomes ``Net.forward``, the one whose code spans line 12.

>>> class Net:
...     def forward(self):
...         return 1
>>> names = CodeNames([Net()])
>>> code = Net.forward.__code__
>>> names.qualname(code.co_filename, "forward", code.co_firstlineno + 1)
'Net.forward'
"""
from __future__ import annotations

from typing import Any, Iterable


class CodeNames:
    """The functions and methods of ``objects`` (instances, classes, functions) outside torch, by file,
    name and line span."""

    def __init__(self, objects: Iterable[Any]) -> None:
        self._spans: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
        for obj in objects:
            if obj is None:
                continue
            fns = [obj] if hasattr(obj, "__code__") else []
            for klass in (obj.__mro__ if isinstance(obj, type) else type(obj).__mro__):
                if klass is object or klass.__module__.startswith("torch."):
                    continue
                fns.extend(v for v in vars(klass).values() if hasattr(getattr(v, "__func__", v), "__code__"))
            for fn in fns:
                self._add(getattr(fn, "__func__", fn).__code__)

    def _add(self, code: Any) -> None:
        lines = [ln for _, _, ln in code.co_lines() if ln is not None] or [code.co_firstlineno]
        span = (min(lines + [code.co_firstlineno]), max(lines), getattr(code, "co_qualname", code.co_name))
        self._spans.setdefault((code.co_filename, code.co_name), []).append(span)

    def qualname(self, file: str, name: str, line: int) -> str:
        """``Class.name`` for the function called ``name`` whose code in ``file`` spans ``line``; ``name``
        unchanged when none does."""
        for first, last, qualname in self._spans.get((file, name), []):
            if first <= line <= last:
                return qualname
        return name


__all__ = ["CodeNames"]
