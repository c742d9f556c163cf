"""A training loop in one cell: the native recorder samples its iterations (0, 1, 2, powers of two) and
lets the others run with the observer off. What a user must still get: the same numbers as a plain run,
a bounded trace, a report that says what was not seen, and the iterations a late NaN came from."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd
from backward_doctor.capture.native_capture import native_available

pytestmark = pytest.mark.skipif(not native_available(build=True), reason="the native recorder is not built here")

LOOP = ("for i in range({n}):\n    opt.zero_grad()\n    xb = x * float('nan') if i == {bad} else x\n"
        "    loss = F.cross_entropy(model(xb), y)\n    loss.backward()\n    opt.step()\n")


def _ns(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(12, 8),
            "y": torch.randint(0, 3, (12,)), "F": F, "torch": torch}


def test_a_loop_is_sampled_and_computes_what_a_plain_run_computes():
    cell = LOOP.format(n=40, bad=-1)
    plain, doctored = _ns(), _ns()
    exec(cell, plain)
    report = bd.diagnose(cell, doctored)
    assert report.trace.engine == "native" and report.ok, report
    its = report.trace.iterations
    assert its.steps == 40 and its.recorded == [0, 1, 2, 4, 8, 16, 32] and its.skipped == 33
    assert report.trace.op_count == len(report.trace.ops) and report.trace.op_count < 40 * 30 / 4
    assert any("7 of the 40 iterations were recorded op by op (iterations 0, 1, 2, 4, 8, 16, 32, counted from 0), "
               "the other 33 ran with the recorder off" in n and "every_iteration=True" in n for n in report.trace.notes)
    # 16 steps: iterations 0-15; the part after the last step is recorded but is no iteration (5 + 11 = 16).
    report = bd.diagnose(LOOP.format(n=16, bad=-1), _ns())
    assert report.trace.iterations.recorded == [0, 1, 2, 4, 8, 16]
    assert any("5 of the 16 iterations were recorded op by op (iterations 0, 1, 2, 4, 8, counted from 0), the "
               "other 11 ran" in n for n in report.trace.notes), report.trace.notes
    # Rule 1: bit for bit the same weights and gradients as without the doctor.
    for p, q in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    # The sampled iterations start where the trace says they do (ops of iteration 8 follow its start).
    k = its.recorded.index(8)
    assert report.trace.ops[its.starts[k]].index == its.starts[k] and its.iteration_of(its.starts[k]) == 8


def test_every_iteration_records_them_all():
    report = bd.diagnose(LOOP.format(n=12, bad=-1), _ns(), every_iteration=True)
    its = report.trace.iterations
    assert its.steps == 12 and its.skipped == 0 and len(report.trace.ops) > 12 * 20
    assert not any("recorded op by op" in n for n in report.trace.notes)
    with pytest.raises(ValueError, match="every_iteration must be True or False"):
        bd.diagnose("x = 1", {}, every_iteration="yes")


def test_nan_in_an_unrecorded_iteration_is_replayed_alone():
    """The bad batch comes in iteration 20 (not sampled): the loop watch sees the NaN loss before that
    iteration's step, keeps its state, and after the run that iteration alone is replayed in detail: the
    same line and iteration as recording every iteration finds, and the end state of a plain run."""
    plain, doctored = _ns(), _ns()
    exec(LOOP.format(n=40, bad=20), plain)
    report = bd.diagnose(LOOP.format(n=40, bad=20), doctored)
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 3, 20), f
    assert report.trace.iterations.first_nonfinite == 20 and report.trace.iterations.replayed == 20
    assert "(i = 20)" in f.location()
    assert any("that iteration alone was replayed" in n for n in report.trace.notes)
    for p, q in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p.isnan(), q.isnan()) and torch.equal(p.nan_to_num(), q.nan_to_num())
    assert doctored["i"] == 39 and doctored["xb"] is doctored["x"]
    # Recording every iteration finds the batch itself (the multiplication by NaN at line 3).
    full = bd.diagnose(LOOP.format(n=40, bad=20), _ns(), every_iteration=True).findings[0]
    assert (full.kind, full.line, full.iteration) == ("nonfinite", 3, 20)


def test_without_rollback_the_unrecorded_iteration_is_still_named():
    f = bd.diagnose(LOOP.format(n=40, bad=20), _ns(), rollback=False).findings[0]
    assert (f.kind, f.iteration, f.title) == ("nonfinite", 20, "NaN/Inf first in iteration 20"), f
    assert f.line == 5 and "every_iteration=True" in f.message  # (the backward of the NaN loss)


def test_a_nan_in_a_sampled_iteration_is_found_as_before():
    f = bd.diagnose(LOOP.format(n=40, bad=16), _ns()).findings[0]
    assert f.kind == "nonfinite" and f.line == 3 and "appeared in iterations" not in f.title


def test_a_memory_limit_records_every_iteration():
    """A simulated device is enforced op by op: no iteration may run unobserved."""
    report = bd.diagnose(LOOP.format(n=10, bad=-1), _ns(), memory_limit="1GiB")
    assert report.trace.iterations.skipped == 0


def test_the_cli_flag():
    from backward_doctor.frontends.cli import _parser

    assert _parser().parse_args(["f.py", "--every-iteration"]).every_iteration
    assert not _parser().parse_args(["f.py"]).every_iteration


def test_an_interrupt_while_the_recorder_sleeps_leaves_nothing_installed():
    """Ctrl-C (here raised by the cell) in an unrecorded iteration: the disabled observer is removed,
    the module hooks are gone, and the next diagnosis records normally."""
    from torch.nn.modules import module as nn_module

    from backward_doctor import native

    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    cell = LOOP.format(n=40, bad=-1).replace("    opt.step()\n", "    opt.step()\n    if i == 10:\n"
                                             "        raise KeyboardInterrupt\n")
    stopped = bd.diagnose(cell, _ns())
    assert stopped.trace.exception.type == "KeyboardInterrupt" and stopped.trace.iterations.steps == 11
    assert not native.load().running()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    report = bd.diagnose(LOOP.format(n=3, bad=-1), _ns())
    assert report.ok and len(report.trace.ops) > 3 * 20


# ---------------------------------------------------------------- the iteration a root cause happened in
def test_a_finding_names_the_iteration_of_the_loop():
    report = bd.diagnose(LOOP.format(n=40, bad=16), _ns())
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration, f.evidence["loop_line"]) == ("nonfinite", 3, 16, 1)
    assert f.location() == "cell line 3, in iteration 16 of the loop at line 1 (i = 16)"
    assert "in iteration 16 of the loop at line 1 (i = 16)" in str(report)
    assert "in iteration 16 of the loop at line 1 (i = 16)" in report.to_html()
    assert type(f).from_dict(f.to_dict()).iteration == 16


@pytest.mark.parametrize("engine, kwargs", [("native", {"every_iteration": True}), ("python", {})])
def test_the_iteration_of_an_unsampled_or_python_tier_nan(engine, kwargs):
    f = bd.diagnose(LOOP.format(n=25, bad=20), _ns(), engine=engine, **kwargs).findings[0]
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 3, 20), f


def test_an_error_in_an_unrecorded_iteration_is_placed_in_it():
    """Labels out of range in iteration 5 (not sampled): the traceback's line, and the iteration that
    was running when it raised."""
    cell = LOOP.format(n=40, bad=-1).replace("F.cross_entropy(model(xb), y)",
                                             "F.cross_entropy(model(xb), y + 3 * (i == 5))")
    report = bd.diagnose(cell, _ns())
    f = report.findings[0]
    assert report.trace.exception is not None and f.line == 4 and f.iteration == 5, (f, report.trace.exception)
    assert f.evidence["loop_value"] == "i = 5"


def test_a_step_outside_a_loop_has_no_iteration():
    ns = _ns()
    ns["x"] = ns["x"] * float("nan")
    f = bd.diagnose("opt.zero_grad()\nloss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n",
                    ns).findings[0]
    assert f.kind == "nonfinite" and f.iteration is None and "iteration" not in f.location()


def test_a_batch_loop_variable_is_described_by_its_shapes():
    """``for xb, yb in batches``: the finding says which batch by shape, and keeps no tensor."""
    ns = _ns()
    ns["batches"] = [(ns["x"], ns["y"])] * 6
    ns["batches"][4] = (ns["x"] * float("nan"), ns["y"])
    cell = ("for xb, yb in batches:\n    opt.zero_grad()\n    loss = F.cross_entropy(model(xb), yb)\n"
            "    loss.backward()\n    opt.step()\n")
    report = bd.diagnose(cell, ns, every_iteration=True)
    f = report.findings[0]
    assert f.iteration == 4 and f.evidence["loop_value"] == "xb = float32[12, 8], yb = int64[12]", f
    assert all(isinstance(v, str) for v in report.trace.iterations.values.values())
    # Sampled (iteration 4 is recorded): the bad batch is that iteration's own, not "an earlier one".
    ns = _ns()  # (fresh weights: the run above left NaN in them)
    ns["batches"] = [(ns["x"], ns["y"])] * 40
    ns["batches"][16] = (ns["x"] * float("nan"), ns["y"])
    f = bd.diagnose(cell, ns).findings[0]
    assert (f.iteration, f.line) == (16, 3) and "appeared in iterations" not in f.title, f


INPLACE_LATE = ("for i in range(300):\n    opt.zero_grad()\n    p = model(x).sigmoid()\n    if i == 200:\n"
                "        p.add_(1e-3)  # in place on what sigmoid saved\n    loss = p.mean()\n    loss.backward()\n"
                "    opt.step()\n")


def test_an_error_in_an_unrecorded_iteration_is_replayed_alone():
    """Iteration 200 raises (an in-place write on a saved tensor) with the recorder off: that iteration is
    replayed from the state it raised in, so the in-place rule sees its ops and names the line; the
    user's traceback, namespace and weights are those of the plain run."""
    plain, doctored = _ns(), _ns()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        exec(INPLACE_LATE, plain)
    report = bd.diagnose(INPLACE_LATE, doctored)
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("inplace", 5, 200), f
    assert "modified by an inplace operation" in report.exception
    assert any("The cell raised in iteration 200" in n for n in report.trace.notes)
    assert doctored["i"] == plain["i"] == 200
    for p, q in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p, q)


