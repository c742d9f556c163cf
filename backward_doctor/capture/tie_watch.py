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

Only the pairs that are separate tensors now are recorded, with their storage keys: whether both trained in the
step is the rule's to read (``ParamInfo``). Nothing here runs a tensor op: attributes and storage identities only.

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
from typing import TYPE_CHECKING, Any, Iterable

from torch import nn

from . import namespace as ns_mod
from .memory import storage_key
from ..trace.ties import UntiedWeights

if TYPE_CHECKING:
    from .record import OpRecorder

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
def init_ties(cls: type) -> tuple[tuple[tuple[str, ...], tuple[str, ...], str, str | None, int | None], ...]:
    """The ties ``cls.__init__`` (and its base classes' ``__init__``, torch's own left out) makes:
    ``(target attrs, source attrs, statement, file, line)`` for each ``self.x.w = self.y.w``. A function's
    source is read through its code object, so a class defined in a notebook cell (IPython keeps the cell's
    lines in ``linecache``) is read too; a class with no readable source has none.

    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
    ...         self.b.weight = self.a.weight
    >>> [(t, s, code) for t, s, code, _, _ in init_ties(Tied)]
    [(('b', 'weight'), ('a', 'weight'), 'self.b.weight = self.a.weight')]
    """
    found = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or (klass.__module__ or "").split(".")[0] == "torch" or klass is object:
            continue
        code = getattr(init, "__code__", None)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target, source = _chain(node.targets[0]), _chain(node.value)
            if target and source and target != source:
                line = code.co_firstlineno + node.lineno - 1 if code is not None else None
                found.append((target, source, ast.unparse(node), getattr(code, "co_filename", None), line))
    return tuple(found)


def _resolve(mod: nn.Module, attrs: Iterable[str]) -> Any:
    obj: Any = mod
    for a in attrs:
        obj = getattr(obj, a, None)
        if obj is None:
            return None
    return obj


def _apart(a: Any, b: Any) -> bool:
    """Two parameters that are not one tensor: different objects with different storage (a parameter made from
    the other's ``.data`` shares its memory, and its updates land on both)."""
    if not (isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter)) or a is b:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return False  # (no memory yet: a model still to be materialised says nothing)
    return storage_key(a) != storage_key(b)


def _hf_ties(mod: nn.Module) -> list[tuple[str, str, str]]:
    """``(target, source, declared)`` names inside ``mod`` for a Hugging Face model's ties."""
    config = getattr(mod, "config", None)
    if config is None or not callable(getattr(mod, "tie_weights", None)):
        return []
    declared = "config.tie_word_embeddings=True"
    keys = vars(mod).get("all_tied_weights_keys")  # (transformers 5: the config already applied)
    if isinstance(keys, dict):
        return [(t, s, declared if t.endswith("lm_head.weight") or "embed" in s else
                 f"{type(mod).__name__}._tied_weights_keys")
                for t, s in list(keys.items())[:_MAX_PAIRS] if isinstance(t, str) and isinstance(s, str)]
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if not getattr(text, "tie_word_embeddings", False):
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


def untied_in(models: list[tuple[str, nn.Module]]) -> list[UntiedWeights]:
    """The declared ties of these models (``(name, module)``) that are two tensors now (see the module
    docstring), each pair once."""
    out: list[UntiedWeights] = []
    seen: set[tuple[int, int]] = set()
    for root, model in models:
        try:  # (a user's module whose attribute or config raises: that model says nothing, the report stands)
            _ties_of(root, model, out, seen)
        except Exception:  # noqa: BLE001
            continue
    return out


def _ties_of(root: str, model: nn.Module, out: list[UntiedWeights], seen: set[tuple[int, int]]) -> None:
    for i, (sub_name, sub) in enumerate(model.named_modules()):
        if i >= _MAX_MODULES:
            break
        prefix = f"{root}.{sub_name}" if sub_name else root
        hf = _hf_ties(sub)
        ties = [(t.split("."), s.split("."), code, None, None) for t, s, code in hf]
        ties += [] if type(sub).__module__.split(".")[0] in ("torch", "transformers") else init_ties(type(sub))
        for target, source, code, file, line in ties:
            a, b = _resolve(sub, target), _resolve(sub, source)
            if not _apart(a, b) or (id(a), id(b)) in seen:
                continue
            seen.add((id(a), id(b)))
            out.append(UntiedWeights(model=prefix, cls=type(sub).__name__,
                                     target=f"{prefix}.{'.'.join(target)}", source=f"{prefix}.{'.'.join(source)}",
                                     target_key=storage_key(a) or 0, source_key=storage_key(b) or 0,
                                     declared=code, file=file, line=line, tie_weights=bool(hf)))


def untied_weights(cap: "OpRecorder") -> list[UntiedWeights]:
    """The run's models, by the variable that holds them (those another thread works on left alone, as
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
    return untied_in(models)


__all__ = ["init_ties", "untied_in", "untied_weights"]
