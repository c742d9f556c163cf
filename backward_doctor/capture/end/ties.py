"""Weights a model declares tied that are separate tensors when the step ends (``trace.untied_weights``).

A tie is two modules holding one ``nn.Parameter`` (GPT-2's ``lm_head.weight`` *is* ``transformer.wte.weight``).
It lives in the modules' attributes only, so whatever gives one of them a new tensor breaks it without a word:
``to_empty()`` after a meta-device init gives every parameter fresh memory of its own, assigning a new
``nn.Parameter`` replaces it on one module, ``load_state_dict(..., assign=True)`` puts one checkpoint tensor per
key in place. Two kinds of declared intent are read, once per run at its end (never per op):

- a Hugging Face model's own map of the ties its config asks for (``all_tied_weights_keys``, transformers 5;
  before it, ``config.tie_word_embeddings`` with ``get_input_embeddings()``/``get_output_embeddings()``);
- a plain module whose ``__init__`` (the user's class, or a base class of it) assigns one submodule's parameter
  to another (``self.head.weight = self.embed.weight``), read from the ``__init__``'s source once per class.
  A tie made on a condition (``if config.tie: ...``) is wanted only when the condition held, which only what
  it made tells: it counts when the pair was one tensor as the step began (:func:`tied_now`, at the namespace
  scan: ``state.py``), so a model built with ``tie=False``, or built and untied within the cell, says nothing.

Only the pairs that are two parameters now are recorded, with their storage keys (equal: two parameters over one
memory): whether both trained in the step is the rule's to read (``ParamInfo``). Nothing here runs a tensor op:
attributes and storage identities only.

>>> import torch.nn as nn
>>> class TinyLM(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
...         self.head.weight = self.embed.weight
>>> m = TinyLM(); untied_in([("m", m)])
[]
>>> m.head.weight = nn.Parameter(m.head.weight.detach().clone())
>>> [(u.target, u.source, u.declared) for u in untied_in([("m", m)])]
[('m.head.weight', 'm.embed.weight', 'self.head.weight = self.embed.weight')]
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any, Iterable, Iterator

from torch import nn

from .. import namespace as ns_mod
from ..recorder.memory import storage_key
from ...util.process import doctors_own
from ...trace.ties import UntiedWeights

_MAX_PAIRS = 64      # declared ties looked at per model (a detection model's regex map expands to hundreds)
_MAX_MODULES = 4096  # submodules walked per model for the classes that tie in ``__init__``


def _chain(node: ast.expr) -> tuple[str, ...] | None:
    """``self.a.b.weight`` as ``("a", "b", "weight")``; None for anything else (a call, a subscript)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and len(parts) >= 2:
        return tuple(reversed(parts))
    return None


@functools.lru_cache(maxsize=512)
def init_ties(cls: type) -> tuple[tuple[tuple[str, ...], tuple[str, ...], str, str | None, int | None, bool], ...]:
    """The ties ``cls.__init__`` (and its base classes' ``__init__``, torch's own left out) makes:
    ``(target attrs, source attrs, statement, file, line, conditional)`` for each ``self.x.w = self.y.w``
    (``conditional``: under an ``if`` or a loop, as ``if tie: self.head.weight = ...``). A function's
    source is read through its code object, so a class defined in a notebook cell (IPython keeps the cell's
    lines in ``linecache``) is read too; a class with no readable source has none.

    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
    ...         self.b.weight = self.a.weight
    >>> [(t, s, code, conditional) for t, s, code, _, _, conditional in init_ties(Tied)]
    [(('b', 'weight'), ('a', 'weight'), 'self.b.weight = self.a.weight', False)]
    """
    found = []
    mro, i = cls.__mro__, 0
    while i < len(mro):
        klass, i = mro[i], i + 1
        init = vars(klass).get("__init__")
        if init is None or (klass.__module__ or "").split(".")[0] in ("torch", "transformers") or klass is object:
            continue
        code = getattr(init, "__code__", None)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            continue
        for node, conditional in _assignments(tree):
            target, source = _chain(node.targets[0]), _chain(node.value)
            if target and source and target != source:
                line = code.co_firstlineno + node.lineno - 1 if code is not None else None
                found.append((target, source, ast.unparse(node), getattr(code, "co_filename", None), line,
                              conditional))
        i = _next_init(tree, mro, i)
    return tuple(found)


