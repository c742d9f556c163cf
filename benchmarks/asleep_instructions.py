"""What always on costs in an iteration it sleeps through, counted in instructions (callgrind), not seconds.

    python benchmarks/asleep_instructions.py [--iterations 100 500] [--jobs 2]
    python benchmarks/asleep_instructions.py --step hf_t5 [--runs 2 6]     # a whole cell: one training step
    python benchmarks/asleep_instructions.py --step loop_2000 --runs 1 2   # a whole loop cell, sampled
    python benchmarks/asleep_instructions.py --bytecodes [--iterations 100 300] [--top 25]

The clock on a shared machine moves a small loop's ratio by several points from run to run, more than a change
to always on's per-iteration hooks moves it; instruction counts do not. Four processes under
``valgrind --tool=callgrind`` (plain and always on, each running the small MLP loop of ``whole_path.py`` for
two lengths): the difference between the lengths is the per-iteration count, the run's setup and report
cancelling out. The cost budget is told never to record an iteration (``CostBudget.records``), so what is
counted is the asleep path alone: the optimizer hooks, the ``backward()`` and ``zero_grad()`` wrappers, the
loop watch, the allocator's reports. (Recorded iterations are the budget's business: ``always_on.py``.)

``--step NAME``: the whole path of one cell of ``whole_path.py``'s workload NAME (a single step: ``run_cell``,
always on's set-up before the cell and its report after, the cost budget as it is), counted as the difference
between running the cell ``SHORT`` and ``LONG`` times after a warm-up run, per run. A single step's extra is
mostly what always on does once a cell (the namespace scanned, the graphs left behind walked, the report); a
loop's (``loop_2000``) adds the iterations it sleeps through and those its budget records (decided by the clock,
which valgrind slows about evenly: the same iterations are picked as outside it, give or take one).
Needs ``valgrind``; each process takes 2-4 minutes (a ``transformers`` workload longer: its import).

``--bytecodes``: the Python bytecodes always on adds to an asleep iteration, by function, in seconds and without
valgrind (one process, a tracer that counts each frame's opcodes, plain and asleep, the same two lengths). The
doctor's hooks are Python: on a loop of 0.2 ms steps their bytecodes are most of what always on costs, and the
count moves only when their code does (callgrind's count also moves by several thousand instructions with where
the heap's free blocks lie).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _measured(asleep: bool) -> tuple[Any, Any]:
    """A measured process's set-up: one torch thread, the native recorder built, one IPython shell (and with
    ``asleep``, the cost budget told never to record: only the iterations always on sleeps through count). The
    shell and ``whole_path``, whose workloads it runs."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent)]
    import torch

    torch.set_num_threads(1)
    import always_on as ao
    import whole_path as wp
    from backward_doctor.capture.loop import choosing as sampling
    from backward_doctor.capture.native_capture import native_available

    native_available(build=True)
    if asleep:
        sampling.CostBudget.records = lambda self, *a, **k: False
    return ao._Shell(), wp


def _child(mode: str, n: int, step: str | None = None) -> None:
    """One measured process: a short warm-up run, then the loop of ``n`` iterations (``step``: a warm-up run of
    that workload's cell, then ``n`` runs of it)."""
    shell, wp = _measured(asleep=step is None)  # (a loop: asleep throughout, see the docstring)
    if step is not None:
        ns, cell = wp.WORKLOADS[step]()
        for _ in range(1 + n):
            shell.run(ns, cell, watched=mode == "on")
        return
    ns = wp.small_mlp()
    for cell in (wp._loop(50), wp._loop(n)):
        shell.run(ns, cell, watched=mode == "on")


def _bytecodes(short: int, long: int) -> dict[tuple[str, str, int], float]:
    """(file, function, first line) -> bytecodes executed per iteration, always on asleep minus plain (both
    through IPython's ``run_cell``; the cost budget told never to record, as in ``_child``)."""
    import collections

    shell, wp = _measured(asleep=True)
    ns = wp.small_mlp()
    counts: collections.Counter = collections.Counter()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            counts[code.co_filename.rsplit("/", 1)[-1], code.co_name, code.co_firstlineno] += 1
        return local

    def new_frame(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return local

    def run(n: int, watched: bool) -> dict:
        counts.clear()
        sys.settrace(new_frame)
        try:
            shell.run(ns, wp._loop(n), watched=watched)
        finally:
            sys.settrace(None)
        return dict(counts)

    per = {}
    for watched in (True, False):
        run(short, watched)  # (a warm-up: what a first run imports and caches is not an iteration's)
        a, b = run(short, watched), run(long, watched)
        per[watched] = {k: (b.get(k, 0) - a.get(k, 0)) / (long - short) for k in set(a) | set(b)}
    return {k: per[True].get(k, 0) - per[False].get(k, 0) for k in set(per[True]) | set(per[False])}


def _count(mode: str, n: int, out: str, step: str | None = None) -> int:
    # (one hash seed: set and dict orders, and so the code paths through them, the same in every process)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.{mode}.{n}",
                           sys.executable, __file__, "--child", mode, str(n)] + (["--step", step] if step else []),
                          env=env, capture_output=True, text=True, check=True)
    return int(re.search(r"refs:\s*([\d,]+)", done.stderr).group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, nargs=2, default=[100, 500], metavar=("SHORT", "LONG"))
    ap.add_argument("--step", default=None, metavar="NAME", help="a whole cell of whole_path.py's workload NAME")
    ap.add_argument("--runs", type=int, nargs=2, default=[2, 6], metavar=("SHORT", "LONG"),
                    help="with --step: how many runs of the cell the two processes of each mode make")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--bytecodes", action="store_true",
                    help="count Python bytecodes with a tracer instead (seconds, no valgrind)")
    ap.add_argument("--top", type=int, default=25, help="with --bytecodes: the functions listed")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.step)
        return
    if args.step is not None:
        sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent)]
        import whole_path as wp

        if args.step not in wp.WORKLOADS:
            ap.error(f"--step: one of {', '.join(wp.WORKLOADS)}")
    if args.bytecodes and args.step:
        ap.error("--bytecodes counts the small loop's iterations: not with --step")
    short, long = args.runs if args.step else args.iterations
    if not long > short > 0:
        ap.error("SHORT LONG: 0 < SHORT < LONG")
    if args.bytecodes:
        extra = _bytecodes(short, long)
        rows = sorted(((v, k) for k, v in extra.items() if abs(v) >= 0.5), reverse=True)
        print(f"bytecodes per iteration always on adds asleep: {sum(extra.values()):,.0f}")
        for v, (file, fn, line) in rows[:args.top]:
            print(f"{v:8.1f}  {file}:{line} {fn}")
        return
    with tempfile.TemporaryDirectory() as out, ThreadPoolExecutor(args.jobs) as pool:
        runs = {(m, n): pool.submit(_count, m, n, out, args.step) for m in ("plain", "on") for n in (short, long)}
        per = {m: (runs[m, long].result() - runs[m, short].result()) / (long - short) for m in ("plain", "on")}
    what = f"instructions per run of the {args.step} cell" if args.step else "instructions per iteration"
    print(f"{what}: plain {per['plain']:,.0f}, always on{'' if args.step else ' asleep'} {per['on']:,.0f} "
          f"(+{per['on'] - per['plain']:,.0f}, {per['on'] / per['plain']:.3f}x)")


if __name__ == "__main__":
    main()
