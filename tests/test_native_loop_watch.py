"""The native tier's per-iteration watches against the Python they implement: the loop watch (``LoopSeries``,
C++) against ``capture/loop/series.py``'s class, the same calls, the same record, call for call, across what a
loop's iterations can bring (finite and NaN losses, NaN gradients, learning rates of every kind, a scheduler's
``initial_lr``, groups that are no list, a loss that is no one-element tensor, more iterations than a series
keeps); the accumulation watch's counting-only windows counted in C (``AccumCounter``) against its Python paths,
on loops that hand windows back to Python (a closure evaluated again, reentrant checkpointing, odd windows).

Skipped, with the reason, where the recorder cannot be built.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import sys
import warnings

import pytest
import torch

import backward_doctor as bd
from backward_doctor import native
from backward_doctor.capture.watches import accumulation as accum_watch
from backward_doctor.capture.loop.series import LoopWatch
from backward_doctor.capture.native_capture import NativeCapture, NativeLoopWatch, native_available
from backward_doctor.trace.accumulation import Accumulation
from backward_doctor.trace.parts import Iterations

pytestmark = pytest.mark.skipif(not native_available(build=True),
                                reason=f"native recorder unavailable: {native.status()['reason']}")


class _Opt:
    """What the watch reads of an optimizer: its ``param_groups``."""

    def __init__(self, groups):
        self.param_groups = groups


def _pair(base: int = 1000):
    """(Python watch, native watch), each with its own Iterations and list of on_nonfinite calls; configured as
    the native capture configures them."""
    ext = native.load(build=True)
    out = []
    for make_native in (False, True):
        its, calls = Iterations(), []
        on = lambda i, what, calls=calls: calls.append((i, what))  # noqa: E731
        if make_native:
            w = NativeLoopWatch(ext, its, base, on)
        else:
            w = LoopWatch(its, live=ext.allocated, live_base=base, sumsq=ext.grad_sumsq, scalar=ext.scalar_value,
                          on_nonfinite=on, groups_sumsq=ext.groups_grad_sumsq)
        out.append((w, its, calls))
    return out


def _param(value: float, grad: float | None) -> torch.Tensor:
    p = torch.full((3,), value, requires_grad=True)
    if grad is not None:
        p.grad = torch.full((3,), grad)
    return p


def _script():
    """Iterations as (losses passed to backward(), an optimizer, or None for a closure-less step)."""
    p, q = _param(1.0, 0.5), _param(2.0, 0.25)
    nan_grad = _param(1.0, math.nan)
    steps = []
    for i in range(40):
        lr = [0.1, 1, True, torch.tensor(0.3), None, 2.5e-4][i % 6]
        group = {"params": [p, q]}
        if lr is not None:
            group["lr"] = lr
        if i % 7 == 0:
            group["initial_lr"] = 0.5
        groups = [group] if i % 5 else ((group,) if i % 10 else [])
        losses = [torch.tensor(float(i))] if i % 4 else [torch.tensor(1.0), torch.tensor([1.0, 2.0]), "x"]
        if i == 9:
            losses = [torch.tensor(math.nan), torch.tensor(math.inf)]
        if i == 12:
            groups = [{"params": [nan_grad], "lr": 0.1}]
        steps.append((losses, _Opt(groups)))
    return steps


def _run(watch, its, steps, repeat: int = 1):
    for _ in range(repeat):
        for losses, opt in steps:
            for loss in losses:
                watch.saw_backward(loss)
            watch.before_step(opt)
            watch.iteration_ended()
            its.steps += 1


def test_the_native_watch_writes_what_the_python_watch_writes():
    (pw, pits, pcalls), (nw, nits, ncalls) = _pair()
    steps = _script()
    _run(pw, pits, steps)
    _run(nw, nits, steps)
    assert dataclasses.asdict(nits) == dataclasses.asdict(pits)
    assert ncalls == pcalls == [(9, "loss")]
    assert nw.backward_calls == pw.backward_calls == sum(len(ls) for ls, _ in steps)
    assert pits.base_lr == 1.0 and pits.lr[:6] == [None, 1.0, 1.0, None, None, 2.5e-4]  # (iteration 0: no group)
    assert pits.loss[9] is None and pits.loss[1] == 1.0


def test_a_long_loop_thins_its_series_the_same_way():
    (pw, pits, _), (nw, nits, _) = _pair()
    steps = [([torch.tensor(float(i % 13))], _Opt([{"params": [_param(1.0, 0.1 * (i % 3))], "lr": 0.01}]))
             for i in range(50)]
    _run(pw, pits, steps, repeat=180)  # 9,000 iterations: past 4,096 points twice
    _run(nw, nits, steps, repeat=180)
    assert pits.stride == 4 and len(pits.loss) <= 4096
    assert dataclasses.asdict(nits) == dataclasses.asdict(pits)


def test_nan_gradients_from_a_finite_loss_are_named_before_the_step():
    (pw, pits, pcalls), (nw, nits, ncalls) = _pair()
    steps = [([torch.tensor(1.0)], _Opt([{"params": [_param(1.0, 0.5)], "lr": 0.1}])),
             ([torch.tensor(2.0)], _Opt([{"params": [_param(1.0, math.inf)], "lr": 0.1}])),
             ([torch.tensor(math.nan)], _Opt([{"params": [_param(1.0, math.nan)], "lr": 0.1}]))]
    _run(pw, pits, steps)
    _run(nw, nits, steps)
    assert ncalls == pcalls == [(1, "gradients")]
    assert (nits.first_nonfinite, nits.first_nonfinite_in) == (1, "gradients")
    assert dataclasses.asdict(nits) == dataclasses.asdict(pits)


def test_an_exception_of_the_users_in_a_group_is_the_optimizers_to_raise(engine):
    """param_groups whose iteration raises: the watches read no norm (an error of a user's object the doctor asked
    is the doctor's, never raised into the step), and the optimizer raises it itself, exactly as without the
    doctor."""
    class Groups(tuple):  # (no list: read by the Python fallback)
        def __iter__(self):
            raise KeyError("the user's")

    (pw, pits, _), (nw, nits, _) = _pair()
    for w, its in ((pw, pits), (nw, nits)):
        w.before_step(_Opt(Groups(({"params": []},))))
        w.iteration_ended()
        assert its.grad_norm == [None]
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups = Groups(({"params": [p], "lr": 0.1},))
    plain = pytest.raises(KeyError, match="the user's")
    with plain:
        opt.step()
    report = bd.diagnose("(p * 2).sum().backward()\nopt.step()\n", {"p": p, "opt": opt}, engine=engine)
    assert (report.exception or "").startswith("KeyError"), report


def test_the_native_watch_keeps_no_capture_alive():
    """The C++ object holds the capture's NaN callback weakly: no run's capture outlives it (a strong reference
    through an object the garbage collector cannot see into kept every one, with what it held)."""
    ns: dict = {}
    exec("import torch\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "x = torch.randn(8, 4)\n", ns)
    cell = "for i in range(20):\n    opt.zero_grad()\n    loss = model(x).pow(2).mean()\n    loss.backward()\n    opt.step()\n"
    report = bd.diagnose(cell, ns, engine="native")
    assert report.trace.iterations.steps == 20 and len(report.trace.iterations.loss) == 20
    del report
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on every object touches torch's deprecated aliases)
        warnings.simplefilter("ignore")
        assert not [o for o in gc.get_objects() if isinstance(o, NativeCapture)]


_ACCUM_CELLS = {
    "a closure evaluated again in its step (L-BFGS)": ("lbfgs", """\
for i in range(30):
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
"""),
    "reentrant checkpointing, accumulation of two late on": ("sgd", """\
from torch.utils.checkpoint import checkpoint
for i in range(40):
    opt.zero_grad()
    checkpoint(model, x, use_reentrant=True).pow(2).mean().backward()
    if i > 24 and i % 3 == 0:
        F.mse_loss(model(x), y).backward()
    if i == 31:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
    opt.step()
"""),
}


@pytest.mark.parametrize("name, accelerate_loaded", [(name, False) for name in _ACCUM_CELLS]
                         + [(list(_ACCUM_CELLS)[1], True)])
def test_counting_windows_in_c_keep_what_python_keeps(name, accelerate_loaded, monkeypatch):
    """The same loop's accumulation record three ways: its counting-only windows counted in C, counted by the
    Python fast path (the counter never engaged), and by the general path (``_counting`` never set). With
    Accelerate loaded and no Accelerator accumulating (a process that imported transformers), counted all the
    same."""
    kind, cell = _ACCUM_CELLS[name]
    if accelerate_loaded:  # (no Accelerator made: its process-wide state empty, as in a fresh process)
        import accelerate.state

        monkeypatch.setattr(accelerate.state.GradientState, "_shared_state", {})
    else:
        monkeypatch.delitem(sys.modules, "accelerate.state", raising=False)
    engaged = []
    real = accum_watch.AccumulationWatch._count_natively

    def count_natively(self):
        real(self)
        engaged.append(self._core is not None)

    def record() -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = (torch.optim.LBFGS(model.parameters(), max_iter=3) if kind == "lbfgs"
               else torch.optim.SGD(model.parameters(), lr=0.05))
        ns = {"torch": torch, "F": torch.nn.functional, "model": model, "opt": opt,
              "x": torch.randn(8, 4, requires_grad=True), "y": torch.randn(8, 1)}
        return dataclasses.asdict(bd.diagnose(cell, ns, engine="native").trace.accumulation)

    with monkeypatch.context() as m:
        m.setattr(accum_watch.AccumulationWatch, "_count_natively", count_natively)
        in_c = record()
    assert any(engaged), "the counter never counted"
    with monkeypatch.context() as m:
        m.setattr(accum_watch.AccumulationWatch, "_count_natively", lambda self: None)
        in_python = record()
    with monkeypatch.context() as m:
        m.setattr(accum_watch.AccumulationWatch, "_counting", property(lambda self: False, lambda self, v: None),
                  raising=False)
        general = record()
    assert in_c == in_python == general
    assert sum(in_c["per_step"]) >= 30 and in_c["per_step"][1] > accum_watch._DETAILED


def test_the_counter_counts_again_after_python_took_a_window_back():
    """A GradScaler's skipped step or ``zeroed_first()`` hands the window to Python; the next plain window is
    counted in C again (not left to the Python fast path for the rest of the run), and the record is the one the
    Python watch keeps for the same calls."""
    ext = native.load(build=True)
    p = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    records = []
    for counter in (ext.AccumCounter, None):
        acc = Accumulation()
        w = accum_watch.AccumulationWatch(acc, frames=None, iteration=lambda: 0, params=lambda: [p], counter=counter)
        w._accelerate = None
        cores = []
        for i in range(40):
            w.zeroing(opt, "optimizer")
            for _ in range(1 + (i % 9 == 0)):
                w.backward_began(torch.tensor(1.0))
                w.backward_ended(True)
            w.step_began(opt, (), {})
            if i in (20, 30):
                w.skipped_step() if i == 20 else w.zeroed_first()
            w.iteration_ended()
            cores.append(w._core is not None)
        w.finish({})
        records.append((dataclasses.asdict(acc), cores))
    (in_c, cores), (in_python, _) = records
    assert in_c == in_python
    assert cores[19] and cores[25] and cores[35], cores  # (engaged again after each hand-back)