def test_a_bad_micro_batch_under_gradient_accumulation_is_replayed():
    """Four micro-batches per optimizer step: the NaN loss of micro-batch 83 is seen at its backward, so
    the state kept is that micro-batch's (the weights do not change until the step)."""
    cell = ("for i in range(160):\n    xb = x * float('nan') if i == 83 else x\n"
            "    loss = F.cross_entropy(model(xb), y) / 4\n    loss.backward()\n"
            "    if (i + 1) % 4 == 0:\n        opt.step()\n        opt.zero_grad()\n")
    report = bd.diagnose(cell, _ns())
    f = report.findings[0]
    assert report.trace.iterations.first_nonfinite == 20 and report.trace.iterations.replayed == 20
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 2, 20), f
    assert "i = 83" in f.location()


def test_the_per_iteration_watch_dispatches_no_op():
    """What runs at every iteration's end (the RNG state kept for a replay, the loss read, the gradients'
    norm, live bytes) must not show up as ops in the user's trace, nor run any kernel."""
    from backward_doctor.capture.native_capture import NativeCapture
    from backward_doctor.run.iteration_replay import IterationRollback

    ns = _ns()
    loss = F.cross_entropy(ns["model"](ns["x"]), ns["y"])
    loss.backward()
    value = loss.detach()
    with NativeCapture(ns) as cap:
        before = cap._ext.op_count()
        IterationRollback("for i in range(3):\n    opt.step()\n", ns).iteration_began(1)
        cap._watch.saw_backward(value)
        cap._watch.before_step(ns["opt"])
        cap._watch.iteration_ended()
        after = cap._ext.op_count()
    assert after == before
    assert cap.trace.iterations.loss == [pytest.approx(loss.item())]
    grads = torch.cat([p.grad.flatten() for p in ns["model"].parameters()])
    assert cap.trace.iterations.grad_norm == [pytest.approx(grads.norm().item(), rel=1e-5)]
