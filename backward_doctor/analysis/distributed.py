"""Rules over the ranks of a distributed run: pure functions of their :class:`RankRecord` s.

Each rank's own trace goes through the usual rules (``analyze``); then the ranks are compared. The
root cause comes first: parameters DDP waits for in vain (``unused_parameters``), ranks that issued
different collectives (``desync``), the rank whose NaN/Inf the all-reduce spread (``nonfinite``), a
rank that died by a signal (``crash``) and where each rank was stuck (``hang``). A peer's "Connection
closed/reset by peer" or timeout is what the others see when one rank fails: a ``consequence``, listed
last, never the root cause.

>>> from backward_doctor.trace.distributed import Collective, RankRecord
>>> a = RankRecord(0, 2, collectives=[Collective(0, "all_gather", seq=3, count=1, sizes=[[17, 4]], line=9)])
>>> b = RankRecord(1, 2, collectives=[Collective(0, "all_gather", seq=3, count=1, sizes=[[16, 4]], line=9)])
>>> [(f.kind, f.rank, f.line) for f in analyze_ranks([a, b])]
[('desync', 1, 9)]
"""
from __future__ import annotations

import re

from .findings import Finding
from .rules import analyze
from .rank_rules import crashed, first_nonfinite, hang, sharded_unused, still_progressing, unused_parameters
from ..trace.distributed import DDP_BACKWARD, Collective, RankRecord, loop_text
from ..trace.queries import sharded_by_fsdp
from ..trace.records import Trace

#: What a rank sees when a peer failed or went missing: a consequence, never the root cause.
CONSEQUENCE = re.compile(r"Connection (closed|reset) by peer|Timed out waiting|Socket Timeout|Broken pipe|"
                         r"Read error|timed out|NCCL communicator was aborted|has been shut down|"
                         r"Watchdog caught collective operation timeout", re.I)
_TIMED_OUT = re.compile(r"Timed out waiting|timed out|Socket Timeout|Watchdog caught collective operation timeout",
                        re.I)
_UNUSED_ERROR = "Expected to have finished reduction in the prior iteration"
#: Collectives whose tensors must have the same shapes on every rank.
_SIZED = frozenset({"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                    "reduce_scatter_tensor", "reduce", "all_reduce_coalesced", DDP_BACKWARD,
                    "all_gather_single", "reduce_scatter_single"})  # (the last two: FSDP2's)
_P2P = frozenset({"send", "recv", "isend", "irecv"})
_FSDP = frozenset({"all_gather_single", "reduce_scatter_single"})


_NOISE = re.compile(r"\[(enforce fail at )?/[^\]]*\]\s*|what\(\):\s*")  # C++ source paths: not the user's


def rank_error(r: RankRecord) -> str:
    """The rank's error in one line: its script's exception, else the last error line it printed.

    >>> rank_error(RankRecord(1, 2, output_tail="  what():  [enforce fail at /x/pair.cc:456] Received data size"))
    'Received data size'
    """
    if r.trace is not None and r.trace.exception is not None:
        return _NOISE.sub("", r.trace.exception.summary().splitlines()[0])
    for line in reversed(r.output_tail.splitlines()):
        if "what():" in line or "Error" in line or "error" in line:
            return _NOISE.sub("", line.strip())[:400]
    return ""


def is_consequence(r: RankRecord) -> bool:
    """The rank failed because a peer did (its error is a lost connection or a timeout), or the
    launcher stopped it after another rank failed.

    >>> is_consequence(RankRecord(0, 2, output_tail="RuntimeError: [pair.cc:553] Connection closed by peer"))
    True
    """
    return bool(r.stopped.startswith("after") or CONSEQUENCE.search(rank_error(r)))


def _slots(r: RankRecord) -> dict[int, Collective]:
    """Sequence number -> the call that issued it (world group, collectives only)."""
    out: dict[int, Collective] = {}
    for c in r.collectives:
        if c.seq is None or c.group or c.op in _P2P:
            continue
        for k in range(1 if c.count is None else c.count):
            out[c.seq + k] = c
    return out


def _signature(c: Collective, base: dict[str, int]) -> tuple:
    """What must match across ranks: op, sizes (where they must agree) and how far the loop has come
    since the rank's first collective (not the loop variable itself: a strided ``range(rank, n, world)``
    differs by rank from the start, in step)."""
    moved = tuple(sorted((k, v - base.get(k, 0)) for k, v in c.loop.items()))
    return (c.op, tuple(map(tuple, c.sizes)) if c.op in _SIZED else (), moved)


