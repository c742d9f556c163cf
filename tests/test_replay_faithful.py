"""A replay leaves the user's world exactly as the failing run left it (issue 46, items 8-10): an error after the
training loop replays no iteration (its side effects would happen twice); an optimizer held by an object
(``runner.opt``) is saved and put back like one bound to a name, and one held out of reach stops the replay, the
report saying why; after the compile-vs-eager replay the names hold the compiled run's objects, and the lists the
cell appends to the compiled run's contents."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import backward_doctor as bd
from backward_doctor.run import engine as tiers
from backward_doctor.run import step


class Runner:
    """What a notebook often holds: the model and its optimizer as attributes of an object of its own."""

    def __init__(self, deep: bool = False) -> None:
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        if deep:  # (held one object further: no snapshot looks that deep)
            self.parts = type("Parts", (), {})()
            self.parts.opt = opt
        else:
            self.opt = opt

    def optimizer(self) -> torch.optim.Optimizer:
        return self.parts.opt if hasattr(self, "parts") else self.opt


def _ns(deep: bool = False, **more) -> dict:
    torch.manual_seed(0)
    return {"runner": Runner(deep), "x": torch.randn(12, 8), "y": torch.randint(0, 3, (12,)), "F": F,
            "torch": torch, **more}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _same_training_state(plain: dict, doctored: dict) -> None:
    """Weights and the whole Adam state (its step count included) as the plain run left them."""
    for p, q in zip(plain["runner"].model.parameters(), doctored["runner"].model.parameters()):
        assert _same(p, q)
    a, b = plain["runner"].optimizer(), doctored["runner"].optimizer()
    assert len(a.state) == len(b.state) > 0
    for p, q in zip(a.state.values(), b.state.values()):
        assert p.keys() == q.keys()
        for key in p:
            assert _same(p[key], q[key]), (key, p[key], q[key])


# ---------------------------------------------------------------- item 8: an error after the loop
AFTER_LOOP = """\
for i in range(40):
    runner.opt.zero_grad()
    loss = F.cross_entropy(runner.model(x), y)
    loss.backward()
    runner.opt.step()
    with open(path, "a") as log:
        log.write(f"{i}\\n")
raise ValueError("the evaluation set is missing")
"""

IN_A_FUNCTION = """\
def train(n):
    for i in range(n):
        runner.opt.zero_grad()
        loss = F.cross_entropy(runner.model(x), y)
        loss.backward()
        runner.opt.step()
        with open(path, "a") as log:
            log.write(f"{i}\\n")
    raise ValueError("the evaluation set is missing")
train(40)
"""


@pytest.mark.parametrize("cell", [AFTER_LOOP, IN_A_FUNCTION], ids=["cell", "function"])
def test_an_error_after_the_loop_replays_no_iteration(engine, tmp_path, cell):
    """The loop ran its 40 iterations (the last ones with the recorder off), then a line after it raised: no
    iteration was running, none is replayed, so the file the body appends to has 40 lines, as without the doctor,
    and no note speaks of an "iteration 40"."""
    plain, doctored = _ns(path=str(tmp_path / "plain.log")), _ns(path=str(tmp_path / "doctored.log"))
    with pytest.raises(ValueError, match="evaluation set"):
        exec(cell, plain)
    report = bd.diagnose(cell, doctored, engine=engine)
    assert "the evaluation set is missing" in report.exception
    written = (tmp_path / "doctored.log").read_text()
    assert written == (tmp_path / "plain.log").read_text() and written.count("\n") == 40
    assert report.trace.iterations.replayed is None and report.trace.iterations.steps == 40
    assert not any("iteration 40" in n or "raised" in n and "replay" in n for n in report.trace.notes), \
        report.trace.notes
    assert report.findings[0].iteration is None, str(report)
    _same_training_state(plain, doctored)


COUNTING_TRAINER = """
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with open(LOG_PATH, "a") as log:
            log.write("step\\n")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
