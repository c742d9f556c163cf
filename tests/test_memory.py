"""Memory accounting on CPU: categories, storages counted once, the peak, bounded traces."""
from __future__ import annotations

import torch

import backward_doctor as bd
from backward_doctor.capture import Capture
from backward_doctor.trace import CATEGORIES


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return {"torch": torch, "model": model, "opt": torch.optim.Adam(model.parameters()),
            "x": torch.randn(256, 64), "y": torch.randint(0, 10, (256,))}


STEP = "loss = torch.nn.functional.cross_entropy(model(x), y)\nloss.backward()\nopt.step()"


def test_categories_after_an_adam_step():
    ns = _mlp()
    report = bd.diagnose(STEP, ns)
    assert report.ok
    mem = report.trace.memory
    param_bytes = sum(p.numel() * 4 for p in ns["model"].parameters())
    last = {c: mem.by_category[c][-1] for c in CATEGORIES}
    assert last["parameters"] == param_bytes
    assert last["gradients"] == param_bytes               # one .grad per parameter, counted once
    # Adam keeps exp_avg and exp_avg_sq (2x parameters) plus a scalar step per parameter.
    assert 2 * param_bytes <= last["optimizer"] <= 2 * param_bytes + 16 * len(list(ns["model"].parameters()))
    assert mem.baseline_bytes == param_bytes + ns["x"].numel() * 4 + ns["y"].numel() * 8
    assert mem.peak_bytes == max(sum(v) for v in zip(*mem.by_category.values()))
    peak = report.trace.op(mem.peak_index)
    assert peak is not None and peak.where.line in (1, 2, 3)


def test_activations_are_counted_in_forward_and_released_after_backward():
    ns = _mlp()
    report = bd.diagnose(STEP, ns)
    tr = report.trace
    act = tr.memory.by_category["activations"]
    hidden = 256 * 128 * 4
    assert max(act) >= 2 * hidden                       # linear output and relu output (saved)
    assert act[-1] < hidden                             # backward freed what the graph saved


def test_views_and_inplace_outputs_are_not_counted_again():
    x = torch.randn(1000)
    with Capture({"x": x}) as cap:
        v = x.view(10, 100)
        s = x[10:]
        x.mul_(2)
        t = x.t() if x.dim() == 2 else x.unsqueeze(0)
    trace = cap.finish()
    assert [op.live_bytes for op in trace.ops] == [4000] * len(trace.ops)
    del v, s, t


def test_new_storage_is_counted_and_freed():
    with Capture() as cap:
        a = torch.zeros(1024)            # 4 KiB
        b = torch.zeros(2048)            # 8 KiB
        del a
        c = b + 1                        # 8 KiB more while a is gone
    trace = cap.finish()
    assert [op.live_bytes for op in trace.ops] == [4096, 4096 + 8192, 8192 + 8192]
    assert trace.memory.peak_bytes == 16384
    del b, c


def test_long_steps_keep_a_bounded_trace():
    x = torch.ones(4)
    with Capture(max_ops=100, tail_ops=50) as cap:
        for _ in range(1000):
            x = x + 1
    trace = cap.finish()
    assert len(trace.ops) == 150
    assert trace.op_count == 1000 and trace.ops_dropped == 850
    assert sum(n for n, _ in trace.op_totals.values()) == 1000
    assert trace.ops[-1].index == 999 and trace.op(120) is None and trace.op(960).index == 960
    assert any("only counted" in n for n in trace.notes)


def test_timeline_is_downsampled_keeping_the_peak():
    with Capture() as cap:
        x = torch.ones(8)
        for i in range(25_000):
            if i == 12_345:
                spike = torch.zeros(10_000)
                del spike
            x = x + 1
    trace = cap.finish()
    mem = trace.memory
    assert len(mem.op_index) <= 20_000
    assert mem.peak_bytes >= 40_000
    assert max(sum(v) for v in zip(*mem.by_category.values())) == mem.peak_bytes
    assert any("one point per 2 ops" in n for n in trace.notes)


def test_timeline_reads_only_whole_samples_after_an_interrupted_add():
    """A cell's own SIGALRM may raise inside ``Timeline.add`` between writing a sample's op index and its
    totals (CI saw an IndexError in finish() that way): the samples read back are the whole ones."""
    from backward_doctor.capture.recorder.memory import Timeline
    tl = Timeline()
    tl.add(0, [1, 2], 3)
    tl.index.append(1)               # interrupted after the op index, before its totals
    assert tl.samples() == ([0], [[1, 2]])
    fresh = Timeline()
    fresh.index.append(0)            # interrupted at the very first sample
    assert fresh.samples() == ([], [])


def test_simulated_oom_is_a_torch_out_of_memory_error():
    ns = _mlp()
    report = bd.diagnose("big = model(x.repeat(64, 1))", ns, memory_limit="4MB")
    assert report.exception.startswith("OutOfMemoryError: Simulated device out of memory")
    f = report.findings[0]
    assert f.kind == "oom" and set(f.fixes) == {"accumulate", "amp", "checkpoint"}
    assert f.evidence["by_category"]["parameters"] == sum(p.numel() * 4 for p in ns["model"].parameters())
    assert bd.diagnose("big = model(x.repeat(64, 1))", _mlp()).ok   # fine without the limit


def test_one_allocation_larger_than_the_whole_device_is_named_with_the_split_it_would_need(engine):
    """Seen on a GPU: one 256 GiB tensor on a 140 GiB device was told "k=2 at least" (a floor counted from the
    26 MiB live). A single request larger than the device needs a split that fits it, or, when it does not grow
    with the batch, a look at its shape (CUDA's allocator says the size: ``util.units.allocator_request``)."""
    cell = "x = torch.randn(100, 100, requires_grad=True)\nbig = x.expand(100, 100, 100, 100).contiguous()\n"
    report = bd.diagnose(cell, {"torch": torch}, memory_limit="200MB", engine=engine)
    f = report.findings[0]
    assert (f.kind, f.line, f.op) == ("oom", 2, "aten::clone"), str(report)
    assert ("The one tensor being allocated, 381.5 MiB, is larger than the whole device by itself. If it grows "
            "with the batch, only a split into 3 micro-batches or more can fit it") in f.message
    assert "check the shape this line asks for" in f.message and "k=2" not in f.message
