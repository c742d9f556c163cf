"""The GPU checklist (issue 31) as one script for a lent GPU: what the doctor sees on CUDA, against what CUDA says.

    python benchmarks/gpu_validation.py --json OUT.json [--only memory oom ...]

Sections (each bounded, each a dict in the JSON; one failing section does not end the run):

- ``memory``: the doctor's live bytes against ``torch.cuda.max_memory_allocated()`` of the same step run
  plain, reserved vs allocated, NVML's view, the categories at the peak (backward runs on autograd's device
  threads on CUDA), gradients bit-identical;
- ``oom``: a real allocator OOM under ``set_per_process_memory_fraction``: the finding, each fix's
  predicted peak against the peak its fixed run really reached, and memory reclaimed afterwards;
- ``assert``: a device-side assert (advanced indexing, which the doctor does not pre-check) in child
  processes: plain (where Python reports it), under the doctor, and the ``sync`` fix's rewrite;
- ``snapshot``: the exported memory snapshot against ``torch.cuda.memory._snapshot()`` of the same step;
- ``async``: what notebook 02 says about asynchronous execution, measured;
- ``always_on``: ``%backward_doctor on`` on a CUDA training loop against the plain cell (wall time, synced);
- ``native``: the native recorder forced on for CUDA, op by op against the Python tier;
- ``compiled``: ``torch.compile`` (inductor) under the doctor: weights, recompilations, what the report says;
- ``panel``: a CUDA report saved as HTML and trace (``$OUT``) for a screenshot elsewhere;
- ``always_on_failures``: ``%backward_doctor on`` when a CUDA loop goes NaN, runs out of memory or indexes
  out of range (run last: a missed device-side assert ends the process's CUDA context).

Nothing here runs without CUDA (it says so and exits 2).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = "loss = torch.nn.functional.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n"
MiB = 1 << 20


def _mlp(width: int = 1024, depth: int = 4, batch: int = 512, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).cuda()
    return {"torch": torch, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
            "x": torch.randn(batch, width, device="cuda"), "y": torch.randint(0, 10, (batch,), device="cuda")}


def _finding(report: Any) -> dict[str, Any] | None:
    if not report.findings:
        return None
    f = report.findings[0]
    ev = {k: v for k, v in f.evidence.items() if isinstance(v, (int, float, str, bool, type(None)))}
    return {"kind": f.kind, "line": f.line, "message": f.message[:600], "fixes": list(f.fixes), "evidence": ev}


def memory() -> dict[str, Any]:
    import backward_doctor as bd

    out: dict[str, Any] = {}
    for name, build in (("mlp", lambda s: _mlp(seed=s)), ("transformer", lambda s: _transformer(s))):
        plain, doc = build(0), build(0)
        exec(STEP, build(9))  # a warm-up step: cuBLAS's workspaces (one per thread: backward runs on another) exist
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        exec(STEP, plain)
        torch.cuda.synchronize()
        plain_peak = torch.cuda.max_memory_allocated()
        plain_after = torch.cuda.memory_allocated()
        report = bd.diagnose(STEP, doc)
        mem = report.trace.memory
        cuda = dict(mem.cuda or {})
        cuda.pop("allocated_per_op", None)
        cuda.pop("allocator_snapshot", None)
        phases: dict[str, int] = {}
        for op in report.trace.ops:
            phases[op.phase] = phases.get(op.phase, 0) + 1
        out[name] = {
            "ok": report.ok, "engine": getattr(report.trace, "engine", None),
            "plain": {"allocated_before": base, "max_allocated": plain_peak, "allocated_after": plain_after,
                      "peak_above_start": plain_peak - base},
            "doctor": {"peak_bytes": mem.peak_bytes, "baseline_bytes": mem.baseline_bytes,
                       "peak_by_category": mem.peak_by_category, "device_total_bytes": mem.device_total_bytes,
                       "allocator": cuda},
            "ops_by_phase": phases, "op_count": report.trace.op_count,
            "grads_bit_identical": all(torch.equal(p.grad, q.grad) for p, q in
                                       zip(plain["model"].parameters(), doc["model"].parameters())),
        }
    return out


def _transformer(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 4), torch.nn.Flatten(), torch.nn.Linear(256 * 64, 10))
    model = model.cuda()
    return {"torch": torch, "model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
            "x": torch.randn(32, 64, 256, device="cuda"), "y": torch.randint(0, 10, (32,), device="cuda")}


def oom() -> dict[str, Any]:
    import backward_doctor as bd

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = 1536 * MiB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    out: dict[str, Any] = {"cap_bytes": cap}
    try:
        def ns() -> dict[str, Any]:
            return _mlp(width=2048, depth=8, batch=16384)

        start = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        report = bd.diagnose(STEP, ns())
        out["diagnose_s"] = time.perf_counter() - t0
        out["finding"] = _finding(report)
        f = report.findings[0] if report.findings else None
        out["predicted"] = {k: v for k, v in (f.evidence if f else {}).items()
                            if "peak" in k or "predict" in k or k in ("fixes_fit", "by_category", "live")}
        torch.cuda.empty_cache()
        out["allocated_after_oom"] = torch.cuda.memory_allocated() - start
        fixes = {}
        for fix in ("accumulate", "amp", "amp:fp16", "checkpoint"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                r = bd.diagnose(STEP, ns(), fix=fix)
                fr = r.fix_result
                comp = fr.comparison if fr else {}
                fixes[fix] = {"applied": fr.applied if fr else None, "fits": fr.fits if fr else None,
                              "message": (fr.message if fr else "")[:300], "code": (fr.code if fr else "")[:600],
                              "after_peak_bytes": (comp.get("after") or {}).get("peak_bytes"),
                              "before_peak_bytes": (comp.get("before") or {}).get("peak_bytes"),
                              "grad_max_rel_err": comp.get("grad_max_rel_err"),
                              "cuda_max_allocated_in_call": torch.cuda.max_memory_allocated(),
                              "finding": _finding(r)}
            except Exception as exc:  # noqa: BLE001
                fixes[fix] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        out["fixes"] = fixes
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    x = torch.ones(1024, 1024, device="cuda")
    out["usable_after"] = float(x.sum().item()) == 1024 * 1024
    out["allocated_at_end"] = torch.cuda.memory_allocated()
    return out


_ASSERT_SRC = "h = model(ids)\nloss = h.pow(2).sum()\nloss.backward()\nprint('loss', loss.item())\n"
_CHILD = r"""
import json, sys, traceback, torch
sys.path.insert(0, {root!r})
mode = {mode!r}
torch.manual_seed(0)