def _next_init(tree: ast.Module, mro: tuple[type, ...], i: int) -> int:
    """Where in ``mro`` the ``__init__`` in ``tree`` goes on: the next class for ``super().__init__()``, the
    class it names for ``Base.__init__(self)``, past the end when it calls none (its bases' ties never run)."""
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__"):
            continue
        base = n.func.value
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            return i
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        return next((j for j in range(i, len(mro)) if mro[j].__name__ == name), len(mro))
    return len(mro)


def _assignments(tree: ast.Module) -> Iterator[tuple[ast.Assign, bool]]:
    """Each one-target assignment of the function in ``tree``, and whether it runs only on a condition (under
    an ``if``, a loop, a ``try``, a ``match``; a ``with`` block runs as the body does)."""
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) \
        else tree.body
    todo = [(stmt, False) for stmt in body]
    while todo:
        node, conditional = todo.pop(0)
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            yield node, conditional
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            todo.extend((n, conditional) for n in node.body)
        elif isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.Match)):
            todo.extend((n, True) for n in ast.walk(node) if isinstance(n, ast.Assign))


def _resolve(mod: nn.Module, attrs: Iterable[str]) -> Any:
    obj: Any = mod
    for a in attrs:
        obj = getattr(obj, a, None)
        if obj is None:
            return None
    return obj


def _apart(a: Any, b: Any) -> bool:
    """Two parameters that are not one: different objects (two parameters over one memory, as
    ``load_state_dict(..., assign=True)`` of a state dict that kept the tie's sharing makes, are apart too:
    each gets its own gradient and its own update, both written to that memory)."""
    if not (isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter)) or a is b:
        return False
    return a.device.type != "meta" and b.device.type != "meta"  # (no memory yet: still to be materialised)


def _hf_ties(mod: nn.Module) -> list[tuple[str, str, str]]:
    """``(target, source, declared)`` names inside ``mod`` for a Hugging Face model's ties."""
    config = vars(mod).get("config")  # (a plain attribute: no nn.Module.__getattr__ miss on every submodule)
    if config is None or not callable(getattr(mod, "tie_weights", None)):
        return []
    declared = "config.tie_word_embeddings=True"
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    wants = getattr(config, "tie_word_embeddings", None)
    wants = getattr(text, "tie_word_embeddings", None) if wants is None else wants
    keys = vars(mod).get("all_tied_weights_keys")  # (transformers 5: the config as the model was built)
    if isinstance(keys, dict):
        # (the embeddings' tie as the config says now: set to False since, on purpose, the model unties them,
        # as ``tie_weights()`` would read it)
        pairs = [(t, s, t.endswith("lm_head.weight") or "embed" in s)
                 for t, s in list(keys.items())[:_MAX_PAIRS] if isinstance(t, str) and isinstance(s, str)]
        return [(t, s, declared if embedding else f"{type(mod).__name__}._tied_weights_keys")
                for t, s, embedding in pairs if wants is not False or not embedding]
    if not wants:
        return []
    try:
        out_emb, in_emb = mod.get_output_embeddings(), mod.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return []
    if out_emb is None or in_emb is None:
        return []
    names = {id(m): n for n, m in mod.named_modules(remove_duplicate=False)}
    if id(out_emb) not in names or id(in_emb) not in names:
        return []
    join = lambda n: f"{n}.weight" if n else "weight"  # noqa: E731
    return [(join(names[id(out_emb)]), join(names[id(in_emb)]), declared)]


def _declared(sub: nn.Module) -> list[tuple[Any, Any, str, str | None, int | None, bool, bool]]:
    """``sub``'s own declared ties: ``(target attrs, source attrs, declared, file, line, conditional, hf)``."""
    ties = [(t.split("."), s.split("."), code, None, None, False, True) for t, s, code in _hf_ties(sub)]
    if type(sub).__module__.split(".")[0] not in ("torch", "transformers"):
        ties += [(*tie, False) for tie in init_ties(type(sub))]
    return ties