"""


@pytest.mark.slow
def test_an_error_after_a_librarys_loop_replays_none_of_its_steps(engine, tmp_path):
    """``trainer.train()`` ran its 10 steps, then the next line of the cell raised: the library's training step is
    not run again (its ``compute_loss`` writes a line each time: 10 lines, as without the doctor)."""
    import library_loops as ll

    ns = ll.hf_rare_token_trainer(COUNTING_TRAINER)
    ns["LOG_PATH"] = str(tmp_path / "steps.log")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        report = bd.diagnose("trainer.train()\nraise ValueError('no test set')\n", ns, engine=engine)
    assert "no test set" in report.exception and report.trace.iterations.steps == 10
    assert (tmp_path / "steps.log").read_text().count("\n") == 10
    assert report.trace.iterations.replayed is None
    assert not any("iteration 10" in n or "raised" in n and "replay" in n for n in report.trace.notes), \
        report.trace.notes


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    yield sh
    sh.run_cell("%backward_doctor off", store_history=False)


@pytest.mark.ipython
@pytest.mark.parametrize("where", ["before", "after"])
def test_under_always_on_an_error_outside_the_loop_replays_no_iteration(shell, engine, tmp_path, where):
    """Always on starts asleep: an error before the loop began (no iteration ran: a replay would run its body a
    first time) or after it ended replays nothing; the file the body writes to is as a plain run leaves it."""
    from IPython.utils.capture import capture_output

    cell = AFTER_LOOP.replace("range(40)", "range(6)")
    if where == "before":
        cell = 'raise ValueError("the evaluation set is missing")\n' + cell.rsplit("raise ValueError", 1)[0]
    plain = _ns(path=str(tmp_path / "plain.log"))
    with pytest.raises(ValueError):
        exec(cell, plain)
    with capture_output():
        shell.run_cell("%backward_doctor off", store_history=False)
        assert shell.run_cell(f"%backward_doctor on --engine {engine}", store_history=False).success
    shell.user_ns.update(_ns(path=str(tmp_path / "doctored.log")))
    with capture_output():
        result = shell.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, ValueError)
    report = bd.last_report()
    assert report is not None and "the evaluation set is missing" in report.exception
    doctored = tmp_path / "doctored.log"
    assert (doctored.read_text() if doctored.exists() else None) == \
        ((tmp_path / "plain.log").read_text() if where == "after" else None)
    assert report.trace.iterations.replayed is None
    assert not any("raised" in n and "replay" in n for n in report.trace.notes), report.trace.notes


def test_an_error_inside_the_loop_is_still_replayed(native_engine, tmp_path):
    """The same loop raising in its iteration 20 (with the recorder off): that iteration is the error's and is
    replayed, as before."""
    cell = AFTER_LOOP.replace("raise ValueError", "pass  #").replace(
        "    runner.opt.step()\n", "    if i == 20:\n        raise ValueError('bad batch')\n    runner.opt.step()\n")
    report = bd.diagnose(cell, _ns(path=str(tmp_path / "doctored.log")), engine=native_engine)
    assert "bad batch" in report.exception
    assert any("The cell raised in iteration 20" in n for n in report.trace.notes), report.trace.notes


# ---------------------------------------------------------------- item 9: optimizers held by objects
NAN_AT_20 = """\
for i in range(40):
    runner.opt.zero_grad()
    xb = x * float("nan") if i == 20 else x
    loss = F.cross_entropy(runner.model(xb), y)
    loss.backward()
    runner.opt.step()
"""
DEEP = NAN_AT_20.replace("runner.opt.", "runner.parts.opt.")


def test_an_optimizer_held_by_an_object_is_put_back_after_the_iteration_replay(native_engine):
    """NaN in iteration 20, unrecorded: it is replayed from its saved state, and afterwards Adam (``runner.opt``)
    is where the plain run left it, not a step ahead."""
    plain, doctored = _ns(), _ns()
    exec(NAN_AT_20, plain)
    report = bd.diagnose(NAN_AT_20, doctored, engine=native_engine)
    assert report.trace.iterations.replayed == 20
    f = report.findings[0]
    assert (f.kind, f.line, f.iteration) == ("nonfinite", 3, 20), str(report)
    _same_training_state(plain, doctored)


def test_an_optimizer_out_of_reach_stops_the_replay_and_the_report_says_why(native_engine):
    """Adam held two objects deep (``runner.parts.opt``): no snapshot holds it, so the iteration is not replayed
    (its step would leave Adam a step ahead) and the note says so instead of claiming its state was restored."""
    plain, doctored = _ns(deep=True), _ns(deep=True)
    exec(DEEP, plain)
    report = bd.diagnose(DEEP, doctored, engine=native_engine)
    assert report.trace.iterations.replayed is None
    note = next(n for n in report.trace.notes if "iteration 20" in n)
    assert "could not be replayed" in note and "steps an optimizer (Adam)" in note, note
    assert report.findings[0].kind == "nonfinite" and report.findings[0].iteration == 20
    _same_training_state(plain, doctored)


ONE_STEP = """\
runner.opt.zero_grad()
loss = F.cross_entropy(runner.model(x * bad), y)
loss.backward()
runner.opt.step()
"""


def test_an_optimizer_held_by_an_object_is_restored_before_the_detailed_replay(monkeypatch, engine):
    """Where every op cannot be screened (CUDA, simulated), a step that went NaN/Inf is replayed from the snapshot
    taken before it: the snapshot holds ``runner.opt`` too, so the replay starts from Adam's state before the step
    and ends where the plain run ended (one Adam step, not two)."""
    monkeypatch.setattr(tiers, "screens_every_op", lambda: False)
    monkeypatch.setattr(step, "screens_every_op", lambda: False)
    plain, doctored = _ns(bad=float("nan")), _ns(bad=float("nan"))
    exec(ONE_STEP, plain)
    with contextlib.redirect_stdout(io.StringIO()):
        report = bd.diagnose(ONE_STEP, doctored, engine=engine)
    assert any("replayed" in n for n in report.trace.notes), report.trace.notes
    assert report.findings[0].kind == "nonfinite" and report.findings[0].line == 2, str(report)
    _same_training_state(plain, doctored)


# ---------------------------------------------------------------- item 10: the compile-vs-eager replay's names
LOG_OF_ZERO = """\
for step in range(3):
    out = model(x)
    loss = torch.log(out - out.max(dim=1, keepdim=True).values).mean()   # log(0) = -inf
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss)
    history["loss"].append(loss.item())
