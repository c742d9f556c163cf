"""Places named as the user knows them: the cell as ``Cell In[2]`` (IPython's name for it), another
cell's function as ``Cell In[1], line 12, in Block.forward``, a module with its class.

The capture records raw places (a temporary file such as ``/tmp/ipykernel_1/167147110.py``, a line, the
function); a frontend that knows better names passes a *namer* (``file or None for the cell`` -> a
name, or None to leave it as it is) to :func:`name_places`, which writes the names into the report,
so text, HTML, the panel and the JSON all say the same thing. The raw file stays in each finding.

>>> from backward_doctor.analysis.findings import Finding
>>> from backward_doctor.report import Report
>>> r = Report(findings=[Finding("oom", "", line=4)])
>>> name_places(r, {}, lambda file: "Cell In[3]" if file is None else None)
>>> r.findings[0].location(), r.places
('Cell In[3], line 4', {'': 'Cell In[3]'})
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from ..trace.records import Where
    from .report import Report

log = logging.getLogger(__name__)

#: ``file`` (None: the cell that ran) -> its name (``Cell In[2]``), None when the frontend does not know it.
Namer = Callable[[Optional[str]], Optional[str]]
#: the key of the cell itself in ``Report.places``
CELL = ""


def name_places(report: "Report", namespace: dict[str, Any] | None, namer: Namer | None = None) -> None:
    """Fill ``report.places`` and each finding's ``place``, ``module_type`` and ``function``."""
    files = {None} | {f.file for f in report.findings} | {op.where.file for op in report.trace.ops}
    if namer is not None:
        for file in files:
            try:
                name = namer(file)
            except Exception:  # noqa: BLE001 - a name is a nicety; the raw place still shows
                log.debug("a place could not be named", exc_info=True)
                name = None
            if name:
                report.places[CELL if file is None else file] = name
        for file in {fi.file for st in report.trace.threads for fi in st.frames if not fi.in_cell}:
            try:
                name = namer(file)
            except Exception:  # noqa: BLE001
                name = None
            if name:
                report.places[file] = name
    for f in report.findings:
        f.place = report.places.get(CELL if f.file is None else f.file, f.place)
        if f.module and not f.module_type and namespace:
            f.module_type = module_type(namespace, f.module) or ""
    fr = report.fix_result  # a fixed run: the original run's findings are named the same way
    if fr is not None and isinstance(fr.original, dict):
        for fd in fr.original.get("findings") or []:
            name = report.places.get(CELL if fd.get("file") is None else fd["file"])
            if name and not fd.get("place"):
                fd["place"] = name


def module_type(namespace: dict[str, Any], path: str) -> str | None:
    """The class name of the module at the dotted ``path`` (``model.blocks.1``), None if not found.

    >>> import torch
    >>> module_type({"net": torch.nn.Sequential(torch.nn.ReLU())}, "net.0")
    'ReLU'
    """
    try:
        from ..capture.namespace import modules
    except ImportError:  # no torch: nothing to look up
        return None
    for root_name, root in modules(namespace):
        if path != root_name and not path.startswith(root_name + "."):
            continue
        rest = path[len(root_name):].lstrip(".")
        try:
            mod = root.get_submodule(rest) if rest else root
        except AttributeError:
            continue
        return type(mod).__name__
    return None


def line_label(places: dict[str, str], line: int | None, file: str | None) -> str:
    """A line as the user knows it: ``Cell In[2], line 4`` when named, else ``cell line 4`` / ``models.py:12``.

    >>> line_label({}, 4, None), line_label({"": "Cell In[2]"}, 4, None), line_label({}, 12, "/x/models.py")
    ('cell line 4', 'Cell In[2], line 4', 'models.py:12')
    """
    if line is None:
        return "(unknown line)"
    name = places.get(CELL if file is None else file)
    if name:
        return f"{name}, line {line}"
    return f"cell line {line}" if file is None else f"{os.path.basename(file)}:{line}"


def where_label(places: dict[str, str], where: "Where") -> str:
    """:func:`line_label` of a recorded place.

    >>> from backward_doctor.trace.records import Where
    >>> where_label({"": "Cell In[4]"}, Where(line=2))
    'Cell In[4], line 2'
    """
    return line_label(places, where.line, where.file)


def file_label(places: dict[str, str], file: str | None) -> str:
    """A file as the user knows it: ``Cell In[2]``, ``the cell``, ``models.py``.

    >>> file_label({"/t/1.py": "Cell In[1]"}, "/t/1.py"), file_label({}, None)
    ('Cell In[1]', 'the cell')
    """
    name = places.get(CELL if file is None else file)
    if name:
        return name
    return "the cell" if file is None else os.path.basename(file)


def cell_code_names(shell: Any) -> Namer | None:
    """The namer of a running IPython ``shell``: a file IPython compiled a cell into is named as its tracebacks
    name it (``Cell In[2]``), any other file is left as it is; None when ``shell`` is not one (no IPython
    compiler to ask). The cell itself (``None``) is left to the caller, who may know which cell runs.

    >>> class Compile:
    ...     def format_code_name(self, name): return ("Cell", "In[2]") if name == "/t/2.py" else None
    >>> name = cell_code_names(type("Shell", (), {"compile": Compile()})())
    >>> name("/t/2.py"), name("/lib/models.py"), name(None), cell_code_names(None)
    ('Cell In[2]', None, None, None)
    """
    code_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if code_name is None:
        return None

    def name(file: Optional[str]) -> Optional[str]:
        label = code_name(file) if file is not None else None
        return f"{label[0]} {label[1]}" if label else None
    return name