def _culprit(calls: dict[int, Collective], bases: dict[int, dict[str, int]]) -> int:
    """The rank not doing what the others do: the minority; between equals, the one whose loop ran
    ahead (it skipped a step); else the first that differs from the lowest rank."""
    sig = {rank: _signature(c, bases[rank]) for rank, c in calls.items()}
    groups: dict[tuple, list[int]] = {}
    for rank in calls:
        groups.setdefault(sig[rank], []).append(rank)
    ordered = sorted(groups.values(), key=len)
    if len(ordered[-1]) > len(ordered[0]) and len(ordered) == 2:
        return ordered[0][0]
    moved = {rank: dict(sig[rank][2]) for rank in calls}
    for name in sorted(set.intersection(*(set(v) for v in moved.values()))):
        values = {rank: moved[rank][name] for rank in moved}
        if len(set(values.values())) > 1:
            return max(values, key=lambda k: (values[k], -k))
    lowest = min(calls)
    return min(rank for rank in calls if sig[rank] != sig[lowest])


def desync(ranks: list[RankRecord], timeout: float | None = None) -> list[Finding]:
    """The first collective (by sequence number) that the ranks issued differently: op, sizes, or the
    loop step they were in. A rank with no collective where the others have one is only a desync when
    it issued later ones (else it stopped there: that is the crash or the hang). Nor are calls every rank
    was still inside when the launcher's time limit stopped ranks that were all still advancing
    (``timeout``): a collective DDP issues from C++ is counted when it is launched, asynchronously, so at
    that moment one rank's call in flight can take the number of the other's next one.

    >>> ok = [RankRecord(k, 2, collectives=[Collective(0, "barrier", seq=0, count=1, line=3)]) for k in range(2)]
    >>> desync(ok)
    []
    """
    slots = {r.rank: _slots(r) for r in ranks}
    bases = {rank: s[min(s)].loop if s else {} for rank, s in slots.items()}
    for seq in sorted(set().union(*slots.values())):
        calls = {rank: s[seq] for rank, s in slots.items() if seq in s}
        gap = [rank for rank, s in slots.items() if seq not in s and s and max(s) > seq]
        if len({_signature(c, bases[rank]) for rank, c in calls.items()}) <= 1 and not gap:
            continue
        if not gap and _in_flight_when_stopped(calls, slots, seq, ranks, timeout):
            continue
        culprit = gap[0] if gap else _culprit(calls, bases)
        c = calls.get(culprit) or next(iter(calls.values()))
        each = "; ".join(f"rank {rank}: {calls[rank].label()}" for rank in sorted(calls))
        each += "".join(f"; rank {rank}: nothing (it went on to later collectives)" for rank in gap)
        missing = [r.rank for r in ranks if r.rank not in calls and r.rank not in gap]
        each += "".join(f"; rank {rank}: nothing (it stopped before)" for rank in missing)
        loops = {loop_text(x.loop) for x in calls.values()}
        apart = len({_signature(x, bases[rank])[2] for rank, x in calls.items()}) > 1
        step = f" They were at different steps of the loop ({', '.join(sorted(loops))}): rank {culprit} skipped " \
               "or repeated a step that issues collectives." if apart else ""
        msg = (f"The ranks issued different collectives at collective #{seq + 1} of the process group: {each}.{step} "
               "Every rank must issue the same collectives, in the same order, with the same sizes; when they "
               "do not, gloo/NCCL pair the wrong calls: a size check aborts a process, or the ranks wait for each "
               "other until the timeout. Make the collectives (and the steps that issue them, `backward()` under "
               "DDP included) the same on every rank: pad or split uneven shards equally, and skip a step on "
               "all ranks or none (decide it from a value all-reduced first).")
        if any(x.op in _FSDP for x in calls.values()):
            msg += (" Under FSDP each sharded module's forward all-gathers its parameters and its backward "
                    "reduce-scatters their gradients: a module one rank's forward skipped (an `if` on the rank or "
                    "on its batch) leaves the others' call unmatched. Run every sharded module on every rank (scale "
                    "its output by 0 where it must not count).")
        evidence = {"seq": seq, "ranks": {str(rank): {"op": x.op, "sizes": x.sizes, "line": x.line, "file": x.file,
                                                       "loop": x.loop} for rank, x in sorted(calls.items())}}
        return [Finding(kind="desync", message=msg, line=c.line, file=c.file, op=c.op, rank=culprit,
                        title="Ranks issued different collectives", evidence=evidence)]
    return []


def _in_flight_when_stopped(calls: dict[int, Collective], slots: dict[int, dict[int, Collective]], seq: int,
                            ranks: list[RankRecord], timeout: float | None) -> bool:
    """Every call at ``seq`` is its rank's last and had not returned, and the time limit stopped every rank
    while it was still advancing (``rank_rules.still_progressing``): nothing to compare yet."""
    return (all(c.count is None and seq == max(slots[rank]) for rank, c in calls.items())
            and still_progressing(ranks, timeout))


