"""The files a DataLoader worker leaves in the run's folder, as the main process reads them
(``workers/main_side.py``; the worker writes them: ``workers/worker_side.py``): its faulthandler dumps (the line saying
which signal asks it for its stacks, the stacks, a crash's), its error records; and a task in words.

>>> ready_signal("/nonexistent/1.stacks") is None
True
>>> task_words([4, 5, 6, 7])
'batch [4, 5, 6, 7]'
"""
from __future__ import annotations

import json
import re
import signal
from typing import Any

_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
#: ``worker 0 ready 12``: the worker's handler is in, and the signal that asks for its stacks
_READY = re.compile(r"^worker \d+ ready(?: (\d+))?$", re.M)


def ready_signal(path: str) -> int | None:
    """The signal that asks the worker whose dump file is ``path`` for its stacks (its latest ready line: a
    worker whose own code took the signal moves to another), None when it has not said it is ready."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            found = _READY.findall(fh.read())
    except OSError:
        return None
    if not found:
        return None
    return int(found[-1]) if found[-1] else int(signal.SIGUSR2)


def worker_stack(text: str) -> list[tuple[str, int, str]]:
    """The worker's main thread in a faulthandler dump (the one running torch's worker loop), innermost
    first; the thread that took the signal when none is."""
    stacks: list[tuple[bool, list[tuple[str, int, str]]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            stacks.append((head.group(1) == "Current thread", []))
            continue
        m = _FRAME.match(line)
        if m and stacks:
            stacks[-1][1].append((m.group(1), int(m.group(2)), m.group(3)))
    for _, frames in stacks:
        if any(fn == "_worker_loop" for _, _, fn in frames):
            return frames
    return next((frames for current, frames in stacks if current), stacks[0][1] if stacks else [])


def fetching(stack: list[tuple[str, int, str]]) -> bool:
    """Inside a fetch (the dataset, the sampler's indices, collate), not waiting for its next task."""
    return any(fn == "fetch" and "fetch.py" in file for file, _, fn in stack)


def crash_stack(path: str) -> list[tuple[str, int, str]] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    at = text.find("Fatal Python error")
    return worker_stack(text[at:]) if at >= 0 else None


def read_errors(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return []


def task_words(indices: Any) -> str:
    """``dataset[5]`` or ``batch [4, 5, 6, 7]`` ('' unknown; an IterableDataset has no indices)."""
    if indices is None:
        return ""
    if isinstance(indices, int):
        return f"dataset[{indices}]"
    if isinstance(indices, (list, tuple)):
        if all(i is None for i in indices):
            return "the next batch of the IterableDataset"
        return f"dataset[{indices[0]}]" if len(indices) == 1 else "batch [" + ", ".join(map(str, indices)) + "]"
    return f"dataset[{indices!r}]"


__all__ = ["crash_stack", "fetching", "read_errors", "ready_signal", "task_words", "worker_stack"]
