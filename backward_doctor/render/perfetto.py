"""The ``perfetto`` renderer: a report as a Chrome/Perfetto trace (JSON ``traceEvents``), opened by
ui.perfetto.dev and chrome://tracing.

One process per run (a distributed report: one per rank, on one clock); on its ``ops`` thread one slice
per recorded op (name, module, line, tensors in ``args``) inside the slices of its phase and of its
loop iteration (a sampled loop whose NaN/Inf iteration was replayed: every iteration the loop recorded, then
the replay, ``iteration k (replayed)``); counter tracks of live memory by category and in all (``live
bytes``; the report's timeline, so their peak is the report's peak); instants where NaN/Inf was first made,
where memory ran out and at the finding's op; a rank's collectives on its ``collectives`` thread. Times are
the ops' own start times (microseconds since the capture started; a report saved before they were recorded
lays its ops end to end).

>>> import json
>>> from backward_doctor.report import Report
>>> from backward_doctor.report.renderers import renderer
>>> events = json.loads(renderer("perfetto").render(Report()))["traceEvents"]
>>> sorted({e["ph"] for e in events})
['M']
"""
from __future__ import annotations

import bisect
import json
import os
from typing import Any

from ..report.places import CELL, where_label
from ..report.renderers import Renderer, register
from ..report.schema import ReportError
from ..trace.parts import Iterations
from ..trace.records import CATEGORIES, OpRecord, Trace
from .view import offending_record

OPS, COLLECTIVES = 1, 2  # thread ids in each process
MAX_US = 1e15  # ~30 years: past it a time is no run's (and its nanoseconds overflow what readers hold)


def _times(ops: list[OpRecord], offset: float = 0.0) -> list[tuple[int, int]]:
    """(start, duration) of each op in whole nanoseconds, ``offset`` (microseconds) added; laid end to end
    when no start was recorded (a report saved before starts were). Each op starts no earlier than the
    previous one ended, and the spans around them are computed in the same integers, so the viewers nest
    the phases' and iterations' slices around the ops exactly."""
    end_to_end = len(ops) > 1 and not any(op.start_us for op in ops)
    out, prev_end = [], _ns(offset, "the run's start")
    for k, op in enumerate(ops):
        dur = _ns(max(op.duration_us, 0.0), f"trace.ops[{k}].duration_us")
        ts = prev_end if end_to_end else max(_ns(op.start_us + offset, f"trace.ops[{k}].start_us"), prev_end)
        out.append((ts, dur))
        prev_end = ts + dur
    return out


def _ns(us: float, what: str) -> int:
    """Microseconds as whole nanoseconds; ``ReportError`` for a time no trace holds (a crafted report's 1e308)."""
    if not -MAX_US <= us <= MAX_US:
        raise ReportError(f"{what}: {us:g} microseconds is past the times a trace holds")
    return round(us * 1000)


def _us(ns: int) -> float:
    return ns / 1000


def _spans(keys: list[Any], times: list[tuple[int, int]]) -> list[tuple[Any, int, int]]:
    """Runs of equal consecutive keys (None: no span) as (key, start, end)."""
    spans: list[tuple[Any, int, int]] = []
    for key, (ts, dur) in zip(keys, times):
        if spans and spans[-1][0] == key:
            spans[-1] = (key, spans[-1][1], max(spans[-1][2], ts + dur))
        else:
            spans.append((key, ts, ts + dur))
    return [s for s in spans if s[0] is not None]


def process_events(report: Any, trace: Trace, places: dict[str, str], pid: int, name: str,
                   offset: float = 0.0) -> list[dict[str, Any]]:
    """The events of one run as process ``pid`` (``offset``: microseconds added to its times). A loop whose
    NaN/Inf iteration was replayed after it (``trace.sampled``): the loop's recorded iterations at their own
    times, then the replayed iteration when it ran (after the run), which the counters and instants are on."""
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": OPS, "args": {"name": "ops"}}]
    its = trace.iterations
    sampled = trace.sampled.ops if trace.sampled is not None else []
    if sampled:
        first = _times(sampled, offset)
        ev += _slices(sampled, first, [_recorded_iteration(its, op.index) for op in sampled], places, pid, its)
        run_end = first[-1][0] + first[-1][1]
        if trace.sampled.started_at and trace.started_at:  # (the replay on the run's clock, never inside it)
            offset += (trace.started_at - trace.sampled.started_at) * 1e6
        offset = max(offset, _us(run_end))
    ops = trace.ops
    times = _times(ops, offset)
    at = {op.index: (_us(ts), _us(dur)) for op, (ts, dur) in zip(ops, times)}
    ev += _slices(ops, times, [its.iteration_of(op.index) for op in ops], places, pid, its,
                 replayed=its.replayed)
    ev += _memory_counters(trace, at, pid)
    ev += _instants(report, trace, at, pid, _us(times[-1][0] + times[-1][1]) if times else offset)
    return ev


