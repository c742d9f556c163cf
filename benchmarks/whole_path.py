"""What users pay: the whole public path against the plain cell, same run, interleaved rounds.

    python benchmarks/whole_path.py              # every workload, 7 rounds
    python benchmarks/whole_path.py --quick      # 3 rounds, no 50M model, no 2,000-iteration loop
    python benchmarks/whole_path.py --smoke      # 1 round, two small workloads (tests)
    python benchmarks/whole_path.py --json OUT   # also write the figures
    python benchmarks/whole_path.py --compare benchmarks/results-whole-path-2026-11-24-before.json

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
``--rss`` adds the peak RSS of ``diagnose`` above the RSS before the step, against a plain step, on the
50M-parameter GPT-2 (separate processes, peak reset before the step). ``--panel`` times the panel the
magic displays (widget + mimebundle) after ``diagnose``; ``--magic`` times ``%%backward_doctor`` in a real
Jupyter kernel until it goes idle with the panel displayed, against the plain cell; ``--cli`` times
``python -m backward_doctor SCRIPT`` against ``python SCRIPT`` (whole processes). ``--always-on`` adds the
"always on" column (``benchmarks/always_on.py``): ``%backward_doctor on`` against the plain cell through
IPython's ``run_cell``, on a cell with no autograd, the single steps, the loops and ``trainer.train()``, and
what is held between cells.
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
from backward_doctor.capture.end import finish as finish_mod  # noqa: E402
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


def library(name: str) -> Callable[[], tuple[dict, str]]:
    """A library's loop (tests/library_loops.py, tiny and offline), 16 optimizer steps: `Trainer.train()`,
    Lightning `fit()` (a new `pl.Trainer` in the cell: a finished one would not train again), Accelerate."""
    def build() -> tuple[dict, str]:
        import library_loops as ll

        if name == "hf_trainer":
            return ll.hf_trainer(steps=16, n=64), ll.HF_TRAIN
        if name == "lightning_fit":
            ns = ll.lit_fit(steps=16)
            ns["ll"] = ll
            return ns, "trainer = ll.lit_trainer(16)\ntrainer.fit(model, loader)\n"
        return ll.accelerate_loop(accum=2, n=256), ll.ACCEL_LOOP
    build.__name__ = name
    return build


WORKLOADS: dict[str, Callable[[], tuple[dict, str]]] = {
    "mlp": mlp, "cnn": cnn, "transformer": transformer,
    "hf_gpt2": _hf("hf_gpt2"), "hf_llama": _hf("hf_llama"), "hf_bert": _hf("hf_bert"), "hf_t5": _hf("hf_t5"),
    "hf_vit": _hf("hf_vit"), "hf_mixtral_moe": _hf("hf_mixtral_moe"), "peft_lora_gpt2": _hf("peft_lora_gpt2"),
    "gpt2_50m": gpt2_50m, "loop_200": loop(200), "loop_2000": loop(2000),
    "hf_trainer": library("hf_trainer"), "lightning_fit": library("lightning_fit"), "accelerate": library("accelerate"),
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
import sys, torch
sys.path[:0] = {paths!r}
import whole_path as W
torch.set_num_threads(1)
ns, cell = W.gpt2_50m()
exec(compile(cell, "<c>", "exec"), ns)          # one plain step first: optimizer state exists
if {doctor!r}:
    import backward_doctor as bd
    bd.diagnose("x = 1", {{}})                  # the doctor imported and its recorder loaded
def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
open("/proc/self/clear_refs", "w").write("5")   # reset the peak: what the second step adds is measured
base = rss()
if {doctor!r}:
    r = bd.diagnose(cell, ns)
    assert r.exception is None, r.exception
else:
    exec(compile(cell, "<c>", "exec"), ns)
print(hwm() - base)
"""


def rss_growth() -> dict[str, float]:
    """Peak RSS above the RSS before the step (MiB), plain vs diagnose(), on the 50M model: separate
    processes, each after one plain step (so AdamW's state exists) and with the peak reset (Linux)."""
    out = {}
    for doctor in (False, True):
        code = RSS_SNIPPET.format(paths=[ROOT, HERE, os.path.join(ROOT, "tests")], doctor=doctor)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
        if res.returncode:
            raise RuntimeError(res.stderr[-2000:])
        out["diagnose" if doctor else "plain"] = int(res.stdout.strip().splitlines()[-1]) / 1024
    out["added_by_doctor"] = out["diagnose"] - out["plain"]
    return out


