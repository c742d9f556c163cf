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
from ..api import check_nproc, check_timeout
from ..capture.janitor import Janitor
from ..util.process import interrupts_allowed
from ..report.combined import CombinedReport
from ..report.schema import ReportError
from ..run.rank import PARENT_ENV, load_rank, paths
from ..trace.distributed import RankRecord

DEFAULT_TIMEOUT = 300.0  # a hang is bounded even without --timeout (gloo's own default is 30 minutes)
GRACE_S = 5.0            # after one rank failed: how long the others get to fail or finish by themselves
STARTUP_S = 120.0        # beyond the timeout: for a rank to start the script at all (Python, torch's import)
_TAIL = 60               # lines of each rank's stderr kept as evidence


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
        self.stopped_at: float | None = None               # when the launcher asked it to stop
        self.progressed_at = time.monotonic()              # when its log last grew
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
        self.stopped, self.stopped_at = why, time.monotonic()
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
           every_iteration: bool = False, echo: bool = True, memory_limit: int | None = None) -> CombinedReport:
    """Run the file ``script`` on ``nproc`` local ranks (fresh processes) under the doctor; the combined
    report. ``memory_limit``: each rank's simulated device capacity in bytes. ``ValueError`` before anything runs for a bad ``nproc`` or ``timeout`` or a missing script.

    >>> launch("no_such_script.py", 2)
    Traceback (most recent call last):
    ValueError: no such file: no_such_script.py
    """
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
        env[PARENT_ENV] = str(os.getpid())  # the rank dies with the launcher, whatever kills it
        argv = [sys.executable, "-m", "backward_doctor.run.rank", script, out_dir, engine]
        argv += (["every"] if every_iteration else []) + ([f"limit={memory_limit}"] if memory_limit else [])
        proc = subprocess.Popen(argv, env=env, text=True,
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
    see ``launch``'s example). A Ctrl-C (a kernel's interrupt) stops the ranks at once and the report says
    where each was; SIGTERM or SIGHUP to this process stop them and remove their folder before it ends as
    the signal would have ended it; killed outright (a kernel restarted: SIGKILL), the ranks die with it
    and its :class:`~backward_doctor.capture.janitor.Janitor` removes their folder once they are gone."""
    out_dir = tempfile.mkdtemp(prefix="backward_doctor-ranks-")
    janitor = Janitor(out_dir)
    port = free_port()
    begin = time.monotonic()
    ranks: list[_Rank] = []
    notes: list[str] = []
    ended_by: list[int] = []
    previous = _on_termination(ended_by)
    try:
        for k in range(nproc):
            ranks.append(start(k, port, out_dir))
        try:
            with interrupts_allowed():  # (inside a diagnosis's hold, as in the magic: a Ctrl-C must reach here)
                _wait(ranks, out_dir, timeout)
        except KeyboardInterrupt:
            stop_all(ranks, "interrupted")
            notes.append(f"interrupted (Ctrl-C) after {time.monotonic() - begin:.1f} s: every rank was stopped, "
                         "its stacks taken first")
        for r in ranks:
            for t in r.threads:
                t.join(timeout=5)
        records = []
        for r in ranks:
            try:
                rec = load_rank(out_dir, r.rank, nproc, script, local=True)
            except ReportError as exc:  # (files the script itself put there, in its ranks' folder)
                rec = RankRecord(r.rank, nproc, script=script)
                notes.append(f"rank {r.rank}'s files could not be read: {exc}")
            code = r.proc.returncode
            rec.exitcode, rec.stopped, rec.output_tail = code, r.stopped, "\n".join(r.tail)
            rec.signal = signal.Signals(-code).name if code is not None and code < 0 and not r.stopped else None
            if r.stopped and r.stopped_at is not None:
                rec.progress_s = max(0.0, r.stopped_at - r.progressed_at)
            records.append(rec)
        notes += [f"rank {rec.rank} was killed by {rec.signal} after its script had finished (gloo's teardown "
                  "at interpreter exit; the run itself completed)"
                  for rec in records if rec.signal and rec.wrote_report and rec.trace and rec.trace.exception is None]
        return CombinedReport(findings=analyze_ranks(records, timeout=timeout), ranks=records, script=script,
                              source=source, nproc=nproc, timeout_s=timeout, duration_s=time.monotonic() - begin,
                              notes=notes)
    finally:
        stop_all(ranks, "the launcher stopped")  # Ctrl-C or an error here: no rank outlives the launcher
        shutil.rmtree(out_dir, ignore_errors=True)
        janitor.close()
        _restore(previous)
        if ended_by:  # end as SIGTERM/SIGHUP would have ended the process, now that nothing is left behind
            os.kill(os.getpid(), ended_by[0])


class _Terminated(BaseException):
    """SIGTERM/SIGHUP arrived while ranks ran: unwinds to ``supervise``'s clean-up."""


def _on_termination(ended_by: list[int]) -> dict[int, Any]:
    """While ranks run: SIGTERM and SIGHUP first stop them and remove their folder (``supervise``), then
    end the process as before. Only the main thread can set handlers; elsewhere nothing changes. A signal
    ignored when the run began stays ignored (``nohup`` ignores SIGHUP: the user asked the run to outlive
    the terminal)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: Any) -> None:
        if not ended_by:
            ended_by.append(signum)
            raise _Terminated(signal.Signals(signum).name)

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            try:
                previous[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                continue
    return previous


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _wait(ranks: list[_Rank], out_dir: str, timeout: float) -> None:
    """Until every rank exits, the time limit passes, or the grace after a failure ends. The limit counts
    from the moment every rank has started the script (its log begun): starting a Python process and
    importing torch is not the script's time, and takes seconds on a busy machine; a rank that never gets
    there is given ``STARTUP_S`` more. Meanwhile each rank's log is watched: when it last grew is when the
    rank last showed progress (a collective, an iteration), which tells a slow run from a hung one."""
    failed_at: float | None = None
    first_failed = None
    logs = {r.rank: paths(out_dir, r.rank)["log"] for r in ranks}
    sizes = {r.rank: -1 for r in ranks}
    deadline = time.monotonic() + timeout + STARTUP_S
    started = False
    while any(r.proc.poll() is None for r in ranks):
        now = time.monotonic()
        for r in ranks:
            try:
                size = os.stat(logs[r.rank]).st_size
            except OSError:
                continue
            if size != sizes[r.rank]:
                sizes[r.rank], r.progressed_at = size, now
        if not started and all(size > 0 for size in sizes.values()):
            started, deadline = True, now + timeout
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
