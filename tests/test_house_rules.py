"""Rules of the house: same results, PyTorch's own errors, no memory held, globals restored."""
from __future__ import annotations

import gc
import signal
import textwrap
import types
import weakref

import pytest
import torch
import torch.optim.optimizer as optim_mod
from torch.nn.modules import module as nn_module

import backward_doctor as bd


def _global_state(params=()):
    return {
        "dispatch_stack": torch._C._len_torch_dispatch_stack(),
        "function_stack": torch._C._len_torch_function_stack(),
        "fwd_pre": len(nn_module._global_forward_pre_hooks),
        "fwd": len(nn_module._global_forward_hooks),
        "fwd_always": len(nn_module._global_forward_hooks_always_called),
        "opt_pre": len(optim_mod._global_optimizer_pre_hooks),
        "opt_post": len(optim_mod._global_optimizer_post_hooks),
        "sigint": signal.getsignal(signal.SIGINT),
        "grad": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "param_hooks": [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params],
    }


def _mlp_ns():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return {"torch": torch, "model": model, "opt": torch.optim.Adam(model.parameters()),
            "x": torch.randn(32, 8), "y": torch.randn(32, 1)}


CELLS = {
    "ok": "loss = torch.nn.functional.mse_loss(model(x), y)\nloss.backward()\nopt.step()",
    "raises_in_backward": "out = torch.sigmoid(model(x))\nout += 1\nout.sum().backward()",
    "raises_in_forward_inside_autocast": textwrap.dedent("""
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                model(torch.randn(3, 5))
    """),
    "keyboard_interrupt": "model(x)\nraise KeyboardInterrupt",
    "simulated_oom": "big = model(x.repeat(1000, 1))\nbig.sum().backward()",
}


@pytest.mark.parametrize("name", list(CELLS))
def test_global_state_restored(name):
    ns = _mlp_ns()
    params = list(ns["model"].parameters())
    before = _global_state(params)
    kwargs = {"memory_limit": 200_000} if name == "simulated_oom" else {}
    report = bd.diagnose(CELLS[name], ns, **kwargs)
    assert _global_state(params) == before
    assert (report.exception is None) == (name == "ok")


def test_global_state_restored_after_timeout():
    ns = _mlp_ns()
    before = _global_state(list(ns["model"].parameters()))
    report = bd.diagnose("model(x)\nwhile True:\n    pass", ns, timeout=0.5)
    assert report.findings[0].kind == "hang"
    assert _global_state(list(ns["model"].parameters())) == before


def test_inplace_version_check_still_raises_exactly_as_pytorch():
    src = "h = torch.sigmoid(model(x))\nh.mul_(2)\nh.sum().backward()"
    plain_ns = _mlp_ns()
    with pytest.raises(RuntimeError) as plain:
        exec(src, plain_ns)
    report = bd.diagnose(src, _mlp_ns())
    assert report.exception == f"RuntimeError: {plain.value}"


def test_gradients_bit_identical_with_and_without_doctor():
    src = CELLS["ok"]
    plain_ns, doc_ns = _mlp_ns(), _mlp_ns()
    exec(src, plain_ns)
    assert bd.diagnose(src, doc_ns).ok
    for p, q in zip(plain_ns["model"].parameters(), doc_ns["model"].parameters()):
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(p, q)


SAVED_ACTIVATION = textwrap.dedent("""
    import weakref
    h = model[0](x.repeat(200, 1))          # ~200 KB activation saved by tanh
    freed.append(False)
    weakref.finalize(h.untyped_storage(), freed.__setitem__, 0, True)
    out = model[2](model[1](h))
    del h
    loss = out.pow(2).mean()
    loss.backward()
""")


@pytest.mark.parametrize("limit", [None, 700_000])  # 700 kB: OOM at the tanh, after h exists
def test_doctor_keeps_no_activation_alive(limit):
    ns = _mlp_ns()
    ns["freed"] = []
    report = bd.diagnose(SAVED_ACTIVATION, ns, memory_limit=limit)
    assert (report.exception is None) == (limit is None)
    for name in ("h", "out", "loss"):  # what a normal run leaves in the namespace
        ns.pop(name, None)
    gc.collect()
    assert ns["freed"] == [True], "the activation's storage is still alive after the step"


