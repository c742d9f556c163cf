"""IPython tier: library loops whose user code (a `LightningModule`) was defined in an earlier cell of a real
InteractiveShell. The findings name that code as IPython's tracebacks do (``Cell In[N], line M, in
LitModel.training_step``), though ``inspect`` cannot find a class defined in a cell."""
from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

import backward_doctor as bd

import library_loops as ll
from test_library_loop_bugs import BUG, LIT_INPLACE, LIT_LEAK, fixed

pytestmark = pytest.mark.ipython

SETUP = """\
import library_loops as ll
loader = ll.xy_loader()
trainer = ll.lit_trainer({steps})
model = {model}
"""


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    yield sh


def _fit(shell, engine: str) -> bd.Report:
    ll.numbered_cell(shell, f"%%backward_doctor --engine {engine}\ntrainer.fit(model, loader)\n")
    return bd.last_report()


def _line(source: str, marker: str = BUG) -> int:
    return next(i for i, t in enumerate(source.splitlines(), 1) if marker in t)


def test_a_bug_in_a_lightning_module_of_an_earlier_cell_is_named_by_its_cell(shell, engine: str) -> None:
    defined = ll.numbered_cell(shell, LIT_INPLACE)
    ll.numbered_cell(shell, SETUP.format(steps=4, model="LitModel()"))
    f = _fit(shell, engine).findings[0]
    assert f.kind == "inplace"
    assert f.location() == (f"Cell In[{defined}], line {_line(LIT_INPLACE)}, in LitModel.training_step, "
                            "in iteration 2 of `trainer.fit(model, loader)` (epoch 0, batch 2)")
    ll.numbered_cell(shell, fixed(LIT_INPLACE, "h = h + 1"))
    ll.numbered_cell(shell, SETUP.format(steps=4, model="LitModel()"))
    assert _fit(shell, engine).findings == []


def test_a_graph_a_cell_defined_lightning_module_keeps_gets_its_line(shell, engine: str) -> None:
    defined = ll.numbered_cell(shell, LIT_LEAK)
    ll.numbered_cell(shell, SETUP.format(steps=8, model="LitModel()"))
    f = _fit(shell, engine).findings[0]
    assert f.kind == "graph_leak"
    assert f.location().startswith(f"Cell In[{defined}], line {_line(LIT_LEAK)}, in LitModel.training_step")
    ll.numbered_cell(shell, fixed(LIT_LEAK, "self.losses.append(loss.detach())"))
    ll.numbered_cell(shell, SETUP.format(steps=8, model="LitModel()"))
    assert _fit(shell, engine).findings == []


def test_a_learning_rate_typed_in_a_cell_is_named_there(shell, engine: str) -> None:
    ll.numbered_cell(shell, "import library_loops as ll\nns = ll.lit_fit()\nLitClassifier = ns['LitClassifier']\n")
    setup = SETUP.format(steps=8, model="LitClassifier(lr=2e5)")  # (a value no other test's cell holds)
    where = ll.numbered_cell(shell, setup)
    f = _fit(shell, engine).findings[0]
    assert f.title.startswith("The learning rate is too high"), f
    assert f.location().startswith(f"Cell In[{where}], line {_line(setup, 'lr=2e5')}"), f.location()
    assert "`model = LitClassifier(lr=2e5)`" in f.message and "`lr=2e-5`" in f.message, f.message
    ll.numbered_cell(shell, SETUP.format(steps=8, model="LitClassifier(lr=0.1)"))
    assert _fit(shell, engine).findings == []


def test_the_lightning_callback_in_a_notebook_names_cells_as_the_magic_does(shell, engine: str) -> None:
    """``DoctorLightningCallback`` on a ``fit()`` in a cell names the code of an earlier cell ``Cell In[N]``, as
    the magic does, never by IPython's temporary file (issue 47, item 4: ``1925881619.py:21``)."""
    from backward_doctor.integrations import DoctorLightningCallback

    defined = ll.numbered_cell(shell, LIT_INPLACE)
    shell.user_ns["doctor_cb"] = DoctorLightningCallback(engine=engine, quiet=True)
    ll.numbered_cell(shell, SETUP.format(steps=4, model="LitModel()").replace(
        "ll.lit_trainer(4)", "ll.lit_trainer(4, callbacks=[doctor_cb])") + "trainer.fit(model, loader)\n")
    report = shell.user_ns["doctor_cb"].doctor.report
    assert report is not None and report.findings, report
    f = report.findings[0]
    assert f.kind == "inplace"
    assert f.location().startswith(f"Cell In[{defined}], line {_line(LIT_INPLACE)}, in LitModel.training_step"), \
        f.location()
    assert ".py" not in str(report).split("\n")[0], str(report).split("\n")[0]
