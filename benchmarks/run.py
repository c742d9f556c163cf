"""Overhead benchmark: plain step vs the doctor vs anomaly mode vs the profiler.

    python benchmarks/run.py                  # full: 15 rounds, 1M-op trace check
    python benchmarks/run.py --quick          # < 2 minutes
    python benchmarks/run.py --device cuda    # on a GPU: + memory history cost, peak vs the allocator
    python benchmarks/run.py --smoke          # one round, tiny trace: checks the script runs (tests)

All modes run in one process, interleaved round by round on the same three CPU
workloads (4-layer MLP, small CNN with BatchNorm, small GPT-style transformer), one
thread. It prints medians and ratios against the plain step measured in the same
rounds, ops per step and microseconds per op, the time to build the report, and
peak RSS of a separate process per mode (with vs without the doctor). On CUDA every
mode ends with ``torch.cuda.synchronize()``; the doctor runs with and without the
allocator's memory history, and its peak (live tensor bytes) is compared with
``torch.cuda.max_memory_allocated`` over the same step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's own logging off the results

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from backward_doctor.capture.native_capture import NativeCapture, native_available  # noqa: E402
from backward_doctor.capture import Capture  # noqa: E402
from backward_doctor import native  # noqa: E402
from backward_doctor.report import Report  # noqa: E402
from backward_doctor.analysis.rules import analyze  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


# Every mode runs the step from a "cell" (code compiled under a cell's file name), as the
# magic does: the doctor's frame walk stops at the cell, as it does in a notebook.
CELL_FILE = "<benchmark-cell>"
CELL = compile("step()", CELL_FILE, "exec")


DEVICE = "cpu"
NATIVE = False  # set in main(): the native recorder is built and the device is the CPU


def _run_cell(step) -> None:
    exec(CELL, {"step": step})
    if DEVICE == "cuda":  # time the kernels, not just their launch
        torch.cuda.synchronize()


def plain(step):
    _run_cell(step)


def _doctored(step, cls=Capture, **kwargs):
    with cls(cell_file=CELL_FILE, **kwargs) as cap:
        _run_cell(step)
    return cap


def doctor(step):
    """First tier, as the magic runs it: the native recorder where it is available (CPU)."""
    return _doctored(step, NativeCapture if NATIVE else Capture, detail=False)


def doctor_python(step):
    """First tier on the Python dispatch mode (where the native recorder cannot be built)."""
    return _doctored(step, detail=False)


def doctor_no_history(step):
    """First tier on CUDA (the Python tier) without the allocator's memory history (its cost, by difference)."""
    return _doctored(step, detail=False, cuda_history=False)


def doctor_detail(step):
    """Second tier: every op screened for NaN/Inf."""
    return _doctored(step, detail=True)


def anomaly(step):
    with torch.autograd.detect_anomaly(check_nan=True):
        _run_cell(step)


def profiler(step):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True,
                 with_stack=True) as prof:
        _run_cell(step)
    return prof


MODES = {"plain": plain, "doctor": doctor, "doctor_python": doctor_python, "doctor_detail": doctor_detail,
         "anomaly": anomaly, "profiler": profiler}
CUDA_MODES = {"doctor_no_history": doctor_no_history}


def modes() -> dict:
    return {**MODES, **CUDA_MODES} if DEVICE == "cuda" else MODES


def report_time(cap: Capture) -> float:
    t = time.perf_counter()
    trace = cap.finish()
    Report(findings=analyze(trace), trace=trace)
    return time.perf_counter() - t


def profiler_table_time(prof) -> float:
    t = time.perf_counter()
    prof.key_averages(group_by_input_shape=True).table(sort_by="cpu_time_total", row_limit=20)
    return time.perf_counter() - t


