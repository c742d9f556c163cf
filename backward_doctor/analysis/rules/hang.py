"""A step that never finished: where every thread was waiting.

>>> from backward_doctor.trace import Trace
>>> hang(Trace())
[]
"""
from __future__ import annotations

from ..findings import Finding, at
from ...trace.queries import is_bookkeeping
from ...trace.records import OpRecord, Trace, Where
from ...trace.stacks import FrameInfo, ThreadStack  # noqa: F401 (FrameInfo: the doctests)


def _main_where(trace: Trace) -> Where:
    for stack in trace.threads:
        if stack.is_main:
            w = Where()
            for fi in reversed(stack.frames):
                if fi.user and w.line is None:
                    w.line, w.file, w.function = fi.line, (None if fi.in_cell else fi.file), fi.function
                if fi.in_cell:
                    w.cell_line = fi.line
                    break
            if w.line is not None:
                # The interrupt's traceback is this same stack: it knows the module on it.
                if trace.exception is not None and trace.exception.where.line == w.line:
                    w.module = trace.exception.where.module
                return w
    return trace.exception.where if trace.exception else Where()


#: Jupyter's service threads (ipykernel 6 and 7: its shell channel and subshells) and IPython's history saver.
_KERNEL_THREADS = ("Control", "Heartbeat", "IOPub", "IPythonHistorySavingThread", "Shell channel", "subshell-")
_KERNEL_FILES = ("ipykernel", "zmq", "jupyter_client", "tornado")


def own_thread(stack: ThreadStack) -> bool:
    """The doctor's own threads and the kernel's (its service threads, the pipes it watches): never part of
    the user's hang, so never named in a report.

    >>> own_thread(ThreadStack("backward_doctor-progress", 1, False)), own_thread(ThreadStack("Shell channel", 2, False))
    (True, True)
    """
    return stack.name.startswith(("backward_doctor",) + _KERNEL_THREADS) or any(
        part in fi.file for fi in stack.frames[-3:] for part in _KERNEL_FILES)


def worth_naming(stack: ThreadStack) -> bool:
    """A thread the hang may be about: the main one, one that ran the user's code, a DataLoader's own (its
    pin-memory thread). Not a multiprocessing queue's feeder thread, a library's idle pool, the kernel's.

    >>> worth_naming(ThreadStack("QueueFeederThread", 1, False, [FrameInfo("/py/multiprocessing/queues.py", 1, "_feed")]))
    False
    """
    if stack.is_main:
        return True
    if own_thread(stack):
        return False
    return any(fi.user or fi.in_cell or "torch/utils/data/" in fi.file.replace("\\", "/") for fi in stack.frames)


def _last_user_op(trace: Trace) -> OpRecord | None:
    """The last op the step itself asked for: not the profiler's ``record_function`` markers around it."""
    return next((op for op in reversed(trace.ops) if not is_bookkeeping(op.op)), None)


def _steps(trace: Trace) -> str:
    n = trace.iterations.steps
    return "none" if not n else f"{n:,} step{'s' if n != 1 else ''}"


def hang(trace: Trace) -> list[Finding]:
    """Timeout or Ctrl-C: name the line the main thread was stuck on, with all stacks."""
    exc = trace.exception
    # A KeyboardInterrupt a hook or the code raised itself (``raise KeyboardInterrupt``) is an error like any
    # other; only one a signal delivered (Ctrl-C, the watchdog) says the step was stuck.
    interrupted = exc is not None and exc.type == "KeyboardInterrupt" and not exc.raised
    if not (trace.timed_out or interrupted):
        return []
    where = _main_where(trace)
    main = next((s for s in trace.threads if s.is_main), None)
    # A Ctrl-C without a timeout photographs no stacks; the interrupt's own traceback is the main stack.
    frames = main.frames if main and main.frames else (exc.frames if interrupted else [])
    inner = frames[-1] if frames else None
    if inner is None:
        waiting = "unknown code"
    elif inner.in_cell or inner.function == "<module>":
        # Stuck in C code called from this very line (a lock, a queue, a sleep): name the call.
        waiting = f"the call on line {inner.line} (`{inner.code}`)"
    else:
        waiting = f"`{inner.function}` ({inner.file.rsplit('/', 1)[-1]}:{inner.line}: `{inner.code}`)"
    how = ("was interrupted by hand" if not trace.timed_out
           else f"made no progress for {trace.timeout_s:g} s (no optimizer step completed; {_steps(trace)} had)"
           if trace.timeout_stall else f"did not finish within the {trace.timeout_s:g} s timeout")
    last = _last_user_op(trace)
    phase = f"; the last PyTorch op was `{last.op}` in {last.phase}" if last else "; no PyTorch op had run yet"
    others = [s.name for s in trace.threads if not s.is_main and worth_naming(s)]
    msg = (f"The step {how}. The main thread was waiting in {waiting}, called from line {where.line}{phase}. "
           "A hang is Python waiting on something that never comes: a lock or event another thread should "
           "release, a queue or DataLoader worker that died, an endless loop, or (on CUDA) a synchronisation "
           "on a kernel that never completes. Read the stacks below: the innermost frame of each thread says "
           "what it waits for." + (f" Other threads: {', '.join(others)}." if others else ""))
    return [at("hang", where, msg, title="The step hangs",
               evidence={"waiting_in": waiting, "threads": len(trace.threads), "ops_run": trace.op_count})]
