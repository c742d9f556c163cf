"""``compile_divergence``'s two precision items (issue 48): a compiled step whose GradScaler keeps skipping is
replayed eagerly like a NaN one, and an error a compiled in-place write causes is placed at that write.

**A GradScaler that keeps skipping.** A model whose padded batch rows (all zeros) give a zero mean square, floored
at 1e-6 before its square root by a custom op (a fast kernel of one's own) that writes into its argument but
declares ``mutates_args=()``: compiled, AOTAutograd takes the op for pure and unused and drops it
(``tests/test_compile_divergence.py`` says more), the square root of zero is finite in the forward but its
gradient is not, and the GradScaler skips every step. The loss stays finite and nothing raises: the model just
never trains. Where the loop clears the gradients after the step (``opt.zero_grad()`` last), the only trace of them
is the scaler's skips, so those alone make the doctor replay the step eagerly. Eager runs the op and trains: the
first op that differs is named at its line. The correct twins: the op declared (silent), the scale starting so high
that the first step's scaled gradients overflow float32 once and then train (dynamic scaling: no replay), the same
skipping loop without ``torch.compile`` (``amp_misuse``'s, not a compile problem), and a compiled model that makes
the inf gradients itself (eager agrees: ``amp_misuse`` from the eager replay, placed inside the model).

**An in-place write in compiled code.** AOTAutograd traces the backward of a compiled region once, while it
compiles: a function that writes in place into a tensor autograd saved fails there, as dynamo's
``BackendCompilerFailed`` at the call of the compiled function (not at ``loss.backward()``, and with no user line in
its traceback). The eager replay raises the same ``RuntimeError`` at ``backward()``, and its ops name the line that
wrote in place. The correct twin, the out-of-place write, stays silent and its gradients bit-identical.

**A training step compiled whole** (``torch.compile(train_step)``, ``backward()`` and the scaler inside it): the
same verdict, compared as a whole (no line: compiled functions are not bisected op by op), with the same graphs and
graph breaks as without the doctor; it used to hang (dynamo compiled the doctor's compile callback inside its own
callback handler's lock).

Compiled with ``backend="aot_eager"`` (AOTAutograd without code generation: seconds on a CPU); one test runs
inductor end to end for both items (``slow``).
"""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd
import library_loops as ll
from report_check import describe, fits_the_schema, silent

MODELS = ll.define("""\
import torch


@torch.library.custom_op("bd_prec::floor_", mutates_args=())  # BUG: it writes into ms
def floor_(ms: torch.Tensor, eps: float) -> None:
    ms.clamp_(min=eps)


@floor_.register_fake
def _(ms, eps):
    return None


@torch.library.custom_op("bd_prec::floor_declared_", mutates_args={"ms"})
def floor_declared_(ms: torch.Tensor, eps: float) -> None:
    ms.clamp_(min=eps)


@floor_declared_.register_fake
def _(ms, eps):
    return None


class Net(torch.nn.Module):
    '''The hidden features and their root mean square (one feature more); padding rows are all zeros.'''

    def __init__(self, floor="declared", eps=1e-6, d_in=16, classes=5):
        super().__init__()
        self.floor, self.eps = floor, eps
        self.fc1 = torch.nn.Linear(d_in, 32, bias=False)
        self.fc2 = torch.nn.Linear(33, classes)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        ms = (h * h).mean(-1, keepdim=True)
        if self.floor == "declared":
            floor_declared_(ms, self.eps)
        elif self.floor == "undeclared":
            floor_(ms, self.eps)
        rms = torch.sqrt(ms)  # <-- first differing
        return self.fc2(torch.cat([h, rms], -1))


def block(x, w):
    h = torch.sigmoid(x @ w)
    h += 0.1  # <-- in place
    return h * 2.0


def block_out_of_place(x, w):
    h = torch.sigmoid(x @ w)
    h = h + 0.1
    return h * 2.0


class Head(torch.nn.Module):
    def __init__(self, inplace=True):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)
        self.act = torch.nn.ReLU(inplace=inplace)

    def forward(self, x):
        h = torch.sigmoid(self.fc(x))
        h = self.act(h)  # <-- relu in place
        return h * 2.0
""", {}, name="compiled_precision")

