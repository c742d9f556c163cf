"""The native first tier (C++ recorder) against the Python tier it replaces on the hot path.

Skipped, with the reason, where the recorder cannot be built (no compiler or ninja).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor import native
from backward_doctor.capture.native_capture import NativeCapture, native_available
from backward_doctor.capture import Capture

pytestmark = pytest.mark.skipif(not native_available(build=True),
                                reason=f"native recorder unavailable: {native.status()['reason']}")

CELL = "<native-test-cell>"
STEP = compile("opt.zero_grad()\nloss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n", CELL, "exec")
# Autograd's own detaches (when it saves an output) and the optimizer's profiler ranges reach a
# Python dispatch mode but are not the user's ops; the native recorder does not list them.
_NOISE = ("aten::detach", "profiler::_record_function_enter_new", "profiler::_record_function_exit")


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    return {"F": F, "model": model, "opt": torch.optim.Adam(model.parameters()),
            "x": torch.randn(16, 32), "y": torch.randint(0, 5, (16,))}


def _cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 5))
    return {"F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            "x": torch.randn(4, 3, 16, 16), "y": torch.randint(0, 5, (4,))}


def _trace(cls, ns):
    with cls(ns, cell_file=CELL, detail=False) as cap:
        exec(STEP, ns)
    return cap.finish()


def _ops(trace):
    ops = [o for o in trace.ops if o.op not in _NOISE]
    pos = {o.index: i for i, o in enumerate(ops)}
    return [(o.op, o.phase, pos.get(o.fwd_index), [m.shape for m in o.inputs], [m.shape for m in o.outputs],
             [m.dtype for m in o.inputs + o.outputs], [m.requires_grad for m in o.inputs + o.outputs],
             o.grad_enabled, o.where.line, o.where.cell_line, o.where.module) for o in ops], ops


@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_same_trace_as_the_python_tier(make):
    ns = make()
    exec(STEP, ns)  # a first step makes the optimizer state, as in training
    py, nat = _trace(Capture, ns), _trace(NativeCapture, ns)
    assert nat.engine == "native" and py.engine == "python"
    (a, a_ops), (b, b_ops) = _ops(py), _ops(nat)
    assert [r[:2] for r in a] == [r[:2] for r in b]
    assert a == b
    # Live bytes after every op, by the same accounting (a Python number passed to an in-place op
    # is an 8-byte tensor only the native recorder sees while the op runs).
    assert all(abs(x.live_bytes - y.live_bytes) <= 64 for x, y in zip(a_ops, b_ops))
    assert nat.memory.peak_bytes == py.memory.peak_bytes
    assert nat.memory.peak_by_category == py.memory.peak_by_category
    assert nat.backward_roots == py.backward_roots == ["NllLossBackward0"]
    assert [(s.optimizer, s.line) for s in nat.optimizer_steps] == \
        [(s.optimizer, s.line) for s in py.optimizer_steps]


def test_gradients_are_bit_identical_and_nothing_is_kept_alive():
    plain, doc = _mlp(), _mlp()
    exec(STEP, plain)
    seen = []
    doc["keep"] = lambda t: seen.append(weakref.ref(t)) or t
    step = compile("h = keep(model[0](x))\nloss = F.cross_entropy(model[1:](h), y)\nloss.backward()\n"
                   "opt.step()\ndel h, loss\n", CELL, "exec")
    plain_step = compile("loss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n", CELL, "exec")
    plain, doc = _mlp(), {**_mlp(), "keep": doc["keep"]}
    exec(plain_step, plain)
    with NativeCapture(doc, cell_file=CELL) as cap:
        exec(step, doc)
    trace = cap.finish()
    for p, q in zip(plain["model"].parameters(), doc["model"].parameters()):
        assert torch.equal(p.grad, q.grad) and torch.equal(p, q)
    gc.collect()
    assert seen and all(r() is None for r in seen), "an activation outlived the step"
    assert trace.op_count > 0


def test_failing_op_evidence_matches_the_python_tier():
    src = ("emb = torch.nn.Embedding(10, 4)\nidx = torch.tensor([[1, 2], [3, 12]])\n"
           "out = emb(idx).sum()\n")
    reports = {e: bd.diagnose(src, {"torch": torch}, engine=e) for e in ("python", "native")}
    py, nat = (reports[e].trace for e in ("python", "native"))
    assert nat.engine == "native"
    assert nat.failed_op is not None and py.failed_op is not None
    assert (nat.failed_op.op, nat.failed_op.phase, nat.failed_op.where.line) == \
        (py.failed_op.op, py.failed_op.phase, py.failed_op.where.line)
    assert [m.shape for m in nat.failed_op.inputs] == [m.shape for m in py.failed_op.inputs]
    assert nat.failed_op.index_check.bad == py.failed_op.index_check.bad == [12]
    assert [f.kind for f in reports["native"].findings] == [f.kind for f in reports["python"].findings]
    assert reports["native"].findings[0].kind == "index_out_of_range"


def test_failed_arguments_are_released():
    box = []
    ns = {"torch": torch, "box": box}
    src = "a = torch.ones(1000, 3)\nbox.append(__import__('weakref').ref(a))\nb = a @ torch.ones(4, 2)\n"
    report = bd.diagnose(src, ns, engine="native")
    assert report.trace.failed_op is not None and report.trace.failed_op.op == "aten::mm"
    del ns["a"]
    gc.collect()
    assert box[0]() is None, "the failing op's argument is still referenced"


def test_recorder_stops_and_pops_its_state_even_when_the_cell_raises():
    ns = _mlp()
    with pytest.raises(RuntimeError):
        with NativeCapture(ns, cell_file=CELL):
            ns["model"](torch.randn(2, 7))
    assert not native.load().running()
    # The allocator's memory reporting slot is free again: the profiler can use it.
    with torch.profiler.profile(profile_memory=True, record_shapes=True) as prof:
        torch.ones(1000) * 2
    assert any(e.cpu_memory_usage > 0 for e in prof.events())
    with NativeCapture(ns, cell_file=CELL) as cap:  # and the recorder can run again
        exec(STEP, ns)
    assert cap.finish().op_count > 10


def test_engine_choice_and_bad_arguments(monkeypatch):
    ns = _mlp()
    before = ns["model"][0].weight.clone()
    with pytest.raises(ValueError, match="engine must be one of"):
        bd.diagnose("opt.step()", ns, engine="fast")
    assert torch.equal(before, ns["model"][0].weight)  # nothing ran
    src = "loss = F.cross_entropy(model(x), y)\nloss.backward()\n"
    assert bd.diagnose(src, ns).trace.engine == "native"
    assert bd.diagnose(src, ns, engine="python").trace.engine == "python"
    assert bd.diagnose(src, ns, memory_limit="1GB").trace.engine == "native"  # the allocator fails past the limit
    assert bd.diagnose(src, ns, rollback=False).trace.engine == "native"  # one run screens every op: no replay
    monkeypatch.setenv("BACKWARD_DOCTOR_NATIVE", "0")
    assert bd.diagnose(src, ns).trace.engine == "python"
    with pytest.raises(ValueError, match="engine='native' cannot be used: switched off"):
        bd.diagnose(src, ns, engine="native")


def test_nonfinite_origin_found_by_the_native_recorder_in_one_run():
    ns = _mlp()
    ns["model"][2].weight.data[0, 0] = float("nan")
    report = bd.diagnose("loss = F.cross_entropy(model(x), y)\nloss.backward()\n", ns)
    assert report.trace.engine == "native" and report.trace.needs_detail is None
    assert not any("replayed" in n for n in report.trace.notes)
    f = report.findings[0]
    assert (f.kind, f.evidence["op"], f.module) == ("nonfinite", "aten::addmm", "model.2")
    assert f.title == "Weights are already NaN/Inf"


@pytest.mark.parametrize("src", [
    "x2 = x.clone()\nx2[1, 3] = float('nan')\nloss = F.cross_entropy(model(x2), y)\nloss.backward()\n",
    "h = model(x)\nloss = (h.log() * 0).sum()\nloss.backward()\n",
    "h = model(x).sum(1)\nloss = torch.sqrt(h - h).sum()\nloss.backward()\n",
])
def test_detail_screening_finds_the_same_origins_as_the_python_tier(src):
    """The detailed replay screens every op's output in C++ (a plain run's kernels) and finds what the
    Python tier's screen finds: the event list, origins, statistics."""
    traces = {}
    for engine in ("native", "python"):
        ns = {**_mlp(), "torch": torch}
        with (NativeCapture if engine == "native" else Capture)(ns, cell_file=CELL, detail=True) as cap:
            try:
                exec(compile(src, CELL, "exec"), ns)
            except Exception as exc:  # noqa: BLE001 - the step's error is evidence
                cap.record_exception(exc)
        traces[engine] = cap.finish()
    # (a Python mode makes autograd accumulate out of place: add where a plain run does add_)
    events = {e: [(ev.op.rstrip("_"), ev.phase, ev.is_origin, ev.kind, ev.reached, ev.output.stats, ev.where.line)
                  for ev in t.nonfinite] for e, t in traces.items()}
    assert events["native"] and events["native"] == events["python"]
    assert traces["native"].nonfinite_reached == traces["python"].nonfinite_reached


