"""Deliver a Ctrl-C at every point where the doctor sets itself up or tears itself down, and list what
it left behind.

A *point* is a line the doctor's own code runs outside the cell (``sys.settrace`` line events in
``backward_doctor`` frames before the cell's first line or after its last). At point ``k`` a
``_thread.interrupt_main()`` makes CPython raise ``KeyboardInterrupt`` in the main thread at its next
check, exactly as a real Ctrl-C does. After the diagnosis returns or raises, :func:`leftovers` lists
every global the doctor touches that is not as it was.

``python tests/fault_injection.py [native|python]`` prints the figures.
"""
from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.optim.optimizer as _optim
from torch import nn
from torch.nn.modules import module as _nn_module

_PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "backward_doctor")
# Set-up and tear-down: the modules that install and remove what the doctor puts into the process (the
# rules and renderers only read the trace once it is inert: an interrupt there leaves nothing behind).
_SETUP = tuple(os.path.join(_PKG, m) for m in (
    "api.py", "run/engine.py", "run/step.py", "capture/runner.py", "capture/context.py", "capture/native_capture.py",
    "capture/recorder/compiling.py", "capture/recorder/memory.py", "capture/loop/hooks.py", "capture/watches/accumulation.py",
    "capture/watches/precision.py",
    "capture/namespace.py", "capture/history.py", "util/process.py", "capture/recorder/mode.py", "native/__init__.py"))
CELL = "opt.zero_grad()\nloss = (model(x) ** 2).mean()\nloss.backward()\nopt.step()\n"


def make_namespace() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(5, 4)}


def baseline() -> dict[str, Any]:
    """What the globals the doctor touches look like when it is not running."""
    import torch.autograd.profiler as prof
    from torch._dynamo.callback import callback_handler

    return {
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "profiler enabled": torch.autograd._profiler_enabled(),
        "module hooks": sum(len(d) for d in (_nn_module._global_forward_pre_hooks, _nn_module._global_forward_hooks,
                                              _nn_module._global_backward_hooks,
                                              _nn_module._global_backward_pre_hooks)),
        "optimizer hooks": len(_optim._global_optimizer_pre_hooks) + len(_optim._global_optimizer_post_hooks),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "warning filters": len(warnings.filters),
        "dynamo callbacks": len(callback_handler.start_callbacks) + len(callback_handler.end_callbacks),
        "profiler functions": (prof._enable_profiler, prof._disable_profiler),
        "native recorder running": _native_running(),
        "watchdog threads": sum(t.name == "backward_doctor-watchdog" and t.is_alive() for t in threading.enumerate()),
        "locks held": _held_locks(),
        "diagnosis marked running": getattr(sys.modules.get("backward_doctor.util.process"), "_owner", None),
        "wrapped functions": _wrapped(),
        "DataLoader iterator methods": _loader_iter_methods(),
    }


def _wrapped() -> tuple:
    """The functions a capture wraps for the run (backward, zero_grad, GradScaler, clipping)."""
    from torch.amp.grad_scaler import GradScaler
    from torch.nn.utils import clip_grad

    return (torch.autograd.backward, torch.optim.Optimizer.zero_grad, nn.Module.zero_grad, GradScaler.scale,
            GradScaler.step, GradScaler.update, clip_grad._clip_grads_with_norm_)


def _loader_iter_methods() -> tuple:
    """The multiprocessing DataLoader iterator's own methods the worker watch wraps during a run."""
    from torch.utils.data import dataloader

    cls = dataloader._MultiProcessingDataLoaderIter
    return tuple(cls.__dict__.get(name) for name in ("__init__", "_next_index", "_try_put_index"))


def _held_locks() -> list[str]:
    """The doctor's module-level locks that are held (a leaked one makes the next diagnosis hang)."""
    held = []
    for name, mod in list(sys.modules.items()):
        if not (name == "backward_doctor" or name.startswith("backward_doctor.")):
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, type(threading.Lock())) and value.locked():
                held.append(f"{name}.{attr}")
    return held


def _native_running() -> bool:
    from backward_doctor import native

    ext = native.ready()
    return bool(ext is not None and ext.running())


def leftovers(before: dict[str, Any], ns: dict) -> list[str]:
    """The globals (and the namespace's per-parameter hooks) not as they were before the diagnosis."""
    for _ in range(50):  # a watchdog thread ends by itself, give it a moment
        if not any(t.name == "backward_doctor-watchdog" and t.is_alive() for t in threading.enumerate()):
            break
        time.sleep(0.01)
    now = baseline()
    out = [k for k in before if now[k] != before[k]]
    if any(getattr(p, "_post_accumulate_grad_hooks", None) for p in ns["model"].parameters()):
        out.append("parameter hooks")
    return out


