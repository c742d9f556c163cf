"""Child processes that never outlive the process that started them (the ranks of ``--nproc``).

A rank started by the launcher (or forked from a Jupyter kernel) must die with it: a kernel restarted while
an ``--nproc`` cell runs is killed with SIGKILL, and ranks left running would hold the kernel's ports (the
restarted kernel then dies with "Address already in use") and the CPU. Linux kills a child whose parent
died when the child asked for it (``PR_SET_PDEATHSIG``); elsewhere nothing is done.

>>> die_with_parent(os.getppid())  # (in a process whose parent is alive: nothing visible happens)
True
"""
from __future__ import annotations

import ctypes
import os
import signal
import stat
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; if ``parent`` (the pid that started it)
    is already gone, exit now. False where the platform cannot do it (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
    return True


def release_inherited_sockets(keep: tuple[int, ...] = (0, 1, 2)) -> int:
    """In a forked child: point every inherited socket descriptor (a kernel's ZeroMQ ports) at /dev/null, so
    the child holds no port of its parent; the descriptor numbers stay taken (nothing the parent's objects
    copied into the child refer to is reused for another file). Returns how many were released.

    >>> release_inherited_sockets(keep=tuple(range(1 << 20)))  # (keeping everything: nothing to do)
    0
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    null = os.open(os.devnull, os.O_RDWR)
    released = 0
    try:
        for fd in fds:
            if fd in keep or fd == null:
                continue
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
                    released += 1
            except OSError:
                continue
    finally:
        os.close(null)
    return released
