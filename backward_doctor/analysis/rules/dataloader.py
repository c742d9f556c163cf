"""DataLoader workers (``num_workers > 0``): which worker, which dataset index, which line of the user's
``Dataset``/``collate_fn`` raised, died or is stuck (``trace.loaders``, from ``capture/workers/main_side.py``).

Three ways a worker shows up in the main process, each hiding where it happened:

- its error re-raised as ``Caught ValueError in DataLoader worker process 1.`` with the worker's traceback
  flattened into the message: the finding is placed at the worker's own line, with the index it loaded;
- ``DataLoader worker (pid(s) N) exited unexpectedly`` (or ``is killed by signal``): which worker, what it
  was loading, how it ended (a signal, a crash's stack);
- a hang whose main thread waits in the iterator's ``_get_data``: the worker it waits for is stuck in the
  user's code (a lock copied locked by ``fork``), or its batch never came (a tensor requiring grad cannot
  be sent to another process). A hang elsewhere in the main process stays the ``hang`` rule's.

>>> from backward_doctor.trace import Trace
>>> dataloader_worker(Trace())
[]
"""
from __future__ import annotations

import re

from ..findings import Finding, at
from ...trace.records import Trace, Where
from ...trace.stacks import FrameInfo, LoaderRecord, WorkerRecord

_RERAISED = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.")
#: a worker gone: seen by the main process's periodic check, or by its SIGCHLD handler (a signal, an exit code)
_EXITED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (?:exited unexpectedly|is killed by signal)")
_GRAD = re.compile(r"requires_grad|requires grad|automatic differentiation|autograd does not support", re.I)
_FORK_AUTOGRAD = re.compile(r"autograd's threading in combination with fork", re.I)
_CUDA_FORK = re.compile(r"re-initialize CUDA in forked subprocess|CUDA.*forked", re.I)
#: samples of different sizes in one batch: ``default_collate`` in a worker stacks into shared memory sized for
#: the first sample, which fails as a resize of that storage
_SIZES = re.compile(r"stack expects each tensor to be equal size|each element in list of batch should be of equal "
                    r"size|Sizes of tensors must match|resize storage that is not resizable", re.I)
_SIGNALS = {9: "SIGKILL", 6: "SIGABRT", 11: "SIGSEGV", 7: "SIGBUS", 15: "SIGTERM", 8: "SIGFPE"}
_OWN_LINE = "; this is the worker's own line"


def dataloader_worker(trace: Trace) -> list[Finding]:
    """A worker's error, death or hang, placed at the worker's own line (see the module doc)."""
    exc = trace.exception
    message = exc.message if exc is not None else ""
    m = _RERAISED.search(message)
    if m:
        found = _worker(trace, lambda w: w.worker == int(m.group(2)) and w.state == "raised")
        return [_raised(trace, *found)] if found else []
    m = _EXITED.search(message)
    if m:
        pids = {int(p) for p in m.group(1).replace(" ", "").split(",") if p}
        found = _worker(trace, lambda w: w.pid in pids)
        return [_exited(trace, *found)] if found else []
    hung = trace.timed_out or (exc is not None and (exc.type == "KeyboardInterrupt"
                                                    or "DataLoader timed out" in message))
    if hung and _main_waits_on_loader(trace):
        found = _worker(trace, lambda w: w.waited_on) or \
            _worker(trace, lambda w: w.state in ("fetching", "could not send"))
        if found:
            return [_stuck(trace, *found)]
        if not trace.loaders:
            return [_unwatched(trace)]
    return []


def _unwatched(trace: Trace) -> Finding:
    """The main process waits for a worker of a loader started before this run (a persistent one)."""
    msg = ("The main process waits in the DataLoader for a worker's batch: the hang is in a worker, not here. "
           "Its workers were started before this run (persistent workers of an earlier cell), so their stacks "
           "were not taken. Run it again with a fresh iterator (`persistent_workers=False`, or a new "
           "`DataLoader`) under the doctor to see the worker's line, or with `num_workers=0` to hang in the "
           "main process, where the stack is yours.")
    return at("dataloader_worker", _where(trace, None), msg, title="Waiting for a DataLoader worker",
              evidence={"worker": None, "task": "", "state": "unwatched"})


def _worker(trace: Trace, match) -> tuple[LoaderRecord, WorkerRecord] | None:
    return next(((rec, w) for rec in trace.loaders for w in rec.workers if match(w)), None)


