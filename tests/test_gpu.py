"""GPU tier: CUDA-only paths. Marked ``gpu``; skipped without CUDA (run on the device machine)."""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd

pytestmark = pytest.mark.gpu


def _ns():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    return {"torch": torch, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "x": torch.randn(32, 64, device="cuda"), "y": torch.randint(0, 10, (32,), device="cuda")}


STEP = "loss = torch.nn.functional.cross_entropy(model(x), y)\nloss.backward()\nopt.step()"


def test_allocator_and_nvml_figures_are_recorded():
    report = bd.diagnose(STEP, _ns())
    assert report.ok, str(report)
    cuda = report.trace.memory.cuda
    assert cuda["max_allocated"] > 0 and cuda["reserved"] >= cuda["allocated"]
    assert report.trace.memory.device_total_bytes > 0
    assert "total" in cuda["nvml"] or "error" in cuda["nvml"]


def test_gradients_bit_identical_on_cuda():
    torch.use_deterministic_algorithms(True, warn_only=True)
    a, b = _ns(), _ns()
    exec(STEP, a)
    assert bd.diagnose(STEP, b).ok
    for p, q in zip(a["model"].parameters(), b["model"].parameters()):
        assert torch.equal(p.grad, q.grad)


def test_bad_index_is_caught_before_the_kernel_and_context_survives():
    ns = _ns()
    ns["emb"] = torch.nn.Embedding(10, 4).cuda()
    report = bd.diagnose("out = emb(torch.tensor([1, 12], device='cuda'))\nout.sum().backward()", ns)
    f = report.findings[0]
    assert f.kind == "index_out_of_range" and f.line == 1 and f.evidence["bad"] == [12]
    assert "checked by backward_doctor before the kernel ran" in report.exception
    assert torch.ones(2, device="cuda").sum().item() == 2.0     # the CUDA context is still usable