@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.float64, 1e308), (torch.float16, 6e4),
                                       (torch.bfloat16, 3e38)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_screen_reads_every_value_of_every_float_dtype(dtype, big, layout):
    """The detail screen reads contiguous CPU tensors bit by bit (no reduction dispatched): one value that
    overflows, anywhere, in any IEEE dtype, is found; a tensor without one is not flagged."""
    x = torch.ones(37, 53, dtype=dtype)
    x[29, 41] = big
    if layout == "transposed":
        x = x.t()
    src = "ok = x * 1\nbad = x * 4\n"
    with NativeCapture({"x": x}, cell_file=CELL, detail=True) as cap:
        exec(compile(src, CELL, "exec"), {"x": x})
    events = cap.finish().nonfinite
    assert [(e.op, e.where.line, e.is_origin) for e in events] == [("aten::mul", 2, True)]
    assert events[0].output.stats.posinf == 1 and events[0].output.stats.nan == 0


@pytest.mark.parametrize("at", [0, 300_001, (1 << 19) - 1])
def test_a_large_tensor_is_screened_on_several_threads(at):
    """Past 256k values the screen splits the tensor over torch's intra-op threads: a value that
    overflows is found in any chunk."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.ones(1 << 19)
        x[at] = 3e38
        with NativeCapture({"x": x}, cell_file=CELL, detail=True) as cap:
            exec(compile("ok = x * 1\nbad = x * 4\n", CELL, "exec"), {"x": x})
        events = cap.finish().nonfinite
    finally:
        torch.set_num_threads(threads)
    assert [(e.op, e.where.line) for e in events] == [("aten::mul", 2)]


def test_a_long_step_is_kept_bounded():
    """Past max_ops the recorder only counts: per-name totals, a bounded timeline, the peak."""
    x = torch.ones(256)
    code = compile("y = x\nbig = None\nfor i in range(3000):\n    y = y + 1\n    if i == 2500:\n"
                   "        big = torch.ones(100_000)\n", CELL, "exec")
    with NativeCapture(cell_file=CELL, max_ops=100) as cap:
        exec(code, {"x": x, "torch": torch})
    trace = cap.finish()
    assert trace.op_count == 3001 and len(trace.ops) == 100  # 3000 adds and one ones()
    assert trace.op_totals["aten::add"][0] == 3000
    assert any("later in the step are only counted" in n for n in trace.notes)
    assert trace.memory.peak_bytes >= 400_000 and trace.memory.peak_index > 2500  # the late peak is kept
    assert cap.buffer_bytes < 1_000_000


def test_a_diagnosis_inside_a_native_run_uses_the_python_tier():
    ns = {"torch": torch, "bd": bd}
    outer = bd.diagnose("inner = bd.diagnose('y = (torch.ones(3, requires_grad=True) * 2).sum()', "
                        "{'torch': torch})\n"
                        "z = torch.ones(2) + 1\n", ns)
    assert outer.trace.engine == "native" and outer.ok
    assert ns["inner"].trace.engine == "python" and ns["inner"].ok
    assert not native.load().running()


def test_a_users_profiler_still_runs_inside_a_native_run():
    """torch.profiler needs the allocator's reporting slot the recorder holds: it gets it for its run."""
    import torch.autograd.profiler as prof_mod

    enable, disable = prof_mod._enable_profiler, prof_mod._disable_profiler
    ns = {"torch": torch, "x": torch.randn(64, 64, requires_grad=True)}
    src = ("with torch.profiler.profile(profile_memory=True) as prof:\n    y = (x * 2).sum()\n"
           "w = x * 3\ny.backward()\n")
    report = bd.diagnose(src, ns)
    assert report.ok and report.trace.engine == "native", report.exception
    assert any(e.cpu_memory_usage > 0 for e in ns["prof"].events())
    assert (prof_mod._enable_profiler, prof_mod._disable_profiler) == (enable, disable)  # put back
    with torch.profiler.profile(profile_memory=True):  # and a diagnosis inside a profiler: Python tier
        inner = bd.diagnose("z = (x * 2).sum()", ns)
    assert inner.ok and inner.trace.engine == "python"


