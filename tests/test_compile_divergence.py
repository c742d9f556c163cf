"""torch.compile vs eager (``compile_divergence``): a compiled step that goes NaN or raises is replayed
eagerly from the same state; whether eager agrees, and where it does not, the first op that differs.

How a compiled step is made to differ from eager on the CPU, honestly: a custom op (``torch.library.
custom_op``) that writes into its argument but declares ``mutates_args=()``. torch's docs say the
declaration must be accurate, otherwise the behaviour is undefined; what happens is that AOTAutograd and
inductor take the op (it returns nothing) for pure and unused, and drop it (pytorch#187319 shows inductor
eliminating such an op), so its in-place cleaning of NaN inputs is lost only when compiled. Eager runs it.
The same op declared with ``mutates_args={"x"}`` is the correct version. Also: a gradient penalty through
a compiled module (AOTAutograd does not support double backward: it raises only compiled), and a real
NaN bug that compiled and eager share (eager places it at the user's line).

Most tests compile with ``backend="aot_eager"`` (AOTAutograd without code generation: seconds on a CPU);
one runs inductor end to end.
"""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd
import library_loops as ll

MODELS = ll.define("""\
import torch


@torch.library.custom_op("bd_tests::zero_nans_", mutates_args=())  # BUG: it writes into x
def zero_nans_(x: torch.Tensor) -> None:
    x.nan_to_num_(0.0)


@zero_nans_.register_fake
def _(x):
    return None


@torch.library.custom_op("bd_tests::zero_nans_declared_", mutates_args={"x"})
def zero_nans_declared_(x: torch.Tensor) -> None:
    x.nan_to_num_(0.0)


@zero_nans_declared_.register_fake
def _(x):
    return None


class Clean(torch.nn.Module):
    '''Missing features arrive as NaN: zeroed in place by a custom op (a fast kernel of one's own).'''

    def __init__(self, declared=False):
        super().__init__()
        self.declared = declared

    def forward(self, x):
        x = x.clone()
        if self.declared:
            zero_nans_declared_(x)
        else:
            zero_nans_(x)
        return x


class Scale(torch.autograd.Function):
    '''A custom autograd Function (the correct compiled model uses one).'''

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x * s

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class Net(torch.nn.Module):
    def __init__(self, declared=False, log=False, d_in=16, classes=5):
        super().__init__()
        self.clean, self.log = Clean(declared), log
        self.fc1 = torch.nn.Linear(d_in, 32)
        self.fc2 = torch.nn.Linear(32, classes)

    def forward(self, x):
        h = torch.relu(self.fc1(self.clean(x)))  # <-- first differing
        if self.log:
            h = torch.log(h)  # <-- log of zero
        return self.fc2(Scale.apply(h, 0.5))
""", {}, name="compiled_models")

LOOP = """\
for step in range(3):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

PENALTY = """\
xi = x.clone().requires_grad_(True)
out = critic(xi)
g, = torch.autograd.grad(out.sum(), xi, create_graph=True)
penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
loss = out.mean() + 10 * penalty
opt.zero_grad()
loss.backward()
opt.step()
"""


def _data(nan: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    if nan:
        x[2, 5] = float("nan")  # a missing feature
    return x, y


def _namespace(backend: str = "aot_eager", **net) -> dict:
    torch.manual_seed(0)
    model = torch.compile(MODELS["Net"](**net), backend=backend)
    x, y = _data()
    return {"torch": torch, "model": model, "x": x, "y": y, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


def _same_weights(a: dict, b: dict) -> None:
    for p, q in zip(a["model"].parameters(), b["model"].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)


def _line(marker: str) -> int:
    return ll.marked_line(MODELS, "Net", marker)


def test_compiled_step_that_drops_an_undeclared_mutation_differs_from_eager(engine):
    plain = _namespace()
    exec(LOOP, plain)
    assert not torch.isfinite(plain["loss"])                          # the compiled step really goes NaN
    ns = _namespace()
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence", str(report)
    assert (f.line, f.function) == (_line("# <-- first differing"), "Net.forward")
    check = report.trace.compile_check
    assert not check.eager_agrees and check.trigger == "nonfinite" and check.stage == "forward"
    assert check.op == "aten.addmm.default" and check.dropped == "bd_tests.zero_nans_"
    assert "compiled with aot_eager" in check.region and check.eager.startswith("stayed finite")
    assert "mutates_args" in f.message and "NaN/Inf" in check.detail
    assert all(g.severity == "warning" for g in report.findings[1:] if g.kind == "nonfinite")  # consequences
    _same_weights(plain, ns)                                            # the namespace ends as compiled left it


def test_declared_mutation_and_a_custom_function_compiled_are_silent_and_bit_identical(engine):
    plain = _namespace(declared=True)
    exec(LOOP, plain)
    ns = _namespace(declared=True)
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=600)
    assert report.findings == [] and report.exception is None, str(report)
    assert report.trace.compile_check is None                            # nothing went wrong: nothing replayed
    _same_weights(plain, ns)


def test_nan_bug_eager_shares_is_placed_at_the_users_line(engine):
    """Eager does the same: the report is the eager replay's, which sees inside the compiled region."""
    ns = _namespace(declared=True, log=True)
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.line == _line("# <-- log of zero"), str(report)
    assert report.trace.compile_check.eager_agrees
    assert any("so the compiler is not the cause" in n for n in report.trace.notes)


