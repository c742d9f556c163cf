"""Per-situation rules of a distributed run (used by ``analysis/distributed.py``): parameters without a
gradient, the first rank with NaN/Inf, a rank killed by a signal, and where each rank was when it hung.

Pure functions of the ranks' records.

>>> from backward_doctor.trace.distributed import RankRecord, UnusedParams
>>> u = UnusedParams(names=["extra.bias"], forward_line=14, backward_line=15)
>>> [(f.kind, f.rank, f.line) for f in unused_parameters([RankRecord(0, 2, unused=[u]), RankRecord(1, 2)])]
[('unused_parameters', 0, 14)]
"""
from __future__ import annotations

from .findings import Finding
from ..trace.distributed import RankRecord, loop_text, place
from ..trace.queries import sharded_by_fsdp


def unused_parameters(ranks: list[RankRecord]) -> list[Finding]:
    """DDP parameters that got no gradient in a ``backward()``: the names, whether all ranks agree."""
    first = {r.rank: r.unused[0] for r in ranks if r.unused}
    if not first:
        return []
    sets = {rank: tuple(sorted(u.names)) for rank, u in first.items()}
    same = len(first) == len(ranks) and len(set(sets.values())) == 1
    rank = min(first)
    u = first[rank]
    names = ", ".join(u.names[:12]) + (f" and {len(u.names) - 12} more" if len(u.names) > 12 else "")
    at = f"in the backward() at {place(u.backward_line, None)}" + (f" ({loop_text(u.loop)})" if u.loop else "")
    if same:
        who = f"on every rank: {names}"
    else:
        others = [r.rank for r in ranks if r.rank not in first]
        who = "; ".join(f"rank {k}: {', '.join(sets[k][:12])}" for k in sorted(first))
        who += f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} used them all)" if others else " (the sets differ by rank)"
        who = "differently by rank: " + who
    msg = (f"{len(u.names)} of the {u.total or '?'} parameters of the DDP-wrapped `{u.module}` got no gradient "
           f"{at}, {who}. The forward was called at {place(u.forward_line, u.forward_file)}. DDP all-reduces "
           "gradients bucket by bucket and waits for every parameter: a bucket with a parameter that got no "
           "gradient is never reduced, so the next forward fails with \"Expected to have finished reduction in "
           "the prior iteration\" (or, when ranks use different parameters, the ranks' all-reduces no longer "
           "pair and they fail or hang). Either use these parameters in the loss on every rank and step, or "
           "wrap the model with `DistributedDataParallel(model, find_unused_parameters=True)` (a little slower: "
           "it walks the graph after each forward).")
    ev = {"parameters": u.names, "same_on_all_ranks": same, "by_rank": {str(k): list(v) for k, v in sets.items()},
          "forward_line": u.forward_line, "backward_line": u.backward_line, "loop": u.loop}
    return [Finding(kind="unused_parameters", message=msg, line=u.forward_line, file=u.forward_file,
                    module=u.module or None, rank=None if same else rank, title="DDP parameters without a gradient",
                    evidence=ev)]