def test_a_recorder_that_cannot_be_built_leaves_the_python_tier_and_a_reason(tmp_path):
    """No compiler, no ninja, broken headers: the doctor says why and runs on the Python tier,
    without trying the build again on every run."""
    import subprocess
    import sys

    bad = tmp_path / "recorder.cpp"
    bad.write_text("#error this recorder is broken on purpose\n")
    script = tmp_path / "nobuild.py"
    script.write_text(
        "import time, torch, backward_doctor as bd\n"
        "from backward_doctor import native\n"
        f"native._SOURCE = {str(bad)!r}\n"
        "r = bd.diagnose('y = (torch.ones(3, requires_grad=True) * 2).sum()\\ny.backward()', {'torch': torch})\n"
        "assert r.ok and r.trace.engine == 'python', r.trace.engine\n"
        "reason = native.status()['reason']\n"
        "assert reason and 'Error' in reason, reason\n"
        "t = time.perf_counter(); assert native.load() is None; assert time.perf_counter() - t < 0.1\n"
        "print('fell back:', reason[:80])\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert proc.returncode == 0 and "fell back" in proc.stdout, proc.stderr[-2000:]


def test_a_failed_step_lasts_until_its_last_op():
    """As on the Python tier: the time after the failing op (IPython printing the traceback, here a
    sleep in an exception handler outside the ops) is not the step's."""
    src = ("import time\ntry:\n    torch.ones(2, 3) @ torch.ones(4, 5)\nexcept RuntimeError:\n    time.sleep(0.5)\n"
           "    raise\n")
    for engine in ("python", "native"):
        report = bd.diagnose(src, {"torch": torch}, engine=engine)
        assert report.trace.engine == engine and report.trace.failed_op is not None
        assert report.trace.duration_s < 0.4, (engine, report.trace.duration_s)


def test_op_durations_are_times_not_bytes():
    """The recorder wrote an op's duration into the slot the last memory category then overwrote: every native
    op 'took' the bytes of the 'other' category / 1000 (526 us for a 0.5 MB batch, whatever the op). The ops'
    durations fit inside the step's, and each one is its own."""
    ns = {"torch": torch, "model": nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)),
          "x": torch.randn(8192, 64), "y": torch.randint(0, 5, (8192,))}  # 2 MB the step does not make: 'other'
    report = bd.diagnose("loss = F.cross_entropy(model(x), y)\nloss.backward()\n", {**ns, "F": F}, engine="native")
    ops, step_us = report.trace.ops, report.trace.duration_s * 1e6
    assert report.trace.engine == "native" and len(ops) > 10
    assert sum(op.duration_us for op in ops) <= step_us, (sum(op.duration_us for op in ops), step_us)
    assert len({op.duration_us for op in ops}) > len(ops) // 2           # not one value for every op
    starts = [op.start_us for op in ops]
    assert starts == sorted(starts) and all(op.start_us + op.duration_us <= step_us + 1 for op in ops)