def _main_waits_on_loader(trace: Trace) -> bool:
    """The main thread was inside a DataLoader iterator's fetch, waiting for a worker's batch (its stack
    at the timeout, or the interrupt's traceback)."""
    frames = [f for s in trace.threads if s.is_main for f in s.frames]
    frames += trace.exception.frames if trace.exception is not None else []
    # (`_get_data` is the multiprocessing iterator's: with num_workers=0 the main thread runs the dataset itself)
    return any(f.file.endswith("dataloader.py") and f.function in ("_get_data", "_try_get_data") for f in frames)


def _user_frame(frames: list[FrameInfo]) -> FrameInfo | None:
    return next((f for f in reversed(frames) if f.user), None)


def _where(trace: Trace, frame: FrameInfo | None) -> Where:
    """The worker's line, called from the cell's line that iterates the loader."""
    main = trace.exception.where if trace.exception is not None else Where()
    if frame is None:
        return Where(line=main.line, file=main.file, cell_line=main.cell_line, function=main.function)
    return Where(line=frame.line, file=None if frame.in_cell else frame.file, cell_line=main.cell_line,
                 function=frame.function)


def _code(frame: FrameInfo | None) -> str:
    return f" (`{_statement(frame)}`)" if frame is not None and frame.code else ""


def _statement(frame: FrameInfo | None) -> str:
    """The frame's line of code without its trailing comment."""
    return (frame.code.split("  #", 1)[0].strip() if frame is not None else "") or "..."


def _at(frame: FrameInfo) -> str:
    """``in `Samples.__getitem__`, line 24``: the place names the file (``Cell In[1]``, ``data.py``)."""
    return f"in `{frame.function}`, line {frame.line}"


def _first_sentence(error: str, limit: int = 160) -> str:
    text = error.split(": ", 1)[-1].split(". ", 1)[0].split(", since ", 1)[0]
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _loading(rec: LoaderRecord, w: WorkerRecord) -> str:
    what = f" {w.task}" if w.task else " its batch"
    return f"loading{what}" + (f" of `{rec.dataset}`" if rec.dataset else "")


def _evidence(rec: LoaderRecord, w: WorkerRecord, **more) -> dict:
    ev = {"worker": w.worker, "pid": w.pid, "task": w.task, "loader": rec.loader, "state": w.state}
    ev.update(more)
    return ev


def _grad_made(w: WorkerRecord) -> tuple[FrameInfo | None, str]:
    """Where a tensor requiring grad the worker produced was made, and the sentence naming it."""
    made = _user_frame(w.made_at)
    if made is None:
        return None, ""
    return made, (f" It got its autograd graph {_at(made)}{_code(made)}: the dataset ran a module (or a "
                  "tensor with requires_grad) with gradients on, in the worker.")


def _advice(w: WorkerRecord, frame: FrameInfo | None) -> str:
    """What to do, for the errors a worker commonly dies of."""
    error = w.error
    if _GRAD.search(error):
        code = _statement(frame)
        return (" A DataLoader worker must hand over plain data: a tensor with an autograd graph cannot be "
                "sent to the main process (and `default_collate` refuses to stack one). Compute it without "
                f"gradients: `with torch.no_grad(): {code}` (or return `.detach()`ed tensors).")
    if _FORK_AUTOGRAD.search(error):
        return (" Autograd's worker threads do not survive `fork`: a worker forked after the main process ran "
                "backward cannot run backward itself. Start workers with "
                "`DataLoader(..., multiprocessing_context='spawn')` (or 'forkserver'), or move this autograd "
                "work out of the dataset.")
    if _CUDA_FORK.search(error):
        return (" CUDA cannot be used in a worker started with `fork`. Keep the dataset on the CPU and move each "
                "batch in the loop (`x = x.to(device, non_blocking=True)`, with `pin_memory=True`), or start the "
                "workers with `multiprocessing_context='spawn'`.")
    if _SIZES.search(error):
        return (" The samples of one batch have different sizes, and `default_collate` stacks them (in a worker "
                "it stacks into shared memory sized for the first sample, hence a storage that cannot be resized). "
                "Pad them "
                "in a `collate_fn`: `def pad_collate(batch): xs, ys = zip(*batch); return "
                "torch.nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.stack(ys)`, then "
                "`DataLoader(..., collate_fn=pad_collate)` (a function defined at top level, so workers can "
                "use it with any start method).")
    if "found <class 'NoneType'>" in error:
        return (" A sample of this batch is `None` (a record that failed to load, returned as `None`): skip it in "
                "the dataset, or drop `None`s in a `collate_fn` before `default_collate`.")
    index = w.task.split("[", 1)[-1].split("]", 1)[0].split(",")[0] if w.task.startswith("dataset[") else ""
    return (" To step into it, load that sample in the main process: " + (f"`dataset[{index}]`" if index else
            "`DataLoader(..., num_workers=0)`") + " raises the same error with a normal traceback.")