class Lookup(torch.nn.Module):  # a table read by advanced indexing (aten.index), which the doctor does not pre-check
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        return self.w[ids]


ns = {{"torch": torch, "model": Lookup().cuda(), "ids": torch.tensor([1, 2, 30], device="cuda")}}
src = {src!r}
res = {{"mode": mode}}
if mode == "plain":
    try:
        exec(compile(src, "<cell>", "exec"), ns)
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        res["error"] = type(exc).__name__ + ": " + str(exc).splitlines()[0]
        res["cell_line"] = [f.lineno for f in tb if f.filename == "<cell>"][-1:]
else:
    import backward_doctor as bd
    if mode == "sync":
        from backward_doctor.fixes import sync
        src = sync.rewrite(src, ns, None).code
        res["code"] = src
    r = bd.diagnose(src, ns, fix="sync" if mode == "syncfix" else None)
    if r.fix_result is not None:
        res["fix"] = {{"applied": r.fix_result.applied, "message": r.fix_result.message[:300],
                      "code": r.fix_result.code[:900]}}
        src = r.fix_result.code or src
    f = r.findings[0] if r.findings else None
    res["exception"] = (r.exception or "").splitlines()[:2]
    if f is not None:
        res["finding"] = {{"kind": f.kind, "line": f.line, "message": f.message[:500], "fixes": list(f.fixes),
                          "cuda_context_lost": f.evidence.get("cuda_context_lost")}}
        res["line_text"] = src.splitlines()[f.line - 1] if f.line else None
