"""The ``memory_viz`` renderer: a report as the memory snapshot PyTorch's viewers read
(pytorch.org/memory_viz, ``python -m torch.cuda._memory_viz``), made from the doctor's own ledger.

A CUDA run's allocator history exists only on the device; this snapshot is made from what the ledger
counted, so a CPU run or a simulated device (``memory_limit``) opens in the same viewers. The format is
``torch.cuda.memory._snapshot()``'s: ``segments`` (the state at the end) and ``device_traces`` (``alloc``,
``free_requested``/``free_completed``, ``oom`` entries with ``addr``, ``size``, ``stream`` and ``frames`` of
``{filename, line, name}``). Each entry's frames say where the storage was made as the frontend names the
place (``Cell In[2]``, the op), its module and its category (``parameter``, ``gradient``,
``optimizer_state``, ``activation``, ``temporary``), innermost first, so the viewer's stack and a flame
graph group memory by category, then by line; ``category`` also colours the timeline.

Addresses are laid out by this exporter (first fit among the lowest :data:`FIRST_FIT_SCAN` free blocks
of one segment, else at its end; exact sizes): the Active Memory Timeline is exact; the segment views
show a plain allocator's packing, not a device's. Only the recorded ops' storages are in it (a sampled
loop's recorded iterations; the trace's first ``STORAGE_EVENTS_CAP`` events). Plain ints below 2**53 and
pickle protocol 4: the viewer's JavaScript unpickler reads nothing else. A distributed report has one device per rank.

A saved report is untrusted: a CUDA run's own snapshot (``trace.memory.cuda.allocator_snapshot``) is never
passed through as it is. Its pickle must hold plain data only (:data:`PLAIN_OPCODES`: dicts, lists, tuples,
strings, bytes, numbers, booleans, None; no opcode that imports, calls or builds an object), it is read as
plain data and written out again by this exporter; anything else is refused (``ReportError``, one line),
as is a ledger whose sizes pass :data:`MAX_ADDRESS`. The replay's work is bounded per event
(:data:`FIRST_FIT_SCAN`), whatever a crafted ledger asks of it.

>>> import pickle
>>> from backward_doctor.report import Report
>>> from backward_doctor.trace.parts import StorageEvents
>>> r = Report()
>>> r.trace.memory.storages = StorageEvents(flat=[1, 0, 4096, 0, -1, 1, 1, 512, 3, 0, 0, 1, 512, 3, 1])
>>> snap = pickle.loads(renderer("memory_viz").render(r))
>>> [(e["action"], e["size"], e["category"]) for e in snap["device_traces"][0]][:3]
[('alloc', 4096, 'parameter'), ('alloc', 512, 'activation'), ('free_requested', 512, 'activation')]
>>> [(b["state"], b["size"]) for b in snap["segments"][0]["blocks"]]
[('active_allocated', 4096), ('inactive', 512)]
"""
from __future__ import annotations

import base64
import binascii
import bisect
import io
import os
import pickle
import pickletools
from typing import Any

from ..report.places import CELL
from ..report.renderers import Renderer, register, renderer
from ..report.schema import ReportError
from ..trace.records import Trace

#: the doctor's categories as the viewers name them (torch.profiler's memory categories, lower case)
LABELS = ("parameter", "gradient", "optimizer_state", "activation", "temporary")
BASE = 0x100000  # where the exporter's one segment starts (addresses stay small, plain ints)
#: how many free blocks (lowest addresses first) an allocation looks at before it takes room at the end: a
#: real step's ledger leaves far fewer holes; a crafted one with 50,000 holes cost 50,000 looks per event
FIRST_FIT_SCAN = 256
#: the largest address or size the viewer's JavaScript reads exactly (and more than any device holds)
MAX_ADDRESS = 2 ** 53
#: the largest allocator snapshot a report holds (``capture/recorder/cuda.py`` keeps none larger)
MAX_SNAPSHOT_BYTES = 16 << 20
#: pickle opcodes of plain data and its memo (protocols 2-4): all PyTorch's allocator snapshot holds. None
#: names a global (GLOBAL, STACK_GLOBAL, EXT1-4), calls (REDUCE, INST, OBJ, NEWOBJ, NEWOBJ_EX) or builds
#: (BUILD) an object, or asks the loader for one (PERSID, BINPERSID).
PLAIN_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1",
    "LONG4", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES",
    "BINBYTES8", "EMPTY_LIST", "LIST", "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET"})
_SNAPSHOT_FIELD = "trace.memory.cuda.allocator_snapshot"


