"""``python -m backward_doctor combine FOLDER``: one report from the files ranks wrote under ``torchrun -m
backward_doctor.run.rank FILE.py FOLDER`` (several machines: their folders gathered into one).

The folder is untrusted input like any saved report: every file is read safely and checked
(``run/rank.py``'s ``load_rank``), rank numbers are bounded (a ``rank99999999.json`` is refused, not a
hundred million records made), and nothing a file names is read. A folder reused by a later run still
holds the earlier run's files of ranks that did not run again: each rank's files say which run wrote them
(torchrun's run id, the world size, when it started), and those of another run are left out, with a note.

>>> combine_folder("/nonexistent")
Traceback (most recent call last):
ValueError: /nonexistent holds no rank files (rank0.json, rank0.log, ...)
"""
from __future__ import annotations

import os
import re

from ..analysis.distributed import analyze_ranks
from ..report.combined import CombinedReport
from ..report.schema import ReportError
from ..run.rank import load_rank
from ..trace.distributed import RankRecord

#: the most ranks one combined report holds (torchrun's largest jobs are smaller; a file named past it is
#: refused rather than a record made for every number below it)
MAX_RANKS = 65_536
_NAME = re.compile(r"rank(\d{1,12})\.(json|log|fault)$")


def rank_files(folder: str) -> list[int]:
    """The ranks that left files in ``folder``; ``ReportError`` for a rank number past :data:`MAX_RANKS`."""
    found: set[int] = set()
    for name in os.listdir(folder):
        m = _NAME.match(name)
        if m:
            rank = int(m.group(1))
            if rank >= MAX_RANKS:
                raise ReportError(f"{os.path.join(folder, name)}: rank {rank} is past the {MAX_RANKS:,} ranks a "
                                  "combined report holds")
            found.add(rank)
    return sorted(found)


def ranges(numbers: list[int]) -> str:
    """``0, 2-5, 9``: a list of numbers, runs folded.

    >>> ranges([0, 2, 3, 4, 5, 9]), ranges([])
    ('0, 2-5, 9', '')
    """
    out: list[str] = []
    for n in sorted(numbers):
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def _same_run(latest: RankRecord, rec: RankRecord) -> bool:
    """Whether ``rec`` was written by the run ``latest`` (the most recently started rank) belongs to."""
    if latest.run and rec.run and latest.run != rec.run:
        return False
    return not (latest.world_size and rec.world_size and latest.world_size != rec.world_size)


def combine_folder(folder: str) -> CombinedReport:
    """The combined report of ranks that wrote into ``folder`` under another launcher (see the module doc).
    ``ValueError`` when the folder holds no rank's files, or a file that is not a rank's (``ReportError``,
    one line naming it). How each process ended is unknown here."""
    found = rank_files(folder) if os.path.isdir(folder) else []
    if not found:
        raise ValueError(f"{folder} holds no rank files (rank0.json, rank0.log, ...)")
    records = [load_rank(folder, k, found[-1] + 1) for k in found]
    latest = max(records, key=lambda r: r.started)
    stale = [r for r in records if not _same_run(latest, r)]
    records = [r for r in records if _same_run(latest, r)]
    world = latest.world_size or max(r.rank for r in records) + 1
    script = next((r.script for r in records if r.script), "")
    source = next((r.trace.source for r in records if r.trace is not None and r.trace.source), "")
    notes = []
    if stale:
        notes.append(f"the files of rank {ranges([r.rank for r in stale])} are from another run (run "
                     f"{stale[0].run or 'unnamed'}, {stale[0].world_size} ranks) than the latest one (run "
                     f"{latest.run or 'unnamed'}, {latest.world_size} ranks): left out")
    missing = [k for k in range(world) if k not in {r.rank for r in records}]
    if missing:
        notes.append(f"rank {ranges(missing)} left no files")
    return CombinedReport(findings=analyze_ranks(records), ranks=records, script=script, source=source,
                          nproc=world, notes=notes)
