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
import socket
import sys
import threading
import time
import tokenize
from dataclasses import dataclass, field
from typing import Any, Callable

from ..capture.recorder.collectives import _SKIP_DIRS, CollectiveRecorder, fill_from_flight_recorder
from ..capture.end.excerpts import keep_excerpts
from ..util.process import one_run_at_a_time
from .engine import ENGINES
from ..report.schema import ReportError, loads, validate
from ..trace.distributed import Collective, RankRecord
from ..trace.stacks import FrameInfo, ThreadStack
from ..util.files import MAX_REPORT_BYTES, UnsafeFile, read_bounded
from ..util.orphans import die_with_parent
from ..util.serde import from_dict


def paths(out_dir: str, rank: int) -> dict[str, str]:
    """The files rank ``rank`` writes in ``out_dir``.

    >>> sorted(paths("/tmp/x", 1))
    ['fault', 'log', 'record']
    """
    base = os.path.join(out_dir, f"rank{rank}")
    return {"record": base + ".json", "log": base + ".log", "fault": base + ".fault"}


def run_rank(script: str, out_dir: str, *, engine: str = "auto", every_iteration: bool = False,
             memory_limit: int | None = None) -> int:
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
    return run_rank_source(source, path, out_dir, namespace, engine=engine, every_iteration=every_iteration,
                           memory_limit=memory_limit)


def run_identity() -> str:
    """Which run this rank belongs to, as every rank of it can tell without talking to the others:
    torchrun's run id (``--rdzv-id``; ``--standalone`` makes a fresh one) and its restart count; '' when
    torchrun gives none ("none": the files' start times and world size tell runs apart then).

    >>> os.environ.get("TORCHELASTIC_RUN_ID") is not None or run_identity() == ""
    True
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run in ("", "none"):
        return ""
    return f"{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _progress(rec: CollectiveRecorder, done: threading.Event) -> None:
    """Every second, the iterations done so far (when they changed) into the log: a rank that still
    advances is slow, not hung (the launcher reads when each log last grew)."""
    from ..capture.runner import running_progress

    last = -1
    while not done.wait(1.0):
        progress = running_progress()
        steps = progress["iterations"] if progress else -1
        if steps != last and steps >= 0:
            rec.write({"steps": steps})
            last = steps


def placement() -> dict[str, Any]:
    """Where torchrun placed this rank: node (``GROUP_RANK``), ``LOCAL_RANK``, the machine's name."""
    def number(name: str) -> int | None:
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else None
    return {"node": number("GROUP_RANK"), "local_rank": number("LOCAL_RANK"), "host": socket.gethostname()[:200]}


def run_rank_source(source: str, cell_file: str, out_dir: str, namespace: dict[str, Any], *, engine: str = "auto",
                    every_iteration: bool = False, build: bool = True, memory_limit: int | None = None) -> int:
    """Run ``source`` (compiled as ``cell_file``) in ``namespace`` as this rank under the capture and the
    collective log; write the record; 0 when the run completed without an exception, else 1.
    It turns ``faulthandler`` on for the whole process (a rank is a process of its own: a forked child
    or ``python -m backward_doctor.run.rank``), so it is not run here; ``fork_ranks._child`` calls it::

        code = run_rank_source(cell, "<backward_doctor-cell-3>", folder, namespace, build=False)
    """
    from .step import run_step  # (the step's imports are heavy; the launcher parent never needs them)

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    files = paths(out_dir, rank)
    for old in (files["record"], files["record"] + ".tmp"):  # an earlier run's record in a reused folder
        try:
            os.remove(old)
        except OSError:
            pass
    fault = open(files["fault"], "w", encoding="utf-8")
    # On a fatal signal (gloo aborts on a size mismatch) and on SIGUSR1 (the launcher asking a hung rank
    # where it is): every thread's Python stack, written from the signal handler, GIL or not.
    faulthandler.enable(file=fault, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=fault, all_threads=True)
    start, started, run = time.perf_counter(), time.time(), run_identity()
    done = threading.Event()
    # Inside the diagnosis's Ctrl-C hold: the recorder's patches go on and come off whole.
    with one_run_at_a_time():
        header = {"run": run, "started": started, "rank": rank, "world_size": world, **placement()}
        with CollectiveRecorder(cell_file=cell_file, source=source, log_path=files["log"], header=header) as rec:
            threading.Thread(target=_progress, args=(rec, done), name="backward_doctor-rank-progress",
                             daemon=True).start()
            try:
                # No replay here (rollback=False): replaying an iteration re-issues its collectives (FSDP's
                # all-gathers, DDP's all-reduces) on this rank alone, which its peers never join.
                report = run_step(source, namespace, cell_file=cell_file, engine=engine,
                                  every_iteration=every_iteration, build=build, rollback=False,
                                  memory_limit=memory_limit)
            finally:
                done.set()
        fill_from_flight_recorder(rec.collectives)
    report.trace.notes.extend(rec.notes)  # (the collective log's own failure, if it stopped)
    its = report.trace.iterations
    if its.first_nonfinite is not None and its.first_nonfinite not in its.recorded and its.recorded:
        how = ("`--every-iteration` records every iteration of every rank and names the op that made it"
               if not report.trace.device.startswith("cuda") else "on CUDA ops are screened only in a replay: "
               "run that rank's batch in one process under the doctor to name the op")
        report.trace.notes.append(
            f"NaN/Inf first showed in iteration {its.first_nonfinite}, which ran with the recorder off; a rank "
            f"does not replay it (the replay would issue collectives its peers never join): {how}.")
    keep_excerpts(report.trace, [(c.file, c.line) for c in rec.collectives]
                  + [(u.forward_file, u.forward_line) for u in rec.unused])
    record = RankRecord(rank=rank, world_size=world, script=cell_file, wrote_report=True, **placement(),
                        collectives=rec.collectives, unused=rec.unused, trace=report.trace,
                        duration_s=time.perf_counter() - start, run=run, started=started,
                        steps=report.trace.iterations.steps)
    tmp = files["record"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record.to_dict(), fh)
    os.replace(tmp, files["record"])  # the launcher never reads half a record
    return 0 if report.trace.exception is None else 1