class _Double(torch.autograd.Function):
    forward = staticmethod(lambda ctx, x: x * 2)
    backward = staticmethod(lambda ctx, g: g * 2)


def test_custom_functions_run_as_without_the_recorder():
    """The recorder holds the allocator's reporting slot, which PyTorch reads as a profiler state: it must
    be one (disabled), or every custom Function's apply reads garbage (std::bad_alloc in the user's step)."""
    w = torch.randn(3, requires_grad=True)
    for _ in range(20):
        w.grad = None
        report = bd.diagnose("loss = Double.apply(w).sum()\nloss.backward()\n"
                             "inside = torch.autograd._profiler_enabled()", {"Double": _Double, "w": w, "torch": torch},
                             engine="native")
        assert report.exception is None, report.exception
        assert report.trace.engine == "native" and report.ok
        assert torch.equal(w.grad, torch.full((3,), 2.0))
    assert not torch.autograd._profiler_enabled()


def test_sparse_tensors_are_recorded_without_their_storage():
    emb = nn.Embedding(10, 3, sparse=True)
    ns = {"emb": emb, "ids": torch.tensor([[1, 2], [3, 9]]), "opt": torch.optim.SparseAdam(list(emb.parameters()))}
    report = bd.diagnose("opt.zero_grad()\nemb(ids).sum().backward()\nopt.step()", ns, engine="native")
    assert report.exception is None and report.ok
    assert emb.weight.grad.is_sparse


