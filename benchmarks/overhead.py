"""Capture overhead: a plain step vs the same step under the doctor, interleaved in rounds.

    python benchmarks/overhead.py [--rounds N] [--quick]

Prints, per workload, the median step time of each mode and its ratio to plain
(measured in the same process, same rounds). One thread, so the 2-core machine's
noise stays low; medians, not means.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backward_doctor.capture import Capture  # noqa: E402
from backward_doctor.rules import analyze  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


def _plain(step):
    step()


def _doctor(step):
    with Capture() as cap:
        step()
    analyze(cap.finish())


def _anomaly(step):
    with torch.autograd.detect_anomaly(check_nan=True):
        step()


MODES = {"plain": _plain, "doctor": _doctor, "anomaly": _anomaly}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    rounds = 5 if args.quick else args.rounds
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")  # detect_anomaly warns on every use
    print(f"torch {torch.__version__}, 1 thread, {rounds} rounds, medians (ms) and ratio vs plain")
    for name, make in WORKLOADS.items():
        step = make()
        for fn in MODES.values():  # warm up every mode once (lazy imports, allocator)
            fn(step)
        times = {m: [] for m in MODES}
        for _ in range(rounds):
            for m, fn in MODES.items():
                t = time.perf_counter()
                fn(step)
                times[m].append(time.perf_counter() - t)
        with Capture() as cap:
            step()
        ops = cap.finish().op_count
        med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
        cells = "  ".join(f"{m} {med[m]:7.2f} ms ({med[m] / med['plain']:.2f}x)" for m in MODES)
        us_per_op = (med["doctor"] - med["plain"]) * 1e3 / ops
        print(f"{name:<12} {ops:5d} ops  {cells}  doctor +{us_per_op:.1f} us/op")


if __name__ == "__main__":
    main()
