"""Fixes (issue 4): OOM fixed by accumulate / checkpoint / amp under a simulated device, the rewritten
cell standing on its own, rollback, honest refusals, the FixResult contract the panel relies on."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.fixes import FixResult, run_fix

STEP = textwrap.dedent("""\
    optimizer.zero_grad()
    logits = model(xb)
    loss = F.cross_entropy(logits, yb)
    loss.backward()
    optimizer.step()
""")


def _ns(model, xb, yb, opt=torch.optim.Adam):
    return {"torch": torch, "nn": nn, "F": F, "model": model, "xb": xb, "yb": yb,
            "optimizer": opt(model.parameters(), lr=1e-3)}


def wide_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))
    return _ns(model, torch.randn(1024, 64), torch.randint(0, 10, (1024,)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self, d=32, n=6):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def res_mlp():
    torch.manual_seed(0)
    return _ns(ResMLP(), torch.randn(1024, 16), torch.randint(0, 10, (1024,)), opt=torch.optim.AdamW)


def plain(setup, source=STEP):
    """The cell run without the doctor: the reference."""
    ns = setup()
    exec(compile(source, "<plain>", "exec"), ns)
    return ns


def grads(ns):
    return [p.grad.clone() for p in ns["model"].parameters()]


def params(ns):
    return [p.detach().clone() for p in ns["model"].parameters()]


def max_rel_err(got, want):
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


def full_peak(setup, source=STEP):
    return bd.diagnose(source, setup()).trace.memory.peak_bytes


@pytest.fixture(scope="module")
def mlp_peak():
    return full_peak(wide_mlp)


@pytest.fixture(scope="module")
def res_peak():
    return full_peak(res_mlp)


# --------------------------------------------------------------------------- accumulate
@pytest.mark.parametrize("fix", ["accumulate:4", "accumulate"])
def test_accumulate_fixes_oom_and_matches_full_batch_gradients(fix, mlp_peak):
    limit = int(mlp_peak * 0.6)
    ns = wide_mlp()
    report = bd.diagnose(STEP, ns, memory_limit=limit, fix=fix)
    fr = report.fix_result
    assert isinstance(fr, FixResult) and fr.applied and fr.fits, fr.message
    assert fr.name.startswith("accumulate:")
    assert report.exception is None and report.fix == fr.name
    before, after = fr.comparison["before"], fr.comparison["after"]
    assert not before["completed"] and before["exception"].startswith("OutOfMemoryError")
    assert after["completed"] and after["peak_bytes"] <= limit
    assert set(after["peak_by_category"]) >= {"parameters", "gradients", "activations"}
    assert fr.original["exception"].startswith("OutOfMemoryError")
    ref = plain(wide_mlp)
    assert max_rel_err(grads(ns), grads(ref)) <= 1e-4
    ref_loss = ref["loss"].item()
    assert abs(after["loss"] - ref_loss) <= 1e-4 * abs(ref_loss)
    assert abs(ns["loss"].item() - ref_loss) <= 1e-4 * abs(ref_loss)   # the whole batch's loss, as before
    assert "for start in range(0, batch_size, micro_size):" in fr.code
    assert fr.diff.startswith("--- original cell\n+++ with fix\n")


def test_accumulate_rewrite_is_readable_code_that_runs_standalone(mlp_peak):
    ns = wide_mlp()
    fr = bd.diagnose(STEP, ns, memory_limit=int(mlp_peak * 0.6), fix="accumulate:4").fix_result
    alone = wide_mlp()
    exec(compile(fr.code, "<kept>", "exec"), alone)       # no doctor at all
    for a, b in zip(params(alone), params(ns)):
        assert torch.equal(a, b)                          # the same step, bit for bit
    for a, b in zip(grads(alone), grads(ns)):
        assert torch.equal(a, b)
    assert "backward_doctor fix accumulate:4" in fr.code and "(loss * share).backward()" in fr.code


def _small_setup():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    return {"torch": torch, "F": F, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "batch": (torch.randn(64, 8), torch.randint(0, 3, (64,))), "extra": {"w": torch.rand(64)}}


@pytest.mark.parametrize("src, expect", [
    # a tuple batch and a dict of per-example weights, summed loss: no weights per micro-batch
    ("""\
        opt.zero_grad()
        per_item = F.cross_entropy(model(batch[0]), batch[1], reduction="none")
        loss = (per_item * extra["w"]).sum()
        loss.backward()
        opt.step()
     """, ["batch_micro = tuple(t[start:start + micro_size] for t in batch)", "extra_micro = {key: value"]),
    # unpacked before the model call: the unpacked names are the batch
    ("""\
        opt.zero_grad()
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
     """, ["x_micro = x[start:start + micro_size]", "share = x_micro.shape[0] / batch_size"]),
])
def test_accumulate_handles_tuple_dict_and_unpacked_batches(src, expect):
    src = textwrap.dedent(src)
    ref = plain(_small_setup, src)
    ns = _small_setup()
    fr = run_fix(src, ns, "accumulate:4").fix_result
    assert fr.applied and fr.fits, fr.message
    for fragment in expect:
        assert fragment in fr.code
    assert ("share" in fr.code) == ("sum()" not in src)  # a sum over the batch needs no weights
    assert max_rel_err([ns["model"].weight.grad], [ref["model"].weight.grad]) <= 1e-5
    assert fr.comparison["grad_max_rel_err"] is not None and fr.comparison["grad_max_rel_err"] <= 1e-5


# --------------------------------------------------------------------------- checkpoint
def test_checkpoint_fixes_oom_with_identical_gradients(res_peak):
    limit = int(res_peak * 0.6)
    ns = res_mlp()
    report = bd.diagnose(STEP, ns, memory_limit=limit, fix="checkpoint")
    fr = report.fix_result
    assert fr.applied and fr.fits, fr.message
    assert "use_reentrant=False" in fr.code and "with checkpointing(*model.blocks):" in fr.code
    blocks = [f"model.blocks[{i}]" for i in range(len(ns["model"].blocks))]
    assert all(f"{b} (" in fr.message for b in blocks) and "..." not in fr.message  # every module named
    assert fr.comparison["after"]["peak_bytes"] <= limit
    ref = plain(res_mlp)
    for a, b in zip(grads(ns), grads(ref)):
        assert torch.equal(a, b)                          # recomputation gives the same gradients
    assert all("forward" not in vars(m) for m in ns["model"].modules())  # patched for the step only
    alone = res_mlp()
    exec(compile(fr.code, "<kept>", "exec"), alone)
    for a, b in zip(params(alone), params(ns)):
        assert torch.equal(a, b)


class Named(nn.Module):
    """Blocks held as attributes, not in a Sequential: the kept code lists each one."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.first, self.second, self.third = Block(d), Block(d), Block(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.third(self.second(self.first(self.inp(x)))))