#: the gradients cleared after the step: the scaler's skips are all that is left of them
LOOP = """\
for step in range(8):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

STEP = """\
out = f(x, w)
loss = out.sum()
loss.backward()
"""


def _line(name: str, marker: str) -> int:
    return ll.marked_line(MODELS, name, marker)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    x[6:] = 0.0  # two padding rows
    return x, y


def _scaled(floor: str | None = "undeclared", compiled: bool = True, backend: str = "aot_eager", eps: float = 1e-6,
            **scaler: float) -> dict:
    torch.manual_seed(0)
    model = MODELS["Net"](floor, eps)
    if compiled:
        model = torch.compile(model, backend=backend)
    x, y = _data()
    return {"torch": torch, "model": model, "x": x, "y": y, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "scaler": torch.amp.GradScaler("cpu", **scaler)}


def _same_end(a: dict, b: dict) -> None:
    """The namespace ends as the plain run left it: weights bit for bit, the scaler's scale."""
    for p, q in zip(a["model"].parameters(), b["model"].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
    assert a["scaler"].get_scale() == b["scaler"].get_scale()


def _ran_compiled(report) -> bool:
    """The doctor's run used the compiled code (ops dispatched from AOTAutograd's runtime)."""
    return any(op.where.compiled for op in report.trace.ops)


# ----------------------------------------------------------------------------- a GradScaler that keeps skipping
def test_what_the_compiled_step_does_without_the_doctor():
    """Plainly: the loss stays finite, the scaler skips all 8 steps, the weights never move; eager trains."""
    plain = _scaled()
    before = [p.detach().clone() for p in plain["model"].parameters()]
    exec(LOOP, plain)
    assert torch.isfinite(plain["loss"]) and plain["scaler"].get_scale() == 2.0 ** 16 / 2 ** 8
    assert all(torch.equal(p, q) for p, q in zip(before, plain["model"].parameters()))
    eager = _scaled(compiled=False)
    exec(LOOP, eager)
    assert eager["scaler"].get_scale() == 2.0 ** 16


#: the gradients cleared before the step: the last ones are still there, inf/NaN, when the run ends
LOOP_ZERO_FIRST = LOOP.replace("    opt.zero_grad()\n", "").replace("for step in range(8):\n",
                                                                  "for step in range(8):\n    opt.zero_grad()\n")


def test_compiled_step_whose_scaler_keeps_skipping_is_compared_with_eager(engine):
    plain = _scaled()
    exec(LOOP, plain)
    ns = _scaled()
    report = fits_the_schema(bd.diagnose(LOOP, ns, engine=engine, timeout=600))
    f = report.findings[0]
    assert f.kind == "compile_divergence" and report.exception is None, describe(report)
    assert (f.line, f.function) == (_line("Net", "# <-- first differing"), "Net.forward"), describe(report)
    check = report.trace.compile_check
    assert check.trigger == "skipping" and not check.eager_agrees and check.stage == "forward", check
    assert check.op == "aten.sqrt.default" and check.dropped == "bd_prec.floor_", check
    assert "skipped 8 of 8 steps" in check.compiled and check.eager.startswith("trained"), check
    assert "never trained" in f.message and "mutates_args" in f.message
    # what the compiled run alone showed (the scale collapsing) is a consequence, after it
    collapse = [g for g in report.findings if g.kind == "amp_misuse"]
    assert collapse and all(g.severity == "warning" and "compiled run only" in g.message for g in collapse)
    assert _ran_compiled(report)                # the doctor's run was the compiled one, not an eager fallback
    _same_end(plain, ns)                        # and the namespace ends as the compiled run left it


def test_the_same_loop_with_the_gradients_left_inf_at_its_end(engine):
    """``opt.zero_grad()`` first: the run ends with inf/NaN gradients, the replay's trigger; the same verdict."""
    report = bd.diagnose(LOOP_ZERO_FIRST, _scaled(), engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.line == _line("Net", "# <-- first differing"), describe(report)
    check = report.trace.compile_check
    assert check.trigger == "nonfinite" and check.eager == "stayed finite (its GradScaler skipped 0 of 8 steps)", check


def test_where_only_the_gradients_differ_the_op_is_found_in_the_backward(engine):
    """A floor of 1e-12: the square roots compiled (0) and eager (1e-6) agree within tolerance, their gradients do
    not (inf against 5e5): the op whose backward parts is found on the region's joint graph."""
    report = bd.diagnose(LOOP, _scaled(eps=1e-12), engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "compile_divergence", describe(report)
    assert (f.line, f.function) == (_line("Net", "# <-- first differing"), "Net.forward"), describe(report)
    check = report.trace.compile_check
    assert check.trigger == "skipping" and check.stage == "backward" and check.op == "aten.sqrt.default", check
    assert check.detail.startswith("its gradient") and "NaN/Inf" in check.detail, check
    assert "first op whose gradient differs" in f.message


def test_compiled_step_with_a_declared_mutation_and_a_scaler_is_silent(engine):
    plain = _scaled(floor="declared")
    exec(LOOP, plain)
    ns = _scaled(floor="declared")
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=600)
    silent(report)
    assert report.trace.compile_check is None and report.trace.precision.scaler.skipped == 0
    assert _ran_compiled(report)
    _same_end(plain, ns)


def test_compiled_step_that_skips_once_then_trains_is_not_replayed(engine):
    """The scale starts at 2**126: the first step's scaled gradients overflow float32, the scaler halves it and
    every later step trains (dynamic scaling doing its job)."""
    plain = _scaled(floor="declared", init_scale=2.0 ** 126)
    exec(LOOP, plain)
    assert plain["scaler"].get_scale() == 2.0 ** 125
    ns = _scaled(floor="declared", init_scale=2.0 ** 126)
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=600)
    assert report.exception is None and report.trace.compile_check is None, describe(report)
    assert {f.kind for f in report.findings} <= {"amp_skipped"}, describe(report)
    assert report.trace.precision.scaler.skipped == 1
    _same_end(plain, ns)


def test_eager_loop_whose_scaler_keeps_skipping_is_not_a_compile_problem(engine):
    report = bd.diagnose(LOOP, _scaled(floor=None, compiled=False), engine=engine, timeout=600)
    assert report.trace.compile_check is None, describe(report)
    assert [f.kind for f in report.findings] == ["amp_misuse"], describe(report)
    assert report.findings[0].evidence["problem"] == "scale_collapse"
    assert report.findings[0].evidence["first_overflow_line"] == _line("Net", "# <-- first differing")


def test_compiled_model_that_makes_the_inf_gradients_itself_agrees_with_eager(engine):
    """No floor at all: eager skips every step too, so the compiler is not the cause; the report is the eager
    replay's, which sees inside the model."""
    report = bd.diagnose(LOOP, _scaled(floor=None), engine=engine, timeout=600)
    check = report.trace.compile_check
    assert check is not None and check.trigger == "skipping" and check.eager_agrees, describe(report)
    assert not [f for f in report.findings if f.kind == "compile_divergence"], describe(report)
    collapse = next(f for f in report.findings if f.kind == "amp_misuse")
    assert collapse.evidence["problem"] == "scale_collapse" and "compiled run only" not in collapse.message
    # the first overflow, a backward op, named at its forward op's line (the eager replay's ops see inside)
    assert collapse.evidence["first_overflow_line"] == _line("Net", "# <-- first differing"), describe(report)
    assert "in the backward of `aten::sqrt`" in collapse.message
    assert any("so the compiler is not the cause" in n for n in report.trace.notes)


# ----------------------------------------------------------------------------- an in-place write in compiled code
def _step(name: str, backend: str = "aot_eager", **kwargs: bool) -> dict:
    """``f(x, w)`` compiled: the function ``name``, or the module class ``name`` (built with ``kwargs``) called on x."""
    torch.manual_seed(0)
    fn = MODELS[name]
    ns = {"torch": torch, "x": torch.randn(4, 8), "w": torch.randn(8, 3, requires_grad=True)}
    if isinstance(fn, type):
        module = torch.compile(fn(**kwargs), backend=backend)
        ns.update(module=module, f=lambda x, w: module(x))
    else:
        ns["f"] = torch.compile(fn, backend=backend)
    return ns


def _grads(ns: dict) -> list[torch.Tensor]:
    return [ns["w"].grad] if "module" not in ns else [p.grad for p in ns["module"].parameters()]


def test_what_an_in_place_write_in_compiled_code_raises_without_the_doctor():
    """Plainly: dynamo's wrapper, at the call of the compiled function, before any backward() of the user's."""
    from torch._dynamo.exc import BackendCompilerFailed

    with pytest.raises(BackendCompilerFailed, match="modified by an inplace operation"):
        exec(STEP, _step("block"))


@pytest.mark.parametrize("name, marker", [("block", "# <-- in place"), ("Head", "# <-- relu in place")],
                         ids=["function", "module_relu_inplace"])
def test_in_place_write_in_compiled_code_is_placed_at_the_write(engine, name, marker):
    report = fits_the_schema(bd.diagnose(STEP, _step(name), engine=engine, timeout=600))
    f = report.findings[0]
    assert f.kind == "inplace" and f.line == _line(name, marker), describe(report)
    assert f.file is not None and f.file.endswith(ll.defined_in(MODELS, name).rsplit("/", 1)[-1])
    assert not [g for g in report.findings if g.kind == "compile_divergence"], describe(report)
    check = report.trace.compile_check
    assert check.trigger == "exception" and check.eager_agrees, check
    assert check.compiled.startswith("raised BackendCompilerFailed while compiling (RuntimeError"), check
    assert any("surfaced while compiling" in n for n in report.trace.notes)


def test_in_place_write_into_a_tensor_eager_code_saved(engine):
    """The compiled function writes into its argument, a tensor the cell's eager sigmoid saved: the error comes at
    ``backward()`` compiled and eager alike, at the compiled function's line."""
    cell = "h = torch.sigmoid(x @ w)\nreg = f(h)\nloss = h.sum() + reg\nloss.backward()\n"
    fn = ll.define("import torch\n\n\ndef bump(h):\n    h.mul_(2.0)  # <-- writes\n    return h.mean()\n", {},
                   name="compiled_bump")["bump"]
    torch.manual_seed(0)
    ns = {"torch": torch, "f": torch.compile(fn, backend="aot_eager"), "x": torch.randn(4, 8),
          "w": torch.randn(8, 3, requires_grad=True)}
    report = bd.diagnose(cell, ns, engine=engine, timeout=600)
    f = report.findings[0]
    assert f.kind == "inplace" and (f.line, f.function) == (5, "bump"), describe(report)
    assert report.trace.compile_check.eager_agrees


@pytest.mark.parametrize("name, kwargs", [("block_out_of_place", {}), ("Head", {"inplace": False})],
                         ids=["function", "module_relu"])
def test_out_of_place_write_compiled_is_silent_and_bit_identical(engine, name, kwargs):
    plain, ns = _step(name, **kwargs), _step(name, **kwargs)
    exec(STEP, plain)
    report = bd.diagnose(STEP, ns, engine=engine, timeout=600)
    silent(report)
    assert report.trace.compile_check is None and _ran_compiled(report)
    for a, b in zip(_grads(plain), _grads(ns)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- inductor end to end
@pytest.mark.slow
def test_inductor_scaler_skipping_and_in_place_write(native_engine):
    """Both items with inductor's generated code (a C++ compiler runs: slow on a small CPU)."""
    report = bd.diagnose(LOOP, _scaled(backend="inductor"), engine="native", timeout=900)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and f.line == _line("Net", "# <-- first differing"), describe(report)
    assert report.trace.compile_check.trigger == "skipping" and "inductor" in report.trace.compile_check.region
    report = bd.diagnose(STEP, _step("block", backend="inductor"), engine="native", timeout=900)
    f = report.findings[0]
    assert f.kind == "inplace" and f.line == _line("block", "# <-- in place"), describe(report)


# ----------------------------------------------------------------------------- a step function compiled whole
STEP_FUNCTION = """\
def train_step(x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss
step_fn = torch.compile(train_step, backend="aot_eager")
for step in range(8):
    loss = step_fn(x, y)
"""


def _graphs(run) -> tuple[int, dict]:
    """The graphs dynamo compiled and its graph breaks while ``run()`` ran."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = run()
    return result, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def test_a_compiled_step_function_whose_scaler_keeps_skipping(engine):
    """``torch.compile(train_step)``: its resumed frames call ``backward()`` and the scaler, and with them the
    doctor's wrappers; the backward compiled lazily inside it called the compile watch, whose own frames dynamo then
    tried to compile from inside its callback handler (it waited on the handler's lock for ever). Now it ends, with
    the same graphs as without the doctor, and the verdict (a compiled function is compared as a whole: no line)."""
    plain = _scaled(compiled=False)
    _, plain_graphs = _graphs(lambda: exec(STEP_FUNCTION, plain))
    assert plain["scaler"].get_scale() == 256.0
    ns = _scaled(compiled=False)
    report, graphs = _graphs(lambda: bd.diagnose(STEP_FUNCTION, ns, engine=engine, timeout=300))
    assert not report.trace.timed_out, describe(report)
    assert graphs == plain_graphs, (graphs, plain_graphs)
    f = report.findings[0]
    assert f.kind == "compile_divergence" and report.trace.compile_check.trigger == "skipping", describe(report)
    assert "compared as a whole" in report.trace.compile_check.why_not
    _same_end(plain, ns)
    from torch._dynamo import trace_rules

    assert not [d for d in trace_rules.SKIP_DIRS if d.rstrip("/").endswith("backward_doctor")]  # put back
