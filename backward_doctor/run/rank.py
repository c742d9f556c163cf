"""One rank of a distributed run: the script under the usual capture plus the collective log, written
to a folder the launcher reads; and :func:`load_rank`, which rebuilds a rank's record from that folder
whether or not the rank lived to write it.

A rank leaves up to three files in ``out_dir``: ``rank{R}.json`` (its :class:`RankRecord`, trace
included, written when the script's run ended), ``rank{R}.log`` (its collectives as JSON lines, written
as they start and end) and ``rank{R}.fault`` (Python stacks from ``faulthandler``: on a fatal signal such
as gloo's abort, and whenever the launcher sends SIGUSR1 to ask where a hung rank is).

Run as ``python -m backward_doctor.run.rank SCRIPT OUT_DIR [ENGINE] [every]`` with torchrun's environment
(RANK, WORLD_SIZE, ...); the script calls ``dist.init_process_group`` itself.

>>> load_rank("/nonexistent", 0, 2).wrote_report
False
"""
from __future__ import annotations

import faulthandler
import json
import linecache
import os
import re
import signal
import sys
import time
import tokenize
from typing import Any

from ..capture.collectives import _SKIP_DIRS, CollectiveRecorder, fill_from_flight_recorder
from ..capture.process import one_run_at_a_time
from ..trace.distributed import Collective, RankRecord
from ..trace.records import FrameInfo, ThreadStack
from ..util.serde import from_dict


def paths(out_dir: str, rank: int) -> dict[str, str]:
    """The files rank ``rank`` writes in ``out_dir``.

    >>> sorted(paths("/tmp/x", 1))
    ['fault', 'log', 'record']
    """
    base = os.path.join(out_dir, f"rank{rank}")
    return {"record": base + ".json", "log": base + ".log", "fault": base + ".fault"}


def run_rank(script: str, out_dir: str, *, engine: str = "auto", every_iteration: bool = False) -> int:
    """Run the file ``script`` as this rank (RANK/WORLD_SIZE from the environment): see
    :func:`run_rank_source`. What the launcher runs in each rank process::

        RANK=0 WORLD_SIZE=2 ... python -m backward_doctor.run.rank train.py /tmp/ranks
    """
    path = os.path.abspath(script)
    with tokenize.open(path) as fh:
        source = fh.read()
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    sys.path.insert(0, os.path.dirname(path))
    sys.argv = [path]
    return run_rank_source(source, path, out_dir, namespace, engine=engine, every_iteration=every_iteration)


def run_rank_source(source: str, cell_file: str, out_dir: str, namespace: dict[str, Any], *, engine: str = "auto",
                    every_iteration: bool = False, build: bool = True) -> int:
    """Run ``source`` (compiled as ``cell_file``) in ``namespace`` as this rank under the capture and the
    collective log; write the record; 0 when the run completed without an exception, else 1.
    It turns ``faulthandler`` on for the whole process (a rank is a process of its own: a forked child
    or ``python -m backward_doctor.run.rank``), so it is not run here; ``fork_ranks._child`` calls it::

        code = run_rank_source(cell, "<backward_doctor-cell-3>", folder, namespace, build=False)
    """
    from .step import run_step  # (the step's imports are heavy; the launcher parent never needs them)

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    files = paths(out_dir, rank)
    fault = open(files["fault"], "w", encoding="utf-8")
    # On a fatal signal (gloo aborts on a size mismatch) and on SIGUSR1 (the launcher asking a hung rank
    # where it is): every thread's Python stack, written from the signal handler, GIL or not.
    faulthandler.enable(file=fault, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=fault, all_threads=True)
    start = time.perf_counter()
    # Inside the diagnosis's Ctrl-C hold: the recorder's patches go on and come off whole.
    with one_run_at_a_time():
        with CollectiveRecorder(cell_file=cell_file, source=source, log_path=files["log"]) as rec:
            report = run_step(source, namespace, cell_file=cell_file, engine=engine, every_iteration=every_iteration,
                              build=build)
        fill_from_flight_recorder(rec.collectives)
    record = RankRecord(rank=rank, world_size=world, script=cell_file, wrote_report=True,
                        collectives=rec.collectives, unused=rec.unused, trace=report.trace,
                        duration_s=time.perf_counter() - start)
    tmp = files["record"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record.to_dict(), fh)
    os.replace(tmp, files["record"])  # the launcher never reads half a record
    return 0 if report.trace.exception is None else 1


