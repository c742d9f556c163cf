"""The one schema of the end-to-end training-step scenarios, and the helpers that build them.

The scenarios themselves live in the package ``tests/scenarios/`` (one module per
family); this module holds what every family shares: the :class:`Scenario`
dataclass, the root-cause markers, and the helpers that build a scenario and the
namespace its cell runs in.  Plain data, no pytest here.

A :class:`Scenario` is one notebook cell (``source``) plus a ``setup()`` that
builds the namespace the cell runs in (seeded model, optimizer, data).  The cell
is run ``runs`` times in that one namespace (the doctor keeps a per-cell
history, so a second run of the same source in the same dict is "the same cell
run again") and the *last* report is checked:

* raising families (``scenarios.FAILING``; tests/test_findings.py):
  ``findings[0]`` has ``kind``, ``line``, ``file``, ``module`` and, when set, ``op``;
* silent families (``scenarios.silent.FAILING``; tests/test_silent.py): the
  report contains a finding of ``kind`` at ``line`` / ``file`` / ``module``
  (and ``op`` when set), and nothing else but ``also`` kinds;
* correct steps (``kind`` None: ``scenarios.CORRECT``, ``scenarios.silent.SILENT``):
  no finding at all.

Conventions
-----------
* Cell lines are 1-based lines of ``source``.  The expected line carries the
  trailing comment ``# <-- root cause``; :func:`cell_line` finds it.  Sources
  are written as ``dedent('''\\ ...''')`` so line 1 is the first statement.
  For ``amp_skipped`` (informational) it is the ``scaler.step`` line.
* File-side scenarios have ``file`` = the absolute path of the models file the
  bug lives in (``tests/buggy_models.py`` for the raising families:
  :func:`_in_file`; ``tests/silent_models.py`` for the silent ones:
  :func:`_in_silent_file`) and ``line`` = the line of its ``# BUG:<name>`` marker.
* ``raises`` = ``(ExceptionType, "message fragment")`` the cell raises when
  run *plainly* (``exec``, no backward_doctor).  ``None`` for scenarios that
  raise nothing (nonfinite, a silently-broken no_grad_path, oom -- which only
  raises under a ``memory_limit`` -- hang, which never returns, and every
  silent family); raising-family scenarios that raise nothing may provide
  ``check(namespace) -> bool`` proving the bug is real.
* ``mentions``: strings the diagnosis must mention.  Raising families: names of
  namespace variables (non-finite *input data*) that must appear in
  ``findings[0].evidence``.  Silent families: strings the finding's message
  must contain *outside the code it quotes* -- the variable that holds a leak,
  the starved parameters, the shapes, and the one-line fix.
* ``also``: other finding kinds that may accompany the expected one (silent
  families; e.g. nonfinite behind amp_skipped).
* ``known_engine_gaps``: ``{aspect: reason}`` for aspects (``"location"``,
  ``"message"``, ``"silent"``, ...) where the engine is known to disagree with
  the issue; tests/test_silent.py marks exactly those ``xfail(strict=True)``.
* On the CPU-only test machine the ``meta`` device stands in for "cuda" in
  device-mismatch scenarios.
* Every setup seeds ``torch.manual_seed(0)`` first, so two calls give
  bit-identical namespaces.

Module paths (``module``) follow the contract: the dotted path from the
namespace variable to the innermost ``nn.Module`` whose ``forward`` was
running when the op ran, e.g. ``"model.0"`` for the first layer of an
``nn.Sequential`` named ``model``; ``None`` when the op ran outside any module
call (loss functions from ``torch.nn.functional`` in the cell, ``.backward()``).
"""

from __future__ import annotations

import math
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import buggy_models as bm
import silent_models as sm

ROOT_MARKER = "# <-- root cause"
BUGGY_MODELS_FILE = bm.PATH
SILENT_MODELS_FILE = sm.PATH
bug_line = bm.bug_line


def cell_line(source: str, marker: str = ROOT_MARKER) -> int:
    """1-based line of ``source`` carrying ``marker`` (exactly one must)."""
    hits = [i for i, text in enumerate(source.splitlines(), start=1) if marker in text]
    if len(hits) != 1:
        raise LookupError(f"{marker!r} found {len(hits)} times in cell source")
    return hits[0]


@dataclass
class Scenario:
    name: str
    kind: Optional[str]  # None for correct (must-stay-silent) scenarios
    source: str
    setup: Callable[[], dict]
    line: Optional[int] = None
    module: Optional[str] = None
    op: Optional[str] = None
    file: Optional[str] = None
    runs: int = 1
    kwargs: dict = field(default_factory=dict)
    raises: Optional[tuple] = None  # (ExceptionType, "fragment") of a plain run
    check: Optional[Callable[[dict], bool]] = None  # extra proof on the namespace after a plain run
    mentions: tuple = ()  # see the module docstring: evidence (raising) or message (silent) must mention these
    also: tuple = ()  # other finding kinds that may accompany this one (e.g. nonfinite behind amp_skipped)
    known_engine_gaps: dict = field(default_factory=dict)
    doc: str = ""  # why this is a realistic situation

    def __repr__(self) -> str:  # short ids in pytest output
        return f"Scenario({self.name})"


def _cell(name, kind, source, setup, module, **kw) -> Scenario:
    """Scenario whose root-cause line is in the cell (marked ``# <-- root cause``)."""
    source = textwrap.dedent(source)
    return Scenario(name, kind, source, setup, cell_line(source), module, **kw)


def _in_file(name, kind, source, setup, module, bug, *, models=bm, **kw) -> Scenario:
    """Scenario whose root-cause line is the ``# BUG:<bug>`` line of ``models`` (default buggy_models.py)."""
    source = textwrap.dedent(source)
    return Scenario(name, kind, source, setup, models.bug_line(bug), module, file=models.PATH, **kw)


def _in_silent_file(name, kind, source, setup, module, bug, **kw) -> Scenario:
    """Scenario whose expected line is the ``# BUG:<bug>`` line of silent_models.py."""
    return _in_file(name, kind, source, setup, module, bug, models=sm, **kw)


def _ns(**values) -> dict:
    """A notebook-like global namespace: the usual imports plus ``values``."""
    ns = {"torch": torch, "nn": nn, "F": F, "np": np, "math": math, "threading": threading, "time": time, "sm": sm}
    ns.update(values)
    return ns


# ---------------------------------------------------------------------------
# helpers for ``check`` callables (and the tests)
# ---------------------------------------------------------------------------


def module_params(ns: dict, leaves: bool = True):
    """(qualified name, parameter) for every nn.Module in the namespace, plus
    (if ``leaves``) leaf tensors that require grad (raw-tensor models)."""
    seen = set()
    for var, value in ns.items():
        if isinstance(value, nn.Module):
            for pname, p in value.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield f"{var}.{pname}", p
        elif leaves and isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad:
            if id(value) not in seen:
                seen.add(id(value))
                yield var, value
