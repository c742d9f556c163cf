"""A ``Trainer`` whose ``TrainingArguments`` an earlier cell built, fixed in a real kernel (nbclient, issue 45).

The notebook's layout: one cell builds the arguments and the Trainer, a later ``%%backward_doctor`` cell runs
``trainer.train()`` and runs out of the simulated device. Each fix the panel offers is clicked (the panel's own
button, its own thread); the fix is set on the live ``trainer`` for the run, measured, and the trainer, its
model and the weights are put back as they were; the code to keep names the earlier cell's line, and the
"insert as a new cell" code, run in the kernel, trains exactly as the doctor's measured run did.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SETUP = """\
%load_ext backward_doctor
import os, sys, json, torch
os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)
import library_loops as ll
tf = ll._transformers()
Trainer, TrainingArguments, TrainerCallback = tf.Trainer, tf.TrainingArguments, tf.TrainerCallback
model, train_ds, out_dir = ll.tiny_bert_classifier(), ll.TokenDataset(n=64, seq=32), os.getcwd()"""
KNOBS = """\
args = TrainingArguments(output_dir=out_dir, max_steps=2, per_device_train_batch_size=32, learning_rate=5e-5,
                         use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                         disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=train_ds)"""
# The weights each finished train() left (the doctor's measured run, then the code to keep), read by the test.
GRAB = """\
def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
ended = []
class Grab(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kw):
        ended.append({k: v.detach().clone() for k, v in model.state_dict().items()})
trainer.add_callback(Grab())"""
LIMIT = "7.4MB"  # 7.7 MB plain; bf16 autocast 7.2 MB, activation checkpointing 4.5 MB, 2 micro-batches 4.1 MB
RUN = f"%%backward_doctor --memory-limit {LIMIT} --engine {{engine}}\ntrainer.train()"
ORIGINAL = "import backward_doctor as bd\noriginal = bd.last_report()\nprint(json.dumps([original.exception.split(':')[0], original.fix_offers]))"
CLICK = """\
from backward_doctor.fixes import run_fix
from backward_doctor.frontends.panel import Panel
got = []
def runner(*a, **k):
    got.append(run_fix(*a, **k))
    return got[-1]
panel = Panel(original, "trainer.train()\\n", get_ipython().user_ns, memory_limit="{limit}", run_fix=runner)
name = next(n for n in panel.fix_buttons if n.split(":")[0] == "{fix}")
before = {{"args": trainer.args, "acc": trainer.accelerator, "d": trainer.args.to_dict(), "bs": trainer._train_batch_size,
          "w": {{k: v.detach().clone() for k, v in model.state_dict().items()}}, "vars": set(vars(model))}}
