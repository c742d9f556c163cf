"""The view model of a report: what every renderer (text, HTML page, widget panel) shows, as plain
data (no HTML, no widgets): the verdict, the offending op and its tensors, memory by module, the ops
table's rows, the fixes that apply, the source lines around a place.

>>> from backward_doctor.report import Report
>>> verdict_parts(Report())[:2]
('ok', 'OK')
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..analysis.findings import forward_where
from ..analysis.rules.hang import own_thread, worth_naming
from ..report.places import line_label
from ..trace.queries import is_bookkeeping, source_lines
from ..trace.records import OpRecord, TensorMeta, Trace, Where
from .style import CATEGORY_LABELS
from .wording import finding_title, ok_headline, original_verdict

if TYPE_CHECKING:
    from ..report.report import Report


FIX_INFO = {
    "accumulate": ("Gradient accumulation",
                   "Split the batch into k micro-batches and step once: the same effective batch, "
                   "about 1/k of the activations."),
    "amp": ("Mixed precision (AMP)",
            "Run forward under autocast: 16-bit activations, fp32 master weights."),
    "checkpoint": ("Activation checkpointing",
                   "Keep activations only at module boundaries and recompute the rest in backward."),
    "sync": ("Synchronous replay",
             "Re-run with synchronous kernel launches to find the op that really failed."),
}


# --------------------------------------------------------------------------- derivations
#: the most bytes a tensor is counted as: past any device (a saved report's shape is untrusted: a product of
#: 100,000 dimensions of 2**64 is a 6-million-bit integer, seconds per multiplication, never a tensor)
MAX_TENSOR_BYTES = 2 ** 62


def tensor_bytes(m: TensorMeta) -> int:
    """Bytes of a tensor from its metadata (4 bytes an element when the dtype is unknown), at most
    :data:`MAX_TENSOR_BYTES` (the product stops growing there: the work is one small multiplication per
    dimension); a dimension of 0 (or below) makes it 0.

    >>> from backward_doctor.trace.records import TensorMeta
    >>> tensor_bytes(TensorMeta([2, 3], "float16", "cpu")), tensor_bytes(TensorMeta([2 ** 64] * 9 + [0], "x", "cpu"))
    (12, 0)
    >>> tensor_bytes(TensorMeta([2 ** 64 - 1] * 100_000, "float32", "cpu")) == MAX_TENSOR_BYTES
    True
    """
    n = _ITEMSIZE.get(m.dtype, 4)
    for s in m.shape:
        s = int(s)
        if s <= 0:
            return 0
        n = min(n * s, MAX_TENSOR_BYTES)
    return n


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8}


def first_sentence(text: str) -> str:
    """The first sentence of a message (code spans in backticks are not split)."""
    depth, out = False, []
    for i, ch in enumerate(text):
        if ch == "`":
            depth = not depth
        out.append(ch)
        if ch in ".:" and not depth and (i + 1 == len(text) or text[i + 1] == " ") and i > 20:
            break
    s = "".join(out).strip()
    return s[:-1] + "." if s.endswith(":") else s


def phase_counts(trace: Trace) -> dict[str, int]:
    return dict(Counter(op.phase for op in trace.ops))


def offending_record(report: "Report") -> tuple[OpRecord | None, list[TensorMeta], list[TensorMeta]]:
    """The op behind the top finding, with the richest inputs/outputs we have (stats when known)."""
    tr = report.trace
    f = report.root_cause
    if f is None:
        return None, [], []
    if f.kind == "nonfinite":
        ev = next((e for e in tr.nonfinite if e.is_origin and e.reached), None)
        if ev is not None:
            rec = tr.op(ev.index)
            return rec, ev.inputs, [ev.output] if ev.output else (rec.outputs if rec else [])
    if f.kind == "oom" and tr.exception and tr.exception.oom:
        rec = tr.op(tr.exception.oom.index)
        if rec is not None:
            return rec, rec.inputs, rec.outputs
    failed = tr.failed_op
    if failed is not None and (f.op is None or f.op == failed.op):
        rec = tr.op(failed.index)
        return rec, failed.inputs, rec.outputs if rec else []
    if f.kind == "inplace":
        idx = next((e.index for e in tr.inplace if e.op == f.op and e.where.line == f.line), None)
        rec = tr.op(idx)
        if rec is not None:
            return rec, rec.inputs, rec.outputs
    if f.op:
        cands = [op for op in tr.ops if op.op == f.op]
        hit = [op for op in cands if forward_where(tr, op).line == f.line] or cands
        if hit:
            return hit[0], hit[0].inputs, hit[0].outputs
    return None, [], []


def memory_by_module(trace: Trace) -> tuple[dict[str, int], str]:
    """Bytes by module at the memory peak, and how they were obtained.

    An OOM carries the ledger's exact breakdown. Otherwise tensors made in the
    forward pass are attributed to the module that made them, counted live at the
    peak when something used them at or after it (from the data flow; a lower
    bound), next to the exact parameter, gradient and optimizer-state bytes; the
    rest of the peak is shown as one remainder.
    """
    exc = trace.exception
    if exc is not None and exc.oom and exc.oom.by_module:
        return dict(exc.oom.by_module), "at the out-of-memory point (exact, from the memory ledger)"
    peak = trace.memory.peak_index
    if peak is None or not trace.ops:
        return {}, ""
    made: dict[int, tuple[int, str, int]] = {}  # key -> (index made, module, bytes)
    last_use: dict[int, int] = {}
    for op in trace.ops:
        for k in op.in_keys:
            if k in made:
                last_use[k] = op.index
        if op.phase != "forward" or op.index > peak:
            continue
        for k, m in zip(op.out_keys, op.outputs):
            if not k or k in op.in_keys or k in made and last_use.get(k, -1) >= op.index:
                continue  # in place, a view, or the same storage again
            made[k] = (op.index, op.where.module or "(outside modules)", tensor_bytes(m))
            last_use[k] = op.index
    out: dict[str, int] = defaultdict(int)
    for k, (i, lab, nbytes) in made.items():
        if i <= peak <= last_use.get(k, i):
            out[lab] += nbytes
    cats = trace.memory.peak_by_category or {}
    for c in ("parameters", "gradients", "optimizer"):
        if cats.get(c):
            out[f"({CATEGORY_LABELS[c]})"] = cats[c]
    rest = trace.memory.peak_bytes - sum(out.values())
    if rest > 0:
        out["(other live tensors)"] = rest
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    return out, "at the peak (forward tensors by module, estimated from data flow)"


def _module_label(trace: Trace, op: OpRecord) -> str:
    if op.phase == "backward":
        w = forward_where(trace, op)
        return f"{w.module} (gradients)" if w.module else "(gradients outside modules)"
    if op.phase == "optimizer":
        return "(optimizer step)"
    return op.where.module or "(outside modules)"


@dataclass
class OpRow:
    name: str
    count: int
    time_us: float
    alloc_bytes: int
    where: str = ""


def op_rows(trace: Trace, group: str = "op", places: dict[str, str] | None = None) -> list[OpRow]:
    """Ops grouped by op name, module or line: count, time, bytes newly allocated (the profiler's own
    markers left out). ``places``: the report's names for the cell and files (``Cell In[2], line 4``)."""
    rows: dict[str, OpRow] = {}
    for op in trace.ops:
        if is_bookkeeping(op.op):
            continue
        if group == "module":
            key = _module_label(trace, op)
        elif group == "line":
            w = forward_where(trace, op)
            key = _line_label(w, places) + (" (backward)" if op.phase == "backward" else "")
        else:
            key = op.op
        row = rows.get(key)
        if row is None:
            row = rows[key] = OpRow(key, 0, 0.0, 0)
        row.count += 1
        row.time_us += op.duration_us
        ins = set(op.in_keys)
        row.alloc_bytes += sum(tensor_bytes(m) for k, m in zip(op.out_keys, op.outputs) if k and k not in ins)
    if group == "op" and trace.ops_dropped:  # totals cover the ops dropped from the middle
        for name, (count, total) in trace.op_totals.items():
            if is_bookkeeping(name):
                continue
            row = rows.setdefault(name, OpRow(name, 0, 0.0, 0))
            row.count, row.time_us = int(count), float(total)
    return list(rows.values())