def test_checkpoint_code_lists_every_module_in_a_with_block():
    def setup():
        torch.manual_seed(0)
        return _ns(Named(), torch.randn(1024, 16), torch.randint(0, 10, (1024,)), opt=torch.optim.AdamW)

    peak = bd.diagnose(STEP, setup()).trace.memory.peak_bytes
    ns = setup()
    fr = bd.diagnose(STEP, ns, memory_limit=int(peak * 0.6), fix="checkpoint").fix_result
    assert fr.applied and fr.fits, fr.message
    chosen = [m for m in ("inp", "first", "second", "third") if f"    model.{m},  # " in fr.code]
    assert len(chosen) >= 2 and "with checkpointing(\n" in fr.code          # each module on its own line
    assert all(f"model.{m} (" in fr.message for m in chosen)               # and named in the message
    assert "functools.partial(checkpoint" not in fr.code.split("def checkpointing")[0]  # the cell reads plainly
    assert all("forward" not in vars(m) for m in ns["model"].modules())   # for this step only
    alone = setup()
    exec(compile(fr.code, "<kept>", "exec"), alone)                       # the kept code runs on its own


def test_checkpoint_refuses_when_one_module_holds_everything(mlp_peak):
    ns = wide_mlp()
    report = bd.diagnose(STEP, ns, memory_limit=int(mlp_peak * 0.6), fix="checkpoint")
    fr = report.fix_result
    assert not fr.applied and fr.fits is None
    assert "would not lower the peak" in fr.message and "accumulate" in fr.message
    assert report.findings[0].kind == "oom"               # the report is the original diagnosis


# --------------------------------------------------------------------------- amp
def test_amp_fixes_oom_and_loss_is_close(mlp_peak):
    limit = int(mlp_peak * 0.75)
    ns = wide_mlp()
    fr = bd.diagnose(STEP, ns, memory_limit=limit, fix="amp").fix_result
    assert fr.applied and fr.fits, fr.message
    assert 'with torch.autocast(device_type="cpu", dtype=torch.bfloat16):' in fr.code
    assert "\nloss.backward()" in fr.code                 # backward outside the autocast block
    ref = plain(wide_mlp)
    assert abs(fr.comparison["after"]["loss"] - ref["loss"].item()) <= 0.02 * abs(ref["loss"].item())
    assert all(p.dtype == torch.float32 for p in ns["model"].parameters())
    alone = wide_mlp()
    exec(compile(fr.code, "<kept>", "exec"), alone)
    assert alone["loss"].item() == pytest.approx(fr.comparison["after"]["loss"], rel=1e-6)