def panel_times(names: list[str], rounds: int) -> list[dict[str, Any]]:
    """From the end of ``diagnose()`` to what the magic displays: the panel widget built and its
    mimebundle (widget + static HTML fallback) made; plus a 100k-op step (wall time, ms)."""
    from backward_doctor.frontends.panel import Panel

    def big() -> tuple[dict, str]:
        return {"x": torch.ones(64), "torch": torch}, "y = x\nfor i in range(100_000):\n    y = y + 1\n"

    rows = []
    for name, build in [(n, WORKLOADS[n]) for n in names] + [("100k_ops", big)]:
        ns, cell = build()
        report = bd.diagnose(cell, ns)
        t = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            Panel(report, cell, ns)._repr_mimebundle_()
            t.append(time.perf_counter() - t0)
        rows.append({"workload": name, "ops": report.trace.op_count, "panel_ms": statistics.median(t[1:]) * 1e3})
    return rows


def loop_profile(n: int = 2000, rounds: int = 3) -> dict[str, Any]:
    """Per-iteration cost over a ``n``-iteration loop cell, plain vs ``diagnose()``: the cell stamps the
    time at the end of each iteration; medians per tenth of the loop (same run, interleaved), so a cost
    that grew with the iteration would show."""
    cell = ("import time as _t\n_ts = [_t.perf_counter()]\n" + _loop(n).replace(
        "    opt.step()\n", "    opt.step()\n    _ts.append(_t.perf_counter())\n"))
    per: dict[str, list[list[float]]] = {"plain": [], "diagnose": []}
    for r in range(rounds + 1):
        for mode in per:
            ns = small_mlp()
            if mode == "plain":
                exec(compile(cell, "<c>", "exec"), ns)
            else:
                assert bd.diagnose(cell, ns).exception is None
            ts = ns["_ts"]
            if r:
                per[mode].append([b - a for a, b in zip(ts, ts[1:])])
    tenth = n // 10
    out: dict[str, Any] = {"n": n, "deciles_us": {}, "ratio": []}
    for mode, runs in per.items():
        med = [statistics.median(v) for v in zip(*runs)]  # per iteration, over the rounds
        out["deciles_us"][mode] = [statistics.median(med[k * tenth:(k + 1) * tenth]) * 1e6 for k in range(10)]
        out[f"{mode}_max_us"] = max(med) * 1e6
    out["ratio"] = [d / p for d, p in zip(out["deciles_us"]["diagnose"], out["deciles_us"]["plain"])]
    return out


KERNEL_SETUP = """
import sys, torch
sys.path[:0] = {paths!r}
torch.set_num_threads(1)
import whole_path as W
_ns, _cell = W.WORKLOADS[{name!r}]()
globals().update(_ns)
%load_ext backward_doctor
"""


def magic_times(names: list[str], rounds: int) -> list[dict[str, Any]]:
    """The magic in a real Jupyter kernel (jupyter_client): wall time from sending the cell to the kernel
    going idle (the panel's display message comes before), ``%%backward_doctor`` vs the plain cell,
    interleaved, medians. Includes what a notebook adds (messages, the widget's comm)."""
    from jupyter_client.manager import start_new_kernel

    rows = []
    for name in names:
        km, kc = start_new_kernel(kernel_name="python3")
        try:
            def run(code: str) -> tuple[float, bool]:
                t0 = time.perf_counter()
                msg_id = kc.execute(code)
                shown = False
                while True:
                    msg = kc.get_iopub_msg(timeout=300)
                    if msg["parent_header"].get("msg_id") != msg_id:
                        continue
                    if msg["msg_type"] == "display_data":
                        shown = True
                    if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                        return time.perf_counter() - t0, shown
            _, _ = run(KERNEL_SETUP.format(paths=[ROOT, HERE, os.path.join(ROOT, "tests")], name=name))
            cell = WORKLOADS[name]()[1]
            plain, magic = [], []
            for r in range(rounds + 1):
                tp, _ = run(cell)
                tm, shown = run("%%backward_doctor\n" + cell)
                assert shown, "the panel was not displayed"
                if r:
                    plain.append(tp)
                    magic.append(tm)
            p, m = statistics.median(plain), statistics.median(magic)
            rows.append({"workload": name, "plain_ms": p * 1e3, "magic_ms": m * 1e3, "magic_x": m / p,
                         "extra_ms": (m - p) * 1e3})
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    return rows


CLI_SCRIPT = """import sys, torch
sys.path[:0] = {paths!r}
torch.set_num_threads(1)
import whole_path as W
_ns, _cell = W.WORKLOADS[{name!r}]()
globals().update(_ns)
exec(compile(_cell, __file__, "exec"))
"""