def analyze_ranks(ranks: list[RankRecord], timeout: float | None = None) -> list[Finding]:
    """All findings of a distributed run, root cause first, each with its ``rank`` (None: all ranks);
    ``timeout``: the launcher's, in seconds (for the hang's message)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    own = {r.rank: [_tag(f, r.rank, r.trace) for f in analyze(r.trace)] if r.trace is not None else []
           for r in ranks}
    roots = unused_parameters(ranks)
    if not roots:  # unused parameters explain the missing DDP all-reduce on their rank
        roots += desync(ranks, timeout)
    nan = first_nonfinite(ranks, own)
    roots += nan
    roots += crashed(ranks, culprit=roots[0].rank if roots else None)
    timed_out = tuple(r.rank for r in ranks if _TIMED_OUT.search(rank_error(r)))
    roots += hang(ranks, culprit=roots[0].rank if roots else None, explained=bool(roots), timeout=timeout,
                  timed_out=timed_out)
    rest: list[Finding] = sharded_unused(ranks)
    for r in ranks:  # each rank's own findings, less what the findings across ranks already say
        for f in own[r.rank]:
            if f.kind == "hang" or (nan and f.kind == "nonfinite"):
                continue  # the combined hang says where every rank was; the first NaN rank is above
            unused_explains = _UNUSED_ERROR in rank_error(r) and any(g.kind == "unused_parameters" for g in roots)
            if f.kind == "exception" and (is_consequence(r) or unused_explains):
                continue  # said once below as a consequence (or explained by unused_parameters)
            rest.append(f)
    first = (roots + rest)[0] if roots or rest else None
    after = []
    for r in ranks:
        received = nan and r.rank in nan[0].evidence.get("spread_to", [])
        culprit = any(f.rank == r.rank for f in roots + rest)  # (stopped after a peer failed, yet the cause)
        if (is_consequence(r) and not culprit) or received:
            after.append(_consequence(r, first, own[r.rank]))
    return roots + rest + after


def _tag(f: Finding, rank: int, trace: Trace | None = None) -> Finding:
    f.rank = rank
    oom = trace.exception.oom if trace is not None and trace.exception is not None else None
    if f.kind == "oom" and oom is not None and sharded_by_fsdp(trace):
        f.message += " " + _fsdp_memory(oom.by_category, oom.requested or 0)
    return f


def _fsdp_memory(by_category: dict[str, int], requested: int) -> str:
    """What FSDP2 offers against this rank's out-of-memory, the largest share first: a rank's parameters,
    gradients and optimizer state shrink with more ranks (each holds 1/N of them); activations do not.

    >>> _fsdp_memory({"parameters": 1, "gradients": 1, "optimizer": 2, "activations": 9, "other": 0}, 0)[:41]
    'Under FSDP2, activations are most of it: '
    """
    state = sum(by_category.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    acts = by_category.get("activations", 0) + by_category.get("other", 0) + requested
    shard = ("more ranks shard the parameters, gradients and optimizer state further (each rank holds 1/N of "
             "them), and `fully_shard(module, reshard_after_forward=True)` (the default) frees each layer's "
             "all-gathered parameters after its forward")
    act = ("activation checkpointing on each sharded block (`torch.utils.checkpoint.checkpoint` in its forward) "
           "or a smaller per-rank batch with gradient accumulation (more ranks do not shrink them)")
    if acts >= state:
        return f"Under FSDP2, activations are most of it: {act}; then {shard}."
    return f"Under FSDP2, the sharded training state is most of it: {shard}; then {act}."


def _consequence(r: RankRecord, root: Finding | None, own: list[Finding]) -> Finding:
    err = rank_error(r) or ("its gradients turned NaN/Inf after the gradients' collective" if r.trace is not None
                            else r.ended())
    where = r.waiting_in or next((c for c in reversed(r.collectives) if c.error), None)
    exc = r.trace.exception.where if r.trace is not None and r.trace.exception is not None else None
    seen = next((f for f in own if f.kind == "nonfinite"), None)  # where the received NaN showed on this rank
    line, file = (where.line, where.file) if where else ((exc.line, exc.file) if exc else
                                                         ((seen.line, seen.file) if seen else (None, None)))
    cause = f"of {root.kind} on rank {root.rank}" if root is not None and root.rank is not None else \
        "of what happened on another rank"
    msg = (f"Rank {r.rank} {r.ended()}: {err}. This is a consequence {cause}, not a root cause: when one rank "
           "fails or issues a different collective, its peers see a closed or reset connection, a timeout, or "
           "the values it sent.")
    return Finding(kind="consequence", message=msg, line=line, file=file, severity="info", rank=r.rank,
                   title=f"Rank {r.rank}: a consequence, not a cause")