def sharded_unused(ranks: list[RankRecord]) -> list[Finding]:
    """FSDP2 parameters that got no gradient in any step the rank recorded: FSDP raises nothing (unlike DDP),
    and the optimizer skips a parameter without a gradient, so they never train. Named at the line that ran
    their module, on every rank or by rank.

    >>> sharded_unused([RankRecord(0, 2), RankRecord(1, 2)])
    []
    """
    starved: dict[int, list] = {}
    for r in ranks:
        tr = r.trace
        if tr is None or not sharded_by_fsdp(tr) or not any(p.got_grad for p in tr.params):
            continue
        params = [p for p in tr.params if p.requires_grad and p.stepped and not p.got_grad]
        if params:
            starved[r.rank] = params
    if not starved:
        return []
    rank = min(starved)
    tr = next(r.trace for r in ranks if r.rank == rank)
    names = [p.name for p in starved[rank]]
    module = ".".join(names[0].split(".")[:-1])
    run = next((op for op in tr.ops if op.phase == "forward" and op.where.module == module), None)
    same = len(starved) == len(ranks) and len({tuple(p.name for p in v) for v in starved.values()}) == 1
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    where = f" Its forward ran at {place(run.where.line, run.where.file)}, and its" if run is not None else " Its"
    who = "on every rank" if same else f"on rank{'s' if len(starved) > 1 else ''} {', '.join(map(str, starved))}"
    msg = (f"{len(names)} sharded parameter tensor(s) of `{module or 'the model'}` ({shown}) got no gradient in any "
           f"recorded step {who}: FSDP2 raises nothing (DDP would) and the optimizer skips a parameter without a "
           f"gradient, so they never train.{where} output never reaches the loss. Use it in the loss, or "
           "remove the module (or freeze it with `requires_grad_(False)` if it is kept for a metric).")
    it = tr.iterations.iteration_of(run.index) if run is not None else None
    return [Finding(kind="unused_parameters", message=msg, line=run.where.line if run else None,
                    file=run.where.file if run else None, module=module or None, rank=None if same else rank,
                    severity="warning", title="Sharded parameters without a gradient", iteration=it,
                    evidence={"parameters": names, "same_on_all_ranks": same, "fsdp": True,
                              "by_rank": {str(k): [p.name for p in v] for k, v in starved.items()}})]


def _nan_key(r: RankRecord) -> tuple[float, int]:
    """(iteration, received) of the rank's first NaN/Inf: a rank that made it itself (from its batch, an
    op of its own) sorts before one that received it, in the same iteration, through a collective (the
    origin is then the DDP backward's line, or a ``c10d::`` op)."""
    tr = r.trace
    if tr is None:
        return (float("inf"), 2)
    its = tr.iterations
    # Only the per-iteration series saw it (a sampled iteration): its iteration, unless a recorded op came first
    # (the ops of a later, recorded iteration are its aftermath: NaN weights from the unrecorded step).
    seen = ((float(its.first_nonfinite), 0 if its.first_nonfinite_in == "loss" else 1)
            if its.first_nonfinite is not None else (float("inf"), 2))
    origins = [e for e in tr.nonfinite if e.is_origin]
    if origins:
        ev = next((e for e in origins if e.reached), origins[0])
        it = tr.iterations.iteration_of(ev.index)
        at_collective = {(c.line, c.file) for c in r.collectives}
        received = ev.op.startswith("c10d::") or (ev.where.line, ev.where.file) in at_collective
        return min((float(it) if it is not None else 0.0, 1 if received else 0), seen)
    return seen


def first_nonfinite(ranks: list[RankRecord], own: dict[int, list[Finding]]) -> list[Finding]:
    """The rank whose NaN/Inf came first (its line); the ranks it spread to through the all-reduce.
    ``own``: each rank's findings from its own trace.

    >>> first_nonfinite([RankRecord(0, 2), RankRecord(1, 2)], {0: [], 1: []})
    []
    """
    bad = [r for r in ranks if any(f.kind == "nonfinite" for f in own[r.rank]) or _nan_key(r)[0] != float("inf")]
    if not bad:
        return []
    first = min(bad, key=lambda r: (_nan_key(r), r.rank))
    f = next((f for f in own[first.rank] if f.kind == "nonfinite"), None)
    if f is None:
        return []
    it = _nan_key(first)[0]
    # Ranks whose own data or ops made NaN/Inf in that same iteration made it too; the rest received it.
    made = [r.rank for r in bad if _nan_key(r) == _nan_key(first)]
    others = [r.rank for r in bad if r.rank not in made]
    spread = (f" The gradients' collective (DDP's all-reduce, FSDP's reduce-scatter) then carried it to "
              f"rank{'s' if len(others) > 1 else ''} "
              f"{', '.join(map(str, others))}, whose own data were finite: every rank's gradients and "
              "weights are NaN/Inf after the step." if others else "")
    step = f" in iteration {it:g}" if it != float("inf") else ""
    who = f"Rank {first.rank} made" if len(made) == 1 else \
        f"Ranks {', '.join(map(str, made))} each made (rank {first.rank}'s shown)"
    f.message = (f"{who} the first NaN/Inf{step}, before any collective carried it (from its own data or "
                 f"ops).{spread} {f.message[:1].upper()}{f.message[1:]}")
    if len(made) == len(ranks):
        f.rank = None  # every rank made it: not one rank's problem (the same bad data or weights everywhere)
    f.evidence = {**f.evidence, "first_rank": first.rank, "made_by": made, "spread_to": others}
    return [f]


