"""The JSON report's format: ``schema.json`` (a JSON Schema shipped in the package, ``docs/report-format.md``
says what each field means) and a small validator of the part of JSON Schema it uses, so that loading a
report someone handed over checks every field's type and size before anything reads it.

A saved report is untrusted input: ``render`` and ``combine`` run on reports from CI artifacts and bug
reports. :func:`check_report` is what every loader calls first (``Report.from_dict``, ``load_report``,
``RankRecord`` files in ``combine``); a report that does not fit raises :class:`ReportError` with one line
that names the field, and the command line exits 2 with it.

The validator knows: ``type`` (one or a list), ``properties``, ``required``, ``additionalProperties``
(a schema), ``items``, ``enum``, ``const``, ``anyOf``, ``$ref`` (to ``#/$defs/...``), ``maxLength``,
``maxItems``, ``maxProperties``, ``minimum``, ``maximum``, plus a depth bound (:data:`MAX_DEPTH`) that JSON
Schema has no word for. Properties the schema does not describe are allowed when loading (a report from a
newer version that only adds fields still loads); ``strict=True`` refuses them, and the tests use that to
catch a field added to a dataclass but not to the schema.

>>> check_report({"format": FORMAT, "version": VERSION, "findings": [{"kind": "oom", "message": "x"}]})
>>> check_report({"findings": [{"kind": "oom", "message": 3}]})
Traceback (most recent call last):
backward_doctor.report.schema.ReportError: findings[0].message: 3 is not a string
>>> check_report({"format": FORMAT, "version": VERSION + 1})
Traceback (most recent call last):
backward_doctor.report.schema.ReportError: version: a report of version 3, written by a newer backward_doctor; this one reads versions 1 to 2
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable

#: ``format`` of every saved report (single-process and distributed alike)
FORMAT = "backward_doctor.report"
#: The report version this backward_doctor writes. 1: reports saved before ``format``/``version`` existed
#: (they load as they are). A field or a finding kind added does not bump it (readers ignore fields they
#: do not know); a field removed or given another meaning does.
VERSION = 2
#: How deeply a report may nest (the deepest real one, a fix's original report inside it, is ~14 levels)
MAX_DEPTH = 48
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.json")

Check = Callable[[Any, int], None]


class ReportError(ValueError):
    """A report that does not fit the schema; the message is one line naming the field."""


class _Invalid(Exception):
    """Raised at the bad value; each level on the way out adds its key, so the path costs nothing when all
    is well. The words are made only when the error is shown (``anyOf`` tries and drops many)."""

    def __init__(self, words: Callable[[], str]) -> None:
        super().__init__()
        self.words = words
        self.path: list[str | int] = []

    @property
    def problem(self) -> str:
        return self.words()


def _where(path: list[str | int]) -> str:
    out = ""
    for key in reversed(path):
        if isinstance(key, str) and not key.isprintable():
            key = json.dumps(key)  # (a key's control characters shown as escapes, never raw on the screen)
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "the report"


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The JSON Schema of a saved report (``schema.json``), parsed once."""
    with open(SCHEMA_FILE, encoding="utf-8") as fh:
        return json.load(fh)


#: a number is what a float holds: NaN, the infinities and an integer past a float's range are not (that
#: integer would overflow where it is used as one: ``float(10**400)``)
_FLOAT_MAX = sys.float_info.max
_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and -_FLOAT_MAX <= v <= _FLOAT_MAX,
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_ARTICLE = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
            "number": "a number", "boolean": "true or false", "null": "null"}


