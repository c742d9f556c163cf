"""What ``--nproc`` costs on an FSDP2 loop, same run: ``python -m backward_doctor --nproc N FILE.py`` (the
whole public path: launcher, ranks under the doctor, combined report printed) against the same script on N
plain processes with torchrun's environment, alternating round by round.

    python benchmarks/distributed.py                      # 5 rounds, 2 ranks, 300 steps
    python benchmarks/distributed.py --rounds 3 --steps 100 --json out.json

Two figures per run, in CPU seconds (this machine's 2 cores are shared: wall times swing with whatever else
runs, CPU time much less): the whole command's (every process it started: ``RUSAGE_CHILDREN``), and the
loop's own as each rank measures it (``time.process_time`` around the loop, summed over the ranks): the
steady-state cost per step. Wall times are kept in the JSON too.
The workload: a 4-layer MLP of ~400k parameters, every ``Linear`` and the model ``fully_shard``-ed, AdamW,
batch 32, one torch thread per rank (as torchrun sets it), gloo on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backward_doctor.frontends.launch import free_port, rank_env  # noqa: E402

SCRIPT = """\
import datetime, time, torch, torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256),
                      nn.ReLU(), nn.Linear(256, 10))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
t0, c0 = time.perf_counter(), time.process_time()
for step in range({steps}):
    x = torch.randn(32, 256, generator=g); y = torch.randint(0, 10, (32,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step(); opt.zero_grad()
print(f"LOOP_S {{time.perf_counter() - t0:.6f}} {{time.process_time() - c0:.6f}}", flush=True)
dist.destroy_process_group()
"""
_LOOP = re.compile(r"LOOP_S ([0-9.]+) ([0-9.]+)")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def plain(path: str, nproc: int) -> dict[str, float]:
    """The script on ``nproc`` processes without the doctor."""
    port, env = free_port(), {**os.environ, "PYTHONPATH": ROOT}
    t0, c0 = time.perf_counter(), _children_cpu()
    procs = [subprocess.Popen([sys.executable, path], env=rank_env(k, nproc, port, env), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for k in range(nproc)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    return _figures(time.perf_counter() - t0, _children_cpu() - c0, "".join(outs), nproc)


def _figures(wall: float, cpu: float, out: str, nproc: int) -> dict[str, float]:
    loops = _LOOP.findall(out)
    if len(loops) != nproc:
        raise RuntimeError(out[-3000:])
    return {"wall_s": wall, "cpu_s": cpu, "loop_wall_s": max(float(w) for w, _ in loops),
            "loop_cpu_s": sum(float(c) for _, c in loops)}


def doctored(path: str, nproc: int) -> dict[str, float]:
    """``python -m backward_doctor --nproc N`` (the loop's times from the ranks' echoed output)."""
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", "--nproc", str(nproc), "--timeout", "1800",
                           path], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT},
                          timeout=3600)
    if "backward_doctor: OK" not in proc.stdout:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return _figures(time.perf_counter() - t0, _children_cpu() - c0, proc.stdout, nproc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fsdp_loop.py")
        with open(path, "w") as fh:
            fh.write(SCRIPT.format(steps=args.steps))
        plain(path, args.nproc)  # warm-up (imports, the native recorder's cache)
        rows = []
        for r in range(args.rounds):
            a, b = (plain(path, args.nproc), doctored(path, args.nproc)) if r % 2 == 0 else \
                tuple(reversed((doctored(path, args.nproc), plain(path, args.nproc))))
            rows.append({"plain": a, "doctor": b})
            print(f"round {r}: command CPU {b['cpu_s']:.1f}/{a['cpu_s']:.1f} s = {b['cpu_s'] / a['cpu_s']:.2f}x; loop "
                  f"CPU {b['loop_cpu_s']:.1f}/{a['loop_cpu_s']:.1f} s = {b['loop_cpu_s'] / a['loop_cpu_s']:.2f}x "
                  f"(wall {b['wall_s']:.1f}/{a['wall_s']:.1f} s)", flush=True)
    wall = [x["doctor"]["cpu_s"] / x["plain"]["cpu_s"] for x in rows]
    loop = [x["doctor"]["loop_cpu_s"] / x["plain"]["loop_cpu_s"] for x in rows]
    summary = {"workload": f"FSDP2 MLP, {args.steps} steps, {args.nproc} ranks (gloo, CPU)", "rounds": rows,
               "command_cpu_ratio_median": statistics.median(wall),
               "command_cpu_ratio_range": [min(wall), max(wall)],
               "loop_cpu_ratio_median": statistics.median(loop), "loop_cpu_ratio_range": [min(loop), max(loop)]}
    print(f"median CPU time: whole command {statistics.median(wall):.2f}x (range {min(wall):.2f}-{max(wall):.2f}), "
          f"loop {statistics.median(loop):.2f}x (range {min(loop):.2f}-{max(loop):.2f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