print("RESULT " + json.dumps(res))
"""


def device_assert() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, env in (("plain", {}), ("plain_launch_blocking", {"CUDA_LAUNCH_BLOCKING": "1"}), ("doctor", {}),
                      ("sync", {}), ("syncfix", {})):
        code = _CHILD.format(root=ROOT, mode=mode.split("_")[0], src=_ASSERT_SRC)
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               env={**os.environ, **env})
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            out[mode] = json.loads(line[7:]) if line else {"rc": p.returncode, "stderr": p.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            out[mode] = {"error": "timed out after 120 s"}
    return out


def snapshot() -> dict[str, Any]:
    import pickle
    import tempfile

    import backward_doctor as bd

    def peak_of(snap: dict) -> tuple[int, int]:
        live = peak = n = 0
        for e in snap["device_traces"][torch.cuda.current_device()]:
            if e["action"] == "alloc":
                live += e["size"]
                n += 1
                peak = max(peak, live)
            elif e["action"] == "free_completed":
                live -= e["size"]
        return peak, n

    ns = _mlp()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    exec(STEP, ns)
    torch.cuda.synchronize()
    own = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    report = bd.diagnose(STEP, _mlp())
    with tempfile.TemporaryDirectory() as d:
        path = report.save_memory_snapshot(os.path.join(d, "s.pickle"))
        with open(path, "rb") as fh:
            exported = pickle.load(fh)
    (p_own, n_own), (p_exp, n_exp) = peak_of(own), peak_of(exported)
    return {"plain_history_peak_bytes": p_own, "plain_allocs": n_own, "exported_peak_bytes": p_exp,
            "exported_allocs": n_exp, "report_peak_bytes": report.trace.memory.peak_bytes,
            "segments_exported": len(exported.get("segments", []))}


def async_claims() -> dict[str, Any]:
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    c = a @ a
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    c = a @ a
    t3 = time.perf_counter()
    c.sum().item()
    t4 = time.perf_counter()
    out: dict[str, Any] = {"matmul_8192_queue_us": (t1 - t0) * 1e6, "matmul_8192_done_ms": (t2 - t0) * 1e3,
                           "item_waits_ms": (t4 - t3) * 1e3}

    def train(sync: bool) -> list[torch.Tensor]:
        ns = _mlp(seed=1)
        model, opt, x, y = ns["model"], ns["opt"], ns["x"], ns["y"]
        for _ in range(200):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if sync:
                torch.cuda.synchronize()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        plain, synced = train(False), train(True)
    finally:
        torch.use_deterministic_algorithms(False)
    out["sync_between_backward_and_step_bit_identical_200_steps"] = all(torch.equal(p, q) for p, q in zip(plain, synced))
    big = torch.cuda.get_device_properties(0).total_memory * 2
    t0 = time.perf_counter()
    try:
        torch.empty(big, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        out["oom_raises_after_ms"] = (time.perf_counter() - t0) * 1e3
        out["oom_message"] = str(exc).splitlines()[0][:200]
    return out


_LOOP = ("for _ in range(100):\n    opt.zero_grad()\n    loss = torch.nn.functional.cross_entropy(model(x), y)\n"
         "    loss.backward()\n    opt.step()\ntorch.cuda.synchronize()\n")


def always_on_without_loss_read() -> dict[str, Any]:
    """``always_on``'s loops with the asleep loss read (a synchronisation an iteration) left out: its share."""
    from unittest import mock

    from backward_doctor.capture import python_sampling

    with mock.patch.object(python_sampling, "cuda_scalar", lambda t: None):
        return always_on(loops_only=True)