class _Compiler:
    """Turns schema nodes into check functions, once per node (``$defs`` are shared, recursion allowed)."""

    def __init__(self, root: dict[str, Any], strict: bool) -> None:
        self.root, self.strict = root, strict
        self.defs: dict[str, Check] = {}

    def ref(self, ref: str) -> Check:
        name = ref.rsplit("/", 1)[-1]
        if name not in self.defs:
            self.defs[name] = lambda v, d: self.defs[name](v, d)  # a placeholder while it compiles (recursion)
            self.defs[name] = self.node(self.root["$defs"][name], name)
        return self.defs[name]

    def node(self, node: dict[str, Any], name: str = "") -> Check:
        if set(node) <= {"type", "maxLength", "minimum", "maximum"} and "type" in node:
            return self._scalar(node)
        checks: list[Check] = []
        if "$ref" in node:
            checks.append(self.ref(node["$ref"]))
        if "type" in node:
            checks.append(self._type(node["type"]))
        if "enum" in node or "const" in node:
            allowed = node["enum"] if "enum" in node else [node["const"]]
            checks.append(self._enum(allowed))
        if "anyOf" in node:
            checks.append(self._any_of([self.node(n) for n in node["anyOf"]]))
        checks += self._bounds(node)
        if "properties" in node or "additionalProperties" in node or "required" in node:
            checks.append(self._object(node, name))
        if "items" in node:
            checks.append(self._items(self.node(node["items"])))
        if len(checks) == 1:
            return checks[0]

        def all_of(v: Any, depth: int) -> None:
            for c in checks:
                c(v, depth)
        return all_of

    def _scalar(self, node: dict[str, Any]) -> Check:
        """A string, number or null with its bounds in one function (most of a report's values: the fast path)."""
        names = [node["type"]] if isinstance(node["type"], str) else list(node["type"])
        py = tuple({"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
                   .get(t, object) for t in names for t in ([t] if t != "number" else [t]))
        py = tuple(t for group in py for t in (group if isinstance(group, tuple) else (group,)))
        slow = self._type(node["type"])
        rest = self._bounds(node)
        exact = "boolean" not in names and "number" not in names and "object" not in names and "array" not in names

        def check(v: Any, depth: int) -> None:
            if not (exact and type(v) in py):
                slow(v, depth)  # (bool is an int, a float may be NaN: the careful test)
            for c in rest:
                c(v, depth)
        return check

    @staticmethod
    def _type(types: str | list[str]) -> Check:
        names = [types] if isinstance(types, str) else list(types)
        tests = [_TYPES[t] for t in names]
        words = " or ".join(_ARTICLE[t] for t in names)

        def check(v: Any, depth: int) -> None:
            for t in tests:
                if t(v):
                    return
            raise _Invalid(lambda: f"{_show(v)} is not {words}")
        return check

    @staticmethod
    def _enum(allowed: list[Any]) -> Check:
        def check(v: Any, depth: int) -> None:
            if not any(v == a and type(v) is type(a) for a in allowed):
                raise _Invalid(lambda: f"{_show(v)} is not one of " + ", ".join(json.dumps(a) for a in allowed[:8])
                               + (", ..." if len(allowed) > 8 else ""))
        return check

    @staticmethod
    def _any_of(options: list[Check]) -> Check:
        def check(v: Any, depth: int) -> None:
            first = None
            for c in options:
                try:
                    c(v, depth)
                    return
                except _Invalid as e:
                    first = first or e
            raise first if first is not None else _Invalid(lambda: "matches nothing")
        return check

    @staticmethod
    def _bounds(node: dict[str, Any]) -> list[Check]:
        out: list[Check] = []
        for key, kind, size, word in (("maxLength", str, len, "characters"), ("maxItems", list, len, "items"),
                                      ("maxProperties", dict, len, "fields")):
            if key in node:
                limit = node[key]

                def check(v: Any, depth: int, limit: int = limit, kind: type = kind, size: Any = size,
                          word: str = word) -> None:
                    if isinstance(v, kind) and size(v) > limit:
                        raise _Invalid(lambda: f"{size(v):,} {word}, more than the {limit:,} allowed")
                out.append(check)
        lo, hi = node.get("minimum"), node.get("maximum")
        if lo is not None or hi is not None:
            def number(v: Any, depth: int) -> None:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and \
                        ((lo is not None and v < lo) or (hi is not None and v > hi)):
                    raise _Invalid(lambda: f"{_show(v)} is out of range [{lo}, {hi}]")
            out.append(number)
        return out

    def _object(self, node: dict[str, Any], name: str) -> Check:
        props = {k: self.node(v) for k, v in node.get("properties", {}).items()}
        required = list(node.get("required", ()))
        extra = node.get("additionalProperties")
        rest = self.node(extra) if isinstance(extra, dict) else None
        closed = extra is False or (self.strict and rest is None)
        where = f"$defs.{name}.properties" if name else "its properties"

        def check(v: Any, depth: int) -> None:
            if not isinstance(v, dict):
                return  # ("type" says what it must be)
            if depth > MAX_DEPTH:
                raise _Invalid(lambda: f"nested more than {MAX_DEPTH} levels deep")
            for key in required:
                if key not in v:
                    raise _Invalid(lambda: f"the required field {key!r} is missing")
            for key, value in v.items():
                c = props.get(key, rest)
                if c is None:
                    if closed:
                        e = _Invalid(lambda: f"a field {key!r} that backward_doctor/report/schema.json does not describe "
                                     f"(add it to {where})")
                        raise e
                    continue
                try:
                    c(value, depth + 1)
                except _Invalid as e:
                    e.path.append(str(key))
                    raise
        return check

    @staticmethod
    def _items(item: Check) -> Check:
        def check(v: Any, depth: int) -> None:
            if not isinstance(v, list):
                return
            if depth > MAX_DEPTH:
                raise _Invalid(lambda: f"nested more than {MAX_DEPTH} levels deep")
            for i, x in enumerate(v):
                try:
                    item(x, depth + 1)
                except _Invalid as e:
                    e.path.append(i)
                    raise
        return check


@functools.lru_cache(maxsize=None)
def _checker(definition: str, strict: bool) -> Check:
    return _Compiler(schema(), strict).ref(f"#/$defs/{definition}")


def validate(data: Any, definition: str = "Report", *, strict: bool = False) -> None:
    """``ReportError`` (one line, the field's path first) unless ``data`` fits ``$defs/definition``.

    >>> validate({"rank": "<script>", "world_size": 2}, "RankRecord")
    Traceback (most recent call last):
    backward_doctor.report.schema.ReportError: rank: "<script>" is not an integer
    >>> validate({"rank": 0, "world_size": 2, "secret": 1}, "RankRecord", strict=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    backward_doctor.report.schema.ReportError: the report: a field 'secret' that ... (add it to $defs.RankRecord.properties)
    """
    try:
        _checker(definition, strict)(data, 0)
    except _Invalid as e:
        raise ReportError(f"{_where(e.path)}: {e.problem}") from None
    except RecursionError:
        raise ReportError(f"the report: nested too deeply (more than {MAX_DEPTH} levels)") from None


def check_report(data: Any, *, strict: bool = False) -> None:
    """A saved report of either kind (see the module doc): its ``format`` and ``version``, then every field."""
    if not isinstance(data, dict):
        raise ReportError(f"the report: {_show(data)} is not an object (a saved report is a JSON object)")
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise ReportError(f"format: {_show(fmt)} is not {FORMAT!r}: not a backward_doctor report")
    version = data.get("version", 1)
    if not _TYPES["integer"](version) or version < 1:
        raise ReportError(f"version: {_show(version)} is not a report version (a whole number from 1)")
    if version > VERSION:
        raise ReportError(f"version: a report of version {version}, written by a newer backward_doctor; this one "
                          f"reads versions 1 to {VERSION}")
    validate(data, "CombinedReport" if data.get("kind") == "distributed" else "Report", strict=strict)


def loads(text: str) -> Any:
    """JSON text as Python values, refusing what a saved report never holds (``NaN``/``Infinity`` literals:
    the doctor writes them as strings) and nesting too deep to parse; ``ReportError`` in one line.

    >>> loads('{"a": [1, 2]}')
    {'a': [1, 2]}
    >>> loads('[' * 100000)
    Traceback (most recent call last):
    backward_doctor.report.schema.ReportError: the report: nested too deeply to read
    """
    def constant(name: str) -> Any:
        raise ReportError(f"the report: {name} is not JSON (a saved report writes it as a string)")
    try:
        return json.loads(text, parse_constant=constant)
    except RecursionError:
        raise ReportError("the report: nested too deeply to read") from None
    except ValueError as e:
        if isinstance(e, ReportError):
            raise
        raise ReportError(f"the report is not JSON ({str(e).splitlines()[0][:200]})") from None