def _read(path: str, limit: int, tail: bool = False) -> str | None:
    """A rank's file, read safely (a regular file, bounded); None when it is not there. A FIFO, a device or
    an oversized record raises ``ReportError`` naming the file (``combine`` exits 2 with it)."""
    try:
        return read_bounded(path, limit, tail=tail, errors="replace")
    except UnsafeFile as exc:
        raise ReportError(str(exc)) from None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReportError(f"{path}: {exc.strerror or exc}") from None


def load_rank(out_dir: str, rank: int, world: int, script: str = "", *, local: bool = False) -> RankRecord:
    """Rank ``rank``'s record: the one it wrote, else one rebuilt from its collective log; its fault
    output's stacks either way (they say where it was when it died or was asked). Every file is untrusted
    input (``combine`` reads folders others gathered): read safely, checked against the schema
    (``ReportError`` naming the file and field). ``local``: the launcher on the machine the ranks ran on,
    just after they ran: a stack frame's source line may be read there (record time); otherwise only the
    script's own lines, from the record, are shown."""
    files = paths(out_dir, rank)
    text = _read(files["record"], MAX_REPORT_BYTES)
    log = read_log(files["log"])
    if text is not None:
        try:
            data = loads(text)
            validate(data, "RankRecord")
        except ReportError as exc:
            raise ReportError(f"{files['record']}: {exc}") from None
        record = RankRecord.from_dict(data)
    else:
        record = RankRecord(rank=rank, world_size=log.world_size or world, script=script,
                            collectives=log.collectives, run=log.run, started=log.started, steps=log.steps,
                            **log.placement)
    record.fault = _read(files["fault"], _FAULT_BYTES, tail=True) or ""
    source = (record.trace.source if record.trace is not None else "").splitlines()
    main_file = record.script or script

    def code(file: str, line: int) -> str:
        if local:
            return linecache.getline(file, line).strip()
        return source[line - 1].strip() if file == main_file and 0 < line <= len(source) else ""
    record.stacks = parse_fault(record.fault, main_file, code)
    fatal = re.search(r"Fatal Python error: (\w[\w ]*)", record.fault)
    if fatal and not record.wrote_report:  # what faulthandler saw kill it (the launcher knows better)
        record.signal = _FATAL.get(fatal.group(1).strip(), fatal.group(1).strip())
    return record


