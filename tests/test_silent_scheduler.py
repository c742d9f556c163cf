"""Issue 48, ``scheduler_misuse``: a learning-rate scheduler stepped out of step with its optimizer, named at the
``scheduler.step()`` line with the iteration, in the user's terms, with the fix as code, and silent on its correct
twin, on both engines; inside a Hugging Face ``Trainer.train()`` and a Lightning ``fit()`` where it applies.

- ``scheduler.step()`` before the first ``optimizer.step()`` (the schedule's first value skipped), per iteration
  and per epoch;
- a scheduler stepped every micro-batch under gradient accumulation (the schedule runs k times too fast);
- a scheduler whose optimizer never stepped (made for an optimizer re-created after it).
Correct twins: the scheduler after ``optimizer.step()``, a per-epoch StepLR after the inner loop, ReduceLROnPlateau
with a metric, a scheduler stepped once per optimizer step under accumulation, a GradScaler whose first steps are
skipped for inf gradients, OneCycleLR/LambdaLR warm-up, a schedule stepped alone to plot it.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import backward_doctor as bd
from report_check import describe as _describe, only, silent as _silent
import library_loops as ll
from backward_doctor.capture.watches.schedules import ScheduleWatch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _only(report, kind: str = "scheduler_misuse"):
    return only(report, kind)


def _diagnose(source: str, ns: dict, engine: str):
    with warnings.catch_warnings():  # (PyTorch's own warning for the order: the doctor says it, in the user's terms)
        warnings.simplefilter("ignore")
        return bd.diagnose(source, ns, engine=engine)


def _ns(sched: str = "StepLR(opt, step_size=1, gamma=0.5)", lr: float = 0.1) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ns = {"torch": torch, "nn": nn, "model": model, "opt": opt, "x": torch.randn(6, 8), "y": torch.randn(6, 2)}
    exec(f"sched = torch.optim.lr_scheduler.{sched}", ns)
    return ns


# ----------------------------------------------------------------------------- before the optimizer
BEFORE = """\
for step in range(4):
    sched.step()
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
"""
AFTER = """\
for step in range(4):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()
"""


def test_scheduler_stepped_before_the_optimizer_skips_the_first_learning_rate(engine):
    f = _only(_diagnose(BEFORE, _ns(), engine))
    assert (f.line, f.file, f.iteration) == (2, None, 0), f
    assert f.evidence["problem"] == "before_optimizer" and f.evidence["scheduler"] == "StepLR"
    assert f.evidence["skipped_lr"] == 0.1 and f.evidence["first_step_lr"] == 0.05
    assert "its first learning rate, 0.1, was skipped: the first optimizer step already ran at 0.05" in f.message
    assert f.evidence["fix_code"] == "opt.step()\nsched.step()  # after the optimizer step: the schedule starts at " \
                                     "its first value"
    assert f.location().startswith("cell line 2, in iteration 0 of the loop at line 1")

    _silent(_diagnose(AFTER, _ns(), engine))


def test_pytorchs_own_warning_still_names_the_users_line(engine):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        bd.diagnose(BEFORE, _ns(), engine=engine)
    ours = [w for w in said if "before `optimizer.step()`" in str(w.message)]
    assert len(ours) == 1 and ours[0].lineno == 2 and ours[0].filename.startswith("<backward_doctor-cell"), \
        [(w.filename, w.lineno) for w in said]


COMPOSITES = {
    "SequentialLR": "SequentialLR(opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2), "
                    "torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], milestones=[2])",
    "ChainedScheduler": "ChainedScheduler([torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2), "
                        "torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)])",
    "CosineAnnealingWarmRestarts": "CosineAnnealingWarmRestarts(opt, T_0=2)",
    "CyclicLR": "CyclicLR(opt, 0.01, 0.1, step_size_up=2)",
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composite_and_cyclic_schedulers_before_and_after_the_optimizer(name, engine):
    """Schedulers with a ``step`` of their own (their children's steps are not counted again)."""
    f = _only(_diagnose(BEFORE, _ns(COMPOSITES[name]), engine))
    assert (f.line, f.iteration, f.evidence["problem"], f.evidence["scheduler"]) == (2, 0, "before_optimizer", name)
    _silent(_diagnose(AFTER, _ns(COMPOSITES[name]), engine))


BEFORE_THEN_NAN = """\
for step in range(12):
    sched.step()
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean() * (float("nan") if step == 9 else 1.0)
    loss.backward()
    opt.step()
"""


def test_a_loop_replayed_for_its_nan_keeps_the_runs_own_scheduler_steps(engine):
    """The iteration that went NaN is replayed alone (it ran unrecorded): the scheduler watch saw the whole run,
    its record stands (the replay's single step would not show the order)."""
    report = _diagnose(BEFORE_THEN_NAN, _ns(), engine)
    if engine == "native":  # (the Python tier records every iteration of so short a loop on the CPU: no replay)
        assert report.trace.iterations.replayed == 9, report.trace.iterations
    kinds = {f.kind: f for f in report.findings}
    assert "nonfinite" in kinds and "scheduler_misuse" in kinds, _describe(report)
    f = kinds["scheduler_misuse"]
    assert (f.line, f.iteration, f.evidence["problem"], f.evidence["calls"]) == (2, 0, "before_optimizer", 12)


EPOCH_BEFORE = """\
for epoch in range(2):
    sched.step()
    for step in range(3):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
"""
EPOCH_AFTER = """\
for epoch in range(2):
    for step in range(3):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    sched.step()
"""


def test_per_epoch_scheduler_at_the_top_of_the_epoch_and_after_the_inner_loop(engine):
    f = _only(_diagnose(EPOCH_BEFORE, _ns(), engine))
    assert (f.line, f.iteration, f.evidence["problem"]) == (2, 0, "before_optimizer"), f
    assert f.evidence["fix_code"].endswith("opt.step()`:\nsched.step()")
    assert "at the end of each epoch" in f.message

    _silent(_diagnose(EPOCH_AFTER, _ns(), engine))


PLATEAU = """\
for epoch in range(3):
    for step in range(2):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        val = ((model(x) - y) ** 2).mean()
    sched.step(val)
"""


def test_reduce_on_plateau_warm_up_and_a_plotted_schedule_stay_silent(engine):
    _silent(_diagnose(PLATEAU, _ns("ReduceLROnPlateau(opt, patience=0)"), engine))
    _silent(_diagnose(AFTER, _ns("OneCycleLR(opt, max_lr=0.1, total_steps=10)"), engine))
    _silent(_diagnose(AFTER, _ns("LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))"), engine))
    plot = "lrs = []\nfor _ in range(5):\n    sched.step()\n    lrs.append(sched.get_last_lr()[0])\n"
    _silent(_diagnose(plot, _ns(), engine))


PLOTTED = """\
dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
shape = torch.optim.lr_scheduler.CosineAnnealingLR(dummy, T_max=10)
before = [shape.step() or shape.get_last_lr()[0] for _ in range(10)]
""" + AFTER + """\
dummy2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
shape2 = torch.optim.lr_scheduler.StepLR(dummy2, step_size=2)
after = [shape2.step() or shape2.get_last_lr()[0] for _ in range(10)]
"""


def test_schedules_plotted_on_optimizers_of_their_own_around_training_stay_silent(engine):
    report = _diagnose(PLOTTED, _ns(), engine)
    assert sorted(s.type for s in report.trace.schedules) == ["CosineAnnealingLR", "StepLR", "StepLR"]
    _silent(report)


# ----------------------------------------------------------------------------- GradScaler skipping the first steps
SCALED = """\
for step in range(4):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
"""


def test_a_gradscaler_that_skips_the_first_step_for_inf_gradients_stays_silent(engine):
    ns = _ns()
    # (a scale so large that the first iteration's scaled gradients overflow: the scaler skips that step and halves)
    ns["y"] = ns["y"] * 1e3
    ns["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, backoff_factor=2.0 ** -100,
                                        growth_interval=1000)
    report = _diagnose(SCALED, ns, engine)
    assert report.trace.precision.scaler.skipped == 1 and report.trace.iterations.steps == 3, _describe(report)
    assert report.trace.schedules[0].steps[0].scaler_skipped == 1
    assert [f for f in report.findings if f.kind == "scheduler_misuse"] == [], _describe(report)


# ----------------------------------------------------------------------------- per micro-batch under accumulation
ACCUM_EVERY = """\
for i in range(12):
    loss = ((model(x) - y) ** 2).mean() / 4
    loss.backward()
    if (i + 1) % 4 == 0:
        opt.step()
        opt.zero_grad()
    sched.step()
"""
ACCUM_ONCE = """\
for i in range(12):
    loss = ((model(x) - y) ** 2).mean() / 4
    loss.backward()
    if (i + 1) % 4 == 0:
        opt.step()
        sched.step()
        opt.zero_grad()
"""


def test_scheduler_stepped_every_micro_batch_runs_the_schedule_k_times_too_fast(engine):
    sched = "StepLR(opt, step_size=1, gamma=0.9)"
    f = _only(_diagnose(ACCUM_EVERY, _ns(sched), engine))
    assert (f.line, f.file, f.iteration) == (7, None, 0), f
    assert f.evidence["problem"] == "too_often" and f.evidence["per_optimizer_step"] == 4
    assert f.evidence["micro_batches"] is True
    assert "once per micro-batch (each `backward()`), while the optimizer steps once every 4 of them" in f.message
    assert "4 scheduler steps per optimizer step, so the schedule runs 4 times too fast" in f.message
    assert f.evidence["fix_code"] == "        opt.step()\n        sched.step()  # once per optimizer step, not per " \
                                     "micro-batch"

    _silent(_diagnose(ACCUM_ONCE, _ns(sched), engine))


# ----------------------------------------------------------------------------- the optimizer that never stepped
ORPHAN = """\
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()
"""
REMADE = """\
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
for step in range(4):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()
"""


def test_a_scheduler_of_an_optimizer_replaced_after_it_is_named(engine):
    f = _only(_diagnose(ORPHAN, _ns(), engine))
    assert (f.line, f.iteration, f.evidence["problem"]) == (7, 0, "optimizer_never_stepped"), f
    assert "whose `SGD` optimizer never stepped since the scheduler was made, while `Adam` stepped 4 time(s)" \
        in f.message
    assert f.evidence["fix_code"] == "sched = torch.optim.lr_scheduler.StepLR(opt, ...)  # the optimizer that steps"

    _silent(_diagnose(REMADE, _ns(), engine))


# ----------------------------------------------------------------------------- library loops
LIT_SCHEDULED = ll.LIT_MODULE.replace(
    "        return torch.optim.SGD(self.parameters(), lr=self.lr)\n",
    "        opt = torch.optim.SGD(self.parameters(), lr=self.lr)\n"
    "        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)\n"
    "        return {'optimizer': opt, 'lr_scheduler': {'scheduler': sched, 'interval': 'step'}}\n")
LIT_STEPPED_BY_HAND = LIT_SCHEDULED.replace(
    "        return loss\n",
    "        self.lr_schedulers().step()  # <-- per batch\n        return loss\n")


def test_lightning_scheduler_stepped_per_batch_under_accumulation(engine):
    ns = ll.lit_fit(LIT_STEPPED_BY_HAND, steps=3, trainer_kwargs={"accumulate_grad_batches": 2})
    report = _diagnose(ll.LIT_FIT, ns, engine)
    f = _only(report)
    assert f.evidence["problem"] == "too_often" and f.evidence["per_optimizer_step"] == 3, _describe(report)
    assert f.line == ll.marked_line(ns, "LitClassifier", "# <-- per batch"), f
    assert "3 times for each optimizer step (by your code and by Lightning, which steps it itself" in f.message
    assert f.evidence["fix_code"] == "# self.lr_schedulers().step()  # deleted: Lightning steps the scheduler " \
                                     "itself, once per optimizer step"

    ns = ll.lit_fit(LIT_SCHEDULED, steps=3, trainer_kwargs={"accumulate_grad_batches": 2})
    _silent(_diagnose(ll.LIT_FIT, ns, engine))


HF_CALLBACK = """\
from transformers import TrainerCallback


class StepSchedule(TrainerCallback):
    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        lr_scheduler.step()  # <-- the Trainer steps it too
"""


def test_a_trainer_whose_scheduler_a_callback_steps_again(engine):
    callback = ll.define(HF_CALLBACK, {}, name="StepSchedule")
    ns = ll.hf_trainer(steps=4, n=32, batch=4, callbacks=[callback["StepSchedule"]()])
    report = _diagnose(ll.HF_TRAIN, ns, engine)
    f = _only(report)
    assert f.evidence["problem"] == "too_often" and f.evidence["per_optimizer_step"] == 2, _describe(report)
    assert (f.file, f.line) == (ll.defined_in(callback, "StepSchedule"),
                                ll.marked_line(callback, "StepSchedule", "# <-- the Trainer")), f
    assert f.iteration == 0, f
    assert "`lr_scheduler.step()` (`StepSchedule" in f.message
    assert "by your code and by the Trainer, which steps it itself" in f.message
    assert f.evidence["fix_code"].startswith("# lr_scheduler.step()  # deleted: the Trainer steps the scheduler")


def test_a_trainer_with_its_own_scheduler_stays_silent(engine):
    # its own (warm-up, then linear decay), under accumulation: stepped once per optimizer step
    ns = ll.hf_trainer(steps=3, accum=2, n=32, batch=4, warmup_steps=2)
    report = _diagnose(ll.HF_TRAIN, ns, engine)
    assert [(s.type, s.library, s.calls) for s in report.trace.schedules] == [("LambdaLR", "transformers", 3)]
    # (this tiny model's loss is left undivided under accumulation: grad_accumulation's, not the scheduler's)
    assert [f for f in report.findings if f.kind == "scheduler_misuse"] == [], _describe(report)

    # given to it: optimizers=(optimizer, scheduler)
    ns = ll.hf_trainer(steps=4, n=32, batch=4)
    opt = torch.optim.AdamW(ns["model"].parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    ns["trainer"] = type(ns["trainer"])(model=ns["model"], args=ns["args"], train_dataset=ns["train_ds"],
                                        optimizers=(opt, sched))
    _silent(_diagnose(ll.HF_TRAIN, ns, engine))


ACCEL_SCHEDULED = ll.ACCEL_LOOP + "        scheduler.step()\n"


def test_an_accelerate_loop_whose_scheduler_was_not_prepared(engine):
    # Accelerate's pattern steps the scheduler in every micro-batch of accumulate(): right for the scheduler
    # accelerator.prepare() wrapped (it steps only with the optimizer), 4x too fast for a plain one
    ns = ll.accelerate_loop(accum=4, n=64, batch=4)
    ns["scheduler"] = torch.optim.lr_scheduler.StepLR(ns["optimizer"], step_size=1, gamma=0.9)
    report = _diagnose(ACCEL_SCHEDULED, ns, engine)
    f = _only(report)
    assert (f.line, f.iteration, f.evidence["problem"]) == (7, 0, "too_often"), _describe(report)
    assert f.evidence["per_optimizer_step"] == 4 and f.evidence["micro_batches"] is True
    assert "`accelerator.prepare` was not given this scheduler" in f.message
    assert f.evidence["fix_code"] == "scheduler = accelerator.prepare(scheduler)  # it steps only when the optimizer " \
                                     "really steps"

    ns = ll.accelerate_loop(accum=4, n=64, batch=4)
    ns["scheduler"] = ns["accelerator"].prepare(torch.optim.lr_scheduler.StepLR(ns["optimizer"], step_size=1,
                                                                                gamma=0.9))
    report = _diagnose(ACCEL_SCHEDULED, ns, engine)
    assert [(s.type, s.library, s.calls) for s in report.trace.schedules] == [("StepLR", "accelerate", 4)]
    _silent(report)


# ----------------------------------------------------------------------------- the watch itself
OTHER_THREAD = """\
import threading


def other():
    p = torch.nn.Parameter(torch.ones(2))
    o = torch.optim.SGD([p], lr=1.0)
    s = torch.optim.lr_scheduler.StepLR(o, step_size=1)
    for _ in range(5):
        s.step()


t = threading.Thread(target=other)
t.start()
t.join()
""" + AFTER


def test_another_threads_scheduler_is_not_counted(engine):
    report = _diagnose(OTHER_THREAD, _ns(), engine)
    assert [(s.type, s.calls) for s in report.trace.schedules] == [("StepLR", 4)], report.trace.schedules
    _silent(report)


def test_a_broken_scheduler_watch_stops_and_the_run_is_bit_identical(engine, monkeypatch):
    plain = _ns()
    exec(AFTER, plain)

    def boom(*args, **kwargs):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(ScheduleWatch, "before", boom)
    ns = _ns()
    report = _diagnose(AFTER, ns, engine)
    assert report.exception is None and report.trace.schedules == []
    for a, b in zip(plain["model"].parameters(), ns["model"].parameters()):
        assert torch.equal(a, b)
    assert ns["sched"].last_epoch == plain["sched"].last_epoch == 4
    notes = [n for n in report.trace.notes if n.startswith("the scheduler watch")]
    assert notes and "injected fault" in notes[0], report.trace.notes
    assert torch.optim.lr_scheduler.LRScheduler.step.__name__ == "step" and \
        not hasattr(torch.optim.lr_scheduler.LRScheduler.step, "__wrapped__")