def always_on(loops_only: bool = False) -> dict[str, Any]:
    from IPython.core.interactiveshell import InteractiveShell

    import backward_doctor as bd

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    out: dict[str, Any] = {}
    for cell_name, cell in (("loop_100", _LOOP), ("loop_500", _LOOP.replace("range(100)", "range(500)")),
                            ("step", STEP + "torch.cuda.synchronize()\n"))[:2 if loops_only else 3]:
        times: dict[str, list[float]] = {"plain": [], "on": []}
        states = {"plain": _mlp(seed=2), "on": _mlp(seed=2)}
        for r in range(6):
            for mode in (("plain", "on") if r % 2 else ("on", "plain")):
                sh.run_cell("%backward_doctor " + ("on" if mode == "on" else "off"), store_history=False)
                sh.user_ns.update(states[mode])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = sh.run_cell(cell, store_history=False)
                t = time.perf_counter() - t0
                if not res.success:
                    raise RuntimeError(f"cell failed: {res.error_in_exec}")
                if r:
                    times[mode].append(t)
        sh.run_cell("%backward_doctor off", store_history=False)
        p, o = statistics.median(times["plain"]), statistics.median(times["on"])
        same = all(torch.equal(a, b) for a, b in zip(states["plain"]["model"].parameters(),
                                                      states["on"]["model"].parameters()))
        out[cell_name] = {"plain_ms": p * 1e3, "on_ms": o * 1e3, "x": o / p, "extra_ms": (o - p) * 1e3,
                          "weights_bit_identical": same,
                          "last_report_ops": bd.last_report().trace.op_count if bd.last_report() else None,
                          "recorded": bd.last_report().trace.iterations.recorded if bd.last_report() else None,
                          "notes": [n[:200] for n in bd.last_report().trace.notes] if bd.last_report() else None}
    return out


def native() -> dict[str, Any]:
    """The native recorder forced on for CUDA (``auto`` keeps CUDA on the Python tier), op by op."""
    from unittest import mock

    import backward_doctor as bd
    from backward_doctor import native as nat
    from backward_doctor.capture import native_capture

    t0 = time.perf_counter()
    ext = nat.load()
    out: dict[str, Any] = {"build_or_load_s": time.perf_counter() - t0, "status": nat.status()}
    if ext is None:
        return out

    def forced(build: bool = False) -> bool:
        e = nat.load() if build else nat.ready()
        return e is not None and not e.running()

    with mock.patch.object(native_capture, "native_available", forced):
        for name, build in (("mlp", lambda: _mlp(seed=3)), ("transformer", lambda: _transformer(3))):
            plain, py, nv = build(), build(), build()
            exec(STEP, plain)
            torch.cuda.synchronize()
            res: dict[str, Any] = {}
            reports = {}
            for engine, ns in (("python", py), ("native", nv)):
                try:
                    reports[engine] = bd.diagnose(STEP, ns, engine=engine)
                except Exception as exc:  # noqa: BLE001
                    res[engine] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            for engine, r in reports.items():
                ops = [(o.op, o.phase) for o in r.trace.ops]
                res[engine] = {"ok": r.ok, "op_count": r.trace.op_count, "peak_bytes": r.trace.memory.peak_bytes,
                               "peak_by_category": r.trace.memory.peak_by_category, "findings": _finding(r),
                               "backward_ops": sum(1 for o in ops if o[1] == "backward"),
                               "ops_head": ops[:6]}
            if len(reports) == 2:
                a = [(o.op, o.phase) for o in reports["python"].trace.ops]
                b = [(o.op, o.phase) for o in reports["native"].trace.ops]
                first = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)
                res["same_ops"] = a == b
                res["first_difference"] = None if first is None else {"index": first, "python": a[first],
                                                                      "native": b[first]}
                res["grads_bit_identical_native"] = all(torch.equal(p.grad, q.grad) for p, q in
                                                        zip(plain["model"].parameters(), nv["model"].parameters()))
            out[name] = res
    return out


def reader() -> dict[str, Any]:
    """What one read of the allocator's allocated bytes costs: ``torch.cuda.memory_allocated()`` against the
    doctor's reader (``capture/recorder/cuda.py``); they must agree."""
    from backward_doctor.capture.recorder.cuda import allocated_reader

    fast = allocated_reader()
    keep = torch.ones(1000, device="cuda")
    out: dict[str, Any] = {"agree": fast() == torch.cuda.memory_allocated(), "reader": fast.__qualname__}
    for name, fn in (("memory_allocated", torch.cuda.memory_allocated), ("reader", fast)):
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        out[name + "_us"] = (time.perf_counter() - t0) / 2000 * 1e6
    del keep
    return out


