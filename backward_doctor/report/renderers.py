"""Renderers, registered in one place: a name -> a class that turns a :class:`Report` into a value.

The report does not know how it is drawn (imports point one way: ``render/`` imports the report, never
the reverse). Each renderer module registers its class with :func:`register` when
``backward_doctor.render`` is imported (the package does so on import), and ``Report.__str__``,
``to_html`` and ``save_html`` look the renderer up here by name, as does ``python -m backward_doctor
render report.json``.

>>> @register
... class Shout(Renderer):
...     name, suffix = "shout", ".txt"
...     def render(self, report):
...         return "OK!" if report.ok else "PROBLEM!"
>>> from backward_doctor.report import Report
>>> renderer("shout").render(Report())
'OK!'
>>> _REGISTRY.pop("shout") is Shout
True
"""
from __future__ import annotations

from typing import Any, TypeVar

from ..util.writing import write_atomic


class Renderer:
    """Turns a report into one value (a string: text, an HTML fragment, a whole page; or bytes, for a
    ``binary`` one: a file format such as the memory_viz pickle)."""

    #: the name it is registered under (``"text"``, ``"html"``, ``"page"``)
    name: str = ""
    #: file suffix when it is written to a file
    suffix: str = ".txt"
    #: ``render`` returns bytes: written to a file only, never printed
    binary: bool = False

    def render(self, report: Any) -> str | bytes:  # a Report (this module sits below report.py, which looks it up)
        raise NotImplementedError


_REGISTRY: dict[str, type[Renderer]] = {}
R = TypeVar("R", bound=type[Renderer])


def register(cls: R) -> R:
    """Class decorator: make ``cls`` the renderer called ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def renderer(name: str) -> Renderer:
    """A new renderer registered as ``name``; ``ValueError`` naming those there are."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"no renderer {name!r}: choose one of {', '.join(sorted(_REGISTRY)) or '(none loaded)'}") \
            from None


def names() -> list[str]:
    """The registered renderers' names."""
    return sorted(_REGISTRY)


def write(report: Any, name: str, path: str) -> str:
    """Render ``report`` with the renderer ``name`` into the file ``path`` (text as UTF-8, bytes as they are);
    returns the path. The file is written whole or not at all (a failed render or write leaves no half file),
    and never through a link planted at ``path`` (``util/writing.py``).

    >>> import os, tempfile
    >>> from backward_doctor.report import Report
    >>> path = write(Report(), "text", os.path.join(tempfile.mkdtemp(), "r.txt"))
    >>> open(path).read().startswith("backward_doctor: OK")
    True
    """
    return write_atomic(path, renderer(name).render(report))