n_ended = len(ended)
panel.fix_buttons[name].click()
panel.wait(300)
fixed = got[-1]
fr = fixed.fix_result
check = fixed.trace.accumulation.check
print(json.dumps({{"name": name, "applied": fr.applied, "fits": fr.fits, "message": fr.message, "code": fr.code,
    "elsewhere": fr.elsewhere, "before": fr.comparison["before"]["peak_bytes"],
    "after": fr.comparison["after"]["peak_bytes"], "check": None if check is None else [check.micro_batches, check.factor],
    "same_args": trainer.args is before["args"], "same_acc": trainer.accelerator is before["acc"],
    "args_equal": trainer.args.to_dict() == before["d"], "bs": trainer._train_batch_size,
    "mixed_precision": trainer.accelerator.mixed_precision, "model_vars": set(vars(model)) == before["vars"],
    "weights_back": all(torch.equal(v, before["w"][k]) for k, v in model.state_dict().items()),
    "trained": len(ended) > n_ended and not all(torch.equal(v, before["w"][k]) for k, v in ended[-1].items()),
    "refused": panel.refused.value, "shown": panel.after.value, "keep": panel.keep.value}}))"""
KEEP = """\
doctored = ended[-1]
get_ipython().run_cell(fr.code)
print(json.dumps({"kept_same": same(ended[-1], doctored) and ended[-1] is not doctored,
                  "kept_args": getattr(getattr(globals().get("trainer"), "args", None),
                                       "per_device_train_batch_size", None)}))"""


def _execute(cells: list[str], tmp_path: Path) -> list:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), old]))
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return nb.cells


def _json(cell) -> dict:
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert not errors, "\n".join(errors[0].traceback)
    text = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def test_trainer_arguments_built_in_an_earlier_cell_are_fixed_on_the_live_trainer(tmp_path, engine):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("transformers")
    cells = [SETUP, KNOBS, GRAB, RUN.format(engine=engine), ORIGINAL]
    cells += [CLICK.format(limit=LIMIT, fix=fix) for fix in ("amp", "checkpoint", "accumulate")] + [KEEP]
    out = _execute(cells, tmp_path)
    # The original run ran out of the simulated device, and every fix it names is offered (each is applied below).
    assert _json(out[4]) == ["OutOfMemoryError", {"accumulate": "", "amp": "", "checkpoint": ""}]
    amp, ckpt, acc = (_json(c) for c in out[5:8])
    for r, knob in ((amp, "bf16=True"), (ckpt, "activation_checkpointing=True"), (acc, "gradient_accumulation_steps=2")):
        assert r["applied"] and r["fits"], r["message"]
        assert r["after"] < 7.4e6 and r["before"], r                          # fits the simulated device
        assert "cannot be applied" not in r["message"] and not r["refused"]
        where = r["elsewhere"]                                                # In[2]: the cell that built them
        assert where["place"] in ("Cell In[2], line 1", "Cell In[2], line 3") and knob in where["setting"]
        assert "-                         disable_tqdm=True, seed=0)" in where["diff"] and knob in where["code"]
        assert where["place"] in r["code"] and r["code"].rstrip().endswith("trainer.train()")
        assert f"trainer.args = dataclasses.replace(trainer.args, {where['setting']})" in r["code"]
        # Restored: the same objects, the same arguments, the model's attributes and weights as before the click.
        assert r["same_args"] and r["same_acc"] and r["args_equal"] and r["bs"] == 32 and r["model_vars"], r
        assert r["mixed_precision"] == "no" and r["weights_back"] and r["trained"], r
        # The panel's after-view: the edit where the arguments are built, and the measured code to insert.
        assert "where the arguments are built" in r["shown"] and where["place"] in r["shown"]
        assert "Insert as a new cell below" in r["keep"] and "dataclasses.replace(trainer.args" in r["keep"]
    assert amp["after"] < amp["before"] and "bf16=True" in amp["code"]
    assert acc["name"] == "accumulate:2" and acc["elsewhere"]["place"] == "Cell In[2], line 1"
    assert acc["elsewhere"]["setting"] == "per_device_train_batch_size=16, gradient_accumulation_steps=2"
    # The effective batch is unchanged (16 x 2 = 32) and the measured equivalence check agrees with one full batch;
    # this BERT's per-batch-mean loss needs the Trainer told so (measured in the first try).
    assert acc["check"][0] == 2 and abs(acc["check"][1] - 1.0) < 1e-5, acc["check"]
    assert "trainer.loss_is_scaled_for_ga = False" in acc["code"]
    keep = _json(out[8])                                                      # the code to keep, run as a new cell
    assert keep == {"kept_same": True, "kept_args": 16}


# --------------------------------------------------------------------------- Lightning
LIT_SETUP = """\
%load_ext backward_doctor
import json, torch
torch.set_num_threads(1)
import test_library_knobs as T
globals().update(T._lit())                  # pl, torch, DataLoader, LitClassifier, model (seeded), ds"""
LIT_KNOBS = """\
loader = DataLoader(ds, batch_size=256)
trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)"""
LIT_GRAB = """\
def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
def snap(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}
ended = []
class Grab(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        ended.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})
trainer.callbacks.append(Grab())"""
LIT_LIMIT = "1.3MB"  # batch 256 needs 1.7 MB; 2 x 128 with accumulate_grad_batches=2 0.96 MB; bf16-mixed 0.94 MB
LIT_CLICK = """\
from backward_doctor.fixes import run_fix
from backward_doctor.frontends.panel import Panel
got = []
def runner(*a, **k):
    got.append(run_fix(*a, **k))
    return got[-1]
panel = Panel(original, "trainer.fit(model, loader)\\n", get_ipython().user_ns, memory_limit="{limit}", run_fix=runner)
name = next(n for n in panel.fix_buttons if n.split(":")[0] == "{fix}")
def state():
    return {{"acc": trainer.accumulate_grad_batches, "bs": loader.batch_sampler.batch_size, "gs": trainer.global_step,
            "plugin": trainer.strategy.precision_plugin, "strategy": trainer.strategy, "sampler": loader.batch_sampler}}
before, w = state(), snap(model)
n_ended = len(ended)
panel.fix_buttons[name].click()
panel.wait(300)
fixed = got[-1]
fr = fixed.fix_result
check = fixed.trace.accumulation.check
print(json.dumps({{"name": name, "applied": fr.applied, "fits": fr.fits, "message": fr.message, "code": fr.code,
    "elsewhere": fr.elsewhere, "after": fr.comparison["after"]["peak_bytes"],
    "check": None if check is None else [check.micro_batches, check.factor],
    "restored": all(state()[k] is v if k in ("plugin", "strategy", "sampler") else state()[k] == v for k, v in before.items()),
    "weights_back": same(snap(model), w), "trained": len(ended) > n_ended and not same(ended[-1], w),
    "refused": panel.refused.value, "shown": panel.after.value, "keep": panel.keep.value}}))"""


