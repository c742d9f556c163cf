"""The DataLoader workers behind a ``dataloader_worker`` finding, for the text and HTML reports: each
worker that raised, died or was photographed in a hang, with what it was loading and its stack (the
frames from torch's worker loop inward: the worker's own code, not the main process's).

>>> from backward_doctor.trace.records import Trace
>>> from backward_doctor.trace.stacks import FrameInfo, LoaderRecord, WorkerRecord
>>> t = Trace(loaders=[LoaderRecord("DataLoader(DS, num_workers=2)", workers=[WorkerRecord(
...     0, pid=7, state="fetching", task="dataset[3]", frames=[FrameInfo("/a/ds.py", 9, "DS.__getitem__",
...     user=True, code="with lock:")])])])
>>> print("\\n".join(worker_lines(t)))
DataLoader workers: DataLoader(DS, num_workers=2)
  worker 0 (pid 7), fetching dataset[3]:
    ds.py:9 in DS.__getitem__: with lock:
"""
from __future__ import annotations

from ..trace.records import Trace
from ..trace.stacks import FrameInfo, LoaderRecord, WorkerRecord
from .style import esc
from .wording import frame_label

_SHOWN = 8


def _frames(w: WorkerRecord) -> list[FrameInfo]:
    """The worker's frames from torch's worker loop inward (the innermost few)."""
    frames = w.frames
    start = next((i for i, f in enumerate(frames) if f.function.endswith("_worker_loop")), 0)
    return frames[start:][-_SHOWN:]


def _head(w: WorkerRecord) -> str:
    """``worker 1 (pid 42), raised loading dataset[13]``."""
    what = {"fetching": "fetching", "idle": "idle, waiting for its next task", "raised": "raised",
            "could not send": "could not send", "exited": "exited", "crashed": "crashed"}
    head = f"worker {w.worker}" + (f" (pid {w.pid})" if w.pid else "") + f", {what.get(w.state, w.state)}"
    if w.state in ("fetching", "could not send"):
        head += f" {w.task}" if w.task else " its batch"
    elif w.task:
        head += f" loading {w.task}"
    if w.waited_on:
        head += " (the main process waited for this batch)"
    return head


def _duplicated(rec: LoaderRecord) -> str:
    """``of its first 16 batches, 8 were equal to a batch another worker delivered`` ('': none counted)."""
    return (f"of its first {rec.batches_checked} batches, {rec.duplicated} were equal to a batch another worker "
            "delivered") if rec.duplicated else ""


def worker_lines(trace: Trace, places: dict[str, str] | None = None) -> list[str]:
    """The workers as text lines (nothing when the run started none that went wrong)."""
    out: list[str] = []
    for rec in trace.loaders:
        out.append(f"DataLoader workers: {rec.loader}")
        if rec.duplicated:
            out.append(f"  {_duplicated(rec)}")
        for w in rec.workers:
            out.append(f"  {_head(w)}:")
            if w.error:
                out.append(f"    error: {w.error.splitlines()[0][:200]}")
            for fi in _frames(w):
                out.append(f"    {frame_label(fi, places)} in {fi.function}: {fi.code}")
            made = [f for f in w.made_at if f.user][-1:]
            for fi in made:
                out.append(f"    (its tensor's graph was made at {frame_label(fi, places)} in {fi.function}: "
                           f"{fi.code})")
    return out


def workers_html(trace: Trace, places: dict[str, str] | None = None) -> str:
    """The same as HTML blocks, one per worker."""
    out = []
    for rec in trace.loaders:
        out.append(f"<div><b>DataLoader workers</b> of <code>{esc(rec.loader)}</code> (innermost last)</div>")
        if rec.duplicated:
            out.append(f'<div class="muted">{esc(_duplicated(rec))}</div>')
        for w in rec.workers:
            rows = "".join(f"<div>{esc(frame_label(fi, places))} in {esc(fi.function)}: <code>{esc(fi.code)}</code>"
                           "</div>" for fi in _frames(w))
            if w.error:
                rows = f'<div class="muted">{esc(w.error.splitlines()[0][:200])}</div>' + rows
            out.append(f'<div class="src"><div class="cap">{esc(_head(w))}</div>'
                       f'<div style="padding:2px 8px">{rows}</div></div>')
    return "".join(out)


__all__ = ["worker_lines", "workers_html"]