FAILS_INSIDE_A_FUNCTION = textwrap.dedent("""
    import weakref
    def forward(x):                          # (a module's forward: its locals live on the traceback)
        h = model[0](x.repeat(200, 1))
        freed.append(False)
        weakref.finalize(h.untyped_storage(), freed.__setitem__, 0, True)
        out = model[2](model[1](h))
        raise MemoryError("out of memory")
    loss = forward(x).sum()
""")


def test_a_failed_steps_tensors_are_freed_at_once_not_at_the_next_garbage_collection(engine):
    """After an OOM the user's next cell (or the fix that would fit) needs the memory back now. The failed
    step's activations hang off the exception's traceback; a cycle through the doctor's own frames kept them
    until the garbage collector ran (1.3 GB on an H200, and every fix then ran out of memory too)."""
    ns = _mlp_ns()
    ns["freed"] = []
    gc.collect()
    gc.disable()  # (what a collection would free is exactly what must not wait for one)
    try:
        report = bd.diagnose(FAILS_INSIDE_A_FUNCTION, ns, engine=engine)
        assert report.exception.startswith("MemoryError")
        assert ns["freed"] == [True], "the failed step's activation is held until a garbage collection"
    finally:
        gc.enable()


@pytest.mark.parametrize("limit", [None, 700_000])
def test_the_namespace_is_let_go_when_the_diagnosis_returns(engine, limit):
    """A capture is a cycle of its own (its ledger and watches call back into it): what it referred to lived until
    the next garbage collection (on an H200: a diagnosed OOM's model and batch, 270 MB on the device). A user who
    drops the namespace gets the memory back at once, as without the doctor."""
    bd.diagnose(CELLS["ok"], _mlp_ns(), engine=engine)  # (warm: torch's own first-use imports leave cycles)
    ns = _mlp_ns()
    batch, weight = weakref.ref(ns["x"]), weakref.ref(ns["model"][0].weight)
    gc.collect()
    gc.disable()
    try:
        report = bd.diagnose(SAVED_ACTIVATION, {**ns, "freed": []}, engine=engine, memory_limit=limit)
        assert (report.exception is None) == (limit is None)
        del ns
        assert batch() is None and weight() is None, "the namespace is held until a garbage collection"
    finally:
        gc.enable()


def test_report_holds_no_tensors():
    ns = _mlp_ns()
    report = bd.diagnose(CELLS["ok"], ns)
    seen, stack = set(), [report]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        assert not isinstance(obj, (torch.Tensor, torch.nn.Module)), type(obj)
        stack.extend(gc.get_referents(obj))


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_very_deep_graph_can_be_freed_after_the_doctor_saw_it(tmp_path, engine):
    """Python tier: looking up autograd nodes gives them Python wrappers; freeing ~70k wrapped nodes
    in one chain overflows the C stack. The doctor bounds its lookups, so the user's next gc survives.
    The native tier wraps no node: every backward op keeps its forward op."""
    import subprocess
    import sys

    if engine == "native" and not _native_ok():
        pytest.skip("the native recorder is not available here")
    check = ("any('not linked to their forward op' in n for n in r.trace.notes)" if engine == "python" else
             "r.trace.engine == 'native' and all(o.fwd_index is not None for o in r.trace.ops "
             "if o.phase == 'backward' and o.op == 'aten::mul')")
    script = tmp_path / "deep.py"
    script.write_text(
        "import gc, torch, backward_doctor as bd\n"
        "ns = {'torch': torch, 'h0': torch.ones(4, requires_grad=True)}\n"
        "src = 'h = h0\\nfor _ in range(34000):\\n    h = h * 1.0001 + 0.001\\nh.sum().backward()\\n'\n"
        f"r = bd.diagnose(src, ns, engine={engine!r})\n"
        f"assert r.ok and {check}, r.trace.notes\n"
        "del ns, r\n"
        "gc.collect()\n"
        "print('survived')\n")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": root})
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[-2000:]


def test_timeout_still_ends_a_run_that_swallows_the_first_interrupt():
    """A KeyboardInterrupt can be eaten (a bare except, a weakref callback): the watchdog repeats it."""
    src = ("swallowed = 0\n"
           "while True:\n"
           "    try:\n"
           "        while True:\n"
           "            pass\n"
           "    except KeyboardInterrupt:\n"
           "        swallowed += 1\n"
           "        if swallowed >= 2:\n"
           "            raise\n")
    ns = {}
    report = bd.diagnose(src, ns, timeout=0.3)
    assert report.findings[0].kind == "hang" and ns["swallowed"] == 2


def _native_ok() -> bool:
    from backward_doctor.capture.native_capture import native_available

    return native_available()