def profile() -> dict[str, Any]:
    """Where the Python tier's time goes on a CUDA step (cProfile of diagnose() on the transformer)."""
    import cProfile
    import io
    import pstats

    import backward_doctor as bd

    bd.diagnose(STEP, _transformer(4))  # warm
    ns = _transformer(4)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    report = bd.diagnose(STEP, ns)
    prof.disable()
    total = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
    return {"diagnose_s": total, "ops": report.trace.op_count, "top_tottime": buf.getvalue()[-5000:]}


def profile_always_on() -> dict[str, Any]:
    """Where always on's time goes on CUDA (cProfile of the cell run by IPython, the Python recorder sampling):
    a 500-iteration loop and a single step."""
    import cProfile
    import io
    import pstats

    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    sh.run_cell("%backward_doctor on", store_history=False)
    out: dict[str, Any] = {}
    for name, cell in (("loop_500", _LOOP.replace("range(100)", "range(500)")),
                       ("step", STEP + "torch.cuda.synchronize()\n")):
        sh.user_ns.update(_mlp(seed=8))
        sh.run_cell(cell, store_history=False)  # (warm)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        sh.run_cell(cell, store_history=False)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out[name] = {"s": time.perf_counter() - t0, "top_tottime": buf.getvalue()[-6000:]}
    sh.run_cell("%backward_doctor off", store_history=False)
    return out


_AMP_LOOP = """\
for xb, yb in loader:
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
    scaler.scale(loss).backward()
{clip}
    scaler.step(optimizer)
    scaler.update()
"""


