"""A temporary folder of the doctor's removed even when the process that made it never gets to (a script
under ``run`` ended by SIGTERM or SIGHUP at their default, a kernel restarted with SIGKILL while an ``--nproc``
cell ran, any SIGKILL).

:class:`Janitor` starts a small Python of its own session (a terminal's hangup and Ctrl-C do not reach it;
the process started for it ends at once, leaving it to run alone, so nobody has to wait for it) that waits
on a pipe. This process holds the only end that writes, and children it forks (DataLoader workers, forked
ranks) hold copies until they end or let go of theirs (:meth:`Janitor.forget`). When every copy is closed,
however the processes holding them ended, the pipe reads empty and the folder is removed.
:meth:`Janitor.close` is the ordinary end: the folder is removed here first, then the pipe closed (the
janitor ends). Where no janitor can be started (no interpreter to run, no processes left), nothing else
changes: the folder is removed at the run's end as before.

>>> import tempfile
>>> folder = tempfile.mkdtemp(prefix="backward_doctor-doctest-")
>>> Janitor(folder).close()  # (its owner never removed it: the janitor does, at once)
>>> import time; deadline = time.monotonic() + 120
>>> while os.path.exists(folder) and time.monotonic() < deadline:
...     time.sleep(0.02)
>>> os.path.exists(folder)
False
"""
from __future__ import annotations

import os
import subprocess
import sys

#: What the janitor runs (``-I -S``: nothing of the user's environment or site imported).
_CODE = """\
import os, shutil, signal, sys
if os.fork():
    os._exit(0)  # (the process started ends at once: reaped by its starter, whatever still holds the pipe)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
while True:
    try:
        if not os.read(0, 64):
            break
    except InterruptedError:
        continue
    except OSError:
        break
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""
_REAP_S = 5.0


class Janitor:
    """See the module doc. ``fd`` is the pipe's end this process writes (None: no janitor)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.fd: int | None = None
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()
        if not sys.executable:
            return
        try:
            r, w = os.pipe()  # (both close-on-exec: only forked children share the writing end)
        except OSError:
            return
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CODE, folder], stdin=r,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True, close_fds=True)
        except (OSError, ValueError, subprocess.SubprocessError):
            os.close(w)
            return
        finally:
            os.close(r)
        self.fd = w

    def forget(self) -> None:
        """In a forked child: let go of this copy of the pipe (the folder is the parent's business)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """The folder's owner is done with it (and has removed it): the janitor ends, and the process started
        for it (gone as soon as it started the janitor) is reaped. In a child forked since: :meth:`forget`."""
        proc, self._proc = (self._proc, None) if os.getpid() == self._pid else (None, self._proc)
        self.forget()
        if proc is not None:
            try:
                proc.wait(timeout=_REAP_S)
            except subprocess.TimeoutExpired:  # (a machine too busy to start a Python: reaped later by subprocess)
                pass


__all__ = ["Janitor"]
