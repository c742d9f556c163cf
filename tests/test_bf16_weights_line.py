"""``amp_misuse`` (updates rounding away) on bf16 weights, placed at the line that made the weights bf16.

Small updates (lr x grad below half a bf16 spacing of the weight) round back to the same weight at
``optimizer.step()``, but the cause is the statement that made the weights bf16: ``model.to(torch.bfloat16)``,
``.bfloat16()``, ``self.to(torch.bfloat16)`` in the model's ``__init__``, ``from_config(..., torch_dtype=...)``,
Lightning's ``precision="bf16-true"``, in the cell or an earlier one (code defined from a file of its own, as a
notebook cell is: ``library_loops.define``). The finding goes there, the fix as code (float32 weights, bf16
compute). Where no source tells, it stays at the step and says the weights were already bf16. Each beside its
correct twin, asserted silent: bf16 autocast over float32 weights, bf16 weights with a learning rate that moves
them. Both engines; tiny random configs, nothing downloaded.
"""
from __future__ import annotations

import linecache
import os

import pytest
import torch

import backward_doctor as bd

import library_loops as ll
from report_check import describe, fits_the_schema, silent

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETUP = """\
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
X, Y = torch.randn(64, 16), torch.randint(0, 5, (64,))
"""
LOOP = """\
opt = torch.optim.AdamW(model.parameters(), lr={lr})
for i in range(4):
    loss = torch.nn.functional.cross_entropy(model(X{x}), Y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
AUTOCAST_LOOP = """\
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
for i in range(4):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(X), Y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
NET = """\
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        self.to(torch.bfloat16)  # <-- cast

    def forward(self, x):
        return self.body(x.to(torch.bfloat16))
"""


@pytest.fixture(autouse=True)
def _forget_defined_cells():
    """The "cells" a test defines (and a real shell's cells) stay in ``linecache`` for the process, as IPython's do
    for a session: each test's are forgotten after it, so that no later test reads them as its own history."""
    before = set(linecache.cache)
    yield
    for name in set(linecache.cache) - before:
        entry = linecache.cache.get(name)
        if name.startswith(ll._DIR) or (entry is not None and len(entry) == 4 and entry[1] is None):
            linecache.cache.pop(name, None)


def _ns() -> dict:
    ns = {"torch": torch}
    exec(SETUP, ns)
    return ns


def _cell_file(marker: str) -> str:
    """The file of the latest "cell" :func:`library_loops.define` wrote that holds ``marker``."""
    return [name for name, entry in linecache.cache.items()
            if name.startswith(ll._DIR) and any(marker in line for line in entry[2])][-1]


def _rounding(report: bd.Report, at_least: float = 0.5) -> object:
    fits_the_schema(report)
    assert [f.kind for f in report.findings] == ["amp_misuse"], describe(report)
    f = report.findings[0]
    assert f.evidence["problem"] == "update_below_precision" and f.evidence["fraction"] >= at_least, describe(report)
    return f


def test_a_cast_in_the_cell_is_the_line(engine):
    report = bd.diagnose("model = model.to(torch.bfloat16)\n" + LOOP.format(lr=1e-5, x=".bfloat16()"), _ns(),
                         engine=engine)
    f = _rounding(report)
    assert (f.line, f.file, f.iteration) == (1, None, None), describe(report)
    assert f.evidence["step_line"] == 7 and "`model = model.to(torch.bfloat16)` is what made" in f.message
    code = f.evidence["fix_code"]
    assert code.startswith("# model = model.to(torch.bfloat16)") and \
        'with torch.autocast(device_type="cpu", dtype=torch.bfloat16):' in code, code

    silent(bd.diagnose(AUTOCAST_LOOP, _ns(), engine=engine))


def test_a_cast_in_an_earlier_cell_is_that_cells_line(engine):
    ns = {"torch": torch}
    ll.define(SETUP + "model = model.to(torch.bfloat16)  # save memory\n", ns, name="cell")
    f = _rounding(bd.diagnose(LOOP.format(lr=1e-5, x=".bfloat16()"), ns, engine=engine))
    assert (f.line, f.file, f.iteration) == (4, _cell_file("# save memory"), None), f.message
    assert f.evidence["fix_code"].startswith("# model = model.to(torch.bfloat16)   <- removed")

    big = {"torch": torch}
    ll.define(SETUP + "model.bfloat16()\n", big, name="cell")
    silent(bd.diagnose(LOOP.format(lr=0.5, x=".bfloat16()"), big, engine=engine))


