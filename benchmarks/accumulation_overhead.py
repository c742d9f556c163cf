"""What the accumulation and mixed-precision watches cost, same run: ``diagnose()`` with them against
``diagnose()`` without them (the loop watch's ``backward`` wrapper and step hook as they were before
them), and the plain cell, interleaved round by round in one process.

    python benchmarks/accumulation_overhead.py            # 9 rounds
    python benchmarks/accumulation_overhead.py --rounds 3 --only loop_200

Workloads: the whole-path ones without these patterns (``benchmarks/whole_path.py``: one step of an MLP, a
CNN, a transformer; a 200- and a 2,000-iteration loop), and one with them (a 2,000-micro-batch loop
accumulating 4 per step under a GradScaler: the watches' cost when they have something to watch, the
measured check included). Times are process CPU time, one torch thread, medians after a warm-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import backward_doctor as bd  # noqa: E402
from backward_doctor.capture.native_capture import native_available  # noqa: E402
import whole_path as W  # noqa: E402

ACCUM = ("for i in range({n}):\n    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
         "        loss = F.cross_entropy(model(x), y) / 4\n    scaler.scale(loss).backward()\n"
         "    if (i + 1) % 4 == 0:\n        scaler.unscale_(opt)\n"
         "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
         "        scaler.step(opt)\n        scaler.update()\n        opt.zero_grad()\n")


def accumulating(n: int) -> Callable[[], tuple[dict, str]]:
    def build() -> tuple[dict, str]:
        ns = W.small_mlp()
        ns.update(torch=torch, scaler=torch.amp.GradScaler("cpu"))
        return ns, ACCUM.format(n=n)
    build.__name__ = f"accumulating_{n}"
    return build


WORKLOADS = {"mlp": W.mlp, "cnn": W.cnn, "transformer": W.transformer, "loop_200": W.loop(200),
             "loop_2000": W.loop(2000), "accumulating_2000": accumulating(2000)}


class Before:
    """The capture with the loop's series as its only watch (the registry's other members taken out), for the
    duration of a ``with`` (put back after): the run as it was before the accumulation and precision watches."""

    def __enter__(self) -> "Before":
        from backward_doctor.capture.watches import training as training_watches  # noqa: F401  (registered before they are saved)
        from backward_doctor.capture.watches import registry as watches

        self.saved = list(watches._REGISTRY)
        watches._REGISTRY[:] = [(n, f) for n, f in self.saved if n == "loop"]
        return self

    def __exit__(self, *exc: Any) -> None:
        from backward_doctor.capture.watches import registry as watches

        watches._REGISTRY[:] = self.saved


def measure(name: str, build: Callable[[], tuple[dict, str]], rounds: int) -> dict[str, Any]:
    spaces = {m: build() for m in ("plain", "before", "after")}
    cell = spaces["plain"][1]
    code = compile(cell, "<bench-cell>", "exec")
    times: dict[str, list[float]] = {m: [] for m in spaces}
    for r in range(rounds + 1):
        for mode in ("plain", "before", "after") if r % 2 else ("plain", "after", "before"):
            ns = spaces[mode][0]
            t0 = time.process_time()
            if mode == "plain":
                exec(code, ns)
            elif mode == "before":
                with Before():
                    report = bd.diagnose(cell, ns)
            else:
                report = bd.diagnose(cell, ns)
            if r:
                times[mode].append(time.process_time() - t0)
            if mode != "plain":
                assert report.exception is None, report.exception
                findings = [f.kind for f in report.findings]
                assert not findings, findings
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"workload": name, "plain_ms": med["plain"] * 1e3, "before_x": med["before"] / med["plain"],
            "after_x": med["after"] / med["plain"], "after_over_before": med["after"] / med["before"]}


def hooks_cost(n: int = 200_000) -> tuple[float, float]:
    """The watches' own work per iteration of a loop without accumulation or low-precision weights (a
    zero_grad, a backward(), a step), called directly: (best of 5, median) microseconds. A bound of what
    they add that does not depend on the machine's load the way whole runs do."""
    from backward_doctor.capture.watches.accumulation import AccumulationWatch
    from backward_doctor.capture.frames import UserFrames
    from backward_doctor.capture.watches.precision import PrecisionWatch
    from backward_doctor.trace.accumulation import Accumulation
    from backward_doctor.trace.precision import Precision

    ns = W.small_mlp()
    model, opt = ns["model"], ns["opt"]
    loss = model(ns["x"]).sum()
    acc = AccumulationWatch(Accumulation(), frames=UserFrames("<cell>"), iteration=lambda: 0,
                            params=lambda: list(model.parameters()))
    pre = PrecisionWatch(Precision(), frames=UserFrames("<cell>"), iteration=lambda: 0)

    def one() -> None:
        acc.zeroing(opt, "optimizer")
        acc.backward_began(loss)
        acc.backward_ended()
        acc.step_began(opt, (), {})
        pre.step_began(opt)
        pre.iteration_ended()
        acc.iteration_ended()

    for _ in range(100):  # past the first windows, which are kept in detail
        one()
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            one()
        runs.append((time.process_time() - t0) / n * 1e6)
    return min(runs), statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--hooks", action="store_true", help="only the watches' own work per iteration, called directly")
    args = ap.parse_args(argv)
    if args.hooks:
        best, med = hooks_cost()
        print(f"the watches' work per loop iteration (zero_grad, backward, step): best {best:.2f} us, median {med:.2f} us")
        return 0
    torch.set_num_threads(1)
    native_available(build=True)
    print(f"# diagnose() with the accumulation/precision watches vs without, same run: torch {torch.__version__}, "
          f"1 thread, {args.rounds} rounds, native recorder {'on' if native_available() else 'off'}")
    print(f"{'workload':<20}{'plain ms':>10}{'before x':>10}{'after x':>10}{'after/before':>14}")
    for name in args.only or list(WORKLOADS):
        row = measure(name, WORKLOADS[name], args.rounds)
        print(f"{name:<20}{row['plain_ms']:>10.1f}{row['before_x']:>10.3f}{row['after_x']:>10.3f}"
              f"{row['after_over_before']:>14.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