def _line_label(w: Where, places: dict[str, str] | None = None) -> str:
    return line_label(places or {}, w.line, w.file)


def op_place(trace: Trace, op: OpRecord | None, places: dict[str, str] | None = None) -> str:
    """Where an op ran, as IPython names it: its line, a backward op's forward line (``backward of Cell In[2],
    line 7``); '' when no line is known. Text, HTML and plots all say it this way.

    >>> t = Trace(ops=[OpRecord(0, "aten::mm", "forward", [], [], where=Where(line=3))])
    >>> op_place(t, t.ops[0], {"": "Cell In[5]"})
    'Cell In[5], line 3'
    """
    if op is None:
        return ""
    w = forward_where(trace, op) if op.phase == "backward" else op.where
    if w.line is None:
        return ""
    label = _line_label(w, places)
    return f"backward of {label}" if op.phase == "backward" else label


SORT_KEYS = {"time": lambda r: -r.time_us, "memory": lambda r: -r.alloc_bytes, "count": lambda r: -r.count,
             "name": lambda r: r.name}


# --------------------------------------------------------------------------- fixes
@dataclass
class FixOption:
    arg: str           # what run_fix / --fix takes: "accumulate:2"
    name: str          # "accumulate"
    title: str
    description: str
    predicted: int | None = None