_FATAL = {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
          "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}
_FAULT_BYTES = 20_000          # the end of a rank's faulthandler output (its last dump)
_LOG_BYTES = 64 * 1024 * 1024  # the end of a rank's collective log


@dataclass
class RankLog:
    """What a rank's log says: its run (header), its collectives, the iterations it reported."""

    collectives: list[Collective] = field(default_factory=list)
    run: str = ""
    started: float = 0.0
    world_size: int = 0
    placement: dict[str, Any] = field(default_factory=dict)  # node, local_rank, host (the header's)
    steps: int = 0


def read_log(path: str) -> RankLog:
    """The collectives a rank logged as it went (an entry never ended: it was still inside it), and its
    header. Lines that are not well-formed entries are skipped (the last line of a rank killed while
    writing it; anything else a crafted file holds).

    >>> read_log("/nonexistent.log").collectives
    []
    """
    out = RankLog()
    entries: dict[int, Collective] = {}
    for line in (_read(path, _LOG_BYTES, tail=True) or "").splitlines():
        try:
            e = json.loads(line)
            if not isinstance(e, dict):
                continue
            if "start" in e:
                validate(e["start"], "Collective")
                c = from_dict(Collective, e["start"])
                entries[c.index] = c
            elif "drop" in e:
                entries.pop(e["drop"], None)
            elif "end" in e and e["end"] in entries:
                count, error = e.get("count"), e.get("error", "")
                end_s = e.get("end_s")
                if (count is None or type(count) is int) and isinstance(error, str) and (
                        end_s is None or type(end_s) in (int, float)):
                    entries[e["end"]].count, entries[e["end"]].error = count, error[:1000]
                    entries[e["end"]].end_s = end_s
            elif "steps" in e and type(e["steps"]) is int:
                out.steps = e["steps"]
            elif "started" in e:  # the header (the same fields as a record's)
                head = {"rank": 0, "world_size": e.get("world_size"), "run": e.get("run"), "started": e["started"],
                        **{k: e[k] for k in ("node", "local_rank", "host") if k in e}}
                validate(head, "RankRecord")
                out.run, out.started, out.world_size = head["run"], head["started"], head["world_size"]
                out.placement = {k: head[k] for k in ("node", "local_rank", "host") if k in head}
        except (ValueError, TypeError):  # not JSON, not an entry (ReportError is a ValueError)
            continue
    out.collectives = [entries[k] for k in sorted(entries)]
    return out


_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_fault(text: str, script: str = "", code: Callable[[str, int], str] | None = None) -> list[ThreadStack]:
    """The thread stacks of the last ``faulthandler`` dump in ``text`` (innermost frame last); ``code(file,
    line)`` gives each frame's source line ('' when not given: nothing is read from disk here).

    >>> s = parse_fault('Thread 0x01 (most recent call first):\\n  File "/t/a.py", line 9 in <module>\\n', "/t/a.py")
    >>> s[0].is_main, s[0].frames[0].line, s[0].frames[0].in_cell, s[0].frames[0].code
    (True, 9, True, '')
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
                                               user=user, code=code(file, line) if code is not None else ""))
        elif raw.strip():  # any other text ends a dump ("Fatal Python error", "Extension modules")
            in_dump, current = False, None
    stacks = dumps[-1] if dumps else []
    for s in stacks:  # the main thread is the one that runs the script's module code
        s.is_main = any(fi.in_cell and fi.function == "<module>" for fi in s.frames)
    return stacks


#: set by ``--nproc``'s launcher to its pid: the rank dies with it (a launcher killed leaves no rank behind)
PARENT_ENV = "BACKWARD_DOCTOR_LAUNCHER_PID"


USAGE = "usage: python -m backward_doctor.run.rank FILE.py FOLDER [auto|native|python] [every] [limit=BYTES]"


def parse_args(argv: list[str]) -> dict[str, Any]:
    """The rank runner's arguments (what ``torchrun -m backward_doctor.run.rank`` is given after the module):
    the script, the folder, then in any order the engine, ``every`` (record every iteration) and
    ``limit=BYTES`` (the simulated device); ``ValueError`` for anything else, before anything runs.

    >>> parse_args(["train.py", "ranks", "every", "limit=1024"])["memory_limit"]
    1024
    >>> parse_args(["train.py", "ranks", "evry"])
    Traceback (most recent call last):
    ValueError: unknown argument 'evry'
    """
    if len(argv) < 2:
        raise ValueError("FILE.py and FOLDER are required")
    out: dict[str, Any] = {"script": argv[0], "out_dir": argv[1], "engine": "auto", "every_iteration": False,
                           "memory_limit": None}
    for a in argv[2:]:
        if a in ENGINES:
            out["engine"] = a
        elif a == "every":
            out["every_iteration"] = True
        elif a.startswith("limit=") and a[6:].isdigit() and int(a[6:]) > 0:
            out["memory_limit"] = int(a[6:])
        else:
            raise ValueError(f"unknown argument {a!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"{USAGE}\nbackward_doctor.run.rank: error: {exc}", file=sys.stderr)
        return 2
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        die_with_parent(int(parent))
    return run_rank(args.pop("script"), args.pop("out_dir"), **args)


if __name__ == "__main__":
    sys.exit(main())