def cuda_peaks(step) -> dict:
    """Peak device memory of one plain step and one doctor step, and the doctor's own peak figure."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    plain(step)
    plain_max = torch.cuda.max_memory_allocated()
    cap = doctor(step)  # resets the peak stats itself at start
    trace = cap.finish()
    return {"plain_max_allocated": plain_max, "doctor_max_allocated": trace.memory.cuda["max_allocated"],
            "doctor_peak_live": trace.memory.peak_bytes}


def bench_workload(name: str, rounds: int) -> dict:
    step = WORKLOADS[name](DEVICE)
    all_modes = modes()
    for fn in all_modes.values():  # warm-up: lazy imports, allocator, caches
        fn(step)
    times = {m: [] for m in all_modes}
    extra = {"report_s": [], "profiler_tables_s": []}
    for _ in range(rounds):
        for m, fn in all_modes.items():
            t = time.perf_counter()
            out = fn(step)
            times[m].append(time.perf_counter() - t)
            if m == "doctor":
                extra["report_s"].append(report_time(out))
            elif m == "profiler":
                extra["profiler_tables_s"].append(profiler_table_time(out))
    cap = doctor(step)
    ops = cap.finish().op_count
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"workload": name, "ops": ops, "median_s": med,
            "ratio": {m: med[m] / med["plain"] for m in all_modes},
            "us_per_op": {m: (med[m] - med["plain"]) * 1e6 / ops for m in all_modes if m != "plain"},
            "cuda": cuda_peaks(step) if DEVICE == "cuda" else None,
            "report_s": statistics.median(extra["report_s"]),
            "report_vs_step": statistics.median(extra["report_s"]) / med["plain"],
            "profiler_tables_steps": statistics.median(extra["profiler_tables_s"]) / med["plain"]}


def rss_child(workload: str, mode: str, steps: int) -> int:
    """Peak RSS (bytes) of a fresh process running ``steps`` steps in ``mode``."""
    code = (f"import sys; sys.path[:0] = [{os.path.dirname(HERE)!r}, {HERE!r}]\n"
            "import torch, resource; torch.set_num_threads(1)\n"
            "import run; from run import MODES, report_time; from workloads import WORKLOADS\n"
            f"run.NATIVE = {mode!r} == 'doctor' and run.native_available(build=True)\n"
            f"step = WORKLOADS[{workload!r}]()\n"
            "MODES['plain'](step)\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
            f"for _ in range({steps}):\n"
            f"    out = MODES[{mode!r}](step)\n"
            f"    if {mode!r} == 'doctor': report_time(out)\n"
            "print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, peak = out.stdout.split()[-2:]
    return int(base), int(peak)


def million_ops(n: int, cls=None) -> dict:
    """Memory of a bounded trace: ``n`` tiny ops in one step (Python heap via tracemalloc, plus what the
    native recorder held in C++ at the end of the step)."""
    cls = cls or (NativeCapture if NATIVE else Capture)
    x = torch.ones(4)
    with cls(cell_file=CELL_FILE, detail=False) as cap:  # warm-up: imports must not count as trace memory
        x + 1
    cap.finish()
    code = compile("y = x\nfor _ in range(n):\n    y = y + 1\n", CELL_FILE, "exec")
    tracemalloc.start()
    t = time.perf_counter()
    with cls(cell_file=CELL_FILE, detail=False) as cap:
        exec(code, {"x": x, "n": n})
    captured = time.perf_counter() - t
    trace = cap.finish()
    elapsed = time.perf_counter() - t
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    native_bytes = getattr(cap, "buffer_bytes", 0)
    return {"ops": trace.op_count, "kept": len(trace.ops), "trace_bytes": current, "peak_bytes": peak,
            "native_bytes": native_bytes, "capture_s": captured, "seconds": elapsed, "engine": trace.engine}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds, smaller trace test (< 2 min)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="one round, no RSS, a 2,000-op trace: checks the script")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available to this torch "
                f"({torch.__version__}); nothing was run")
    global DEVICE, NATIVE
    DEVICE = args.device
    NATIVE = DEVICE == "cpu" and native_available(build=True)
    if not NATIVE:
        print(f"# doctor = the Python first tier (native recorder: {native.status()['reason'] or 'not on CUDA'})")
    rounds = args.rounds or (1 if args.smoke else 5 if args.quick else 15)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    gpu = f", {torch.cuda.get_device_name()}" if DEVICE == "cuda" else ""
    print(f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, device {DEVICE}{gpu}, 1 thread, {rounds} rounds (medians)", flush=True)
    results = []
    header = f"{'workload':<12}{'ops':>6}  " + "  ".join(f"{m:>15}" for m in modes())
    print(header)
    for name in WORKLOADS:
        r = bench_workload(name, rounds)
        results.append(r)
        cells = "  ".join(f"{r['median_s'][m] * 1e3:7.2f}ms {r['ratio'][m]:4.2f}x" for m in modes())
        print(f"{name:<12}{r['ops']:>6}  {cells}", flush=True)
        if r["cuda"]:
            c = r["cuda"]
            print(f"{'':<12}cuda max_memory_allocated: plain {c['plain_max_allocated'] / 2**20:.1f} MiB, with the "
                  f"doctor {c['doctor_max_allocated'] / 2**20:.1f} MiB "
                  f"({c['doctor_max_allocated'] / max(1, c['plain_max_allocated']):.3f}x); the doctor's peak of "
                  f"live tensors {c['doctor_peak_live'] / 2**20:.1f} MiB "
                  f"({c['doctor_peak_live'] / max(1, c['doctor_max_allocated']):.3f}x the allocator's)")
    print("\nper op (us, over plain):", "; ".join(
        f"{r['workload']}: " + ", ".join(f"{m} {v:.1f}" for m, v in r["us_per_op"].items()) for r in results))
    print("report build / plain step:", "; ".join(f"{r['workload']} {r['report_vs_step']:.2f}" for r in results))
    print("profiler tables / plain step:", "; ".join(f"{r['workload']} {r['profiler_tables_steps']:.1f}"
                                                    for r in results))
    steps = 3 if args.quick else 10
    rss = {}
    for name in ([] if args.smoke or DEVICE == "cuda" else WORKLOADS):  # host memory: a CPU question
        (b0, plain_rss), (b1, doc_rss) = rss_child(name, "plain", steps), rss_child(name, "doctor", steps)
        rss[name] = {"plain": plain_rss, "doctor": doc_rss, "ratio": doc_rss / plain_rss,
                     "plain_growth": plain_rss - b0, "doctor_growth": doc_rss - b1}
        print(f"peak RSS {name}: plain {plain_rss / 2**20:.1f} MiB, doctor {doc_rss / 2**20:.1f} MiB "
              f"({doc_rss / plain_rss:.3f}x); growth over one warm plain step: plain "
              f"{(plain_rss - b0) / 2**20:.1f} MiB, doctor {(doc_rss - b1) / 2**20:.1f} MiB")
    n = 2_000 if args.smoke else 200_000 if args.quick else 1_000_000
    big = million_ops(n)
    print(f"trace of {big['ops']} ops ({big['kept']} kept one by one, {big['engine']} tier): "
          f"{big['trace_bytes'] / 2**20:.1f} MiB held after finish, {big['peak_bytes'] / 2**20:.1f} MiB peak "
          f"(Python heap) + {big['native_bytes'] / 2**20:.1f} MiB in the native recorder; "
          f"{big['capture_s']:.1f} s to capture, {big['seconds']:.1f} s with finish")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "rss": rss, "trace": big}, fh, indent=1)


if __name__ == "__main__":
    main()
