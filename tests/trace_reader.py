"""A strict reader of the Chrome Trace Event Format (JSON object form), for the tests of the ``perfetto``
exporter: what Perfetto's and chrome://tracing's importers need, checked, then queried.

Perfetto's own trace processor reads the file too (``test_perfetto_reader.py``, in a browser); this reader
needs none and checks it strictly: every event's phase, name, process,
thread, time and arguments checked against the format, complete events (``X``) properly nested on each
thread (a viewer drops or misdraws slices that overlap partly), counters numeric, no NaN/Infinity.

>>> r = TraceReader({"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
...                                  {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 1, "dur": 2}]})
>>> [(s["name"], s["depth"]) for s in r.slices()]
[('a', 0), ('b', 1)]
"""
from __future__ import annotations

import json
import math
from typing import Any

PHASES = {"X", "B", "E", "i", "I", "C", "M", "b", "e", "n", "s", "t", "f"}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}
EPS = 1e-3  # microseconds: one nanosecond


class TraceError(AssertionError):
    pass


def _no_constants(name: str) -> Any:
    raise TraceError(f"{name} is not JSON")


class TraceReader:
    """Check ``data`` (a dict, a JSON string or a path) and answer queries over it."""

    def __init__(self, data: Any) -> None:
        if isinstance(data, str):
            if data.lstrip().startswith("{"):
                data = json.loads(data, parse_constant=_no_constants)
            else:
                with open(data, encoding="utf-8") as fh:
                    data = json.load(fh, parse_constant=_no_constants)
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise TraceError("not a trace: an object with a traceEvents list")
        if data.get("displayTimeUnit", "ms") not in ("ms", "ns"):
            raise TraceError(f"displayTimeUnit {data['displayTimeUnit']!r}")
        self.data = data
        self.events = data["traceEvents"]
        for e in self.events:
            self._check(e)
        self._slices = self._nest()

    @staticmethod
    def _check(e: Any) -> None:
        if not isinstance(e, dict) or e.get("ph") not in PHASES:
            raise TraceError(f"event without a known phase: {e!r}")
        ph = e["ph"]
        if not isinstance(e.get("name"), str):
            raise TraceError(f"event without a name: {e!r}")
        for key in ("pid", "tid"):
            if key in e and (not isinstance(e[key], int) or isinstance(e[key], bool)):
                raise TraceError(f"{key} must be an int: {e!r}")
        if "pid" not in e:
            raise TraceError(f"event without pid: {e!r}")
        if ph == "M":
            if e["name"] not in METADATA or not isinstance(e.get("args"), dict):
                raise TraceError(f"bad metadata event: {e!r}")
            return
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"bad ts: {e!r}")
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or not math.isfinite(dur) or dur < 0:
                raise TraceError(f"bad dur: {e!r}")
            if "tid" not in e:
                raise TraceError(f"slice without tid: {e!r}")
        if ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in args.values()):
                raise TraceError(f"counter args must be numbers: {e!r}")
        if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            raise TraceError(f"bad instant scope: {e!r}")
        if "args" in e and not isinstance(e["args"], dict):
            raise TraceError(f"args must be an object: {e!r}")

    def _nest(self) -> list[dict[str, Any]]:
        """Complete events per thread, sorted as viewers sort them, each with its depth; partial overlaps fail."""
        out = []
        threads: dict[tuple[int, int], list[dict]] = {}
        for e in self.events:
            if e["ph"] == "X":
                threads.setdefault((e["pid"], e["tid"]), []).append(e)
        for key, evs in threads.items():
            evs.sort(key=lambda e: (e["ts"], -e["dur"]))
            stack: list[float] = []
            for e in evs:
                start, end = e["ts"], e["ts"] + e["dur"]
                while stack and stack[-1] <= start + EPS:
                    stack.pop()
                if stack and end > stack[-1] + EPS:
                    raise TraceError(f"slice {e['name']!r} at {start} overlaps its parent's end {stack[-1]} "
                                     f"on thread {key}")
                out.append({**e, "depth": len(stack)})
                stack.append(end)
        return out

    # ------------------------------------------------------------------ queries
    def slices(self, cat: str | None = None, pid: int | None = None) -> list[dict[str, Any]]:
        return [s for s in self._slices if (cat is None or s.get("cat") == cat) and (pid is None or s["pid"] == pid)]

    def counter(self, name: str, key: str, pid: int | None = None) -> list[tuple[float, float]]:
        """(ts, value) of one series of a counter track."""
        return sorted((e["ts"], e["args"][key]) for e in self.events
                      if e["ph"] == "C" and e["name"] == name and (pid is None or e["pid"] == pid))

    def instants(self, pid: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ph"] in ("i", "I") and (pid is None or e["pid"] == pid)]

    def processes(self) -> dict[int, str]:
        return {e["pid"]: e["args"]["name"] for e in self.events if e["ph"] == "M" and e["name"] == "process_name"}

    def threads(self, pid: int) -> dict[int, str]:
        return {e["tid"]: e["args"]["name"] for e in self.events
                if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}
