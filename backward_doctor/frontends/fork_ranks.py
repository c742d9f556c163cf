"""``%%backward_doctor --nproc N``: a notebook cell on N local ranks, forked from the kernel.

``torch.multiprocessing.spawn`` cannot pickle what a cell defines; ``fork`` copies the kernel as it is
(its model, data and functions) in a few milliseconds. Each child becomes a rank (torchrun's
environment), runs the cell under the doctor like ``python -m backward_doctor --nproc N`` does and
ends with ``os._exit``; the kernel never joins the process group and only reads what the ranks left.
A forked child first calls ``torch.set_num_threads(1)``: an OpenMP pool the kernel used does not
survive ``fork``, and a multi-threaded op in the child would wait on it forever. After CUDA has been
initialised in the kernel a fork cannot use it, so that is refused (as ``accelerate.notebook_launcher``
does).

>>> launch_cell("x = 1", {}, 0)
Traceback (most recent call last):
ValueError: --nproc must be a whole number of ranks from 1 to 64, not 0
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from ..report.combined import CombinedReport
from ..util.orphans import die_with_parent, release_inherited_sockets
from ..api import check_nproc
from .launch import DEFAULT_TIMEOUT, _Rank, rank_env, supervise


class _Forked:
    """The parts of ``subprocess.Popen`` the launcher uses, for a forked child."""

    def __init__(self, pid: int, out_fd: int, err_fd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = os.fdopen(out_fd, "r", encoding="utf-8", errors="replace")
        self.stderr = os.fdopen(err_fd, "r", encoding="utf-8", errors="replace")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _child(rank: int, nproc: int, port: int, out_dir: str, source: str, cell_file: str, namespace: dict[str, Any],
           engine: str, every_iteration: bool, out_fd: int, err_fd: int, parent: int,
           memory_limit: int | None = None) -> None:
    """The rank's whole life in the forked child; never returns (``os._exit``). It dies with the kernel
    (a kernel restarted meanwhile leaves no rank running) and holds none of the kernel's sockets (the
    restarted kernel binds the same ports)."""
    code = 1
    try:
        die_with_parent(parent)
        os.setsid()  # its own session: the launcher can kill it and whatever it starts
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        release_inherited_sockets()
        # The kernel's streams talk to Jupyter over sockets the child must not touch: plain fds instead.
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.stdin = open(os.devnull)
        import torch

        torch.set_num_threads(1)
        os.environ.update(rank_env(rank, nproc, port, {}))
        from ..run.rank import run_rank_source

        code = run_rank_source(source, cell_file, out_dir, namespace, engine=engine,
                               every_iteration=every_iteration, build=False, memory_limit=memory_limit)
    except BaseException:  # noqa: BLE001 - the child must reach os._exit whatever happened
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def launch_cell(source: str, namespace: dict[str, Any], nproc: int, *, timeout: float | None = None,
                engine: str = "python", every_iteration: bool = False, echo: bool = True,
                memory_limit: int | None = None) -> CombinedReport:
    """Run the cell ``source`` on ``nproc`` ranks forked from this process (``namespace``: the
    kernel's variables, as the cell sees them); the combined report (``memory_limit``: each rank's
    simulated device, in bytes). This process never joins the
    process group. ``ValueError`` before anything runs for bad arguments or an initialised CUDA."""
    from ..api import check_timeout
    from ..capture.runner import cell_filename

    check_nproc(nproc)
    timeout = check_timeout(timeout) or DEFAULT_TIMEOUT
    if not hasattr(os, "fork"):
        raise ValueError("--nproc in a notebook forks the kernel, which this platform cannot do; "
                         "save the cell as a script and run `python -m backward_doctor --nproc N FILE.py`")
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise ValueError("CUDA is already initialised in this kernel, and a forked rank cannot use it: restart "
                         "the kernel and run the --nproc cell before anything touches the GPU, or run the code as "
                         "a script with `python -m backward_doctor --nproc N FILE.py`")
    cell_file = cell_filename()

    def start(k: int, port: int, out_dir: str) -> _Rank:
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(r_out)
            os.close(r_err)
            _child(k, nproc, port, out_dir, source, cell_file, namespace, engine, every_iteration, w_out, w_err,
                   parent, memory_limit)
        os.close(w_out)
        os.close(w_err)
        return _Rank(k, _Forked(pid, r_out, r_err), echo)  # type: ignore[arg-type]

    return supervise(start, nproc, timeout, script=cell_file, source=source)