def _walk(models: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, nn.Module, tuple, Any, Any]]:
    """``(path, submodule, tie, target, source)`` for each declared tie of these models, the two resolved now;
    a model whose attributes or config raise is left out (the report stands without it)."""
    for root, model in models:
        try:
            found = []
            for i, (sub_name, sub) in enumerate(model.named_modules()):
                if i >= _MAX_MODULES:
                    break
                for tie in _declared(sub):
                    found.append((f"{root}.{sub_name}" if sub_name else root, sub, tie,
                                  _resolve(sub, tie[0]), _resolve(sub, tie[1])))
        except Exception as exc:  # noqa: BLE001
            if not doctors_own(exc):  # (a signal handler's exception: the user's, it goes on)
                raise
            continue
        yield from found


def tied_now(models: list[tuple[str, nn.Module]]) -> set[tuple[int, tuple[str, ...]]]:
    """``(id(submodule), target attrs)`` of the conditional ties (``if tie: self.head.weight = ...``) that are
    one tensor now, before the step: whether the condition held is known only from what it made.

    >>> class Maybe(nn.Module):
    ...     def __init__(self, tie=True):
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
    ...         if tie:
    ...             self.b.weight = self.a.weight
    >>> len(tied_now([("m", Maybe())])), len(tied_now([("m", Maybe(tie=False))]))
    (1, 0)
    """
    return {(id(sub), tuple(tie[0])) for _, sub, tie, a, b in _walk(models)
            if tie[5] and isinstance(a, nn.Parameter) and a is b}


def untied_in(models: list[tuple[str, nn.Module]],
              tied_before: set[tuple[int, tuple[str, ...]]] | None = None) -> list[UntiedWeights]:
    """The declared ties of these models (``(name, module)``) that are two tensors now (see the module
    docstring), each pair once. A conditional tie counts only when it is in ``tied_before`` (:func:`tied_now`
    before the step): a model built with ``tie=False`` wants two tensors."""
    out: list[UntiedWeights] = []
    seen: set[tuple[int, int]] = set()
    for prefix, sub, tie, a, b in _walk(models):
        target, source, code, file, line, conditional, hf = tie
        if conditional and (id(sub), tuple(target)) not in (tied_before or set()):
            continue
        if not _apart(a, b) or (id(a), id(b)) in seen:
            continue
        seen.add((id(a), id(b)))
        out.append(UntiedWeights(model=prefix, cls=type(sub).__name__,
                                 target=f"{prefix}.{'.'.join(target)}", source=f"{prefix}.{'.'.join(source)}",
                                 target_key=storage_key(a) or 0, source_key=storage_key(b) or 0,
                                 declared=code, file=file, line=line, tie_weights=hf))
    return out


def untied_weights(cap: Any) -> list[UntiedWeights]:
    """The declared ties of the run's models (``cap``: the run's ``OpRecorder``) that are two tensors at its
    end: the models by the variable that holds them (those another thread works on left alone, as
    ``elsewhere.py`` says), then those the step ran that the namespace does not name (a library's)."""
    models: list[tuple[str, nn.Module]] = []
    ids: set[int] = set()
    for name, mod in ns_mod.modules(cap.namespace):
        if not cap.elsewhere.leaves(name) and id(mod) not in ids:
            ids.add(id(mod))
            models.append((name, mod))
    for outer in {stack[0] for _, stack in cap._where_stacks if stack}:
        mod, name = cap._modules.get(outer, (lambda: None, ""))
        mod = mod()
        if isinstance(mod, nn.Module) and id(mod) not in ids:
            ids.add(id(mod))
            models.append((name or type(mod).__name__, mod))
    return untied_in(models, getattr(cap, "_tied_before", None))


__all__ = ["init_ties", "tied_now", "untied_in", "untied_weights"]