def crashed(ranks: list[RankRecord], culprit: int | None = None) -> list[Finding]:
    """Ranks killed by a signal before their run ended (gloo aborts a process on a size mismatch):
    no Python exception there, but their log and ``faulthandler`` say where.

    >>> [(f.kind, f.rank) for f in crashed([RankRecord(1, 2, exitcode=-6, signal="SIGABRT")])]
    [('crash', 1)]
    """
    out = []
    for r in ranks:
        if not r.signal or r.stopped or r.wrote_report:
            continue
        where = r.waiting_in
        frame = _user_frame(r)
        line, file = (where.line, where.file) if where else ((frame.line, None if frame.in_cell else frame.file)
                                                            if frame else (None, None))
        err = next((ln.strip() for ln in reversed(r.output_tail.splitlines()) if "what():" in ln), "")
        inside = f" inside {where.label()}" if where else (f" at {place(line, file)}" if line else "")
        msg = (f"Rank {r.rank} was killed by {r.signal}{inside}, without a Python exception"
               + (f": {err}" if err else "") + ". " +
               ("This is the desync above surfacing: the backend checked the sizes it received against what "
                "it expected and aborted the process." if culprit is not None else
                "A C++ error (often a collective's check in gloo/NCCL) or the system ended the process; the stack "
                "below is where its Python code was."))
        out.append(Finding(kind="crash", message=msg, line=line, file=file, rank=r.rank,
                           severity="warning" if culprit is not None else "error",
                           title=f"Rank {r.rank} died ({r.signal})", evidence={"error": err, "exitcode": r.exitcode}))
    return out


def _user_frame(r: RankRecord):
    main = next((s for s in r.stacks if s.is_main), r.stacks[0] if r.stacks else None)
    if main is None:
        return None
    return next((fi for fi in reversed(main.frames) if fi.user), None)


def position(r: RankRecord) -> tuple[str, int | None, str | None]:
    """Where a rank was when the run ended: (words, line, file).

    >>> from backward_doctor.trace.distributed import Collective
    >>> position(RankRecord(0, 2, collectives=[Collective(0, "barrier", seq=4, line=17)]))
    ('waiting in barrier at line 17 (collective #5)', 17, None)
    """
    if r.waiting_in is not None:
        c = r.waiting_in
        seq = f" (collective #{c.seq + 1})" if c.seq is not None else ""
        return f"waiting in {c.label()}{seq}", c.line, c.file
    failed = next((c for c in reversed(r.collectives) if c.error), None)
    if failed is not None:
        return f"failed in {failed.label()}", failed.line, failed.file
    frame = _user_frame(r)
    if r.stopped and frame is not None:
        file = None if frame.in_cell else frame.file
        return f"at {place(frame.line, file)} in {frame.function} (`{frame.code}`)", frame.line, file
    return r.ended(), None, None


def still_progressing(stuck: list[RankRecord], timeout: float | None) -> bool:
    """Every rank the launcher's time limit stopped had shown progress (a collective or an iteration
    logged) shortly before: within the last tenth of the limit, between 3 and 30 s. A hung rank logs
    nothing more once it waits.

    >>> still_progressing([RankRecord(0, 2, stopped="timeout", progress_s=0.4)], 60.0)
    True
    >>> still_progressing([RankRecord(0, 2, stopped="timeout", progress_s=50.0)], 60.0)
    False
    """
    recent = min(30.0, max(3.0, 0.1 * (timeout or 0.0)))
    return all(r.stopped == "timeout" and r.progress_s is not None and r.progress_s <= recent for r in stuck)


