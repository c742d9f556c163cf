"""Which frames are the user's, and where the user was.

A frame is "user" unless its file lies in torch, in this package, in the standard
library or in site-packages (IPython, ipykernel, numpy...). The cell's own
filename is always user code. Classification is cached per code object because
it runs for every op.

>>> finder = UserFrames(cell_file="<cell>")
>>> finder.is_user(__file__)
False
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
import traceback
import types
from typing import Iterable

from ..trace.records import Where
from ..trace.stacks import FrameInfo, ThreadStack

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get("stdlib"), paths.get("platstdlib"), paths.get("purelib"), paths.get("platlib"), _PKG_DIR}
    try:
        import torch

        dirs.add(os.path.dirname(os.path.abspath(torch.__file__)))
    except Exception:  # pragma: no cover - torch is a hard dependency
        pass
    for p in sys.path:
        if p.endswith(("site-packages", "dist-packages")):
            dirs.add(p)
    return tuple(sorted(os.path.abspath(d) + os.sep for d in dirs if d))


# Code that runs what torch.compile made: AOTAutograd's runtime wrappers (the compiled autograd
# Function), inductor's output code and the modules it generates (a cache directory, often under /tmp,
# which would otherwise pass for user code). An op whose stack passes through them ran compiled.
_COMPILED_RUNTIME = (os.path.join("torch", "_functorch", "_aot_autograd") + os.sep,
                     os.path.join("torch", "_inductor", "output_code.py"))
_GENERATED = os.sep + "torchinductor_"
LIBRARY, USER, CELL, COMPILED = 0, 1, 2, 3


class UserFrames:
    """Finds the innermost user frame and the innermost cell frame of a stack."""

    def __init__(self, cell_file: str) -> None:
        self.cell_file = cell_file
        self._library = _library_dirs()
        self._cache: dict[types.CodeType, int] = {}  # 0 library, 1 user, 2 cell
        self._lines: dict[tuple[types.CodeType, int], int | None] = {}

    def is_user(self, filename: str) -> bool:
        return self._classify_file(filename) > 0

    def _classify_file(self, filename: str) -> int:
        """CELL, USER, LIBRARY, or COMPILED (library code that runs torch.compile's output)."""
        if filename == self.cell_file:
            return CELL
        if filename.startswith("<"):
            # <frozen ...>, <string>, <eval_with_key> (fx), <ipython-input-...> of other cells: only
            # real ipython cells count as user code.
            return USER if filename.startswith("<ipython-input") else LIBRARY
        path = os.path.abspath(filename)
        if _GENERATED in path or path.endswith(_COMPILED_RUNTIME[1]) or _COMPILED_RUNTIME[0] in path:
            return COMPILED
        if path.startswith(self._library):
            return LIBRARY
        # ipykernel writes cells to files in a temp dir; those are user code.
        return USER

    def _classify(self, code: types.CodeType) -> int:
        kind = self._cache.get(code)
        if kind is None:
            kind = self._cache[code] = self._classify_file(code.co_filename)
        return kind

    def where(self, frame: types.FrameType | None) -> Where:
        """Walk outwards from ``frame``; return the innermost user and cell lines."""
        w = Where()
        cache = self._cache  # hot loop: one dict lookup per frame
        f = frame
        while f is not None:
            code = f.f_code
            kind = cache.get(code)
            if kind is None:
                kind = self._classify(code)
            if kind:
                if kind == COMPILED:
                    w.compiled = True
                else:
                    if w.line is None:
                        w.line = f.f_lineno
                        w.file = None if kind == CELL else code.co_filename
                        w.function = getattr(code, "co_qualname", code.co_name)  # "Block.forward" (3.11+)
                        w.lasti = f.f_lasti
                    if kind == CELL:
                        w.cell_line = f.f_lineno
                        break
            f = f.f_back
        return w

    def where_recorded(self, codes: list[types.CodeType], lastis: list[int], first: int, n: int) -> Where:
        """:meth:`where` over a recorded stack: ``codes[first:first + n]`` with their bytecode offsets,
        innermost first (the native recorder's). The walk over live frames above is kept apart: it runs
        for every op of the Python tier."""
        w = Where()
        for j in range(first, first + n):
            code = codes[j]
            kind = self._classify(code)
            if kind == COMPILED:
                w.compiled = True
            elif kind:
                if w.line is None:
                    w.line = self.line_at(code, lastis[j])
                    w.file = None if kind == CELL else code.co_filename
                    w.function = getattr(code, "co_qualname", code.co_name)  # "Block.forward" (3.11+)
                    w.lasti = lastis[j]
                if kind == CELL:
                    w.cell_line = self.line_at(code, lastis[j])
                    break
        return w

    def line_at(self, code: types.CodeType, lasti: int) -> int | None:
        """The source line of bytecode offset ``lasti`` in ``code`` (what ``frame.f_lineno`` says)."""
        key = (code, lasti)
        if key not in self._lines:
            self._lines[key] = next((ln for start, end, ln in code.co_lines() if start <= lasti < end), None)
        return self._lines[key]

    def frame_info(self, filename: str, lineno: int, name: str, code: str = "") -> FrameInfo:
        kind = self._classify_file(filename)
        return FrameInfo(file=filename, line=lineno, function=name, in_cell=kind == CELL,
                         user=kind in (USER, CELL), code=code)

    def from_traceback(self, tb: types.TracebackType | None) -> list[FrameInfo]:
        """Frames of a traceback, outermost first, as plain records."""
        out = []
        for fs in traceback.extract_tb(tb):
            out.append(self.frame_info(fs.filename, fs.lineno or 0, fs.name, fs.line or ""))
        return out

    def where_in(self, frames: Iterable[FrameInfo]) -> Where:
        """Innermost user/cell position in a list of frames ordered outermost first."""
        w = Where()
        for fi in reversed(list(frames)):
            if fi.user and w.line is None:
                w.line, w.file, w.function = fi.line, (None if fi.in_cell else fi.file), fi.function
            if fi.in_cell:
                w.cell_line = fi.line
                break
        return w

    def thread_stacks(self, limit: int = 40) -> list[ThreadStack]:
        """Every Python thread's stack right now (for hangs), main thread first."""
        names = {t.ident: t.name for t in threading.enumerate()}
        main = threading.main_thread().ident
        me = threading.get_ident()
        stacks = []
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue  # the watchdog itself is not the story
            frames = [
                self.frame_info(fs.filename, fs.lineno or 0, fs.name, fs.line or "")
                for fs in traceback.extract_stack(frame, limit=limit)
                if not os.path.abspath(fs.filename).startswith(_PKG_DIR + os.sep)  # the doctor's own frames
            ]
            stacks.append(ThreadStack(name=names.get(ident, f"thread-{ident}"), ident=ident,
                                      is_main=ident == main, frames=frames))
        stacks.sort(key=lambda s: (not s.is_main, s.name))
        return stacks
