"""Memory that creeps up inside one cell's training loop: the line that keeps it, and where it is heading.

A tensor kept from an earlier iteration that still carries its autograd graph (``outputs.append(out)``,
``total += loss``, a cache on a module) keeps what its graph saved for a backward that never comes, and
one more every iteration. The rule names the line that stores it (the root cause, not the line where
memory finally ran out), the growth per iteration measured at each iteration's end
(``Trace.iterations.live_bytes``) and, on a device or under ``memory_limit``, the iteration at which it
will be full at that rate. When the cell did run out of memory, this finding comes first and the
``oom`` finding is its consequence (``rules/__init__.py``).

>>> from backward_doctor.trace import Trace
>>> loop_leak(Trace())
[]
"""
from __future__ import annotations

from ..findings import Finding, at
from ..trends import memory_growth
from .silent import holder_place, keeping_code, keeping_fix
from ...trace.parts import GraphHolder
from ...trace.records import Trace
from ...util.units import format_bytes


def _kept(trace: Trace) -> list[GraphHolder]:
    """Holders whose graph comes from an iteration before the one running at the end: graphs of at least
    three iterations in all (one tensor kept on purpose, ``first_loss``, is not a creep)."""
    its = trace.iterations
    current = its.steps if trace.exception is not None else its.steps - 1
    kept = [h for h in trace.graph_holders if h.from_iteration is not None and h.from_iteration < current
            and not h.earlier_runs]
    spans = {i for h in kept for i in (h.iteration, h.from_iteration) if i is not None}
    chain = any(h.iteration is not None and h.iteration - h.from_iteration >= 2 for h in kept)
    return kept if len(spans) >= 3 or chain else []


def loop_leak(trace: Trace) -> list[Finding]:
    """Graphs kept across the iterations of the cell's loop, with the memory they add per iteration."""
    kept = _kept(trace)
    if not kept:
        return []
    first = kept[0]
    var, where = holder_place(trace, first)
    limit = trace.memory.limit_bytes or trace.memory.device_total_bytes
    growth = memory_growth(trace.iterations, limit)
    iterations = sorted({i for h in kept for i in range(h.from_iteration, (h.iteration or h.from_iteration) + 1)})
    fix = keeping_fix(trace, where, var, first.store, scalar=not first.shape)
    paths = ", ".join(f"`{h.path}`" for h in kept[:3]) + (" ..." if len(kept) > 3 else "")
    nbytes = sum(h.bytes + h.graph_bytes for h in kept)
    span = f"{iterations[0]}-{iterations[-1]}" if len(iterations) > 1 else str(iterations[0])
    msg = (f"`{var}` keeps tensors from earlier iterations of the loop that still carry their autograd graph "
           f"({paths}: graphs of iterations {span}, {format_bytes(nbytes)} in the {len(kept)} looked at). Each "
           "iteration adds one more graph, " + ("with what it saved for a backward that never comes."
                                                if any(h.graph_bytes for h in kept) else
                                                "its nodes and the tensor itself (what they saved for backward "
                                                "was freed when a backward ran through them)."))
    evidence = {"variable": var, "holders": [h.path for h in kept], "bytes": nbytes,
                "iterations": [iterations[0], iterations[-1]]}
    code = keeping_code(trace, where, not first.shape)
    if code:  # (the storing line rewritten: shown as code under the finding)
        evidence["fix_code"] = code
    if growth is not None:
        evidence["growth"] = growth
        msg += (f" Live memory grew by {format_bytes(growth['per_iteration'])} per iteration "
                f"({format_bytes(growth['from'])} at iteration {growth['first']}, "
                f"{format_bytes(growth['to'])} at iteration {growth['last']})")
        if growth["full_at"] is not None and trace.exception is None:
            msg += (f"; at that rate the {format_bytes(limit)} "
                    f"{'memory limit' if trace.memory.limit_bytes else 'device'} is full at iteration "
                    f"{growth['full_at']:,}")
        msg += "."
    oom = trace.exception is not None and "out of memory" in (trace.exception.message or "").lower() \
        or (trace.exception is not None and trace.exception.type == "OutOfMemoryError")
    if oom:
        msg += " This is why memory ran out: the out-of-memory error is its consequence."
    msg += f" Fix: {fix}."
    return [at("graph_leak", where, msg, severity="error" if oom else "warning",
               title="Graphs of earlier iterations kept alive", iteration=iterations[0], evidence=evidence)]


__all__ = ["loop_leak"]
