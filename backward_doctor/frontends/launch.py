"""``python -m backward_doctor --nproc N FILE.py``: run a script on N local ranks, as ``torchrun`` would,
each under the doctor, and combine what they left into one report.

Every rank is a fresh ``python -m backward_doctor.run.rank`` process with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT a free port; the script
calls ``dist.init_process_group`` itself). Their output is echoed line by line with a ``[rankR]`` prefix.
The launcher waits at most ``timeout`` seconds; when one rank fails the others get a short grace period
(they usually fail at once with a lost connection); whoever is still running then is asked for its
stacks (SIGUSR1: ``faulthandler``) and killed. How each process ended is evidence too.

>>> check_nproc(0)
Traceback (most recent call last):
ValueError: --nproc must be a whole number of ranks from 1 to 64, not 0
"""
from __future__ import annotations

import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Callable

from ..analysis.distributed import analyze_ranks
from ..report.combined import CombinedReport
from ..run.rank import load_rank, paths

DEFAULT_TIMEOUT = 300.0  # a hang is bounded even without --timeout (gloo's own default is 30 minutes)
GRACE_S = 5.0            # after one rank failed: how long the others get to fail or finish by themselves
_MAX_NPROC = 64
_TAIL = 60               # lines of each rank's stderr kept as evidence


