"""Fault injection, one watch at a time: every watch the doctor installs into the user's calls (``capture/guard.py``,
``GUARDED``) is broken on purpose (one of its methods raises), and the user's run must complete exactly as without
the doctor (parameters, optimizer and scaler state bit-identical, no exception), the report saying which watch
stopped. A watch added to the registry without a way to break it here fails :func:`test_every_watch_is_broken_here`.
"""
from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.capture import guard, state as state_mod
from backward_doctor.capture.loop import hooks as loop_hooks
from backward_doctor.capture.workers import main_side as worker_watch
from backward_doctor.capture.watches.accumulation import AccumulationWatch
from backward_doctor.capture.context import Capture
from backward_doctor.capture.watches.frozen import FrozenWatch
from backward_doctor.capture.watches.orphans import OrphanWatch
from backward_doctor.capture.loop.sampling import LoopSampling
from backward_doctor.capture.loop.series import LoopWatch
from backward_doctor.capture.native_capture import NativeLoopWatch
from backward_doctor.capture.loop.optimizer import OptimizerHooks
from backward_doctor.capture.watches.precision import PrecisionWatch
from backward_doctor.run.iteration_replay import IterationRollback


def boom(*args, **kwargs):
    raise RuntimeError("injected fault")


# ----------------------------------------------------------------------------- the workloads
LOOP = """
for i, (xb, yb) in enumerate(loader):
    opt.zero_grad()
    loss = F.mse_loss(net(xb), yb)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
"""


def loop_namespace(workers: int = 0, compiled: bool = False) -> dict:
    """12 iterations (the native recorder samples them: some asleep), an enabled CPU GradScaler, clipping."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ds = torch.utils.data.TensorDataset(torch.randn(48, 6), torch.randn(48, 2))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ns = {"torch": torch, "F": F, "net": net, "opt": opt, "loader": loader,
          "scaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)}
    if compiled:
        ns["net"] = torch.compile(net, backend="eager")
    return ns


def state_of(ns: dict) -> dict:
    """Everything the run leaves that must be bit-identical: weights, optimizer state, scaler state."""
    opt = ns["opt"]
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(opt.param_groups[0]["params"])}
    for i, st in enumerate(opt.state.values()):
        out.update({f"s{i}.{k}": v.clone() if torch.is_tensor(v) else v for k, v in st.items()})
    out["scale"] = ns["scaler"].get_scale()
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def plain(**kw) -> dict:
    ns = loop_namespace(**kw)
    exec(LOOP, ns)
    return state_of(ns)


# ----------------------------------------------------------------------------- how each watch is broken
def _native_loop_watch_broken(monkeypatch):
    init = NativeLoopWatch.__init__

    def broken(self, *a, **kw):
        init(self, *a, **kw)
        self.before_step = boom
    monkeypatch.setattr(NativeLoopWatch, "__init__", broken)
    monkeypatch.setattr(LoopWatch, "before_step", boom)


BREAK = {
    "recorder": lambda mp: mp.setattr(Capture, "_where", boom),
    "modules": lambda mp: mp.setattr(state_mod.CaptureState, "_register_module", boom),
    "gradients": lambda mp: mp.setattr(state_mod.CaptureState, "_got_gradient", boom),
    "optimizer": lambda mp: (mp.setattr(OptimizerHooks, "_recorded_step_began", boom),
                             mp.setattr(OptimizerHooks, "_check_stale_unrecorded", boom)),
    "loop": _native_loop_watch_broken,
    "accumulation": lambda mp: mp.setattr(AccumulationWatch, "step_began", boom),
    "precision": lambda mp: mp.setattr(PrecisionWatch, "scaler_stepped", boom),
    "frozen": lambda mp: mp.setattr(FrozenWatch, "recorded_update", boom),
    "orphans": lambda mp: mp.setattr(OrphanWatch, "finish", boom),
    "sampling": lambda mp: (mp.setattr(loop_hooks.LoopHooks, "_begin_iteration", boom),
                            mp.setattr(LoopSampling, "_begin_iteration", boom)),
    "rollback": lambda mp: mp.setattr(IterationRollback, "iteration_began", boom),
    "compile": lambda mp: mp.setattr(Capture, "_compile_started", boom),
    "workers": lambda mp: mp.setattr(worker_watch, "_Watched", boom),
}
#: the watches a diagnose() of LOOP exercises (which engine: the native recorder is C++; only the sampled native
#: run keeps a rollback), and the workload's options
ENGINES = {"recorder": ("python",), "rollback": ("native",)}
OPTIONS = {"compile": {"compiled": True}, "workers": {"workers": 2}}
#: broken where their own entry points are (tests below)
ELSEWHERE = {"collectives", "library", "trigger", "schedule"}  # (schedule: tests/test_silent_scheduler.py)


def test_every_watch_is_broken_here():
    assert set(BREAK) | ELSEWHERE == set(guard.GUARDED)


@pytest.mark.parametrize("name", sorted(BREAK))
def test_a_broken_watch_stops_and_the_run_is_bit_identical(name, engine, monkeypatch):
    if engine not in ENGINES.get(name, ("native", "python")):
        pytest.skip(f"the {name} watch does not run on the {engine} engine")
    options = OPTIONS.get(name, {})
    expected = plain(**options)
    BREAK[name](monkeypatch)
    if options.get("compiled"):
        torch._dynamo.reset()  # (it compiles again, under the doctor: not from the plain run's cache)
    ns = loop_namespace(**options)
    report = bd.diagnose(LOOP, ns, engine=engine)
    assert report.trace.exception is None, report
    assert_identical(state_of(ns), expected)
    what = guard.GUARDED[name][0]
    stopped = [n for n in report.trace.notes if n.startswith(f"{what} stopped")]
    assert stopped and "injected fault" in stopped[0] and "Please report it" in stopped[0], report.trace.notes


@pytest.mark.parametrize("spelling", ["torch.amp", "torch.cuda.amp"])
def test_a_disabled_gradscaler_is_a_healthy_loop(engine, spelling):
    """The precision watch read a disabled scaler's ``_scale`` (it never makes one) and raised AttributeError into
    the step: nanoGPT's ``torch.cuda.amp.GradScaler(enabled=False)`` for fp32/bf16 runs."""
    results = []
    for doctored in (False, True):
        ns = loop_namespace()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the old spelling says it is deprecated, and CUDA is not there)
            ns["scaler"] = (torch.amp.GradScaler("cpu", enabled=False) if spelling == "torch.amp"
                            else torch.cuda.amp.GradScaler(enabled=False))
        if doctored:
            report = bd.diagnose(LOOP, ns, engine=engine)
            assert report.trace.exception is None and report.findings == [], report
            assert not any("stopped" in n for n in report.trace.notes), report.trace.notes
        else:
            exec(LOOP, ns)
        results.append(state_of(ns))
    assert_identical(*results)