def test_a_simulated_device_fails_the_allocation_inside_the_op_as_a_plain_run_allocates():
    """The native recorder simulates a device by failing the allocation that would overflow it, so the
    step runs the kernels a plain run runs (a Python dispatch mode makes ``linear`` take its out-of-place
    bias add on non-contiguous input: ``aten::add`` instead of ``aten::add_``)."""
    def make():
        torch.manual_seed(0)
        return {"lin": nn.Linear(64, 64), "x": torch.randn(8, 64, 32, requires_grad=True)}

    src = "h = lin(x.transpose(1, 2))\nloss = h.sum()\nloss.backward()"
    ok = bd.diagnose(src, make(), engine="native", memory_limit="10MB")
    assert ok.ok and ok.trace.engine == "native"
    assert "aten::add_" in [o.op for o in ok.trace.ops]  # what a plain run does
    report = bd.diagnose(src, make(), engine="native", memory_limit="200KB")
    assert report.exception.startswith("OutOfMemoryError: Simulated device out of memory")
    f = report.findings[0]
    assert f.kind == "oom" and f.line in (1, 3)
    oom = report.trace.exception.oom
    assert oom.simulated and oom.live > 200_000 >= oom.live - oom.requested
    import gc
    gc.collect()
    # the memory of the failed allocation went back: the next plain step still works
    ns = make()
    exec(src, ns)


def test_the_allocators_count_is_the_blocks_allocated_since_start():
    """``allocated()``: net CPU bytes handed out since ``start()`` (the live series of an asleep loop), kept in the
    recorder's own table of blocks: thousands alive at once (the table grows), freed in another order; a block
    allocated before start and freed during the run does not count. (The allocator reports to the threads that
    carry the recorder's thread-local state: the cell's, autograd's and torch's intra-op workers.)"""
    ext = native.load()
    before = torch.empty(1 << 16, dtype=torch.uint8)
    ext.start(CELL, False, 1000, -1, False)
    try:
        assert ext.sleep()
        kept = [torch.empty(64 + i % 7 * 16, dtype=torch.uint8) for i in range(5000)]
        grown = ext.allocated()
        assert grown >= sum(t.untyped_storage().nbytes() for t in kept), grown
        del before  # (allocated before start: its free is not this run's)
        assert ext.allocated() == grown
        half = sum(t.untyped_storage().nbytes() for t in kept[::2])
        del kept[::2]
        assert ext.allocated() == grown - half
        extra = torch.empty(1 << 12, dtype=torch.uint8)
        assert ext.allocated() == grown - half + (1 << 12)
        kept.clear()
        del extra
        assert 0 <= ext.allocated() < 4096, ext.allocated()  # (no tensor left: at most small bookkeeping)
    finally:
        ext.stop()


