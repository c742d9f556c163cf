"""Fixes for loops a library runs are the library's own knobs (``fixes/library_knobs.py``), applied and
measured inside real ``transformers.Trainer.train()``, Lightning ``Trainer.fit()`` and Accelerate loops on a
simulated device, with the code to keep; a fix that cannot apply to the cell is not offered and says why.

Each cell builds its arguments, as a notebook cell does (the library objects come from
``tests/library_loops.py``'s tiny, offline setups). The code to keep is checked as the tour checks it: run
without the doctor from the same start, it leaves the weights the doctor's fixed run left, bit for bit.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

import backward_doctor as bd
from backward_doctor.fixes import run_fix
from backward_doctor.render.view import applicable_fixes

import library_loops as ll

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- transformers
HF_CELL = """\
args = TrainingArguments(output_dir=out_dir, max_steps=2, per_device_train_batch_size=32, learning_rate=5e-5,
                         use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                         disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=train_ds)
trainer.train()
"""
HF_LIMIT = "5MB"  # a batch of 32 needs 7.7 MB, two micro-batches of 16 need 4.1 MB


def _hf(tmp_path) -> dict:
    tf = ll._transformers()
    return {"torch": torch, "Trainer": tf.Trainer, "TrainingArguments": tf.TrainingArguments,
            "model": ll.tiny_bert_classifier(), "train_ds": ll.TokenDataset(n=64, seq=32), "out_dir": str(tmp_path)}


def test_trainer_train_out_of_memory_is_fixed_with_training_arguments(tmp_path):
    ns = _hf(tmp_path)
    report = bd.diagnose(HF_CELL, ns, memory_limit=HF_LIMIT)
    assert report.findings[0].kind == "oom" and report.exception.startswith("OutOfMemoryError")
    assert report.fix_offers == {"accumulate": "", "amp": "", "checkpoint": ""}
    assert [o.arg for o in applicable_fixes(report)] == ["accumulate:2", "amp", "checkpoint"]
    # The panel's button: the cell as it is was already run; the rewritten one runs from the restored state.
    fixed = run_fix(HF_CELL, ns, "accumulate:2", original=report, memory_limit=HF_LIMIT)
    fr = fixed.fix_result
    assert fr.applied and fr.fits and fixed.ok, fr.message
    assert "per_device_train_batch_size=16" in fr.code and "gradient_accumulation_steps=2" in fr.code
    assert "trainer.train()" in fr.code and ".backward(" not in fr.code        # the library's loop, its knobs
    assert not fr.comparison["before"]["completed"] and fr.comparison["after"]["peak_bytes"] <= 5e6
    assert "transformers' own gradient accumulation" in fr.message
    # This BERT's forward takes **kwargs but its loss is a per-batch mean: the Trainer would leave it undivided
    # (measured in the first try); the fix tells it so, and the fixed run's accumulation is checked clean.
    assert "trainer.loss_is_scaled_for_ga = False" in fr.code and "left each micro-batch's loss undivided" in fr.message
    assert fixed.trace.accumulation.check is not None and abs(fixed.trace.accumulation.check.factor - 1.0) < 1e-5
    doctored = _weights(ns["model"])
    plain = _hf(tmp_path)
    exec(fr.code, plain)                                                       # the code to keep, no doctor
    assert _same(_weights(plain["model"]), doctored)


@pytest.mark.parametrize("fix, knob", [("amp", "bf16=True"), ("checkpoint", "activation_checkpointing=True")])
def test_trainer_amp_and_checkpointing_are_training_arguments_measured(tmp_path, fix, knob):
    """bf16 and activation checkpointing (transformers 5's name) are applied as TrainingArguments and measured on the device: on this tiny
    BERT neither fits 5 MB (its peak is attention scores, 32x32 per head, that both keep), and the report says
    so in red, with the next step, rather than guessing."""
    ns = _hf(tmp_path)
    fixed = bd.diagnose(HF_CELL, ns, memory_limit=HF_LIMIT, fix=fix)
    fr = fixed.fix_result
    assert fr.applied and knob in fr.code and fr.comparison["after"]["peak_bytes"], fr.message
    kept = "".join(ln for ln in fr.code.splitlines(True) if not ln.startswith("# "))
    assert kept.replace(", " + knob, "") == HF_CELL                            # one keyword added, nothing else
    assert fr.code.startswith("# backward_doctor fix ")
    if not fr.fits:
        assert "The fixed step did not complete: OutOfMemoryError" in fr.message and fr.rolled_back


def test_trainer_built_in_another_cell_is_fixed_on_the_live_trainer_and_put_back(tmp_path):
    """Outside IPython there is no input history: the fix is set on the live trainer for the run, the report
    says where the arguments would be (not found) and gives the assignment; the trainer is put back after."""
    pytest.importorskip("ipywidgets")
    from backward_doctor.frontends.panel import Panel

    ns = _hf(tmp_path)
    exec(HF_CELL.replace("trainer.train()\n", ""), ns)                          # an earlier cell built them
    report = bd.diagnose("trainer.train()", ns, memory_limit=HF_LIMIT)
    assert report.findings[0].kind == "oom"
    assert report.fix_offers == {"accumulate": "", "amp": "", "checkpoint": ""}
    panel = Panel(report, "trainer.train()", ns)
    assert set(panel.fix_buttons) == {"accumulate:2", "amp", "checkpoint"} and not panel.refused.value
    trainer, args = ns["trainer"], ns["trainer"].args
    weights = _weights(ns["model"])
    fixed = run_fix("trainer.train()", ns, "accumulate:2", original=report, memory_limit=HF_LIMIT)
    fr = fixed.fix_result
    assert fr.applied and fr.fits, fr.message
    assert fr.elsewhere["place"] is None and "not found in this kernel's input history" in fr.message
    assert fr.elsewhere["live"] == ("trainer.args = dataclasses.replace(trainer.args, per_device_train_batch_size=16, "
                                    "gradient_accumulation_steps=2)") and fr.elsewhere["live"] in fr.code
    assert fr.comparison["after"]["peak_bytes"] <= 5e6 and abs(fixed.trace.accumulation.check.factor - 1) < 1e-5
    assert ns["trainer"] is trainer and trainer.args is args and args.per_device_train_batch_size == 32
    assert _same(_weights(ns["model"]), weights)                                 # the fix is not kept: put back
    text = str(fixed)
    assert "set them on the live object: trainer.args = dataclasses.replace(" in text.replace("\n    ", " ")
    assert "cannot be applied" not in text



def test_a_live_fix_cancelled_while_it_runs_puts_the_trainer_back(tmp_path):
    ns = _hf(tmp_path)
    exec(HF_CELL.replace("trainer.train()\n", ""), ns)                          # an earlier cell built them
    report = bd.diagnose("trainer.train()", ns, memory_limit=HF_LIMIT)
    trainer, args, accelerator = ns["trainer"], ns["trainer"].args, ns["trainer"].accelerator
    # Cancelled at the first model call after the fixed cell set the new arguments on the live trainer.
    fixed = run_fix("trainer.train()", ns, "accumulate:2", original=report, memory_limit=HF_LIMIT,
                    cancel=lambda: trainer.args is not args)
    assert fixed.fix_result.cancelled and "Cancelled while the fixed cell ran" in fixed.fix_result.message
    assert trainer.args is args and trainer.accelerator is accelerator and trainer._train_batch_size == 32

# --------------------------------------------------------------------------- Lightning
LIT_CELL = """\
loader = DataLoader(ds, batch_size=256)
trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
"""
LIT_LIMIT = "1.3MB"  # batch 256 needs 1.7 MB; 2 x 128 with accumulate_grad_batches=2 0.96 MB; bf16-mixed 0.94 MB
WIDE = ll.LIT_MODULE.replace("torch.nn.Linear(d_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes)",
                             "torch.nn.Linear(d_in, 512), torch.nn.ReLU(), torch.nn.Linear(512, classes)")


def _lit() -> dict:
    pl = ll._lightning()
    for name in ("pytorch_lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ns = {"pl": pl, "torch": torch, "DataLoader": torch.utils.data.DataLoader}
    ll.define(WIDE, ns, name="LitClassifier")
    torch.manual_seed(0)
    ns["model"] = ns["LitClassifier"]()
    g = torch.Generator().manual_seed(0)
    ns["ds"] = torch.utils.data.TensorDataset(torch.randn(1024, 16, generator=g), torch.randint(0, 5, (1024,), generator=g))
    return ns


@pytest.mark.parametrize("engine", ["native", "python"])
def test_lightning_fit_is_fixed_with_accumulate_grad_batches_and_a_smaller_loader_batch(engine):
    from backward_doctor.capture.native_capture import native_available

    if engine == "native" and not native_available(build=True):
        pytest.skip("the native recorder is not built here")
    ns = _lit()
    report = bd.diagnose(LIT_CELL, ns, memory_limit=LIT_LIMIT, engine=engine)
    assert report.exception.startswith("OutOfMemoryError")
    fixed = run_fix(LIT_CELL, ns, "accumulate:2", original=report, memory_limit=LIT_LIMIT)
    fr = fixed.fix_result
    assert fr.applied and fr.fits, fr.message
    assert "DataLoader(ds, batch_size=128)" in fr.code and "accumulate_grad_batches=2" in fr.code
    assert "trainer.fit(model, loader)" in fr.code and "Lightning's own gradient accumulation" in fr.message
    doctored = _weights(ns["model"])
    plain = _lit()
    exec(fr.code, plain)
    assert _same(_weights(plain["model"]), doctored)
    assert not _same(_weights(_lit()["model"]), doctored)                      # it did train


def test_lightning_amp_is_bf16_mixed_precision():
    ns = _lit()
    fixed = bd.diagnose(LIT_CELL, ns, memory_limit=LIT_LIMIT, fix="amp")
    fr = fixed.fix_result
    assert fr.applied and fr.fits and 'precision="bf16-mixed"' in fr.code, fr.message
    assert fr.comparison["after"]["peak_bytes"] < fr.comparison["before"]["peak_bytes"]


#: A LightningModule that optimizes by hand: its forward runs outside `optimizer.step()`, so the trace shows the
#: activations each block saves, from which the checkpoint fix chooses its modules.
MANUAL = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


def block():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


class LitManual(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 256), block(), block(), torch.nn.Linear(256, 5))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""
MANUAL_LIMIT = "16MB"  # batch 512: 18.5 MB plain (4.2 MB of weights, as much for gradients, 10 MB of activations)


def _manual() -> dict:
    ns = _lit()
    ll.define(MANUAL, ns, name="LitManual")
    torch.manual_seed(0)
    ns["model"] = ns["LitManual"]()
    return ns


def test_lightning_checkpointing_runs_fit_with_the_chosen_modules_checkpointed():
    ns = _manual()
    cell = LIT_CELL.replace("max_steps=4", "max_steps=2").replace("batch_size=256", "batch_size=512")
    report = bd.diagnose(cell, ns, memory_limit=MANUAL_LIMIT)
    assert report.exception.startswith("OutOfMemoryError") and report.fix_offers["checkpoint"] == ""
    # Manual optimization: Lightning's accumulate_grad_batches is refused by Lightning, so it is not offered.
    assert "automatic_optimization = False" in report.fix_offers["accumulate"]
    fixed = run_fix(cell, ns, "checkpoint", original=report, memory_limit=MANUAL_LIMIT)
    fr = fixed.fix_result
    assert fr.applied and fr.fits, fr.message
    assert "with checkpointing(\n    model.net[0],  # Linear\n    model.net[1],  # Sequential" in fr.code
    assert "    trainer.fit(model, loader)\n" in fr.code and "the library's loop runs the modules checkpointed" in \
        fr.message
    assert "forward" not in vars(ns["model"].net[1])                            # put back after the block
    doctored = _weights(ns["model"])
    plain = _manual()
    exec(fr.code, plain)
    assert _same(_weights(plain["model"]), doctored)


# --------------------------------------------------------------------------- Accelerate
ACC_CELL = """\
accelerator = Accelerator(cpu=True)
loader = DataLoader(ds, batch_size=128)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
""" + ll.ACCEL_LOOP
ACC_LIMIT = "700KB"  # batch 128 needs 0.9 MB, 2 x 64 with gradient_accumulation_steps=2 0.53 MB


def _acc() -> dict:
    acc = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh process's state, as ll.accelerate_loop
    GradientState._reset_state()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 5))
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 5, (512,), generator=g))
    return {"torch": torch, "Accelerator": acc.Accelerator, "DataLoader": torch.utils.data.DataLoader,
            "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "ds": ds}


def test_accelerate_loop_is_fixed_with_gradient_accumulation_steps_and_amp_is_not_offered():
    ns = _acc()
    report = bd.diagnose(ACC_CELL, ns, memory_limit=ACC_LIMIT)
    assert report.findings[0].kind == "oom"
    offers = report.fix_offers
    assert offers["accumulate"] == "" and "once per process" in offers.get("amp", "once per process")
    assert "amp" not in [o.name for o in applicable_fixes(report)]
    # The cell rebinds `model`, `optimizer` and `loader` to Accelerate's wrappers: `fix=` snapshots the namespace
    # before the original run, so the fixed cell starts where the original did, as the code to keep will.
    ns = _acc()
    fixed = bd.diagnose(ACC_CELL, ns, memory_limit=ACC_LIMIT, fix="accumulate:2")
    fr = fixed.fix_result
    assert fr.applied and fr.fits, fr.message
    assert "Accelerator(cpu=True, gradient_accumulation_steps=2)" in fr.code and "batch_size=64" in fr.code
    doctored = _weights(ns["model"])
    plain = _acc()
    exec(fr.code, plain)
    assert _same(_weights(plain["model"]), doctored)


CALLBACK_SCRIPT = """\
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import library_loops as ll
from backward_doctor.integrations import DoctorCallback
tf = ll._transformers()
callback = DoctorCallback(memory_limit="5MB")
args = tf.TrainingArguments(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=32, use_cpu=True,
                            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
trainer = tf.Trainer(model=ll.tiny_bert_classifier(), args=args, train_dataset=ll.TokenDataset(n=64, seq=32),
                     callbacks=[callback])
trainer.train()
"""


def test_the_callbacks_advice_names_the_training_arguments_and_where_the_script_builds_them(tmp_path):
    """A callback cannot re-run the training, so its report offers no fix to run: its advice names the knobs to
    set, with the numbers of this run, and the script's line that builds the TrainingArguments (issue 45)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "train_hf.py"
    script.write_text(CALLBACK_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 1 and "OutOfMemoryError" in done.stderr, done.stderr[-2000:]
    offers = json.loads((tmp_path / "out" / "backward_doctor-report.json").read_text())["fix_offers"]
    assert offers["accumulate"].startswith("set `per_device_train_batch_size=16, gradient_accumulation_steps=2` "
                                           "in `TrainingArguments` where they are built (train_hf.py, line 7)")
    assert offers["amp"].startswith("set `bf16=True` in `TrainingArguments` where they are built (train_hf.py, line 7)")
    assert "not offered for this cell: accumulate - set `per_device_train_batch_size=16" in \
        done.stderr.replace("\n    ", " ")
