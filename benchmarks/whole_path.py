"""What users pay: the whole public path against the plain cell, same run, interleaved rounds.

    python benchmarks/whole_path.py              # every workload, 7 rounds
    python benchmarks/whole_path.py --quick      # 3 rounds, no 50M model, no 2,000-iteration loop
    python benchmarks/whole_path.py --smoke      # 1 round, two small workloads (tests)
    python benchmarks/whole_path.py --json OUT   # also write the figures

Each workload is a namespace (model, optimizer, batch) and the cell a user would write. Modes, on
separate copies of the namespace built from the same seed, interleaved round by round:

- ``plain``: ``exec`` of the cell, as a notebook runs it;
- ``diagnose``: ``backward_doctor.diagnose(cell, ns)``, the whole public path (engine choice, capture,
  finishing the trace, the rules, the report), what the CLI and the magic run before rendering;
- ``+ html``: the same plus ``report.to_html()`` (what a notebook without widgets displays);
- ``capture only``: the native recorder's first tier around the cell (the figure ``run.py`` reports;
  kept as one column, not the headline).

Times are process CPU time (one torch thread), medians over the rounds after a warm-up; ratios are
against ``plain`` measured in the same rounds. The per-phase columns split ``diagnose`` into capture
(the step under the recorder, hooks, watchdog), finish (records -> trace, end-of-step inspection),
rules, snapshot + replay (CUDA only: zero here), and the rest (argument checks, engine choice, report).
``--rss`` adds peak RSS growth of ``diagnose`` over a plain step on the 50M-parameter GPT-2 (separate
processes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import backward_doctor as bd  # noqa: E402
from backward_doctor.capture import finish as finish_mod  # noqa: E402
from backward_doctor.capture.native_capture import NativeCapture, native_available  # noqa: E402
from backward_doctor.run import step as step_mod  # noqa: E402
from workloads import GPT  # noqa: E402

STEP = "opt.zero_grad()\nloss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n"
LM_STEP = ("opt.zero_grad()\nlogits = model(idx[:, :-1])\n"
           "loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())\nloss.backward()\nopt.step()\n")
HF_STEP = "opt.zero_grad()\nout = model(**batch)\nloss = out.loss\nloss.backward()\nopt.step()\n"


def _loop(n: int) -> str:
    return (f"for i in range({n}):\n    opt.zero_grad()\n    loss = F.cross_entropy(model(x), y)\n"
            "    loss.backward()\n    opt.step()\n")


def mlp() -> tuple[dict, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return {"model": model, "opt": torch.optim.Adam(model.parameters()), "x": torch.randn(128, 256),
            "y": torch.randint(0, 10, (128,)), "F": F}, STEP


def small_mlp() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01), "x": torch.randn(16, 32),
            "y": torch.randint(0, 10, (16,)), "F": F}


def cnn() -> tuple[dict, str]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            "x": torch.randn(32, 3, 32, 32), "y": torch.randint(0, 10, (32,)), "F": F}, STEP


def transformer() -> tuple[dict, str]:
    torch.manual_seed(0)
    model = GPT()
    return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=3e-4),
            "idx": torch.randint(0, 256, (8, 64)), "F": F}, LM_STEP


def _hf(name: str) -> Callable[[], tuple[dict, str]]:
    def build() -> tuple[dict, str]:
        import compat_workloads as cw

        return cw.WORKLOADS[name]()
    build.__name__ = name
    return build


def gpt2_50m() -> tuple[dict, str]:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=50257, n_positions=128, n_embd=512, n_layer=8, n_head=8)
    model = tf.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, 50257, (2, 64))
    return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
            "batch": {"input_ids": ids, "labels": ids.clone()}}, HF_STEP


def loop(n: int) -> Callable[[], tuple[dict, str]]:
    def build() -> tuple[dict, str]:
        return small_mlp(), _loop(n)
    build.__name__ = f"loop_{n}"
    return build


WORKLOADS: dict[str, Callable[[], tuple[dict, str]]] = {
    "mlp": mlp, "cnn": cnn, "transformer": transformer,
    "hf_gpt2": _hf("hf_gpt2"), "hf_llama": _hf("hf_llama"), "hf_bert": _hf("hf_bert"), "hf_t5": _hf("hf_t5"),
    "hf_vit": _hf("hf_vit"), "hf_mixtral_moe": _hf("hf_mixtral_moe"), "peft_lora_gpt2": _hf("peft_lora_gpt2"),
    "gpt2_50m": gpt2_50m, "loop_200": loop(200), "loop_2000": loop(2000),
}
QUICK_SKIP = {"gpt2_50m", "loop_2000"}
SMOKE = ["mlp", "loop_200"]


class Phases:
    """Process time spent in the pieces of ``diagnose``, by wrapping the functions ``run_step`` calls."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, mod: Any, name: str, phase: str) -> None:
        fn = getattr(mod, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.t[phase] = self.t.get(phase, 0.0) + time.process_time() - t0
        self._saved.append((mod, name, fn))
        setattr(mod, name, timed)

    def __enter__(self) -> "Phases":
        self._wrap(step_mod, "run_source", "capture")   # the step under capture, finish included
        self._wrap(finish_mod, "finish", "finish")      # (subtracted from capture below)
        self._wrap(step_mod, "analyze", "rules")
        self._wrap(step_mod, "snapshot_for", "snapshot")
        self._wrap(step_mod, "replay_in_detail", "replay")
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self.t["capture"] = self.t.get("capture", 0.0) - self.t.get("finish", 0.0)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def measure(name: str, build: Callable[[], tuple[dict, str]], rounds: int, warmup: int = 1) -> dict[str, Any]:
    namespaces = {m: build() for m in ("plain", "diagnose", "html", "capture")}
    cell = namespaces["plain"][1]
    code = compile(cell, "<bench-cell>", "exec")
    native = native_available()
    times: dict[str, list[float]] = {m: [] for m in namespaces}
    phases: list[dict[str, float]] = []
    ops = 0
    for r in range(warmup + rounds):
        keep = r >= warmup
        t, _ = _timed(lambda: exec(code, namespaces["plain"][0]))
        if keep:
            times["plain"].append(t)
        with Phases() as ph:
            t, report = _timed(lambda: bd.diagnose(cell, namespaces["diagnose"][0]))
        assert report.exception is None, report.exception
        if keep:
            times["diagnose"].append(t)
            phases.append({**ph.t, "other": t - sum(ph.t.values())})
            ops = report.trace.op_count
        t, _ = _timed(lambda: bd.diagnose(cell, namespaces["html"][0]).to_html())
        if keep:
            times["html"].append(t)
        if native:
            def capture_only() -> None:
                with NativeCapture(namespaces["capture"][0], cell_file="<bench-cell>", detail=False):
                    exec(code, namespaces["capture"][0])
            t, _ = _timed(capture_only)
            if keep:
                times["capture"].append(t)
    med = {m: statistics.median(v) for m, v in times.items() if v}
    base = med["plain"]
    phase_med = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in
                 ("capture", "finish", "rules", "snapshot", "replay", "other")}
    return {"workload": name, "ops": ops, "plain_ms": base * 1e3,
            "diagnose_ms": med["diagnose"] * 1e3, "diagnose_x": med["diagnose"] / base,
            "html_ms": med["html"] * 1e3, "html_x": med["html"] / base,
            "capture_x": med["capture"] / base if "capture" in med else None,
            "extra_ms": (med["diagnose"] - base) * 1e3,
            "budget_ms": (1.25 * base + 0.025) * 1e3,
            "within_budget": med["diagnose"] <= 1.25 * base + 0.025,
            "phases_ms": {k: v * 1e3 for k, v in phase_med.items()}}