def test_the_cpu_allocator_is_wrapped_while_recording_and_its_blocks_outlive_it():
    """The recorder counts CPU blocks by wrapping c10's CPU allocator for the recording (torch's own memory reports,
    a mutex and a map at every allocation, are off then): wrapped from start to stop and put back after, also when
    an op failed during the recording; a block allocated while recording and freed after it ends is freed as any
    other (by the allocator's own deleter), and counts in no later recording; a block freed during the recording
    leaves the count (the loop's live memory goes down as the step frees what it made)."""
    ext = native.load()
    assert not ext.cpu_allocator_wrapped()
    ext.start(CELL, False, 1000, -1, False)
    try:
        assert ext.cpu_allocator_wrapped()
        kept = torch.ones(1 << 14)  # (outlives the recording)
        made = ext.allocated()
        assert made >= kept.untyped_storage().nbytes()
        x = torch.randn(256, 256, requires_grad=True)
        (x * 2).sum().backward()
        with_grad = ext.allocated()
        x.grad = None
        assert ext.allocated() <= with_grad - 256 * 256 * 4
    finally:
        ext.stop()
    assert not ext.cpu_allocator_wrapped()
    ext.start(CELL, False, 1000, -1, False)
    try:
        assert ext.allocated() == 0
        del kept  # (allocated by the earlier recording: not this one's)
        assert ext.allocated() == 0
        with pytest.raises(RuntimeError):
            torch.empty(3) @ torch.empty(4)
    finally:
        ext.stop()
    assert not ext.cpu_allocator_wrapped()
    again = torch.arange(10.0)  # (the default allocator again, its blocks freed as before)
    assert again.sum().item() == 45.0


def test_the_graph_walk_in_cpp_answers_as_the_python_walk():
    """``GraphWalks`` (step_state.graph_holders' walks of the graphs tensors still carry) in C++ and in Python:
    the same earlier run found first, the same oldest node, the same limit, the same sharing of clean nodes."""
    from backward_doctor.capture.end.step_state import GraphWalks

    seq = torch._C._autograd._get_sequence_nr
    w = torch.ones(3, requires_grad=True)
    runs, kept = [], []
    for r in range(3):  # three earlier "runs", each leaving a graph behind
        lo = seq()
        kept.append(_Double.apply(w * (r + 1)).exp())
        runs.append((r + 10, lo, seq()))
    start = seq()
    fresh = (w * 3).sin().sum()
    shared = w.cos()
    holders = [fresh, shared.sum(), (shared * 2).sum(), (kept[2] + kept[0]).sum(), (kept[1] * w).mean(),
               _Double.apply(shared).sum(), torch.ones(2, requires_grad=True) * 1]
    deep = w
    for _ in range(30):
        deep = deep * 1.5
    holders.append(deep.sum())
    for limit in (2000, 5, 1):
        for earlier in (runs, runs[1:], []):
            answers = {}
            for native_walk in (True, False):
                walks = GraphWalks(start, earlier, limit, native=native_walk)
                assert (walks._c is not None) == native_walk
                answers[native_walk] = [(walks.earlier_runs(t), walks.oldest_seq(t)) for t in holders]
            assert answers[True] == answers[False], (limit, earlier)
    walks = GraphWalks(start, runs)
    assert [walks.earlier_runs(t) for t in holders[3:5]] == [[12], [11]]
    assert walks.oldest_seq(fresh) >= start and walks.oldest_seq(kept[0]) == start  # (no node of this run)
    assert walks.earlier_runs(kept[0]) == [10] and GraphWalks(start, runs[1:]).earlier_runs(kept[0]) == []


def test_nonzero_each_answers_as_torchs_any():
    """The cell start's check of the gradients an earlier step consumed (``_any_each``), read in C++ up to the
    first value other than zero: the same answers as ``any()``; None where it does not read (torch answers)."""
    from backward_doctor.capture.context import _any_each

    ext = native.load()
    cases = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        z = torch.zeros(1000, dtype=dtype)
        last, nan, neg0 = z.clone(), z.clone(), z.clone()
        last[-1], nan[-1], neg0[:] = 1e-7, float("nan"), -0.0
        cases += [z, last, nan, neg0, torch.ones(3, dtype=dtype), torch.zeros(0, dtype=dtype)]
    tiny = torch.zeros(5)
    tiny[3] = 1e-45  # (a float32 denormal)
    cases.append(tiny)
    answers = ext.nonzero_each(cases)
    assert answers == [bool(t.any()) for t in cases]
    odd = [torch.zeros(4, 4).t(), torch.arange(3), torch.zeros(2, dtype=torch.complex64)]
    odd[0][1, 2] = 1.0
    assert ext.nonzero_each(odd) == [None, None, None]
    assert _any_each(cases + odd) == [bool(t.any()) for t in cases + odd]