def test_lightning_trainer_and_loader_built_in_an_earlier_cell_are_fixed_on_the_live_objects(tmp_path, engine):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("pytorch_lightning")
    run = f"%%backward_doctor --memory-limit {LIT_LIMIT} --engine {engine}\ntrainer.fit(model, loader)"
    cells = [LIT_SETUP, LIT_KNOBS, LIT_GRAB, run, ORIGINAL]
    cells += [LIT_CLICK.format(limit=LIT_LIMIT, fix=fix) for fix in ("amp", "accumulate")] + [KEEP]
    out = _execute(cells, tmp_path)
    exc, offers = _json(out[4])
    assert exc == "OutOfMemoryError" and offers["accumulate"] == offers["amp"] == "", offers
    amp, acc = _json(out[5]), _json(out[6])
    for r, knob in ((amp, "precision='bf16-mixed'"), (acc, "accumulate_grad_batches=2")):
        assert r["applied"] and r["fits"] and r["after"] < 1.3e6, r["message"]
        # Checkpointing cannot lower this peak (one Linear makes it): advice text with the reason, not a button.
        assert "cannot be applied" not in r["message"] and "<code>checkpoint</code>: checkpointing would not" in \
            r["refused"] and "<code>accumulate" not in r["refused"] and "<code>amp" not in r["refused"]
        where = r["elsewhere"]                                                # In[2]: the cell that built them
        assert where["place"] == ("Cell In[2], line 3" if r is amp else "Cell In[2], line 1"), where
        assert f"+                     enable_progress_bar=False, enable_model_summary=False, {knob})" in where["diff"]
        assert where["place"] in r["code"] and r["code"].rstrip().endswith("trainer.fit(model, loader)")
        assert r["restored"] and r["weights_back"] and r["trained"], r       # the objects as they were
        assert where["place"] in r["shown"] and "Insert as a new cell below" in r["keep"]
    assert "+loader = DataLoader(ds, batch_size=128)" in acc["elsewhere"]["diff"]
    assert "trainer.strategy.precision_plugin = MixedPrecision('bf16-mixed', 'cpu')" in amp["code"]
    assert acc["name"] == "accumulate:2" and acc["check"][0] == 2 and abs(acc["check"][1] - 1.0) < 1e-5, acc["check"]
    keep = _json(out[7])                                                      # the code to keep, run as a new cell
    assert keep["kept_same"], keep