def test_amp_fp16_goes_through_a_grad_scaler():
    ns = wide_mlp()
    fr = run_fix(STEP, ns, "amp:fp16").fix_result
    assert fr.applied, fr.message
    assert "scaler.scale(loss).backward()" in fr.code and "scaler.step(optimizer)" in fr.code
    assert "scaler.update()" in fr.code
    assert fr.fits, fr.message
    assert isinstance(ns["scaler"], torch.amp.GradScaler)


# --------------------------------------------------------------------------- rollback
DROPOUT_STEP = textwrap.dedent("""\
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    steps = steps + 1 if "steps" in globals() else 1
""")


def dropout_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
    return _ns(model, torch.randn(256, 16), torch.randint(0, 4, (256,)))


def test_rollback_original_plus_fix_equals_fix_alone():
    ns = dropout_mlp()
    report = bd.diagnose(DROPOUT_STEP, ns, fix="accumulate:2")   # the original completes and steps Adam
    fr = report.fix_result
    assert fr.applied and fr.fits and fr.rolled_back
    assert fr.comparison["before"]["completed"]
    alone = dropout_mlp()
    exec(compile(fr.code, "<kept>", "exec"), alone)
    for a, b in zip(params(ns), params(alone)):
        assert torch.equal(a, b)                          # parameters, Adam state and RNG were all restored
    assert ns["steps"] == 1                               # the cell's own names too
    opt = ns["optimizer"]
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    # Without rollback the fix runs on top of the original step: a second Adam step.
    ns2 = dropout_mlp()
    bd.diagnose(DROPOUT_STEP, ns2, fix="accumulate:2", rollback=False)
    assert not all(torch.equal(a, b) for a, b in zip(params(ns2), params(alone)))
    assert ns2["steps"] == 2


def test_failed_fix_rolls_back_to_before_the_fix(mlp_peak):
    ns = wide_mlp()
    before = params(ns)
    fr = bd.diagnose(STEP, ns, memory_limit=int(mlp_peak * 0.2), fix="accumulate:2").fix_result
    assert fr.applied and not fr.fits and fr.rolled_back
    assert "did not complete" in fr.message and "rolled back" in fr.message
    assert all(torch.equal(a, b) for a, b in zip(params(ns), before))
    assert all(p.grad is None for p in ns["model"].parameters())
    assert "xb_micro" not in ns and "loss_total" not in ns


def test_rollback_skipped_with_a_warning_when_ram_is_short(monkeypatch):
    from backward_doctor.run import snapshot as snapshot_mod

    monkeypatch.setattr(snapshot_mod, "available_ram", lambda: 1000)
    with pytest.warns(RuntimeWarning, match="rollback skipped"):
        fr = run_fix(STEP, wide_mlp(), "accumulate:2").fix_result
    assert any("rollback skipped" in w for w in fr.warnings)
    assert fr.applied and not fr.rolled_back


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("source, fix, fragment", [
    ("y = model(xb)\n", "accumulate:2", "no `.backward()` call"),
    ("loss = model(torch.randn(4, 64)).sum()\nloss.backward()\n", "accumulate:2", "found no batch"),
    ("for i in range(2):\n    model(xb).sum().backward()\n", "accumulate:2", "inside a loop"),
    ("optimizer.zero_grad()\noptimizer.step()\nloss = F.cross_entropy(model(xb), yb)\n", "amp", "no `.backward()`"),
    (STEP, "sync", "nothing to add here"),
])
def test_a_fix_that_does_not_apply_says_why(source, fix, fragment):
    ns = wide_mlp()
    report = bd.diagnose(source, ns, fix=fix)
    fr = report.fix_result
    assert not fr.applied and fragment in fr.message, fr.message
    assert fr.code == "" and fr.fits is None
    assert fr.message.startswith(f"{fix} cannot be applied: ")
    assert bd.last_report() is report


def test_unknown_or_malformed_fix_raises_before_anything_runs():
    ns = {}
    for bad in ("magic", "accumulate:0", "accumulate:x", "checkpoint:3", 7):
        with pytest.raises(ValueError):
            bd.diagnose("ran = True", ns, fix=bad)
        with pytest.raises(ValueError):
            run_fix("ran = True", ns, bad)
    assert "ran" not in ns