def applicable_fixes(report: "Report") -> list[FixOption]:
    """One option per fix the findings name that can be applied to the cell (``report.fix_offers``, when it was
    checked), with the predicted peak where the rules gave one."""
    seen: list[FixOption] = []
    names: set[str] = set()
    refused = {name for name, why in (report.fix_offers or {}).items() if why}
    for f in report.findings:
        preds = f.evidence.get("predicted_peak") or {}
        limit = f.evidence.get("limit")
        for name in f.fixes:
            if name in names or name in refused:
                continue
            names.add(name)
            arg, pred = name, preds.get(name)
            if name == "accumulate":
                ks = [k for k in (2, 4, 8) if f"accumulate:{k}" in preds]
                k = next((k for k in ks if limit and preds[f"accumulate:{k}"] <= 0.9 * limit), ks[-1] if ks else None)
                if k:
                    arg, pred = f"accumulate:{k}", preds[f"accumulate:{k}"]
            title, desc = FIX_INFO.get(name, (name, ""))
            seen.append(FixOption(arg, name, title, desc, pred))
    return seen


def refused_fixes(report: "Report") -> list[tuple[str, str]]:
    """(fixes, why they cannot be applied to this cell) for the fixes the findings name but the cell does not
    allow; fixes refused for the same reason share one line (``accumulate, amp``).

    >>> from backward_doctor.report import Report
    >>> refused_fixes(Report(fix_offers={"accumulate": "two backwards", "amp": "two backwards", "sync": ""}))
    [('accumulate, amp', 'two backwards')]
    """
    by_reason: dict[str, list[str]] = {}
    for name, why in (report.fix_offers or {}).items():
        if why:
            by_reason.setdefault(why, []).append(name)
    return [(", ".join(names), why) for why, names in by_reason.items()]


# --------------------------------------------------------------------------- pieces
def source_context(trace: Trace, line: int | None, file: str | None, around: int = 3) -> list[tuple[int, str]]:
    """(number, text) of the lines around ``line`` in the cell or in ``file``, as far as the report holds
    them (the cell's source, the excerpts copied at record time): nothing is read from this machine's disk.

    >>> source_context(Trace(source="a\\nb\\nc"), 2, None, around=1), source_context(Trace(), 1, "/etc/passwd")
    ([(1, 'a'), (2, 'b'), (3, 'c')], [])
    """
    if line is None:
        return []
    lines = source_lines(trace, file)
    if line not in lines:
        return []
    return [(i, lines[i]) for i in range(line - around, line + around + 1) if i in lines]