def test_real_allocator_oom():
    ns = _ns()
    free, total = torch.cuda.mem_get_info()
    ns["n"] = int(total // 4 * 2)  # twice the device in float32 elements
    report = bd.diagnose("big = torch.empty(n, device='cuda')", ns)
    f = report.findings[0]
    assert f.kind == "oom" and f.line == 1 and not f.evidence["simulated"]


def test_benchmark_script_runs_on_cuda_and_compares_peaks():
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "run.py")
    out = subprocess.run([sys.executable, script, "--device", "cuda", "--smoke"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("cuda max_memory_allocated") == 3, out.stdout
    assert "doctor_no_history" in out.stdout


def test_memory_snapshot_is_the_allocators_own_history(tmp_path):
    """On CUDA the export is the allocator's own snapshot and history (recorded during the step), kept in the
    report's JSON too; not the ledger's reconstruction (whose frames end in a ``category`` frame)."""
    import pickle

    report = bd.diagnose(STEP, _ns())
    assert "allocator_snapshot" in report.trace.memory.cuda
    path = report.save_memory_snapshot(str(tmp_path / "cuda.pickle"))
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    entries = snap["device_traces"][torch.cuda.current_device()]
    assert snap["segments"] and any(e["action"] == "alloc" for e in entries)
    assert not any(f.get("filename") == "category" for e in entries for f in e.get("frames", []))
    again = bd.Report.from_dict(report.to_dict())
    assert again.save_memory_snapshot(str(tmp_path / "again.pickle")) and \
        (tmp_path / "again.pickle").read_bytes() == (tmp_path / "cuda.pickle").read_bytes()


def test_advanced_indexing_past_the_end_is_caught_before_the_kernel_and_context_survives():
    """Found on an H200 (benchmarks/gpu_validation.py): ``w[ids]`` with an id past the table was a device-side
    assert reported at the next line, the CUDA context lost; now checked before the launch."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(10, 4, device="cuda"))
    ns = {"torch": torch, "w": w, "ids": torch.tensor([1, 2, 30], device="cuda")}
    report = bd.diagnose("h = w[ids]\nloss = h.pow(2).sum()\nloss.backward()", ns)
    f = report.findings[0]
    assert (f.kind, f.line) == ("index_out_of_range", 1) and f.evidence["bad"] == [30]
    assert "checked by backward_doctor before the kernel ran" in report.exception
    assert torch.ones(2, device="cuda").sum().item() == 2.0


def test_a_cell_that_first_uses_the_gpu_names_its_device_and_says_what_was_not_recorded():
    """A process that has not touched the GPU is diagnosed as a CPU process (the doctor starts no CUDA context);
    a cell that moves its model to CUDA itself then runs on the Python tier's CPU path, screened op by op, and
    the report says the device and that the allocator's figures were not taken. In a fresh process."""
    import json
    import subprocess
    import sys

    code = ("import json, torch, backward_doctor as bd\n"
            "assert not torch.cuda.is_initialized()\n"
            "ns = {'torch': torch}\n"
            "r = bd.diagnose('model = torch.nn.Linear(8, 2).cuda()\\n'\n"
            "                'loss = model(torch.randn(4, 8, device=\"cuda\")).sum()\\nloss.backward()', ns)\n"
            "print(json.dumps({'ok': r.ok, 'device': r.trace.device, 'notes': r.trace.notes,\n"
            "                  'grad': ns['model'].weight.grad is not None, 'cuda': r.trace.memory.cuda}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["grad"] and got["device"] == "cuda:0" and got["cuda"] is None, got
    assert any("CUDA was first used inside this cell" in n for n in got["notes"]), got


NAN_AT_7 = """
for i in range(12):
    opt.zero_grad()
    out = model(x)
    out = out / (i - 7) if i == 7 else out
    loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()
    opt.step()
"""


def test_always_on_replays_the_iteration_a_cuda_loop_went_nan_in():
    """On CUDA the Python recorder screens only scalars (a per-op screen would synchronise every op); the
    iteration whose loss went NaN is replayed alone from the state kept when it showed (CUDA RNG included:
    the model has dropout), and the report names the op, line and iteration."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    ns = _ns()
    ns["model"].insert(1, torch.nn.Dropout(0.1))
    sh.user_ns.update(ns)
    try:
        with capture_output():
            sh.run_cell("%backward_doctor on", store_history=False)
            result = sh.run_cell(NAN_AT_7, store_history=True)
    finally:
        sh.run_cell("%backward_doctor off", store_history=False)
    assert result.success
    report = bd.last_report()
    f = report.findings[0]
    # (line 4 of the cell: IPython drops its leading blank line)
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::div", 4, 7), str(report)
    assert report.trace.iterations.replayed == 7


def test_one_allocation_larger_than_the_device_is_named_as_such():
    cell = "x = torch.ones(4, device='cuda')\nbig = torch.empty(1 << 38, dtype=torch.uint8, device='cuda')\n"
    report = bd.diagnose(cell, {"torch": torch})
    f = report.findings[0]
    assert f.kind == "oom" and f.line == 2, str(report)
    assert "The one tensor being allocated, 256.0 GiB, is larger than the whole device by itself" in f.message


def test_hf_trainer_callback_on_cuda_samples_steps_and_replays_the_nan_step(tmp_path):
    """The transformers callback on a CUDA Trainer: the Python recorder samples the steps (0, 1, 2, 4, 8: asleep
    its dispatch mode is off the stack), weights as a plain run's; a step whose loss goes NaN asleep is replayed."""
    pytest.importorskip("transformers")
    import library_loops as ll

    from backward_doctor import integrations

    def trainer(source, callback, poison=False):
        return ll.hf_rare_token_trainer(source, [callback] if callback else None, poison=poison, use_cpu=False)

    plain = trainer(None, None)
    plain["trainer"].train()
    cb = integrations.DoctorCallback(tmp_path)
    ns = trainer(None, cb)
    ns["trainer"].train()
    its = cb.report.trace.iterations
    assert cb.report.ok and its.steps == 10 and its.recorded == [0, 1, 2, 4, 8], (str(cb.report), its.recorded)
    assert next(ns["model"].parameters()).is_cuda
    for a, b in zip(ns["model"].state_dict().values(), plain["model"].state_dict().values()):
        assert torch.equal(a, b)
    cb = integrations.DoctorCallback(tmp_path)
    ns = trainer(ll.HF_NAN, cb, poison=True)
    ns["trainer"].train()
    f = cb.report.findings[0]
    assert (f.kind, f.op) == ("nonfinite", "aten::log"), str(cb.report)
    assert cb.report.trace.iterations.replayed == ll.POISONED_STEP


def test_gradients_consumed_earlier_are_read_per_device():
    """(Not yet run on a GPU: written after this session's device time ran out.)"""
    from backward_doctor.capture.context import _any_each

    ts = [torch.zeros(3, device="cuda"), torch.ones(2, device="cuda"), torch.zeros(1), torch.ones(4, device="cuda")]
    assert _any_each(ts) == [False, True, False, True]