# --------------------------------------------------------------------------- Accelerate
ACC_SETUP = LIT_SETUP.replace("globals().update(T._lit())                  # pl, torch, DataLoader, LitClassifier, "
                              "model (seeded), ds", "globals().update(T._acc())  # Accelerator, DataLoader, model, "
                              "optimizer, ds (seeded)")
ACC_KNOBS = """\
accelerator = Accelerator(cpu=True)
loader = DataLoader(ds, batch_size=128)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)"""
# The weights as bytes (numpy's copy, no tensor allocated): a clone would count on the simulated device.
ACC_GRAB = """\
def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
def snap(m):
    return {k: v.detach().numpy().tobytes() for k, v in m.state_dict().items()}
ended = []
optimizer.optimizer.register_step_post_hook(lambda o, a, k: ended.append(snap(model)))"""
ACC_LIMIT = "700KB"  # batch 128 needs 0.9 MB, 2 x 64 with gradient_accumulation_steps=2 0.53 MB
ACC_CLICK = (LIT_CLICK.replace('"trainer.fit(model, loader)\\n"', "LOOP")
             .replace('''    return {{"acc": trainer.accumulate_grad_batches, "bs": loader.batch_sampler.batch_size, "gs": trainer.global_step,
            "plugin": trainer.strategy.precision_plugin, "strategy": trainer.strategy, "sampler": loader.batch_sampler}}''',
                      '''    return {{"acc": accelerator.gradient_accumulation_steps, "bs": loader.batch_sampler.batch_size,
            "gs": accelerator.step, "sampler": loader.batch_sampler, "plugin": accelerator.gradient_state.plugin_kwargs,
            "strategy": accelerator.state}}'''))


def test_accelerate_loop_with_the_accelerator_built_in_an_earlier_cell_is_fixed_on_the_live_objects(tmp_path, engine):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("accelerate")
    import library_loops as ll

    assert "LOOP" in ACC_CLICK and "accelerator.step" in ACC_CLICK
    run = f"%%backward_doctor --memory-limit {ACC_LIMIT} --engine {engine}\n{ll.ACCEL_LOOP}"
    cells = [ACC_SETUP, ACC_KNOBS, ACC_GRAB, run, ORIGINAL, f"LOOP = {ll.ACCEL_LOOP!r}\n"
             + ACC_CLICK.format(limit=ACC_LIMIT, fix="accumulate"), KEEP]
    out = _execute(cells, tmp_path)
    exc, offers = _json(out[4])
    assert exc == "OutOfMemoryError" and offers["accumulate"] == "", offers
    assert "once per process" in offers["amp"]                                # advice text with its reason
    acc = _json(out[5])
    assert acc["applied"] and acc["fits"] and acc["after"] < 700e3, acc["message"]
    assert "cannot be applied" not in acc["message"] and "<code>accumulate" not in acc["refused"]
    where = acc["elsewhere"]
    assert where["place"] == "Cell In[2], line 2" and where["setting"] == "batch_size=64; gradient_accumulation_steps=2"
    assert "+accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)" in where["diff"]
    assert "+loader = DataLoader(ds, batch_size=64)" in where["diff"] and where["place"] in acc["code"]
    assert "accelerator.gradient_accumulation_steps = 2\nloader.batch_sampler.batch_size = 64" in acc["code"]
    assert acc["restored"] and acc["weights_back"] and acc["trained"], acc
    assert where["place"] in acc["shown"] and "loader.batch_sampler.batch_size = 64" in acc["keep"]
    assert acc["name"] == "accumulate:2" and acc["check"][0] == 2 and abs(acc["check"][1] - 1.0) < 1e-5, acc["check"]
    keep = _json(out[6])                                                      # the code to keep, run as a new cell
    assert keep["kept_same"], keep