def slow(ranks: list[RankRecord], where: dict[int, tuple[str, int | None, str | None]],
         timeout: float | None) -> list[Finding]:
    """The time limit ran out while every rank was still advancing: a slow run, not a hang (a ``timeout``)."""
    first = min(ranks, key=lambda r: r.rank)
    words, line, file = where[first.rank]
    each = "; ".join(f"rank {r.rank}: {r.steps} iterations, last progress {r.progress_s:.1f} s before it was "
                     f"stopped, {where[r.rank][0]}" for r in sorted(ranks, key=lambda r: r.rank)
                     if r.progress_s is not None)
    limit = f"the {timeout:g} s time limit" if timeout else "the time limit"
    msg = (f"The ranks were still working when {limit} ran out: {each}. Nothing was stuck: every rank kept "
           "issuing collectives or finishing iterations until it was stopped, so this is a slow run, not a hang. "
           "Give it more time (`--timeout`), fewer iterations, or fewer ranks per core; a busy machine slows "
           "every rank.")
    return [Finding(kind="timeout", message=msg, line=line, file=file, title="The run needed more time",
                    severity="warning", evidence={"positions": {str(k): w[0] for k, w in where.items()},
                                                  "progress_s": {str(r.rank): r.progress_s for r in ranks}})]


def hang(ranks: list[RankRecord], culprit: int | None = None, explained: bool = False,
         timeout: float | None = None, timed_out: tuple[int, ...] = ()) -> list[Finding]:
    """The launcher's timeout ended ranks still running, or the process group's own timeout made ranks
    fail (``timed_out``): where each one was, and which is not where the others are (the culprit of a
    desync; else the minority; else the one that issued fewest).

    >>> from backward_doctor.trace.distributed import Collective
    >>> ranks = [RankRecord(0, 2, stopped="timeout", collectives=[Collective(0, "barrier", seq=4, line=17)]),
    ...          RankRecord(1, 2, stopped="timeout", collectives=[Collective(0, "all_reduce", seq=4, line=9)])]
    >>> [(f.kind, f.rank, f.line) for f in hang(ranks, timeout=5)]
    [('hang', 0, 17)]
    """
    stuck = [r for r in ranks if r.stopped in ("timeout", "interrupted") or r.rank in timed_out]
    if not stuck:
        return []
    where = {r.rank: position(r) for r in ranks}
    if not explained and still_progressing(stuck, timeout):
        return slow(ranks, where, timeout)
    if culprit is None:
        groups: dict[tuple, list[int]] = {}
        for r in ranks:
            groups.setdefault(where[r.rank][1:], []).append(r.rank)
        small = min(groups.values(), key=len)
        culprit = small[0] if len(groups) > 1 and len(small) < max(map(len, groups.values())) else \
            min(ranks, key=lambda r: (sum(c.count or 1 for c in r.collectives), r.rank)).rank
    words, line, file = where[culprit]
    each = "; ".join(f"rank {k}: {w[0]}" for k, w in sorted(where.items()))
    limit = f" within {timeout:g} s" if timeout and any(r.stopped == "timeout" for r in stuck) else \
        " before the run was interrupted (Ctrl-C)" if any(r.stopped == "interrupted" for r in stuck) else \
        " before the process group's timeout"
    msg = (f"The ranks did not finish{limit}: {each}. "
           f"Rank {culprit} is not where the others are." +
           (" The finding above is why." if explained else
            " A collective only completes when every rank of the group issues it; a rank that took another "
            "path (a skipped step, a rank-dependent branch, a different number of batches) leaves the others "
            "waiting until the process group's timeout (30 minutes by default in gloo)."))
    return [Finding(kind="hang", message=msg, line=line, file=file, rank=culprit, title="The ranks hang",
                    severity="warning" if explained else "error",
                    evidence={"positions": {str(k): w[0] for k, w in where.items()}})]