# --------------------------------------------------------------------------- contract for the panel
def test_fix_result_json_round_trip(mlp_peak):
    report = bd.diagnose(STEP, wide_mlp(), memory_limit=int(mlp_peak * 0.6), fix="accumulate:4")
    data = json.loads(json.dumps(report.to_dict()))
    again = bd.Report.from_dict(data)
    assert again.to_dict() == report.to_dict()
    fr = again.fix_result
    assert isinstance(fr, FixResult) and fr.name == "accumulate:4" and fr.applied
    assert set(fr.comparison) >= {"before", "after", "grad_max_rel_err"}
    for side in ("before", "after"):
        assert set(fr.comparison[side]) >= {"peak_bytes", "peak_by_category", "step_s", "loss"}
    assert bd.Report.from_dict(fr.original).findings[0].kind == "oom"
    assert "accumulate:4" in str(again) and "code to keep" in str(again)


def test_progress_and_cancel(mlp_peak):
    seen = []
    report = run_fix(STEP, wide_mlp(), "accumulate:4", memory_limit=int(mlp_peak * 0.6),
                     progress=lambda f, t: seen.append((f, t)))
    assert report.fix_result.fits
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert any("(4/4)" in t for _, t in seen)             # one report per micro-batch

    ns = wide_mlp()
    start = params(ns)
    calls = []

    def cancel():                                         # stop during the second micro-batch's forward
        calls.append(1)
        return sum("running the cell with" in t for _, t in seen2) >= 2

    seen2 = []
    report = run_fix(STEP, ns, "accumulate:4", progress=lambda f, t: seen2.append((f, t)), cancel=cancel)
    fr = report.fix_result
    assert fr.cancelled and not fr.applied and fr.rolled_back and "Cancelled" in fr.message
    assert all(torch.equal(a, b) for a, b in zip(params(ns), start))
    assert all(p.grad is None for p in ns["model"].parameters())
    assert "xb_micro" not in ns


def test_sync_on_cpu_checks_the_bad_ids_before_the_embedding():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    ns = {"torch": torch, "emb": emb, "ids": torch.tensor([[1, 2, 10]]),
          "opt": torch.optim.SGD(emb.parameters(), lr=0.1)}
    src = "opt.zero_grad()\nloss = emb(ids).sum()\nloss.backward()\nopt.step()\n"
    report = bd.diagnose(src, ns, fix="sync")
    fr = report.fix_result
    assert fr.applied and not fr.fits, fr.message
    assert "if ((ids < 0) | (ids > 9)).any():" in fr.code
    assert report.exception.startswith("IndexError: ids holds values outside 0..9")
    assert report.findings[0].kind == "index_out_of_range"
    with pytest.raises(IndexError, match="outside 0..9"):
        exec(fr.code, dict(ns))