def amp() -> dict[str, Any]:
    """The float16 GradScaler recipe on CUDA: clipping before ``unscale_`` (amp_misuse) and the documented order."""
    import backward_doctor as bd

    def ns() -> dict[str, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
        xs, ys = torch.randn(8, 32, 64, device="cuda"), torch.randint(0, 10, (8, 32), device="cuda")
        return {"torch": torch, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                "loader": list(zip(xs, ys)), "scaler": torch.amp.GradScaler("cuda")}

    clip = "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
    cells = {"clip_before_unscale": _AMP_LOOP.format(clip=clip),
             "unscale_then_clip": _AMP_LOOP.format(clip="    scaler.unscale_(optimizer)\n" + clip)}
    out: dict[str, Any] = {}
    for name, cell in cells.items():
        plain, doc = ns(), ns()
        exec(cell, plain)
        r = bd.diagnose(cell, doc)
        out[name] = {"finding": _finding(r), "kinds": [f.kind for f in r.findings],
                     "weights_bit_identical": all(torch.equal(p, q) for p, q in zip(plain["model"].parameters(),
                                                                                    doc["model"].parameters())),
                     "scale": doc["scaler"].get_scale()}
    return out


_NAN_LOOP = """
steps = 0
for i in range(60):
    opt.zero_grad()
    out = model(x)
    out = out / (i - 45) if i == 45 else out
    loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()
    opt.step()
    steps += 1
torch.cuda.synchronize()
"""
_OOM_LOOP = """
for i in range(30):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if i == 12:
        big = torch.empty(1 << 38, dtype=torch.uint8, device="cuda")
    loss.backward()
    opt.step()
"""
_BAD_INDEX_LOOP = """
for i in range(30):
    opt.zero_grad()
    target = y.clone()
    if i == 20:
        target[3] = 99
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
"""


def always_on_failures() -> dict[str, Any]:
    """``%backward_doctor on`` when a CUDA loop fails: NaN at iteration 45 (no exception), a real allocator OOM
    at iteration 12, a class index out of range at iteration 20 (a device-side assert when run plain: only
    under the doctor here, last, since an assert would end this process's CUDA context)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    import backward_doctor as bd

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    out: dict[str, Any] = {}
    for name, cell in (("nan_at_45", _NAN_LOOP), ("oom_at_12", _OOM_LOOP), ("bad_index_at_20", _BAD_INDEX_LOOP)):
        sh.run_cell("%backward_doctor on", store_history=False)
        sh.user_ns.update(_mlp(seed=4))
        t0 = time.perf_counter()
        with capture_output() as cap:
            res = sh.run_cell(cell, store_history=True)
        r = bd.last_report()
        shown = [o.data.get("text/plain", "")[:700] for o in cap.outputs]
        out[name] = {"cell_s": round(time.perf_counter() - t0, 2), "success": res.success,
                     "error": repr(res.error_in_exec)[:300] if res.error_in_exec else None,
                     "steps": sh.user_ns.get("steps"), "finding": _finding(r) if r else None,
                     "iteration": getattr(r.findings[0], "iteration", None) if r and r.findings else None,
                     "op": getattr(r.findings[0], "op", None) if r and r.findings else None,
                     "shown": shown, "stderr_tail": cap.stderr[-800:],
                     "allocated_after_mb": torch.cuda.memory_allocated() / MiB}
        sh.run_cell("%backward_doctor off", store_history=False)
        sh.user_ns.pop("big", None)
    return out


_COMPILED_STEP = ("opt.zero_grad()\nloss = torch.nn.functional.cross_entropy(cmodel(x), y)\nloss.backward()\n"
                  "opt.step()\n")


def compiled() -> dict[str, Any]:
    """``torch.compile`` (inductor) on CUDA under the doctor: the same weights as the plain compiled steps, no
    recompilation caused by the doctor, and what the report says of the compiled region."""
    import torch._dynamo.utils as dyn_utils

    import backward_doctor as bd

    plain, doc = _mlp(seed=5), _mlp(seed=5)
    for ns in (plain, doc):
        ns["cmodel"] = torch.compile(ns["model"])
    t0 = time.perf_counter()
    for _ in range(3):
        exec(_COMPILED_STEP, plain)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    frames = dict(dyn_utils.counters["stats"])
    reports = []
    t0 = time.perf_counter()
    for _ in range(3):
        reports.append(bd.diagnose(_COMPILED_STEP, doc))
    torch.cuda.synchronize()
    r = reports[-1]
    return {"plain_3_steps_s": round(compile_s, 1), "doctor_3_steps_s": round(time.perf_counter() - t0, 1),
            "dynamo_stats_before": frames, "dynamo_stats_after": dict(dyn_utils.counters["stats"]),
            "weights_bit_identical": all(torch.equal(p, q) for p, q in zip(plain["model"].parameters(),
                                                                           doc["model"].parameters())),
            "ok": [x.ok for x in reports], "op_count": [x.trace.op_count for x in reports],
            "ops_head": [o.op for o in r.trace.ops[:12]],
            "compile_check": str(getattr(r.trace, "compile_check", None))[:400],
            "findings": [f.kind for f in r.findings], "not_seen": str(getattr(r.trace, "not_seen", ""))[:300],
            "text": str(r)[:1200]}


def panel() -> dict[str, Any]:
    """The report of a CUDA step saved as HTML and as a trace, for a screenshot where a browser is."""
    import backward_doctor as bd

    out_dir = os.environ.get("OUT") or "."
    ns = _transformer(6)
    exec(STEP, _transformer(7))
    r = bd.diagnose(STEP, ns)
    html = r.save_html(os.path.join(out_dir, "cuda_report.html"))
    trace = r.save_trace(os.path.join(out_dir, "cuda_trace.json"))
    return {"html": html, "trace": trace, "ok": r.ok, "text": str(r)[:800]}


SECTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "memory": memory, "oom": oom, "assert": device_assert, "snapshot": snapshot, "async": async_claims,
    "always_on": always_on, "native": native, "reader": reader, "profile": profile, "amp": amp,
    "compiled": compiled, "panel": panel, "always_on_failures": always_on_failures,
    "always_on_without_loss_read": always_on_without_loss_read, "profile_always_on": profile_always_on}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", default=None, choices=sorted(SECTIONS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_validation: no CUDA device here; nothing run", file=sys.stderr)
        return 2
    sys.path.insert(0, ROOT)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "cuda": torch.version.cuda}
    for name in args.only or list(SECTIONS):
        t0 = time.perf_counter()
        try:
            results[name] = SECTIONS[name]()
        except Exception as exc:  # noqa: BLE001 - one section's failure is a result, the next still runs
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:600],
                             "traceback": traceback.format_exc()[-2500:]}
        results[name + "_s"] = round(time.perf_counter() - t0, 1)
        print(f"== {name} ({results[name + '_s']} s)\n{json.dumps(results[name], indent=1, default=str)[:6000]}",
              flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