def check_nproc(nproc: Any) -> int:
    """``nproc`` as an int; ``ValueError`` unless it is a whole number from 1 to 64.

    >>> check_nproc(2)
    2
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= _MAX_NPROC:
        raise ValueError(f"--nproc must be a whole number of ranks from 1 to {_MAX_NPROC}, not {nproc!r}")
    return nproc


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``nproc`` on one machine.

    >>> e = rank_env(1, 2, 29500, {})
    >>> e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["MASTER_ADDR"], e["MASTER_PORT"]
    ('1', '2', '1', '127.0.0.1', '29500')
    """
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="backward_doctor")
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not each take every core
    # PyTorch's Flight Recorder: the sizes of the collectives DDP launches in C++ (run/rank.py reads it).
    env.setdefault("TORCH_FR_BUFFER_SIZE", "4000")
    # Never TORCH_DISTRIBUTED_DEBUG=DETAIL: DDP segfaults with it on gloo (measured, torch 2.13).
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        env["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
    return env


class _Rank:
    """One rank's process and the threads echoing its output."""

    def __init__(self, rank: int, proc: subprocess.Popen, echo: bool) -> None:
        self.rank, self.proc = rank, proc
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self.stopped = ""
        self.threads = [threading.Thread(target=self._pump, args=(proc.stdout, sys.stdout, echo, False), daemon=True),
                        threading.Thread(target=self._pump, args=(proc.stderr, sys.stderr, echo, True), daemon=True)]
        for t in self.threads:
            t.start()

    def _pump(self, pipe: IO[str], sink: IO[str], echo: bool, keep: bool) -> None:
        for line in iter(pipe.readline, ""):
            if keep:
                self.tail.append(line.rstrip("\n"))
            if echo:
                try:
                    sink.write(f"[rank{self.rank}] {line}")
                    sink.flush()
                except (OSError, ValueError):
                    pass
        pipe.close()

    def ask_for_stacks(self, why: str) -> bool:
        """SIGUSR1: faulthandler writes every thread's stack (from the signal handler, so even a rank
        stuck in C++ answers). False when it had already exited."""
        if self.proc.poll() is not None:
            return False
        self.stopped = why
        try:
            if hasattr(signal, "SIGUSR1"):
                os.kill(self.proc.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
        return True

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own session: DataLoader workers too
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(ranks: list["_Rank"], why: str) -> None:
    """Ask every running rank for its stacks, then freeze them all, then kill them: were one killed
    first, the others would fail (a lost connection) and log that before their own end came.

    >>> stop_all([], "timeout")  # nothing running: nothing to do
    """
    asked = [r for r in ranks if r.ask_for_stacks(why)]
    if not asked:
        return
    time.sleep(0.5)  # faulthandler writes from the signal handler: a few milliseconds
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for r in asked:
            r.signal_group(sig)
    for r in asked:
        r.proc.wait()


def _failed(r: _Rank, out_dir: str) -> bool:
    """It exited with its script's exception, or died before writing its record."""
    code = r.proc.returncode
    return code is not None and code != 0 and (code == 1 or not os.path.exists(paths(out_dir, r.rank)["record"]))


def launch(script: str, nproc: int, *, timeout: float | None = None, engine: str = "auto",
           every_iteration: bool = False, echo: bool = True) -> CombinedReport:
    """Run the file ``script`` on ``nproc`` local ranks (fresh processes) under the doctor; the combined
    report. ``ValueError`` before anything runs for a bad ``nproc`` or ``timeout`` or a missing script.

    >>> launch("no_such_script.py", 2)
    Traceback (most recent call last):
    ValueError: no such file: no_such_script.py
    """
    from ..api import check_timeout

    check_nproc(nproc)
    timeout = check_timeout(timeout) or DEFAULT_TIMEOUT
    if not os.path.isfile(script):
        raise ValueError(f"no such file: {script}")
    script = os.path.abspath(script)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def start(k: int, port: int, out_dir: str) -> _Rank:
        env = rank_env(k, nproc, port)
        # The ranks import this very backward_doctor, wherever it was imported from.
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = [sys.executable, "-m", "backward_doctor.run.rank", script, out_dir, engine]
        proc = subprocess.Popen(argv + (["every"] if every_iteration else []), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True, errors="replace")
        return _Rank(k, proc, echo)

    with open(script, encoding="utf-8", errors="replace") as fh:
        source = fh.read()
    return supervise(start, nproc, timeout, script=script, source=source)


def supervise(start: Callable[[int, int, str], "_Rank"], nproc: int, timeout: float, *, script: str,
              source: str) -> CombinedReport:
    """Start ``nproc`` ranks with ``start(rank, port, out_dir)``, wait for them (see the module doc),
    read what each left in ``out_dir`` and combine it (``launch`` and ``fork_ranks.launch_cell`` use it;
    see ``launch``'s example)."""
    out_dir = tempfile.mkdtemp(prefix="backward_doctor-ranks-")
    port = free_port()
    begin = time.monotonic()
    ranks: list[_Rank] = []
    try:
        for k in range(nproc):
            ranks.append(start(k, port, out_dir))
        _wait(ranks, out_dir, begin + timeout)
        for r in ranks:
            for t in r.threads:
                t.join(timeout=5)
        records = []
        for r in ranks:
            rec = load_rank(out_dir, r.rank, nproc, script)
            code = r.proc.returncode
            rec.exitcode, rec.stopped, rec.output_tail = code, r.stopped, "\n".join(r.tail)
            rec.signal = signal.Signals(-code).name if code is not None and code < 0 and not r.stopped else None
            records.append(rec)
        notes = [f"rank {rec.rank} was killed by {rec.signal} after its script had finished (gloo's teardown "
                 "at interpreter exit; the run itself completed)"
                 for rec in records if rec.signal and rec.wrote_report and rec.trace and rec.trace.exception is None]
        return CombinedReport(findings=analyze_ranks(records, timeout=timeout), ranks=records, script=script,
                              source=source, nproc=nproc, timeout_s=timeout, duration_s=time.monotonic() - begin,
                              notes=notes)
    finally:
        stop_all(ranks, "the launcher stopped")  # Ctrl-C or an error here: no rank outlives the launcher
        shutil.rmtree(out_dir, ignore_errors=True)


def combine_folder(folder: str) -> CombinedReport:
    """The combined report of ranks that wrote into ``folder`` under another launcher (``torchrun -m
    backward_doctor.run.rank FILE.py FOLDER`` on each machine, the folders gathered into one).
    ``ValueError`` when the folder holds no rank's files. How each process ended is unknown here.

    >>> combine_folder("/nonexistent")
    Traceback (most recent call last):
    ValueError: /nonexistent holds no rank files (rank0.json, rank0.log, ...)
    """
    import re

    found = set()
    if os.path.isdir(folder):
        found = {int(m.group(1)) for name in os.listdir(folder) if (m := re.match(r"rank(\d+)\.(json|log)$", name))}
    if not found:
        raise ValueError(f"{folder} holds no rank files (rank0.json, rank0.log, ...)")
    records = [load_rank(folder, k, max(found) + 1) for k in sorted(found)]
    world = max([r.world_size for r in records] + [max(found) + 1])
    script = next((r.script for r in records if r.script), "")
    source = next((r.trace.source for r in records if r.trace is not None and r.trace.source), "")
    notes = [f"rank {k} left no files" for k in range(world) if k not in found]
    return CombinedReport(findings=analyze_ranks(records), ranks=records, script=script, source=source,
                          nproc=world, notes=notes)


def _wait(ranks: list[_Rank], out_dir: str, deadline: float) -> None:
    """Until every rank exits, the deadline passes, or the grace after a failure ends."""
    failed_at: float | None = None
    first_failed = None
    while any(r.proc.poll() is None for r in ranks):
        now = time.monotonic()
        if failed_at is None:
            first_failed = next((r for r in ranks if _failed(r, out_dir)), None)
            if first_failed is not None:
                failed_at = now
        if now >= deadline:
            stop_all(ranks, "timeout")
            return
        if failed_at is not None and now >= failed_at + GRACE_S:
            stop_all(ranks, f"after rank {first_failed.rank} failed")
            return
        time.sleep(0.05)