def verdict_parts(report: "Report") -> tuple[str, str, str, str]:
    """(severity, badge, headline, one sentence). A fixed run that works says what was wrong before it."""
    tr = report.trace
    if report.ok:
        fr = report.fix_result
        before = original_verdict(fr) if fr is not None and fr.applied and fr.fits else ""
        if before:
            slow = f" With it ops run up to {fr.slowdown:g}x slower." if fr.slowdown else ""
            return "ok", "fixed", f"The step ran with {fr.name}", f"Without it: {before}.{slow}"
        headline = ok_headline(tr)
        return "ok", "OK", headline[0].upper() + headline[1:], ""
    top = report.root_cause
    if top is None:
        what = "timed out" if tr.timed_out else "did not complete"
        return "error", "problem", f"The step {what}", (report.exception or "").split("\n")[0]
    title = finding_title(top)
    return top.severity, top.severity if top.severity != "error" else "problem", \
        f"{title} at {top.location()}", first_sentence(top.message)


# --------------------------------------------------------------------------- fix results


# --------------------------------------------------------------------------- threads and parameters
def hang_threads(trace: Trace) -> tuple[list, list[str]]:
    """The thread stacks worth reading in a hang report, and the names of the library threads folded away
    (``QueueFeederThread ×6``). The main thread always shows; threads that ran the user's code and a
    DataLoader's own show; the doctor's and the kernel's threads (Heartbeat, IOPub, Shell channel, the
    progress poller) are left out altogether.

    >>> from backward_doctor.trace.stacks import FrameInfo, ThreadStack
    >>> t = Trace(threads=[ThreadStack("MainThread", 1, True), ThreadStack("Heartbeat", 2, False,
    ...                    [FrameInfo("/zmq/heartbeat.py", 5, "run")]), ThreadStack("pool-1", 3, False)])
    >>> [s.name for s in hang_threads(t)[0]], hang_threads(t)[1]
    (['MainThread'], ['pool-1'])
    """
    shown, folded = [], []
    exc = trace.exception
    if not any(st.is_main and st.frames for st in trace.threads) and exc is not None and exc.frames:
        # A Ctrl-C without a timeout photographs no stacks: the interrupt's traceback is the main one.
        from ..trace.stacks import ThreadStack

        shown.append(ThreadStack("MainThread", 0, True, list(exc.frames)))
    for st in trace.threads:
        if st.is_main and not st.frames and shown:
            continue
        if worth_naming(st):
            shown.append(st)
        elif not own_thread(st):
            folded.append(st.name)
    counts = Counter(folded)
    return shown, [name if counts[name] == 1 else f"{name} ×{counts[name]}" for name in dict.fromkeys(folded)]


def used_parameters(trace: Trace) -> tuple[int, int, int] | None:
    """(tensors, trainable, bytes) of the parameters of the models the step ran, when fewer than all
    the namespace holds (None: the totals are the step's own).

    A model is used when its forward ran (known by identity at capture time, whatever it is called) or
    one of its parameters got a gradient or was stepped. A report saved before parameters carried their
    bytes gets the totals' share by element count.

    >>> used_parameters(Trace()) is None
    True
    """
    params = trace.params
    if not params:
        return None
    used = [p for p in params if p.in_run_model or p.got_grad or p.stepped]
    if not used or len(used) >= len(params):
        return None
    nbytes = sum(p.nbytes for p in used)
    if not nbytes:
        nbytes = int(trace.parameters.bytes * sum(p.numel for p in used) / (sum(p.numel for p in params) or 1))
    return len(used), sum(p.requires_grad for p in used), nbytes