def _recorded_iteration(its: Iterations, index: int) -> int | None:
    """The recorded iteration of the loop's own run that op ``index`` ran in (``iterations.starts``), whatever
    iteration was replayed; None where the report does not say."""
    k = bisect.bisect_right(its.starts, index) - 1
    return its.recorded[max(0, k)] if its.starts and max(0, k) < len(its.recorded) else None


def _slices(ops: list[OpRecord], times: list[tuple[int, int]], iteration: list[int | None], places: dict[str, str],
            pid: int, its: Iterations, replayed: int | None = None) -> list[dict[str, Any]]:
    """One slice per op inside a slice per phase run inside a slice per iteration (``args.loop``: its loop
    variables; ``replayed``: the iteration run again after the loop, named so)."""
    ev: list[dict[str, Any]] = []
    for it, start, end in _spans(iteration, times):
        again = it is not None and it == replayed
        ev.append({"ph": "X", "cat": "iteration", "name": f"iteration {it}" + (" (replayed)" if again else ""),
                   "pid": pid, "tid": OPS, "ts": _us(start), "dur": _us(end - start),
                   "args": {"iteration": it, "loop": its.values.get(str(it), ""), "replayed": again}})
    for (_, phase), start, end in _spans(list(zip(iteration, (op.phase for op in ops))), times):
        ev.append({"ph": "X", "cat": "phase", "name": phase, "pid": pid, "tid": OPS, "ts": _us(start),
                   "dur": _us(end - start)})
    for op, (ts, dur) in zip(ops, times):
        ev.append({"ph": "X", "cat": "op", "name": op.op, "pid": pid, "tid": OPS, "ts": _us(ts), "dur": _us(dur),
                   "args": {"index": op.index, "phase": op.phase, "module": op.where.module or "",
                            "line": where_label(places, op.where), "inputs": [m.short() for m in op.inputs],
                            "outputs": [m.short() for m in op.outputs], "live_bytes": op.live_bytes}})
    return ev


def _memory_counters(trace: Trace, at: dict[int, tuple[float, float]], pid: int) -> list[dict[str, Any]]:
    """Live bytes by category after each op of the timeline (an op not kept one by one has no time: left out),
    and the peak's own sample when the timeline merged it away."""
    mem = trace.memory
    samples = [(i, {c: mem.by_category.get(c, [0] * (k + 1))[k] for c in CATEGORIES})
               for k, i in enumerate(mem.op_index)]
    if mem.peak_index is not None and mem.peak_by_category and mem.peak_index not in mem.op_index:
        samples.append((mem.peak_index, {c: mem.peak_by_category.get(c, 0) for c in CATEGORIES}))
    out = []
    for index, by_cat in samples:
        t = at.get(index)
        if t is None:
            continue
        ts = t[0] + t[1]
        out.append({"ph": "C", "name": "memory by category", "pid": pid, "tid": 0, "ts": ts, "args": by_cat})
        # (a JSON counter's track is its name and its series: "live" with "bytes" reads "live bytes" in Perfetto)
        out.append({"ph": "C", "name": "live", "pid": pid, "tid": 0, "ts": ts,
                    "args": {"bytes": sum(by_cat.values())}})
    out.sort(key=lambda e: e["ts"])
    return out