def _raised(trace: Trace, rec: LoaderRecord, w: WorkerRecord) -> Finding:
    frame = _user_frame(w.frames)
    made, made_text = _grad_made(w) if _GRAD.search(w.error) else (None, "")
    place = frame or made
    exc_type = w.error.split(":", 1)[0] or (trace.exception.type if trace.exception else "an error")
    there = (f" {_at(place)}{_code(place)}"
             if place is not None else " inside PyTorch's own code (no line of yours was on its stack)")
    msg = (f"DataLoader worker {w.worker} raised {exc_type} while {_loading(rec, w)}{there}: "
           f"{w.error.split(': ', 1)[-1]}. The main process re-raised it as `Caught {exc_type} in DataLoader "
           f"worker process {w.worker}`, with the worker's traceback flattened into that message"
           f"{_OWN_LINE if place is not None else ''}.{made_text}{_advice(w, made or frame)}")
    return at("dataloader_worker", _where(trace, made or frame), msg,
              title=f"{exc_type} in DataLoader worker {w.worker}",
              evidence=_evidence(rec, w, error=w.error))


def _exited(trace: Trace, rec: LoaderRecord, w: WorkerRecord) -> Finding:
    frame = _user_frame(w.frames)
    code = w.exitcode
    if code is not None and code < 0:
        how = f"was killed by {_SIGNALS.get(-code, f'signal {-code}')}"
        if -code == 9:
            how += (" (on Linux usually the kernel's out-of-memory killer: every worker holds its own copy of what "
                    "it touches; fewer workers, a smaller `prefetch_factor`, or data held in NumPy arrays or "
                    "tensors rather than Python lists of objects, which each access copies)")
    else:
        how = f"exited with status {code}" if code is not None else "ended"
    if w.state == "crashed":
        how = "crashed" + (f" {_at(frame)}{_code(frame)}" if frame else "") + \
            (f" ({_SIGNALS.get(-code, '')})" if code and code < 0 else "")
    msg = (f"DataLoader worker {w.worker} (pid {w.pid}) {how} while {_loading(rec, w)}. The main process only "
           "saw it gone (torch's error names no line of yours); the worker's own output (above the error) says more. "
           "`DataLoader(..., num_workers=0)` runs the same code in the main process, where an error has a "
           "normal traceback.")
    return at("dataloader_worker", _where(trace, frame), msg, title=f"DataLoader worker {w.worker} died",
              evidence=_evidence(rec, w, exitcode=code))


def _stuck(trace: Trace, rec: LoaderRecord, w: WorkerRecord) -> Finding:
    frame = _user_frame(w.frames)
    if w.state == "could not send":
        made, made_text = _grad_made(w)
        msg = (f"The main process waits for a batch that never comes: DataLoader worker {w.worker} computed it "
               f"({w.task or 'its batch'}) but could not send it ({_first_sentence(w.error)}). "
               "multiprocessing printed that error in the worker and dropped the batch; the main process then "
               f"waits in `_get_data` forever.{made_text}{_advice(w, made)}")
        return at("dataloader_worker", _where(trace, made or frame), msg, title="A DataLoader batch was lost",
                  evidence=_evidence(rec, w, error=w.error))
    if frame is None:
        msg = (f"The main process waits in the DataLoader for worker {w.worker}'s batch, and no worker is inside "
               "your code: the batch was lost (a worker that was killed, or one that could not send its batch; "
               "the workers' output says which).")
        return at("dataloader_worker", _where(trace, None), msg, title="A DataLoader batch was lost",
                  evidence=_evidence(rec, w))
    locked = any(k in frame.code for k in ("with ", "acquire", "Lock", "lock"))
    msg = (f"DataLoader worker {w.worker} (pid {w.pid}) is stuck {_at(frame)}{_code(frame)}, "
           f"{_loading(rec, w)}; the main process is not "
           "the one that hangs: it waits for that batch in the iterator's `_get_data`.")
    if locked:
        msg += (" A lock in a forked worker is a copy of the main process's lock as it was at the fork: if another "
                "thread of the main process held it then, the copy stays locked forever (threads are not copied, "
                "so no one releases it). Do not share locks (or objects guarded by one: caches, loggers, "
                "clients) between the main process's threads and the dataset; create them in `worker_init_fn`, "
                "or start workers with `multiprocessing_context='spawn'`.")
    else:
        msg += " Its stack below says what it waits for."
    return at("dataloader_worker", _where(trace, frame), msg, title=f"DataLoader worker {w.worker} is stuck",
              evidence=_evidence(rec, w, code=_statement(frame)))


__all__ = ["dataloader_worker"]