def test_double_backward_through_a_compiled_module_fails_only_compiled(engine):
    torch.manual_seed(0)
    critic = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
                           backend="aot_eager")
    ns = {"torch": torch, "critic": critic, "x": torch.randn(5, 4),
          "opt": torch.optim.SGD(critic.parameters(), lr=0.01)}
    report = bd.diagnose(PENALTY, ns, engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.title == "Fails only when compiled", str(report)
    assert f.line == 3                                     # the gradient that is differentiated again
    # AOTAutograd says "does not currently support double backward", or, where the compiled backward donates
    # buffers (a compile cache warmed by another test), that it "requires create_graph=False"
    assert ("double backward" in report.exception or "create_graph=False" in report.exception), report.exception
    assert "_orig_mod" in f.message
    # The correct version: the penalty's forward through the original module.
    ns["critic"] = torch.compile(critic._orig_mod, backend="aot_eager")
    fixed = PENALTY.replace("out = critic(xi)", "out = critic._orig_mod(xi)")
    report = bd.diagnose(fixed, ns, engine=engine, timeout=600)
    assert report.findings == [] and report.exception is None, str(report)


@pytest.mark.slow
def test_inductor_drops_the_undeclared_mutation_too(native_engine):
    """The same bisection with inductor's generated code (a C++ compiler runs: slow on a small CPU)."""
    ns = _namespace(backend="inductor")
    report = bd.diagnose(LOOP, ns, engine="native", timeout=900)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.line == _line("# <-- first differing"), str(report)
    assert "compiled with inductor" in report.trace.compile_check.region
    assert report.trace.compile_check.dropped == "bd_tests.zero_nans_"


# ----------------------------------------------------------------------------- library loops
LIT_MODULE = ll.LIT_MODULE.replace(
    "self.net = torch.nn.Sequential(torch.nn.Linear(d_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))",
    "self.net = Net(declared=declared)").replace("def __init__(self, d_in=16, classes=5, lr=0.1):",
                                                 "def __init__(self, d_in=16, classes=5, lr=0.1, declared=False):")


def _lightning(declared: bool) -> dict:
    ns = {"Net": MODELS["Net"]}
    ll.define(LIT_MODULE, ns, name="lit_compiled")
    torch.manual_seed(0)
    model = ns["LitClassifier"](declared=declared)
    model.net = torch.compile(model.net, backend="aot_eager")
    x, y = _data()
    loader = ll.xy_loader(dataset=torch.utils.data.TensorDataset(x, y), batch=8)
    return {"model": model, "loader": loader, "make_trainer": lambda: ll.lit_trainer(3)}


LIT_CELL = "trainer = make_trainer()\ntrainer.fit(model, loader)\n"


def test_lightning_fit_with_a_compiled_submodule(engine):
    report = bd.diagnose(LIT_CELL, _lightning(declared=False), engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.line == _line("# <-- first differing"), str(report)
    assert report.trace.compile_check.region.startswith("`model.net`")
    ok = _lightning(declared=True)
    report = bd.diagnose(LIT_CELL, ok, engine=engine, timeout=600)
    assert report.findings == [] and report.exception is None, str(report)


def _accelerate(declared: bool) -> dict:
    torch.manual_seed(0)
    x, y = _data()
    ns = ll.accelerate_loop(model=MODELS["Net"](declared=declared),
                            loader_kwargs={"dataset": torch.utils.data.TensorDataset(x, y)})
    ns["model"] = torch.compile(ns["model"], backend="aot_eager")
    return ns


def test_accelerate_loop_with_a_compiled_model(engine):
    report = bd.diagnose(ll.ACCEL_LOOP, _accelerate(declared=False), engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.line == _line("# <-- first differing"), str(report)
    plain, ok = _accelerate(declared=True), _accelerate(declared=True)
    exec(ll.ACCEL_LOOP, plain)
    report = bd.diagnose(ll.ACCEL_LOOP, ok, engine=engine, timeout=600)
    assert report.findings == [] and report.exception is None, str(report)
    _same_weights(plain, ok)


def test_op_by_op_comparison_of_a_model_with_dropout_finds_nothing_and_keeps_the_rng():
    """Dropout draws the same mask eagerly and compiled (the same seed, inductor's random ops as torch's), and
    the comparison's draws do not touch the user's generator."""
    from backward_doctor.run.compile_graphs import backend_of, compare_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).train()
    x = torch.randn(4, 8)
    before = torch.get_rng_state()
    result = compare_module(model, (x,), {}, backend_of(torch.compile(model, backend="aot_eager")))
    assert result["op"] == "" and result["ops_compared"] > 0 and result["stage"] == "", result
    assert torch.equal(before, torch.get_rng_state())


class _HFNet(torch.nn.Module):
    """``Net`` as a ``transformers.Trainer`` wants a model: keyword inputs, a dict with the loss."""

    def __init__(self, declared: bool) -> None:
        super().__init__()
        self.net = MODELS["Net"](declared=declared)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _hf_compiling(declared: bool, subclass: bool = False) -> dict:
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model inside ``train()`` (nothing
    compiled is in the namespace before the cell runs). ``subclass``: the user's own ``Trainer`` subclass (its
    class lives in the user's module, not in ``transformers``)."""
    tf = ll._transformers()
    cls = type("MyTrainer", (tf.Trainer,), {"__module__": __name__}) if subclass else tf.Trainer
    torch.manual_seed(0)
    model = _HFNet(declared)
    args = ll.hf_args(steps=2, batch=8, torch_compile=True, torch_compile_backend="aot_eager")
    return {"trainer": cls(model=model, args=args, train_dataset=_Rows()), "model": model}


@pytest.mark.parametrize("subclass", [False, True], ids=["Trainer", "subclass"])
def test_trainer_told_to_compile_is_replayed_eagerly_and_bisected(engine, subclass):
    """Without the eager replay the compiled run's NaN read as bad data; the replay starts from the Trainer's
    state before the step (its own optimizer, made in the first train(), would carry the NaN into it)."""
    report = bd.diagnose(ll.HF_TRAIN, _hf_compiling(declared=False, subclass=subclass), engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.line == _line("# <-- first differing"), str(report)
    check = report.trace.compile_check
    assert check.region.startswith("`trainer.model_wrapped`") and check.dropped == "bd_tests.zero_nans_", check
    plain, ok = _hf_compiling(declared=True, subclass=subclass), _hf_compiling(declared=True, subclass=subclass)
    exec(ll.HF_TRAIN, plain)
    report = bd.diagnose(ll.HF_TRAIN, ok, engine=engine, timeout=600)
    assert report.findings == [] and report.exception is None, str(report)
    _same_weights(plain, ok)


def test_the_doctors_module_hooks_break_no_compiled_graph(engine):
    """The recorder's module hooks, called inside a compiled module, were traced by dynamo: the native one's
    ``set_stack`` (a C function) broke the graph twice. They stand aside while dynamo traces (the Python tier's
    did not break it either)."""
    from torch._dynamo.utils import counters

    ns = _namespace(declared=True)
    torch._dynamo.reset()
    counters.clear()
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=600)
    assert report.findings == [] and report.exception is None, str(report)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