# ----------------------------------------------------------------------------- the entry points that are not a capture's
def test_a_broken_collective_log_lets_every_collective_run(monkeypatch):
    import torch.distributed as dist
    from backward_doctor.capture.recorder.collectives import CollectiveRecorder

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(CollectiveRecorder, "_begin", boom)
        t = torch.arange(4.0)
        with CollectiveRecorder() as rec:
            dist.all_reduce(t)
            dist.barrier()
        assert torch.equal(t, torch.arange(4.0)) and rec.collectives == []
        assert rec.notes and rec.notes[0].startswith("the collective log stopped") and len(rec.notes) == 1
    finally:
        dist.destroy_process_group()


def test_a_broken_library_callback_lets_the_trainer_finish(tmp_path, monkeypatch, capsys):
    import library_loops as ll
    from backward_doctor.integrations import DoctorCallback
    from backward_doctor.run import open_diagnosis as watch_mod

    def trained(callbacks):
        ns = ll.hf_trainer(steps=4, callbacks=callbacks, output_dir=str(tmp_path))
        ns["trainer"].train()
        return {n: p.detach().clone() for n, p in ns["model"].named_parameters()}

    expected = trained(None)
    monkeypatch.setattr(watch_mod.OpenDiagnosis, "end", boom)
    got = trained([DoctorCallback(str(tmp_path))])
    assert_identical(got, expected)
    assert "no report for this training run (the doctor's own error: RuntimeError: injected fault)" in \
        capsys.readouterr().err


@pytest.mark.ipython
def test_a_broken_backward_trigger_lets_the_cell_run(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from backward_doctor.frontends.always_on import AlwaysOn

    shell = InteractiveShell.instance()
    cell = ("torch.manual_seed(0)\nm = torch.nn.Linear(3, 1)\nsgd = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "jobs['go'](m(torch.ones(2, 3)))\nsgd.step()\n")
    setup = "import torch\njobs = {'go': lambda t: t.sum().backward()}\n"  # (a backward() the guess cannot see)
    with capture_output():
        shell.run_cell("%load_ext backward_doctor", store_history=False)
        shell.run_cell(setup + cell)
        expected = shell.user_ns["m"].weight.detach().clone()
        monkeypatch.setattr(AlwaysOn, "_open_at", boom)
        shell.run_cell("%backward_doctor on")
        try:
            result = shell.run_cell(cell)
        finally:
            shell.run_cell("%backward_doctor off")
    assert result.success, result.error_in_exec
    assert torch.equal(shell.user_ns["m"].weight, expected)


@pytest.mark.ipython
def test_a_watch_that_fails_to_end_leaves_nothing_installed(monkeypatch):
    """Always on's watch opened at a cell's first backward() and its end failed (the doctor's own error): the
    cell's outcome stands, the doctor says there is no report, and nothing of the capture outlives the cell
    (the next cell is watched afresh; ``nothing_left_running`` checks the process)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from backward_doctor.run.open_diagnosis import OpenDiagnosis

    shell = InteractiveShell.instance()
    setup = ("import torch\ntorch.manual_seed(0)\nm = torch.nn.Linear(3, 1)\n"
             "sgd = torch.optim.SGD(m.parameters(), lr=0.1)\n"
             "def step_(t):\n    t.sum().backward()\n    sgd.step()\njobs = {'go': step_}\n")
    cell = "h = m(torch.ones(2, 3))\njobs['go'](h)\n"  # (the guess cannot see the backward(): the trigger opens)
    with capture_output():
        shell.run_cell("%load_ext backward_doctor", store_history=False)
        shell.run_cell(setup)
        shell.run_cell(cell)
        expected = shell.user_ns["m"].weight.detach().clone()
        shell.run_cell(setup)
        shell.run_cell("%backward_doctor on")
        try:
            with monkeypatch.context() as mp:
                mp.setattr(OpenDiagnosis, "end", boom)
                with capture_output() as broken:
                    result = shell.run_cell(cell)
            weight = shell.user_ns["m"].weight.detach().clone()
            before = bd.last_report()
            with capture_output():
                shell.run_cell("h = m(torch.ones(2, 3)) / 0 * 0\njobs['go'](h)\n")
        finally:
            shell.run_cell("%backward_doctor off")
    assert result.success, result.error_in_exec
    assert torch.equal(weight, expected)
    assert "no report for this cell (the doctor's own error: RuntimeError: injected fault)" in broken.stderr
    report = bd.last_report()
    assert report is not before and [f.kind for f in report.findings][:1] == ["nonfinite"], report