def test_a_cast_in_the_models_init_is_that_line(engine):
    ns = {"torch": torch}
    ll.define(NET, ns, name="Net")
    torch.manual_seed(0)
    ns["model"] = ns["Net"]()
    ns["X"], ns["Y"] = torch.randn(64, 16), torch.randint(0, 5, (64,))
    f = _rounding(bd.diagnose(LOOP.format(lr=1e-5, x=""), ns, engine=engine))
    assert (f.line, f.file) == (ll.marked_line(ns, "Net", "# <-- cast"), ll.defined_in(ns, "Net")), f.message
    assert f.function == "Net.__init__" and f.evidence["fix_code"].startswith("# self.to(torch.bfloat16)")


def test_the_line_not_found_stays_at_the_step(engine):
    ns = _ns()
    ns["weights_from_elsewhere"] = ns.pop("model").to(torch.bfloat16)  # (no source says where)
    f = _rounding(bd.diagnose(LOOP.format(lr=1e-5, x=".bfloat16()").replace("model", "weights_from_elsewhere"),
                              ns, engine=engine))
    assert (f.line, f.file, f.iteration) == (6, None, 0) and "fix_code" not in f.evidence
    assert "were already bfloat16 when this step first ran (iteration 0)" in f.message and "not found" in f.message


def test_a_trainer_on_a_model_loaded_in_bf16_in_an_earlier_cell(engine):
    tf = ll._transformers()
    ns = ll.hf_trainer(steps=2)
    ns.update(AutoModelForSequenceClassification=tf.AutoModelForSequenceClassification,
              cfg=ns["model"].config)
    ll.define("""\
torch.manual_seed(0)
model = AutoModelForSequenceClassification.from_config(
    cfg, torch_dtype=torch.bfloat16)  # half the memory
trainer = Trainer(model=model, args=args, train_dataset=train_ds)
""", ns, name="cell")
    f = _rounding(bd.diagnose(ll.HF_TRAIN, ns, engine=engine), at_least=0.2)  # (the LayerNorms' weights, 1.0)
    assert (f.line, f.file) == (2, _cell_file("# half the memory")), f.message
    assert f.evidence["fix_code"].splitlines() == [
        "model = AutoModelForSequenceClassification.from_config(cfg, torch_dtype=torch.float32)   # float32 weights",
        "args = TrainingArguments(..., bf16=True)"]

    silent(bd.diagnose(ll.HF_TRAIN, ll.hf_trainer(steps=2, bf16=True), engine=engine))


def test_lightning_bf16_true_set_in_an_earlier_cell(engine):
    ns = ll.lit_fit(module_kwargs={"lr": 1e-4})
    ns["ll"] = ll
    ll.define('trainer = ll.lit_trainer(4,\n    precision="bf16-true")\n', ns, name="cell")
    f = _rounding(bd.diagnose(ll.LIT_FIT, ns, engine=engine))
    assert (f.line, f.file) == (1, _cell_file('precision="bf16-true"')), f.message
    assert f.evidence["fix_code"] == "trainer = ll.lit_trainer(4, precision='bf16-mixed')   # float32 weights"

    ok = ll.lit_fit(module_kwargs={"lr": 1e-4})
    ok["ll"] = ll
    ll.define('trainer = ll.lit_trainer(4, precision="bf16-mixed")\n', ok, name="cell")
    silent(bd.diagnose(ll.LIT_FIT, ok, engine=engine))


@pytest.mark.ipython
def test_a_cast_in_an_earlier_cell_of_a_real_shell_is_named_by_its_cell(engine):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()

    def cell(source: str) -> int:
        return ll.numbered_cell(shell, source)

    cell("%load_ext backward_doctor")
    made = cell("import torch\n" + SETUP + "model = model.to(torch.bfloat16)  # save memory\n")
    cell(f"%%backward_doctor --engine {engine}\n" + LOOP.format(lr=1e-5, x=".bfloat16()"))
    f = _rounding(bd.last_report())
    assert f.location() == f"Cell In[{made}], line 5", f.location()  # (after `import torch`)
    cell("model = torch.nn.Linear(1, 1)\n")  # (the shell is shared: a float32 model there for the next test)