def _instants(report: Any, trace: Trace, at: dict[int, tuple[float, float]], pid: int,
              end: float) -> list[dict[str, Any]]:
    marks: list[tuple[int | None, str, dict[str, Any]]] = []
    origin = next((e for e in trace.nonfinite if e.is_origin), None)
    if origin is not None:
        marks.append((origin.index, f"first NaN/Inf: {origin.op}", {"op": origin.op, "index": origin.index}))
    oom = trace.exception.oom if trace.exception is not None else None
    if oom is not None:
        marks.append((oom.index, "out of memory", {"requested": oom.requested or 0, "live": oom.live,
                                                   "simulated": oom.simulated}))
    top = getattr(report, "root_cause", None)
    if top is not None and getattr(report, "trace", None) is trace:
        rec, _, _ = offending_record(report)
        marks.append((rec.index if rec is not None else None, f"finding: {top.kind}",
                      {"title": top.title or top.kind, "line": top.location() if hasattr(top, "location") else ""}))
    out = []
    for index, name, args in marks:
        t = at.get(index) if index is not None else None
        out.append({"ph": "i", "s": "t", "cat": "mark", "name": name, "pid": pid, "tid": OPS,
                    "ts": t[0] if t is not None else end, "args": args})
    return out


def _collective_events(rank: Any, pid: int, t0: float, end: float) -> list[dict[str, Any]]:
    out = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": COLLECTIVES, "args": {"name": "collectives"}}]
    for c in rank.collectives:
        if not c.start_s:
            continue
        ts = (c.start_s - t0) * 1e6
        stop = (c.end_s - t0) * 1e6 if c.end_s else max(end, ts)  # still inside it when the rank stopped
        out.append({"ph": "X", "cat": "collective", "name": c.op, "pid": pid, "tid": COLLECTIVES, "ts": ts,
                    "dur": max(0.0, stop - ts), "args": {"call": c.label(), "seq": c.seq, "count": c.count,
                                                         "pending": c.pending, "error": c.error}})
    return out


def trace_events(report: Any) -> dict[str, Any]:
    """The whole trace as a dict (``traceEvents`` and what the doctor adds in ``otherData``)."""
    if not hasattr(report, "ranks"):
        events = process_events(report, report.trace, report.places, 1, report.places.get(CELL, "the cell"))
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": _other(report.trace)}
    name = os.path.basename(report.script) if report.script else "the script"
    starts = [_start(r.trace) for r in report.ranks if r.trace is not None and _start(r.trace)]
    starts += [c.start_s for r in report.ranks for c in r.collectives if c.start_s]
    t0 = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for r in report.ranks:
        pid = r.rank + 1
        if r.trace is not None:
            offset = (_start(r.trace) - t0) * 1e6 if _start(r.trace) and t0 else 0.0
            events += process_events(report, r.trace, {CELL: name}, pid, f"rank {r.rank}: {r.ended()}", offset)
            end = offset + r.trace.duration_s * 1e6
        else:
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"rank {r.rank}: {r.ended()}"}})
            end = r.duration_s * 1e6
        events += _collective_events(r, pid, t0, end)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"ranks": len(report.ranks), "findings": [f.kind for f in report.findings]}}


def _start(trace: Trace) -> float:
    """When the run began (its loop's own start when one iteration was replayed after it)."""
    return trace.sampled.started_at if trace.sampled is not None and trace.sampled.started_at else trace.started_at


def _other(trace: Trace) -> dict[str, Any]:
    return {"ops": len(trace.ops), "sampled_ops": len(trace.sampled.ops) if trace.sampled is not None else 0,
            "op_count": trace.op_count, "peak_bytes": trace.memory.peak_bytes,
            "engine": trace.engine, "torch": trace.torch_version}


@register
class PerfettoRenderer(Renderer):
    """Chrome/Perfetto trace JSON."""

    name, suffix = "perfetto", ".json"

    def render(self, report: Any) -> str:
        """The trace as strict JSON; ``ReportError`` (one line) when a number of the report is past what one
        holds (a crafted report's 1e308 seconds, multiplied into microseconds: no ``Infinity`` is written)."""
        try:
            return json.dumps(trace_events(report), separators=(",", ":"), allow_nan=False)
        except (ValueError, OverflowError) as exc:
            if isinstance(exc, ReportError):
                raise
            raise ReportError(f"the report holds a number past what a trace holds ({exc})") from None


__all__ = ["PerfettoRenderer", "process_events", "trace_events"]