RSS_SNIPPET = """
import resource, sys, torch
sys.path[:0] = {paths!r}
import whole_path as W
torch.set_num_threads(1)
ns, cell = W.gpt2_50m()
exec(compile(cell, "<c>", "exec"), ns)          # one plain step first: optimizer state exists
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if {doctor!r}:
    import backward_doctor as bd
    r = bd.diagnose(cell, ns)
    assert r.exception is None, r.exception
else:
    exec(compile(cell, "<c>", "exec"), ns)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def rss_growth() -> dict[str, float]:
    """Peak RSS growth (MiB) of a second step, plain vs diagnose(), on the 50M model (fresh processes)."""
    out = {}
    for doctor in (False, True):
        code = RSS_SNIPPET.format(paths=[ROOT, HERE, os.path.join(ROOT, "tests")], doctor=doctor)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
        if res.returncode:
            raise RuntimeError(res.stderr[-2000:])
        out["diagnose" if doctor else "plain"] = int(res.stdout.strip().splitlines()[-1]) / 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rss", action="store_true", help="also measure peak RSS growth on the 50M model")
    ap.add_argument("--only", nargs="*", default=None, help="workload names")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    native_available(build=True)  # as diagnose() would: build or load the recorder before timing
    rounds = 1 if args.smoke else 3 if args.quick else 7
    names = args.only or (SMOKE if args.smoke else [n for n in WORKLOADS if not (args.quick and n in QUICK_SKIP)])
    print(f"# whole public path vs plain cell: torch {torch.__version__}, {platform.machine()}, 1 thread, "
          f"{rounds} rounds, native recorder {'on' if native_available() else 'off'}", flush=True)
    head = (f"{'workload':<16}{'ops':>8}{'plain ms':>10}{'diagnose':>10}{'x':>7}{'+html x':>9}{'capture x':>10}"
            f"{'extra ms':>10}  phases ms: capture / finish / rules / other")
    print(head, flush=True)
    rows = []
    for name in names:
        row = measure(name, WORKLOADS[name], rounds)
        rows.append(row)
        p = row["phases_ms"]
        cap = f"{row['capture_x']:.2f}" if row["capture_x"] else "-"
        mark = "" if row["within_budget"] else "  over 1.25x+25ms"
        print(f"{name:<16}{row['ops']:>8}{row['plain_ms']:>10.1f}{row['diagnose_ms']:>10.1f}{row['diagnose_x']:>7.2f}"
              f"{row['html_x']:>9.2f}{cap:>10}{row['extra_ms']:>10.1f}  {p['capture']:.1f} / {p['finish']:.1f} / "
              f"{p['rules']:.1f} / {p['other']:.1f}{mark}", flush=True)
    result: dict[str, Any] = {"torch": torch.__version__, "rounds": rounds, "rows": rows}
    if args.rss:
        result["rss_mib"] = rss_growth()
        print(f"peak RSS growth of one step on GPT-2 50M (MiB): {result['rss_mib']}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