def _tracer(on_point: Callable[[], None]) -> Callable:
    """A trace function calling ``on_point`` at each line of the doctor's code run outside the cell."""
    state = {"cell": 0}

    def local(frame, event, arg):
        if event == "line" and not state["cell"]:
            on_point()
        return local

    def trace(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith("<backward_doctor-cell"):
            if event == "call":
                state["cell"] += 1

                def cell_local(f, e, a):
                    if e == "return":
                        state["cell"] -= 1
                    return cell_local
                return cell_local
            return None
        if name in _SETUP and not state["cell"]:
            return local
        return None
    return trace


def count_points(run: Callable[[], Any]) -> int:
    n = [0]

    def point() -> None:
        n[0] += 1

    sys.settrace(_tracer(point))
    try:
        run()
    finally:
        sys.settrace(None)
    return n[0]


def where_points(run: Callable[[], Any]) -> list[str]:
    """``file:line`` of each point, in order."""
    out: list[str] = []

    def tracer() -> Callable:
        state = {"cell": 0}

        def local(frame, event, arg):
            if event == "line" and not state["cell"]:
                out.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
            return local

        def trace(frame, event, arg):
            name = frame.f_code.co_filename
            if name.startswith("<backward_doctor-cell"):
                if event == "call":
                    state["cell"] += 1

                    def cell_local(f, e, a):
                        if e == "return":
                            state["cell"] -= 1
                        return cell_local
                    return cell_local
                return None
            if name in _SETUP and not state["cell"]:
                return local
            return None
        return trace

    sys.settrace(tracer())
    try:
        run()
    finally:
        sys.settrace(None)
    return out


def interrupt_at(k: int, run: Callable[[], Any]) -> tuple[bool, Any]:
    """Run with a Ctrl-C delivered at point ``k``; returns (whether it was delivered, the result or the
    exception that came out)."""
    n = [0]
    fired = [False]

    def point() -> None:
        n[0] += 1
        if n[0] == k and not fired[0]:
            fired[0] = True
            _thread.interrupt_main()

    sys.settrace(_tracer(point))
    try:
        try:
            result: Any = run()
        except BaseException as exc:  # noqa: BLE001 - what came out is the observation
            result = exc
        finally:
            sys.settrace(None)
        time.sleep(0)  # a pending interrupt not yet delivered lands here, outside the doctor
    except KeyboardInterrupt as exc:
        result = exc
    return fired[0], result


def attack(engine: str, every: int = 1, verbose: bool = False) -> dict[str, Any]:
    """Try every ``every``-th point of one diagnosis on ``engine``; figures and the first failures."""
    import backward_doctor as bd

    def run(ns: dict) -> Callable[[], Any]:
        return lambda: bd.diagnose(CELL, ns, engine=engine, timeout=30)

    ns = make_namespace()
    bd.diagnose(CELL, ns, engine=engine)  # warm up (imports, builds)
    before = baseline()
    where = where_points(run(make_namespace()))
    points = len(where)
    bad: list[tuple[int, list[str]]] = []
    tried = 0
    import faulthandler

    for k in range(1, points + 1, every):
        for _ in range(3):  # a Ctrl-C delivered late, in the harness itself, is not the doctor's: try again
            try:
                ns = make_namespace()
                before = baseline()  # (what an earlier attempt left and _cleanup could not undo is not this one's)
                break
            except KeyboardInterrupt:
                continue
        faulthandler.dump_traceback_later(60, exit=True)  # an attempt that hangs is a finding too: say where
        fired, _ = interrupt_at(k, run(ns))
        faulthandler.cancel_dump_traceback_later()
        if verbose and k % 100 == 0:
            print(f"  {engine}: point {k}/{points}, {len(bad)} left state", file=sys.stderr, flush=True)
        if not fired:
            continue
        tried += 1
        for _ in range(3):  # an interrupt delivered late (after the diagnosis) is not the doctor's
            try:
                left = leftovers(before, ns)
                break
            except KeyboardInterrupt:
                continue
        if left:
            bad.append((k, where[k - 1] if k <= len(where) else "?", left))
            _cleanup()
    return {"engine": engine, "points": points, "tried": tried, "left_state": len(bad), "examples": bad[:20]}


def _cleanup() -> None:
    """Undo what a failed attempt left, so the next attempt starts clean (only for the attack itself)."""
    while torch._C._len_torch_dispatch_stack():
        torch._C._pop_torch_dispatch_stack(None)
    from backward_doctor import native

    ext = native.ready()
    if ext is not None and ext.running():
        ext.stop()
    for d in (_nn_module._global_forward_pre_hooks, _nn_module._global_forward_hooks,
              _optim._global_optimizer_pre_hooks, _optim._global_optimizer_post_hooks):
        d.clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in _held_locks():
        mod, attr = name.rsplit(".", 1)
        getattr(sys.modules[mod], attr).release()
    g = sys.modules.get("backward_doctor.util.process")
    if g is not None:
        g._owner, g._depth = None, 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(_PKG))
    for eng in sys.argv[1:] or ["native", "python"]:
        print(attack(eng, verbose=True), flush=True)
