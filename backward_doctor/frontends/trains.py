"""Will this cell train? A guess made before it runs, in microseconds, from its text and the code of the
functions it calls, so that always-on watching costs nothing on the cells that do not.

A cell trains when it calls ``backward``, an optimizer's ``step``, a library's ``train``/``fit`` or the
like, itself or through functions and methods defined in the notebook (their code objects name those
attributes: ``co_names``), followed a few calls deep. The guess errs on the side of watching: a cell that
only mentions ``model.train()`` is watched for nothing (a few milliseconds). What it cannot see (a training
function imported from an installed package under an unremarkable name) is caught at run time by the
cheap trigger of ``frontends/always_on.py``, at the first ``backward()``.

>>> might_train("loss.backward()", {})
True
>>> might_train("print(df.head())", {})
False
>>> def fit_one(m): m.zero_grad(); m(1).backward()
>>> might_train("fit_one(net)", {"fit_one": fit_one})
True
"""
from __future__ import annotations

import re
import types
from typing import Any

import torch

from ..capture.frames import _library_dirs

#: Names whose call means training: autograd's entry points, an optimizer's step, the libraries' loops.
TRAIN_NAMES = frozenset({
    "backward", "manual_backward", "step", "fit", "train", "grad", "training_step", "fit_loop", "run_training",
    "train_model", "train_epoch", "train_one_epoch", "train_step", "accumulate"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?")
_DEPTH = 3  # calls followed from the cell into the notebook's own functions
_MAX_CACHE = 4096
_by_code: dict[types.CodeType, bool] = {}  # (code objects hold no tensor: names and constants only)
_Names = tuple  # (the heads a cell names, then its (head, token) pairs: see _tokens)
_by_source: dict[str, "_Names | bool"] = {}  # a cell's text -> its names (see _tokens)
_MAX_KEPT_SOURCE, _MAX_SOURCES = 2000, 256  # (at most ~0.5 MB of cell text)
#: values whose attributes and calls run no code of the user's (and a name the namespace lacks: a builtin,
#: or one the cell assigns; a plain tensor, whose methods are torch's: ``x.backward()`` is caught by its name):
#: ``n = len(x)`` is decided without a function call
INERT = frozenset({type(None), int, float, bool, str, bytes, complex, list, tuple, dict, set, range,
                   torch.Tensor, torch.nn.Parameter})


def might_train(source: str, namespace: dict[str, Any]) -> bool:
    """Whether running ``source`` in ``namespace`` may call autograd or an optimizer (see the module doc)."""
    tokens = _by_source.get(source)
    if tokens is None:
        tokens = _tokens(source)
    if tokens is True:
        return True
    heads, pairs = tokens
    if is_data(heads, namespace):  # (most names of a cell are data: nothing of the user's runs there)
        return False
    get = namespace.get
    names = {token for head, token in pairs if type(get(head)) not in INERT}
    seen: set[int] = set()
    return any(_trains(fn, _DEPTH, seen) for name in names for fn in _callables(namespace, name))


def is_data(names: tuple[str, ...], namespace: dict[str, Any]) -> bool:
    """Whether every one of ``names`` is :data:`INERT` in ``namespace`` (or missing from it): a cell that names
    only these runs nothing of the user's. (A plain loop: it runs before every cell with a call while always
    on is on, and inside IPython's ``run_cell`` a ``map()`` over the names cost that cell ~1.5%, measured.)

    >>> is_data(("n", "len", "x"), {"x": [1, 2]}), is_data(("f",), {"f": print})
    (True, False)
    """
    get = namespace.get
    for name in names:
        if type(get(name)) not in INERT:
            return False
    return True


def names_of(source: str) -> tuple[str, ...] | None:
    """The names ``source`` mentions (``x`` of ``x`` and ``x.attr``), or None when one is a training name. When
    :func:`is_data` says they are all data, ``might_train`` is False: a caller that runs the same cell again may
    test that alone.

    >>> names_of("n = len(x.data)"), names_of("loss.backward()")
    (('n', 'len', 'x'), None)
    """
    tokens = _by_source.get(source)
    if tokens is None:
        tokens = _tokens(source)
    return None if tokens is True else tokens[0]


def _tokens(source: str) -> _Names | bool:
    """The names ``source`` mentions, as (its distinct heads, its distinct (``head``, ``head.attr``) pairs), or
    True when one is a training name; kept by the cell's text (a notebook re-runs its cells: the text is what
    the guess reads again, the namespace is not).

    >>> _tokens("n = len(x.data)")
    (('n', 'len', 'x'), (('n', 'n'), ('len', 'len'), ('x', 'x.data')))
    """
    found: list[tuple[str, str]] = []
    verdict: _Names | bool = False
    for token in _IDENT.findall(source):
        head, _, attr = token.partition(".")
        if head in TRAIN_NAMES or attr in TRAIN_NAMES:
            verdict = True
            break
        found.append((head, token))
    else:
        pairs = tuple(dict.fromkeys(found))
        verdict = (tuple(dict.fromkeys(head for head, _ in pairs)), pairs)
    if len(_by_source) > _MAX_SOURCES:
        _by_source.clear()
    if len(source) <= _MAX_KEPT_SOURCE:  # (a long cell's text is not kept: its regex run is a small part of it)
        _by_source[source] = verdict
    return verdict


def _callables(namespace: dict[str, Any], token: str) -> list[Any]:
    """The functions ``token`` (``f``, ``Cls`` or ``obj.method``) may run, where they are the user's."""
    head, _, attr = token.partition(".")
    obj = namespace.get(head)
    if obj is None:
        return []
    if attr:
        owner = obj if isinstance(obj, type) or isinstance(obj, types.ModuleType) else type(obj)
        obj = getattr(owner, attr, None)
    if isinstance(obj, type):  # a class: what constructing or calling it runs
        return [f for name in ("__init__", "__call__", "forward", "run") if (f := _user_function(vars(obj).get(name)))]
    fn = _user_function(obj)
    return [fn] if fn is not None else []


def _user_function(obj: Any) -> types.FunctionType | None:
    fn = getattr(obj, "__func__", obj)
    if not isinstance(fn, types.FunctionType) or _is_library(fn.__code__.co_filename):
        return None
    return fn


def _is_library(filename: str) -> bool:
    """An installed package, the standard library, torch (not: a notebook's cells, ``exec``'d code, a file of
    the user's own)."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    return filename.startswith(_library_dirs())


def _trains(fn: types.FunctionType, depth: int, seen: set[int]) -> bool:
    """``fn``'s code names a training attribute, or a user function it calls (by a global name) does."""
    if id(fn) in seen:
        return False
    seen.add(id(fn))
    code = fn.__code__
    hit = _by_code.get(code)
    if hit is None:
        if len(_by_code) > _MAX_CACHE:
            _by_code.clear()
        hit = _by_code[code] = _names_training(code)
    if hit or depth <= 1:
        return hit
    globals_ = fn.__globals__
    return any(_trains(g, depth - 1, seen) for name in _global_names(code)
               if (g := _user_function(globals_.get(name))) is not None)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _names_training(code: types.CodeType) -> bool:
    """The code (or code nested in it: inner functions, comprehensions, methods of a class body) names a
    training attribute."""
    if TRAIN_NAMES.intersection(code.co_names):
        return True
    return any(isinstance(c, types.CodeType) and _names_training(c) for c in code.co_consts)


__all__ = ["might_train", "names_of", "is_data", "INERT", "TRAIN_NAMES"]