def cli_times(names: list[str], rounds: int, tmp: str) -> list[dict[str, Any]]:
    """``python -m backward_doctor SCRIPT`` against ``python SCRIPT`` (wall time of the whole process,
    interpreter and torch import included, as a CI job pays it)."""
    rows = []
    for name in names:
        path = os.path.join(tmp, f"bench_{name}.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(CLI_SCRIPT.format(paths=[ROOT, HERE, os.path.join(ROOT, "tests")], name=name))
        plain, cli = [], []
        for r in range(rounds + 1):
            for cmd, out in (([sys.executable, path], plain), ([sys.executable, "-m", "backward_doctor", path], cli)):
                t0 = time.perf_counter()
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
                if res.returncode:
                    raise RuntimeError(res.stderr[-2000:])
                if r:
                    out.append(time.perf_counter() - t0)
        p, c = statistics.median(plain), statistics.median(cli)
        rows.append({"workload": name, "plain_s": p, "cli_s": c, "cli_x": c / p, "extra_s": c - p})
    return rows


def compare(rows: list[dict[str, Any]], path: str) -> None:
    """The new figures beside an earlier run's (same script on older code): diagnose() ms and x."""
    with open(path, encoding="utf-8") as fh:
        old = {r["workload"]: r for r in json.load(fh)["rows"]}
    print(f"\n{'workload':<16}{'before':>22}{'now':>22}{'budget':>10}", flush=True)
    for r in rows:
        o = old.get(r["workload"])
        was = f"{o['diagnose_ms']:.1f} ms = {o['diagnose_x']:.2f}x" if o else "-"
        now = f"{r['diagnose_ms']:.1f} ms = {r['diagnose_x']:.2f}x"
        print(f"{r['workload']:<16}{was:>22}{now:>22}{'met' if r['within_budget'] else 'MISSED':>10}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rss", action="store_true", help="also measure peak RSS growth on the 50M model")
    ap.add_argument("--panel", action="store_true", help="also time the panel (widget + mimebundle)")
    ap.add_argument("--magic", action="store_true", help="also time %%%%backward_doctor in a real Jupyter kernel")
    ap.add_argument("--cli", action="store_true", help="also time python -m backward_doctor against python")
    ap.add_argument("--iterations", action="store_true", help="also the per-iteration cost over a 2,000-step loop")
    ap.add_argument("--always-on", action="store_true",
                    help="also %%backward_doctor on against the plain cell in IPython (benchmarks/always_on.py)")
    ap.add_argument("--only", nargs="*", default=None, help="workload names")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", default=None, metavar="OLD.json",
                    help="print each workload beside the same figures of an earlier run (--json of older code)")
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
    if args.compare:
        compare(rows, args.compare)
    if args.rss:
        result["rss_mib"] = rss_growth()
        print(f"peak RSS above the RSS before one step on GPT-2 50M (MiB): {result['rss_mib']}", flush=True)
    small = [n for n in ("mlp", "transformer", "hf_gpt2") if n in names] or names[:1]
    if args.iterations:
        result["iterations"] = lp = loop_profile(200 if args.smoke else 2000, rounds)
        print("per-iteration median by tenth of the loop, diagnose / plain: "
              + " ".join(f"{x:.2f}" for x in lp["ratio"]) + f" (plain {lp['deciles_us']['plain'][0]:.0f} us; slowest "
              f"iteration {lp['diagnose_max_us']:.0f} us under the doctor, {lp['plain_max_us']:.0f} us plain)", flush=True)
    if args.panel:
        result["panel"] = panel_times(small, rounds)
        for row in result["panel"]:
            print(f"panel {row['workload']:<14} ({row['ops']} ops): {row['panel_ms']:.0f} ms", flush=True)
    if args.magic:
        result["magic"] = magic_times(small, rounds)
        for row in result["magic"]:
            print(f"magic {row['workload']:<14} plain {row['plain_ms']:.0f} ms, %%backward_doctor until the panel "
                  f"{row['magic_ms']:.0f} ms ({row['magic_x']:.2f}x, +{row['extra_ms']:.0f} ms)", flush=True)
    if args.cli:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result["cli"] = cli_times(small, rounds, tmp)
        for row in result["cli"]:
            print(f"cli   {row['workload']:<14} python {row['plain_s']:.2f} s, python -m backward_doctor "
                  f"{row['cli_s']:.2f} s ({row['cli_x']:.2f}x, +{row['extra_s']:.2f} s)", flush=True)
    if args.always_on:
        import always_on

        result["always_on"] = always_on.run(WORKLOADS, names, rounds)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
