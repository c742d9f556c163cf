"""The library callbacks inside real ``transformers.Trainer.train()`` and Lightning ``Trainer.fit()`` runs
(tiny random configs, nothing downloaded; the shared kit ``tests/library_loops.py``): a correct run is
silent, writes nothing and trains bit-identically; a run that goes NaN/Inf is stopped and its report
(JSON + HTML) names the op, line and iteration; a run that raises leaves the report before the exception
propagates; nothing stays installed afterwards."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import backward_doctor as bd
from backward_doctor import integrations
from backward_doctor.capture.native_capture import native_available

import fault_injection as fi
import library_loops as ll

HF_NAN, POISONED_SAMPLE, POISONED_STEP = ll.HF_NAN, ll.POISONED_SAMPLE, ll.POISONED_STEP
HF_RAISES = '''
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        if self.state.global_step == 5:
            return out.logits @ out.logits   # <-- here
        return out.loss
'''


def _hf(source: str | None, callback, poison: bool = False) -> dict:
    return ll.hf_rare_token_trainer(source, [callback] if callback else None, poison=poison)


def _state(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _clean_after(before: dict, ns: dict, hook) -> None:
    left = fi.leftovers(before, ns)
    assert left == [], left
    assert sys.excepthook is hook
    trainer = ns["trainer"]
    assert "training_step" not in vars(trainer)  # the step wrapper is gone with the watch


@pytest.fixture
def native():
    if not native_available(build=True):
        pytest.skip("the replay of an unrecorded iteration needs the native recorder (it samples the loop)")


def test_lazy_imports_and_bad_arguments():
    with pytest.raises(ValueError, match="on_nonfinite must be 'stop' or 'continue'"):
        integrations.LoopDoctor(on_nonfinite="halt")
    with pytest.raises(ValueError, match="timeout"):
        integrations.LoopDoctor(timeout=-3)
    assert integrations.DoctorCallback.__mro__[1].__name__ == "TrainerCallback"
    assert integrations.DoctorLightningCallback.__mro__[1].__name__ == "Callback"
    with pytest.raises(AttributeError):
        integrations.Nothing  # noqa: B018


def test_hf_correct_training_is_silent_writes_nothing_and_is_bit_identical(tmp_path, capsys):
    plain = _hf(None, None)
    plain["trainer"].train()
    cb = integrations.DoctorCallback(tmp_path)
    before, hook = fi.baseline(), sys.excepthook
    ns = _hf(None, cb)
    ns["trainer"].train()
    assert cb.report is not None and cb.report.ok, str(cb.report)
    assert cb.report.trace.iterations.steps == 10 and os.listdir(tmp_path) == []
    assert "backward_doctor" not in capsys.readouterr().err
    for a, b in zip(_state(ns["model"]), _state(plain["model"])):
        assert torch.equal(a, b)
    _clean_after(before, ns, hook)


def test_hf_nan_in_an_unrecorded_step_is_stopped_replayed_and_written(tmp_path, native, capsys):
    cb = integrations.DoctorCallback(tmp_path)
    before, hook = fi.baseline(), sys.excepthook
    ns = _hf(HF_NAN, cb, poison=True)
    ns["trainer"].train()
    assert ns["trainer"].state.global_step == POISONED_STEP + 1    # stopped after the step that went NaN/Inf
    report = cb.report
    f = report.findings[0]
    line = ll.marked_line(ns, "MyTrainer", "# <-- here")
    assert (f.kind, f.op, f.line, f.function) == ("nonfinite", "aten::log", line, "MyTrainer.compute_loss"), str(report)
    its = report.trace.iterations
    assert its.first_nonfinite == POISONED_STEP and its.replayed == POISONED_STEP
    assert POISONED_STEP not in its.recorded                      # found by replaying that step alone
    assert f"iteration {POISONED_STEP}" in str(report)
    with open(tmp_path / "backward_doctor-report.json", encoding="utf-8") as fh:
        saved = json.load(fh)
    assert saved["findings"][0]["op"] == "aten::log" and not saved["ok"]
    assert (tmp_path / "backward_doctor-report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    err = capsys.readouterr().err
    assert "backward_doctor: PROBLEM - NaN/Inf created here" in err and "backward_doctor-report.html" in err
    _clean_after(before, ns, hook)


def test_hf_nan_gradients_from_a_finite_loss_in_an_unrecorded_step_are_replayed(tmp_path, native, capsys):
    """NaN/Inf shows only in the gradients (``sqrt`` at 0), at the optimizer step, after ``training_step``
    returned: the step's batch is still known (it was not: "could not be replayed"), and the fused AdamW that
    wrote NaN into the weights does not hide the origin."""
    cb = integrations.DoctorCallback(tmp_path)
    ns = _hf(ll.HF_NAN_GRADIENTS, cb, poison=True)
    ns["trainer"].train()
    f = cb.report.findings[0]
    line = ll.marked_line(ns, "MyTrainer", "# <-- here")
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::sqrt", line, POISONED_STEP), str(cb.report)
    assert cb.report.trace.iterations.replayed == POISONED_STEP and "training_step" not in vars(ns["trainer"])


def test_hf_on_nonfinite_continue_trains_to_the_end(tmp_path, native):
    cb = integrations.DoctorCallback(tmp_path, on_nonfinite="continue")
    ns = _hf(HF_NAN, cb, poison=True)
    ns["trainer"].train()
    assert ns["trainer"].state.global_step == 10
    assert cb.report.findings[0].op == "aten::log" and (tmp_path / "backward_doctor-report.json").exists()


def test_hf_training_that_raises_leaves_its_report_before_the_exception(tmp_path):
    cb = integrations.DoctorCallback(tmp_path)
    before, hook = fi.baseline(), sys.excepthook
    ns = _hf(HF_RAISES, cb)
    with pytest.raises(RuntimeError):
        ns["trainer"].train()
    report = cb.report
    assert report is not None and report.exception.startswith("RuntimeError")
    f = report.findings[0]
    assert (f.kind, f.line) == ("shape_mismatch", ll.marked_line(ns, "MyTrainer", "# <-- here")), str(report)
    assert report.trace.iterations.steps == 5
    assert json.loads((tmp_path / "backward_doctor-report.json").read_text())["exception"].startswith("RuntimeError")
    _clean_after(before, ns, hook)


def test_hf_callback_stands_aside_inside_a_diagnosed_cell(tmp_path):
    cb = integrations.DoctorCallback(tmp_path)
    ns = _hf(None, cb)
    report = bd.diagnose(ll.HF_TRAIN, ns)
    assert report.ok and report.trace.iterations.steps == 10  # the cell's own run saw the loop
    assert cb.report is None and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- Lightning
LIT_RAISES = ll.LIT_MODULE.replace(
    "        loss = F.cross_entropy(logits, y)\n",
    "        loss = F.cross_entropy(logits, y)\n"
    "        if self.global_step == 5:\n"
    "            loss = loss + logits @ logits  # <-- here\n")
LIT_NAN = ll.LIT_MODULE.replace(
    "        loss = F.cross_entropy(logits, y)\n",
    "        loss = F.cross_entropy(logits, y)\n"
    "        loss = loss * torch.exp(x.abs().max() * 30)  # <-- here\n")


def _lit(source: str, callback, **kw) -> dict:
    return ll.lit_fit(module_source=source, steps=8,
                      trainer_kwargs={"callbacks": [callback] if callback else [], **kw})


def test_lightning_correct_fit_is_silent_and_bit_identical(tmp_path):
    plain = _lit(ll.LIT_MODULE, None)
    exec(ll.LIT_FIT, plain)
    cb = integrations.DoctorLightningCallback(tmp_path)
    before = fi.baseline()
    ns = _lit(ll.LIT_MODULE, cb)
    exec(ll.LIT_FIT, ns)
    assert cb.report is not None and cb.report.ok and cb.report.trace.iterations.steps == 8, str(cb.report)
    assert os.listdir(tmp_path) == []
    for a, b in zip(_state(ns["model"]), _state(plain["model"])):
        assert torch.equal(a, b)
    assert fi.leftovers(before, ns) == []


def test_lightning_nonfinite_stops_fit_and_writes_the_report(tmp_path):
    cb = integrations.DoctorLightningCallback(tmp_path)
    ns = _lit(LIT_NAN, cb)
    exec(ll.LIT_FIT, ns)
    its = cb.report.trace.iterations
    assert its.first_nonfinite == 0 and ns["trainer"].global_step == 1  # stopped after the first bad batch
    f = cb.report.findings[0]  # placed in the LightningModule's training_step, not at fit()
    assert (f.kind, f.function, f.iteration) == ("nonfinite", "LitClassifier.training_step", 0), str(cb.report)
    assert (f.file, f.line) == (ll.defined_in(ns, "LitClassifier"), ll.marked_line(ns, "LitClassifier", "# <-- here"))
    saved = json.loads((tmp_path / "backward_doctor-report.json").read_text())
    assert not saved["ok"] and saved["trace"]["iterations"]["first_nonfinite"] == 0


def test_lightning_fit_that_raises_reports_through_on_exception(tmp_path):
    cb = integrations.DoctorLightningCallback(tmp_path)
    before = fi.baseline()
    ns = _lit(LIT_RAISES, cb)
    with pytest.raises(RuntimeError):
        exec(ll.LIT_FIT, ns)
    report = cb.report
    assert report is not None and report.exception.startswith("RuntimeError") and report.trace.iterations.steps == 5
    assert report.findings[0].kind == "shape_mismatch", str(report)
    assert (tmp_path / "backward_doctor-report.html").exists()
    assert fi.leftovers(before, ns) == []


def test_lightning_callback_replays_a_mixed_precision_step_in_its_precision_context(tmp_path):
    """``precision="bf16-mixed"``: the sixth batch's loss is Inf only under autocast. The callback samples (5 is
    not recorded on the native recorder) and replays that batch's ``training_step`` inside the trainer's precision
    context, as ``fit()`` ran it: without it the replay stayed finite and the origin was not located."""
    cb = integrations.DoctorLightningCallback(tmp_path)
    ns = ll.lit_fit(ll.LIT_BF16_NAN, "LitBf16", steps=8,
                    trainer_kwargs={"callbacks": [cb], "precision": "bf16-mixed"})
    exec(ll.LIT_FIT, ns)
    f = cb.report.findings[0]
    assert (f.kind, f.op, f.iteration) == ("nonfinite", "aten::log", 5), str(cb.report)
    assert (f.file, f.line) == (ll.defined_in(ns, "LitBf16"), ll.marked_line(ns, "LitBf16", "# <-- here"))


def test_hf_nan_screened_only_at_scalars_is_replayed_at_its_step(tmp_path, monkeypatch):
    """CUDA's first tier, simulated on the CPU: the Python recorder records every step but screens only the
    scalars a forward makes; the step whose loss went NaN/Inf is replayed alone with every op screened."""
    from backward_doctor.run import open_diagnosis as watch

    monkeypatch.setattr(watch, "screens_every_op", lambda: False)
    cb = integrations.DoctorCallback(tmp_path, engine="python")
    ns = _hf(HF_NAN, cb, poison=True)
    ns["trainer"].train()
    assert ns["trainer"].state.global_step == POISONED_STEP + 1
    report = cb.report
    f = report.findings[0]
    line = ll.marked_line(ns, "MyTrainer", "# <-- here")
    assert (f.kind, f.op, f.line) == ("nonfinite", "aten::log", line), str(report)
    assert report.trace.engine == "python" and report.trace.iterations.replayed == POISONED_STEP
    assert any(f"NaN/Inf first appeared in iteration {POISONED_STEP}, which ran with its ops screened for NaN/Inf "
               "only where they made a scalar" in n for n in report.trace.notes), report.trace.notes


def test_hf_on_cuda_simulated_samples_steps_and_replays_the_nan_one(tmp_path, monkeypatch):
    """As on CUDA (simulated on the CPU): the Python recorder samples the library's steps (0, 1, 2, 4, 8),
    asleep with its dispatch mode off the stack; the step that went NaN/Inf, asleep, is replayed alone. A
    correct run trains bit-identically."""
    from backward_doctor.capture import python_sampling
    from backward_doctor.run import open_diagnosis as watch

    monkeypatch.setattr(watch, "screens_every_op", lambda: False)
    monkeypatch.setattr(python_sampling, "samples_here", lambda: True)
    monkeypatch.setattr(python_sampling, "trains_on_cuda", lambda params: True)
    plain = _hf(None, None)
    plain["trainer"].train()
    cb = integrations.DoctorCallback(tmp_path, engine="python")
    before, hook = fi.baseline(), sys.excepthook
    ns = _hf(None, cb)
    ns["trainer"].train()
    its = cb.report.trace.iterations
    assert cb.report.ok and its.steps == 10 and its.recorded == [0, 1, 2, 4, 8], (str(cb.report), its.recorded)
    for a, b in zip(_state(ns["model"]), _state(plain["model"])):
        assert torch.equal(a, b)
    _clean_after(before, ns, hook)

    cb = integrations.DoctorCallback(tmp_path, engine="python")
    ns = _hf(HF_NAN, cb, poison=True)
    ns["trainer"].train()
    f = cb.report.findings[0]
    assert (f.kind, f.op, f.line) == ("nonfinite", "aten::log", ll.marked_line(ns, "MyTrainer", "# <-- here"))
    its = cb.report.trace.iterations
    assert its.replayed == POISONED_STEP and POISONED_STEP not in its.recorded, its
    assert any(f"NaN/Inf first appeared in iteration {POISONED_STEP}, which ran with the recorder off" in n
               for n in cb.report.trace.notes), cb.report.trace.notes
