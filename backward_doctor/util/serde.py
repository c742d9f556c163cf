"""Plain-dataclass <-> JSON-ready dict conversion, driven by the type hints.

Every record of the trace and the report is a dataclass of str/int/float/bool,
lists, dicts and nested dataclasses, so a round trip needs no custom code::

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class P:
    ...     x: int
    >>> from_dict(P, to_dict(P(3)))
    P(x=3)
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """Recursively turn dataclasses/tuples into dicts/lists (JSON-serialisable)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON; keep it readable
        return "nan"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return "inf" if obj > 0 else "-inf"
    return obj


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _convert(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    if tp is float and isinstance(value, str):  # what to_dict wrote for a non-finite float
        return _NONFINITE.get(value, value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            return _convert(arg, value)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return from_dict(tp, value)
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return [_convert(arg, v) for v in value]
    if origin is dict:
        args = typing.get_args(tp)
        val_tp = args[1] if len(args) == 2 else Any
        return {k: _convert(val_tp, v) for k, v in value.items()}
    return value


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build ``cls`` from :func:`to_dict` output; unknown keys are ignored."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
    return cls(**kwargs)