"""

PENALTY = """\
xi = x.clone().requires_grad_(True)
out = critic(xi)
outs.append(out)
g, = torch.autograd.grad(out.sum(), xi, create_graph=True)
penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
loss = out.mean() + 10 * penalty
opt.zero_grad()
loss.backward()
opt.step()
"""


def _compiled(**more) -> dict:
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), backend="aot_eager")
    return {"torch": torch, "model": model, "x": torch.randn(12, 8),
            "opt": torch.optim.SGD(model.parameters(), lr=0.1), **more}


def test_after_the_eager_replay_the_names_hold_the_compiled_runs_objects(engine):
    """NaN in a compiled loop, eager agreeing: the report is the eager replay's, but ``loss`` is the compiled run's
    own tensor, the last item of the list the cell appends to, which holds three losses, not six; the lists nested
    in a dict too."""
    plain = _compiled(losses=[], history={"loss": []})
    exec(LOG_OF_ZERO, plain)
    ns = _compiled(losses=[], history={"loss": []})
    losses, history = ns["losses"], ns["history"]
    report = bd.diagnose(LOG_OF_ZERO, ns, engine=engine, timeout=600)
    assert report.trace.compile_check is not None and report.trace.compile_check.eager_agrees, str(report)
    assert ns["losses"] is losses and ns["history"] is history and len(losses) == 3
    assert ns["loss"] is losses[-1] and len(history["loss"]) == 3
    assert {k for k in ns if not k.startswith("__")} == {k for k in plain if not k.startswith("__")}
    assert ns["step"] == 2
    for a, b in zip(plain["losses"], losses):
        assert _same(a.detach(), b.detach())
    for p, q in zip(plain["model"].parameters(), ns["model"].parameters()):
        assert _same(p, q)


def test_names_the_eager_replay_bound_but_the_compiled_run_never_reached_are_gone(engine):
    """Double backward through a compiled module raises at line 4, compiled only: the eager replay runs the
    whole cell. Afterwards ``g``, ``penalty`` and ``loss`` are unbound as the compiled run left them, and ``out``
    is the compiled run's output, the one item of ``outs``."""
    torch.manual_seed(0)
    critic = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), backend="aot_eager")
    ns = {"torch": torch, "critic": critic, "x": torch.randn(5, 4), "outs": [],
          "opt": torch.optim.SGD(critic.parameters(), lr=0.01)}
    report = bd.diagnose(PENALTY, ns, engine=engine, timeout=600)
    assert report.findings[0].kind == "compile_divergence", str(report)
    assert report.trace.compile_check.eager.startswith("ran without an error")
    assert not {"g", "penalty", "loss"} & ns.keys()
    assert len(ns["outs"]) == 1 and ns["out"] is ns["outs"][0]


def test_lists_nested_in_the_namespace_are_put_back_after_the_iteration_replay(native_engine):
    """The iteration replay runs in a copy of the namespace, whose lists are copies; a list in a dict is not: the
    replayed iteration's append is taken back."""
    cell = NAN_AT_20 + "    history['loss'].append(loss.item())\n"
    plain, doctored = _ns(history={"loss": []}), _ns(history={"loss": []})
    exec(cell, plain)
    report = bd.diagnose(cell, doctored, engine=native_engine)
    assert report.trace.iterations.replayed == 20
    assert len(doctored["history"]["loss"]) == len(plain["history"]["loss"]) == 40
