"""The end-to-end training-step scenarios, one module per family (plain data, no pytest here).

The schema (:class:`scenario_kit.Scenario`) and the helpers that build a
scenario live in ``tests/scenario_kit.py``; setups used by more than one family
in :mod:`scenarios._setups`.  This package assembles the lists the tests use:

* raising families (``tests/test_findings.py``, ``tests/test_scenarios_plain.py``):
  ``NONFINITE``, ``INPLACE``, ``DEVICE``, ``DTYPE``, ``SHAPE``, ``INDEX``,
  ``BACKWARD_TWICE``, ``NO_GRAD``, ``OOM``, ``HANG`` (together ``FAILING``),
  ``CORRECT`` steps, ``ALL`` and ``BY_NAME`` -- here;
* silent families (``tests/test_silent.py``): ``from scenarios import silent``.
"""

from __future__ import annotations

from scenario_kit import (
    BUGGY_MODELS_FILE,
    ROOT_MARKER,
    Scenario,
    bug_line,
    cell_line,
    module_params,
)

from .amp_misuse import AMP_CROSSING
from .backward_twice import BACKWARD_TWICE, BACKWARD_TWICE_ERR
from .correct import CORRECT
from .device import DEVICE, DEVICE_ERR
from .dtype import DTYPE
from .hang import HANG
from .index import INDEX
from .inplace import INPLACE, LEAF_INPLACE, SAVED_INPLACE
from .no_grad import NO_GRAD, NO_GRAD_FN
from .nonfinite import NONFINITE
from .oom import OOM
from .shape import SHAPE

KINDS = (
    "nonfinite",
    "inplace",
    "device_mismatch",
    "dtype_mismatch",
    "shape_mismatch",
    "index_out_of_range",
    "backward_twice",
    "no_grad_path",
    "oom",
    "hang",
    "amp_misuse",
)

FAILING: list[Scenario] = (NONFINITE + INPLACE + DEVICE + DTYPE + SHAPE + INDEX + BACKWARD_TWICE + NO_GRAD + OOM + HANG
                           + AMP_CROSSING)
ALL: list[Scenario] = FAILING + CORRECT
BY_NAME: dict[str, Scenario] = {s.name: s for s in ALL}

__all__ = [
    "ALL", "AMP_CROSSING", "BACKWARD_TWICE", "BACKWARD_TWICE_ERR", "BUGGY_MODELS_FILE", "BY_NAME", "CORRECT", "DEVICE", "DEVICE_ERR",
    "DTYPE", "FAILING", "HANG", "INDEX", "INPLACE", "KINDS", "LEAF_INPLACE", "NONFINITE", "NO_GRAD", "NO_GRAD_FN",
    "OOM", "ROOT_MARKER", "SAVED_INPLACE", "SHAPE", "Scenario", "bug_line", "cell_line", "module_params",
]