def test_globals_restored_and_no_memory_held_after_fixes(mlp_peak):
    import gc
    import weakref

    import torch.optim.optimizer as optim_mod
    from torch.nn.modules import module as nn_module

    def state():
        return (torch._C._len_torch_dispatch_stack(), len(nn_module._global_forward_pre_hooks),
                len(nn_module._global_forward_hooks), len(optim_mod._global_optimizer_pre_hooks),
                len(optim_mod._global_optimizer_post_hooks), torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"))
    before = state()
    ns = wide_mlp()
    report = bd.diagnose(STEP, ns, memory_limit=int(mlp_peak * 0.6), fix="accumulate")
    run_fix(STEP, wide_mlp(), "amp", memory_limit=int(mlp_peak * 0.75))
    run_fix(STEP, wide_mlp(), "accumulate:4", cancel=lambda: True)
    assert state() == before
    # The report keeps no tensor of the user's: dropping the namespace frees the batch.
    ref = weakref.ref(ns["xb"])
    ns.clear()
    gc.collect()
    assert ref() is None
    assert report.fix_result.fits


def test_run_fix_from_a_report_the_widget_already_has(mlp_peak):
    limit = int(mlp_peak * 0.6)
    ns = wide_mlp()
    original = bd.diagnose(STEP, ns, memory_limit=limit)          # what the panel shows first
    report = run_fix(STEP, ns, "accumulate:4", original=original.to_dict(), memory_limit=limit)
    fr = report.fix_result
    assert fr.applied and fr.fits and not fr.rolled_back          # nothing ran twice, nothing to undo
    assert fr.original == original.to_dict()
    assert fr.comparison["before"]["peak_bytes"] == original.trace.memory.peak_bytes
    assert fr.comparison["predicted_peak"] == original.findings[0].evidence["predicted_peak"]["accumulate:4"]


def test_plain_accumulate_doubles_k_until_the_step_fits_even_for_a_batch_made_in_the_cell(mlp_peak):
    src = "xb = torch.randn(1024, 64)\nyb = torch.randint(0, 10, (1024,))\n" + STEP
    ns = wide_mlp()
    del ns["xb"], ns["yb"]
    fr = bd.diagnose(src, ns, memory_limit=int(mlp_peak * 0.5), fix="accumulate").fix_result
    assert fr.applied and fr.fits, fr.message
    assert "Tried first: accumulate:2 still ran out of memory" in fr.message and "itself" in fr.message
    assert "_2 " not in fr.code and "accum_steps = " in fr.code        # fresh names, not accum_steps_2
    assert fr.comparison["after"]["peak_bytes"] <= int(mlp_peak * 0.5)
    assert fr.comparison["predicted_is_lower_bound"] is True           # it ran out in the first layer


def test_plain_accumulate_stops_when_the_optimizer_step_itself_does_not_fit(mlp_peak):
    fr = bd.diagnose(STEP, wide_mlp(), memory_limit=int(mlp_peak * 0.25), fix="accumulate").fix_result
    assert fr.applied and not fr.fits and fr.rolled_back
    assert any("in the optimizer step" in w for w in fr.warnings), fr.message


def test_run_fix_from_a_background_thread_with_a_cancel_event(mlp_peak):
    """The panel runs fixes in a thread so its Cancel button stays live."""
    import threading

    ns = wide_mlp()
    start = params(ns)
    original = bd.diagnose(STEP, ns, memory_limit=int(mlp_peak * 0.6))
    stop = threading.Event()
    out = {}

    def progress(fraction, text):
        if "(2/4)" in text:
            stop.set()

    def work():
        out["report"] = run_fix(STEP, ns, "accumulate:4", original=original, memory_limit=int(mlp_peak * 0.6),
                                progress=progress, cancel=stop.is_set)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    fr = out["report"].fix_result
    assert fr.cancelled and fr.rolled_back
    assert all(torch.equal(a, b) for a, b in zip(params(ns), start))


def test_the_callers_report_is_not_modified(mlp_peak):
    ns = wide_mlp()
    original = bd.diagnose(STEP, ns, memory_limit=int(mlp_peak * 0.6))
    before = original.to_dict()
    for fix in ("checkpoint", "accumulate:4"):
        run_fix(STEP, ns, fix, original=original, memory_limit=int(mlp_peak * 0.6))
        assert original.to_dict() == before and original.fix_result is None


def test_plain_accumulate_stops_when_smaller_micro_batches_do_not_help():
    """A dense embedding gradient that alone does not fit: the same allocation fails for every k."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(8192, 32, mode="mean"), nn.Linear(32, 2))
    ns = {"torch": torch, "F": F, "model": model, "docs": torch.randint(0, 8192, (64, 20)),
          "y": torch.randint(0, 2, (64,)), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    src = "optimizer.zero_grad()\nloss = F.cross_entropy(model(docs), y)\nloss.backward()\noptimizer.step()\n"
    report = bd.diagnose(src, ns, memory_limit="1.5MB", fix="accumulate")
    fr = report.fix_result
    assert fr.applied and not fr.fits
    assert any("do not shrink the allocation that fails" in w for w in fr.warnings), fr.message
    assert fr.message.count("still ran out of memory") <= 2


def test_snapshot_restores_scheduler_scaler_rng_and_names():
    import random

    from backward_doctor.run.snapshot import Snapshot

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ns = {"model": model, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
          "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0), "loss": torch.tensor(3.0), "n": 1}
    snap = Snapshot.take(ns, rebinds={"loss", "n", "fresh"})
    draws = (random.random(), torch.rand(1))
    scaler = ns["scaler"]
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)
    ns["sched"].step()
    scaler.update(new_scale=8.0)
    ns.update(loss=torch.tensor(9.0), n=2, fresh="made by the cell")
    model.eval()
    snap.restore(ns)
    assert opt.state == {} or all(not s for s in opt.state.values())       # momentum buffers made later: gone
    assert opt.param_groups[0]["lr"] == 0.1 and ns["sched"].last_epoch == 0
    assert ns["scaler"].get_scale() == 1024.0
    assert float(ns["loss"]) == 3.0 and ns["n"] == 1 and "fresh" not in ns
    assert model.training and all(p.grad is None for p in model.parameters())
    again = (random.random(), torch.rand(1))
    assert again[0] == draws[0] and torch.equal(again[1], draws[1])        # the same random numbers again
