"""The silent families (issue 3): training bugs that raise nothing, seen across runs.

Each failing scenario's cell is run ``runs`` times in one namespace and the last
report must contain a finding of ``kind`` at ``line`` / ``file`` / ``module``
(see ``tests/scenario_kit.py`` for the schema); the ``SILENT`` scenarios
(``kind`` None) must give ``report.findings == []`` on each of ``max(3, runs)``
runs.  Used by ``tests/test_silent.py`` as ``from scenarios import silent``.
"""

from __future__ import annotations

from scenario_kit import ROOT_MARKER, SILENT_MODELS_FILE, Scenario, cell_line

from .amp_misuse import AMP_CORRECT, AMP_MISUSE
from .amp_skipped import AMP_SKIPPED
from .broadcast import BROADCAST
from .detached import DETACHED
from .grad_accumulation import GRAD_ACCUMULATION, GRAD_ACCUMULATION_CORRECT
from .graph_leak import GRAPH_LEAK
from .silent_correct import SILENT as SILENT_CORRECT
from .stale_grad import STALE_GRAD

KINDS = ("graph_leak", "stale_grad", "detached", "broadcast", "amp_skipped", "grad_accumulation", "amp_misuse")

FAILING: list[Scenario] = GRAPH_LEAK + STALE_GRAD + DETACHED + BROADCAST + AMP_SKIPPED + GRAD_ACCUMULATION + AMP_MISUSE
SILENT: list[Scenario] = SILENT_CORRECT + GRAD_ACCUMULATION_CORRECT + AMP_CORRECT
ALL: list[Scenario] = FAILING + SILENT
BY_NAME: dict[str, Scenario] = {s.name: s for s in ALL}
assert len(BY_NAME) == len(ALL), "scenario names must be unique"

__all__ = [
    "ALL", "AMP_MISUSE", "AMP_SKIPPED", "BROADCAST", "GRAD_ACCUMULATION", "BY_NAME", "DETACHED", "FAILING", "GRAPH_LEAK", "KINDS", "ROOT_MARKER",
    "SILENT", "SILENT_MODELS_FILE", "STALE_GRAD", "Scenario", "cell_line",
]