def load_rank(out_dir: str, rank: int, world: int, script: str = "") -> RankRecord:
    """Rank ``rank``'s record: the one it wrote, else one rebuilt from its collective log; its fault
    output's stacks either way (they say where it was when it died or was asked)."""
    files = paths(out_dir, rank)
    record = None
    try:
        with open(files["record"], encoding="utf-8") as fh:
            record = RankRecord.from_dict(json.load(fh))
    except (OSError, ValueError):
        record = RankRecord(rank=rank, world_size=world, script=script, collectives=read_log(files["log"]))
    try:
        with open(files["fault"], encoding="utf-8", errors="replace") as fh:
            record.fault = fh.read()[-20000:]
    except OSError:
        pass
    record.stacks = parse_fault(record.fault, record.script or script)
    fatal = re.search(r"Fatal Python error: (\w[\w ]*)", record.fault)
    if fatal and not record.wrote_report:  # what faulthandler saw kill it (the launcher knows better)
        record.signal = _FATAL.get(fatal.group(1).strip(), fatal.group(1).strip())
    return record


_FATAL = {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
          "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


def read_log(path: str) -> list[Collective]:
    """The collectives a rank logged as it went (an entry never ended: it was still inside it).

    >>> read_log("/nonexistent.log")
    []
    """
    entries: dict[int, Collective] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    e = json.loads(line)
                except ValueError:  # the last line of a rank killed while writing it
                    continue
                if "start" in e:
                    c = from_dict(Collective, e["start"])
                    entries[c.index] = c
                elif "drop" in e:
                    entries.pop(e["drop"], None)
                elif "end" in e and e["end"] in entries:
                    entries[e["end"]].count, entries[e["end"]].error = e.get("count"), e.get("error", "")
                    entries[e["end"]].end_s = e.get("end_s")
    except OSError:
        return []
    return [entries[k] for k in sorted(entries)]


_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_fault(text: str, script: str = "") -> list[ThreadStack]:
    """The thread stacks of the last ``faulthandler`` dump in ``text`` (innermost frame last).

    >>> s = parse_fault('Thread 0x01 (most recent call first):\\n  File "/t/a.py", line 9 in <module>\\n', "/t/a.py")
    >>> s[0].is_main, s[0].frames[0].line, s[0].frames[0].in_cell
    (True, 9, True)
    """
    dumps: list[list[ThreadStack]] = []
    current: ThreadStack | None = None
    in_dump = False
    for raw in text.splitlines():
        m = _HEADER.match(raw)
        if m:
            if not in_dump:
                dumps.append([])
            in_dump = True
            current = ThreadStack(name=f"thread {m.group(2)}", ident=int(m.group(2), 16), is_main=False)
            dumps[-1].append(current)
            continue
        f = _FRAME.match(raw)
        if f and current is not None:
            file, line = f.group(1), int(f.group(2))
            user = not file.startswith(_SKIP_DIRS) and not file.startswith("<frozen")
            current.frames.insert(0, FrameInfo(file=file, line=line, function=f.group(3), in_cell=file == script,
                                               user=user, code=linecache.getline(file, line).strip()))
        elif raw.strip():  # any other text ends a dump ("Fatal Python error", "Extension modules")
            in_dump, current = False, None
    stacks = dumps[-1] if dumps else []
    for s in stacks:  # the main thread is the one that runs the script's module code
        s.is_main = any(fi.in_cell and fi.function == "<module>" for fi in s.frames)
    return stacks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine = argv[2] if len(argv) > 2 else "auto"
    return run_rank(argv[0], argv[1], engine=engine, every_iteration="every" in argv[3:])


if __name__ == "__main__":
    sys.exit(main())