class _FirstFit:
    """A first-fit allocator over one growing segment: where each block goes, and how far it reached."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (addr, size), sorted, merged
        self.end = BASE

    def alloc(self, size: int) -> int:
        for i in range(min(len(self.free), FIRST_FIT_SCAN)):  # (bounded: see FIRST_FIT_SCAN)
            addr, room = self.free[i]
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (addr + size, room - size)
                return addr
        if self.free and self.free[-1][0] + self.free[-1][1] == self.end:  # grow the free tail
            addr = self.free.pop()[0]
        else:
            addr = self.end
        self.end = addr + size
        return addr

    def release(self, addr: int, size: int) -> None:
        i = bisect.bisect(self.free, (addr, size))
        if i < len(self.free) and addr + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i and self.free[i - 1][0] + self.free[i - 1][1] == addr:
            addr, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (addr, size))


def _frames(trace: Trace, places: dict[str, str], op: int, category: str, cache: dict) -> list[dict[str, Any]]:
    """Innermost first: the user's line (named as the frontend names it) and the op, a second frame for
    the cell line when the first is in another file, the module, the category."""
    key = (op, category)
    got = cache.get(key)
    if got is not None:
        return got
    rec = trace.op(op) if op >= 0 else None
    frames: list[dict[str, Any]] = []
    if rec is None:
        what = "made before the step" if op < 0 else "made by an op not kept one by one"
        frames.append({"filename": "(no recorded op)", "line": 0, "name": what})
    else:
        w = rec.where
        name = places.get(CELL if w.file is None else w.file) or \
            (places.get(CELL, "the cell") if w.file is None else os.path.basename(w.file))
        frames.append({"filename": name, "line": int(w.line or 0), "name": f"{rec.op} ({rec.phase})"})
        if w.file is not None and w.cell_line is not None:
            frames.append({"filename": places.get(CELL, "the cell"), "line": int(w.cell_line),
                           "name": w.function or "<cell>"})
        if w.module:
            frames.append({"filename": "module", "line": 0, "name": w.module})
    frames.append({"filename": "category", "line": 0, "name": category})
    cache[key] = frames
    return frames


def device_trace(trace: Trace, places: dict[str, str], device: int = 0) -> tuple[list[dict], dict | None]:
    """One device's entries and its segment at the end (None: nothing was counted)."""
    events = trace.memory.storages.events()
    final_cat: dict[int, int] = {}
    for action, number, _, cat, _ in events:
        if action != 0:
            final_cat[number] = cat
    oom = trace.exception.oom if trace.exception is not None else None
    oom_at = None if oom is None else (oom.index if oom.index is not None else trace.op_count)
    space, cache = _FirstFit(), {}
    live: dict[int, tuple[int, int, list]] = {}  # number -> (addr, size, frames)
    out: list[dict[str, Any]] = []

    def add_oom() -> None:
        nonlocal oom_at
        requested = int(oom.requested or 0)
        limit = trace.memory.limit_bytes
        free = max(0, int(limit) - (oom.live - requested if oom.simulated else oom.live)) if limit else 0
        out.append({"action": "oom", "addr": 0, "size": requested, "stream": 0, "device_free": free,
                    "frames": _frames(trace, places, oom_at, "temporary", {})})
        oom_at = None

    for action, number, size, _, op in events:
        if oom_at is not None and op > oom_at:
            add_oom()
        cat = final_cat.get(number, 4)
        category = LABELS[cat] if 0 <= cat < len(LABELS) else LABELS[4]
        if action == 1:
            frames = _frames(trace, places, op, category, cache)
            if not 0 <= size < MAX_ADDRESS - space.end:
                raise ReportError(f"trace.memory.storages: a storage of {size:,} bytes (after "
                                  f"{space.end - BASE:,} bytes) is past what a memory snapshot holds")
            addr = space.alloc(size)
            live[number] = (addr, size, frames)
            out.append({"action": "alloc", "addr": addr, "size": int(size), "stream": 0, "frames": frames,
                        "category": category})
        elif action == 0 and number in live:
            addr, size, frames = live.pop(number)
            space.release(addr, size)
            for what in ("free_requested", "free_completed"):
                out.append({"action": what, "addr": addr, "size": int(size), "stream": 0, "frames": frames,
                            "category": category})
    if oom_at is not None:
        add_oom()
    if out:
        # The viewer's legend code expects an 'unknown' category among those it saw (else it fails): the
        # closing 'snapshot' entry, as CUDA's allocator writes one when a snapshot is taken, carries it.
        out.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [], "category": "unknown"})
    if space.end == BASE:
        return out, None
    blocks, at = [], BASE
    for addr, size, frames in sorted(live.values(), key=lambda b: b[0]):
        if addr > at:
            blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive",
                           "frames": []})
        blocks.append({"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                       "frames": frames})
        at = addr + size
    if at < space.end:
        blocks.append({"address": at, "size": space.end - at, "requested_size": 0, "state": "inactive",
                       "frames": []})
    allocated = sum(b[1] for b in live.values())
    segment = {"device": device, "address": BASE, "total_size": space.end - BASE, "allocated_size": allocated,
               "active_size": allocated, "requested_size": allocated, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}
    return out, segment


def snapshot(report: Any) -> dict[str, Any]:
    """The snapshot as a dict (a distributed report: one device per rank, in rank order)."""
    if hasattr(report, "ranks"):
        name = os.path.basename(report.script) if report.script else "the script"
        parts = [(r.trace, {CELL: name}) if r.trace is not None else (None, {}) for r in report.ranks]
    else:
        parts = [(report.trace, report.places)]
    snap: dict[str, Any] = {"segments": [], "device_traces": []}
    for device, (trace, places) in enumerate(parts):
        events, segment = device_trace(trace, places, device) if trace is not None else ([], None)
        snap["device_traces"].append(events)
        if segment is not None:
            snap["segments"].append(segment)
    return snap


def allocator_snapshot(report: Any) -> bytes | None:
    """A CUDA run's own allocator history, as the capture kept it (None: none was kept), checked and written
    out again as plain data (:func:`plain_snapshot`): ``ReportError`` when it is anything else."""
    cuda = getattr(getattr(report, "trace", None), "memory", None)
    kept = (cuda.cuda or {}).get("allocator_snapshot") if cuda is not None else None
    if kept is None or kept == "":
        return None
    if not isinstance(kept, str) or len(kept) > MAX_SNAPSHOT_BYTES * 4 // 3 + 4:
        raise ReportError(f"{_SNAPSHOT_FIELD}: not a snapshot this exporter writes (a base64 string of at most "
                          f"{MAX_SNAPSHOT_BYTES:,} bytes)")
    try:
        raw = base64.b64decode(kept, validate=True)
    except (binascii.Error, ValueError):
        raise ReportError(f"{_SNAPSHOT_FIELD}: not base64") from None
    return plain_snapshot(raw)


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain data only (a second lock: :func:`plain_snapshot` lets no opcode through that gets here)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def plain_snapshot(raw: bytes) -> bytes:
    """A memory snapshot's pickle, checked opcode by opcode before anything is loaded (:data:`PLAIN_OPCODES`),
    loaded as plain data, checked to be a snapshot (a dict with ``segments`` and ``device_traces`` lists)
    and pickled again by this exporter; ``ReportError`` (one line) otherwise. Nothing of ``raw`` is passed on
    as it is.

    >>> import pickle, os
    >>> plain_snapshot(pickle.dumps({"segments": [], "device_traces": [[]]})) == pickle.dumps(
    ...     {"segments": [], "device_traces": [[]]}, protocol=4)
    True
    >>> plain_snapshot(pickle.dumps({"segments": [], "device_traces": [], "x": os.system}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    backward_doctor.report.schema.ReportError: trace.memory.cuda.allocator_snapshot: refused: ... STACK_GLOBAL at byte ...
    """
    if len(raw) > MAX_SNAPSHOT_BYTES:
        raise ReportError(f"{_SNAPSHOT_FIELD}: {len(raw):,} bytes, more than the {MAX_SNAPSHOT_BYTES:,} a snapshot "
                          "may have")
    try:
        for op, arg, pos in pickletools.genops(raw):
            if op.name not in PLAIN_OPCODES:
                raise ReportError(f"{_SNAPSHOT_FIELD}: refused: a snapshot holds plain data only, and this pickle "
                                  f"would import or call code when opened (opcode {op.name} at byte {pos})")
            if op.name == "PROTO" and not 2 <= arg <= 4:
                raise ReportError(f"{_SNAPSHOT_FIELD}: refused: pickle protocol {arg} (a snapshot is written with "
                                  "2 to 4)")
        data = _PlainUnpickler(io.BytesIO(raw)).load()
        if not (isinstance(data, dict) and isinstance(data.get("segments"), list)
                and isinstance(data.get("device_traces"), list)):
            raise ReportError(f"{_SNAPSHOT_FIELD}: not a memory snapshot (a dict of 'segments' and "
                              "'device_traces' lists)")
        return pickle.dumps(data, protocol=4)
    except ReportError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other way the bytes fail to read: refused in one line
        raise ReportError(f"{_SNAPSHOT_FIELD}: not a readable pickle ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:120]})") from None


@register
class MemoryVizRenderer(Renderer):
    """The snapshot pickle (bytes): the real allocator history on CUDA, else made from the ledger."""

    name, suffix, binary = "memory_viz", ".pickle", True

    def render(self, report: Any) -> bytes:
        real = allocator_snapshot(report)
        if real is not None:
            return real
        return pickle.dumps(snapshot(report), protocol=4)  # (the viewer's unpickler reads protocols 2-4)


__all__ = ["LABELS", "MemoryVizRenderer", "device_trace", "plain_snapshot", "snapshot"]
