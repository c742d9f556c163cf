"""Capture one training step: every aten op, live memory, non-finite values, failures.

:class:`Capture` is the public context manager; a private dispatch mode hands it each op (forward, backward and
optimizer step alike). Everything is turned into strings and numbers as it happens (see ``trace.py``); tensors and
modules are only ever weakly referenced, and every global touched (dispatch mode, module and optimizer hooks,
per-parameter hooks) is restored on exit, exceptions included.

>>> import torch
>>> x = torch.randn(4, 3, requires_grad=True)
>>> with Capture() as cap:
...     (x * 2).sum().backward()
>>> trace = cap.finish()   # builds the trace's records once, after the step
>>> [op.phase for op in trace.ops]
['forward', 'forward', 'forward', 'backward', 'backward', 'backward']
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.optim.optimizer as _optim
from torch.nn.modules import module as _nn_module

from . import namespace as ns_mod
from .recorder.compiling import CompileWatch
from .elsewhere import elsewhere
from .guard import nothing
from .workers.main_side import WorkerWatch
from .loop.hooks import LoopHooks
from .recorder.module_modes import ModeWatch
from .loop.optimizer import OptimizerHooks
from ..util.process import complete, doctors_own, interrupts_deferred
from .recorder.mode import _DoctorMode, take_off
from .recorder.record import OpRecorder, passed_on
from .recorder.memory import shape_of, storage_key
from .. import native
from ..trace.parts import Carrier
from ..trace.records import Trace, Where

if TYPE_CHECKING:
    from .history import CellHistory

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root
_WRAPPER_FILES = (os.path.join("torch", "_dynamo", "eval_frame.py"), os.path.join("torch", "_compile.py"),
                  os.path.join("torch", "utils", "_python_dispatch.py"))
_sequence_nr = torch._C._autograd._get_sequence_nr


def _any_each(tensors: list[torch.Tensor]) -> list[bool]:
    """``bool(t.any())`` of each tensor, with one synchronisation per CUDA device rather than one per tensor (a
    cell's start reads every gradient an earlier step consumed: on a GPU each read waited for the device), and
    on the CPU only up to the first value other than zero where the native recorder is loaded.

    >>> _any_each([torch.zeros(2), torch.ones(3)])
    [False, True]
    """
    out: list[bool] = [False] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    # (the native recorder reads a CPU gradient up to its first value other than zero, where torch reads it all)
    ext = native.ready()
    known = ext.nonzero_each(tensors) if ext is not None and hasattr(ext, "nonzero_each") else [None] * len(tensors)
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if known[i] is not None:
                out[i] = known[i]
            elif t.device.type == "cpu" or t.is_sparse:
                out[i] = bool(t.any())
            else:
                by_device.setdefault(t.device, []).append(i)
        for idx in by_device.values():
            for i, v in zip(idx, torch.stack([tensors[i].any() for i in idx]).tolist()):
                out[i] = bool(v)
    return out


class Capture(OptimizerHooks, LoopHooks, OpRecorder):  # (OpRecorder's base, CaptureState, holds the fields)
    """Record the ops and memory of the code run inside ``with Capture(...)``.

    ``namespace``: the user's globals, read to name variables and modules and to
    count what existed before. ``memory_limit``: simulated device capacity in
    bytes; the op that pushes live bytes past it raises ``torch.OutOfMemoryError``.
    ``check_indices``: validate index ranges before index ops run (default: on
    CUDA only, where a bad index would otherwise kill the context). ``cuda_history``:
    on CUDA, record the allocator's history (``torch.cuda.memory._record_memory_history``)
    during the run; it costs time per allocation (see benchmarks/).
    """

    def __init__(self, namespace: dict[str, Any] | None = None, *, cell_file: str = "<cell>",
                 source: str = "", memory_limit: int | None = None, max_ops: int = 50_000,
                 tail_ops: int = 10_000, check_indices: bool | None = None,
                 history: "CellHistory | None" = None, detail: bool = True, cuda_history: bool = True) -> None:
        super().__init__(namespace, cell_file=cell_file, source=source, memory_limit=memory_limit,
                         max_ops=max_ops, tail_ops=tail_ops, check_indices=check_indices, history=history,
                         detail=detail, cuda_history=cuda_history)
        self._compile_watch = CompileWatch(lambda: self._guarded("compile", self._compile_started),
                                           lambda: self._guarded("compile", self._compile_ended))
        self._workers = WorkerWatch(self)
        self._mode: _DoctorMode | None = None
        self._modes = ModeWatch()  # each model's train()/eval() and gradient mode at its first calls

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Capture":
        # A Ctrl-C can land after start() completed and before `with` protects its body (then
        # __exit__ would never run): whatever comes out of here, nothing stays installed.
        try:
            self.start()
            return self
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> bool:
        self.stop()
        return False

    def start(self) -> None:
        """Install the dispatch mode and the hooks. A Ctrl-C meanwhile is held back; if one came, all
        that was installed is undone before it is delivered: a capture is never half installed."""
        import torch._dynamo  # noqa: F401  (the first dispatch mode imports it: keep that out of step time)

        with interrupts_deferred() as deferral:
            self._install_or_undo(deferral)

    def _install_or_undo(self, deferral: Any) -> None:
        # (A `try` of its own: as the first statement of a `with` body it would leave an instruction
        # between the two that neither protects.)
        try:
            self._install()
        except BaseException:
            self._undo.undo_all()
            raise
        if deferral.pending and deferral.depth == 1:
            # A Ctrl-C while installing, delivered as this section ends: nothing may stay installed. Inside
            # a diagnosis's hold (depth > 1) it is handed to the cell's handler as the cell begins, under the
            # capture: a handler that does not raise lets the cell run, and it must run recorded.
            self._undo.undo_all()

    def _install(self) -> None:
        self._prepare()
        if self._cuda:
            from .recorder import cuda as _cuda
            _cuda.start(self)
            self._undo.push("CUDA memory history", lambda: _cuda.stop(self))
        self._t0 = time.perf_counter()
        self.trace.started_at = time.time()
        mode = _DoctorMode(self)
        self._undo.push("dispatch mode", lambda: self._take_off(mode))
        mode.__enter__()
        self._mode = mode

    def _prepare(self) -> None:
        """What exists before the step (namespace, parameters, optimizer state), and the global hooks.
        Each undo step goes on the stack before what it undoes is installed (every one of them is safe
        to run when nothing, or only part, was installed)."""
        self._guard_watches()
        self._undo.push("parameter hooks", self._remove_parameter_hooks)
        self._scan_namespace()
        if self.history is not None:
            self._forget_zeroed_grads()
        self.trace.memory.baseline_bytes = self._ledger.total
        self._undo.push("module and optimizer hooks", self._remove_global_hooks)
        self._add_global_hooks()
        self._undo.push("compile callbacks", self._compile_watch.remove)
        self._compile_watch.install()
        self._workers.install(self._undo)
        self._watch = self._make_watch()
        self._make_watches()
        self._find_library_loop()

    def _take_off(self, mode: _DoctorMode) -> None:
        """The doctor's dispatch mode off, wherever the cell left it: modes the cell entered and never left
        stay on (``mode.take_off``)."""
        kept = take_off(mode)
        if kept:
            self.trace.notes.append(f"the cell left its own dispatch mode on ({', '.join(kept)}): it stays on, "
                                    "and the doctor's, under it, was taken off")

    # (Hooks come and go during the run too: the native recorder's sleep, torch.compile. An exception from a
    # signal handler can land on any line, so a handle is in its list from the line that makes it, and
    # leaves the list only once removed: whatever is interrupted, the undo finds every hook still installed.)
    @staticmethod
    def _remove_all(handles: list[Any]) -> None:
        while handles:
            handles[-1].remove()  # (removing twice is harmless)
            handles.pop()

    def _remove_parameter_hooks(self) -> None:
        self._remove_all(self._handles)

    def _add_global_hooks(self) -> None:
        if not self._global_handles and not self.guards.stopped("optimizer"):  # (once: compilations nest)
            self._global_handles.append(_optim.register_optimizer_step_pre_hook(self._optim_pre))
            self._global_handles.append(_optim.register_optimizer_step_post_hook(self._optim_post))
        self._add_module_hooks()

    def _add_module_hooks(self) -> None:
        if not self._module_handles and not self.guards.stopped("modules"):
            self._module_handles.append(_nn_module.register_module_forward_pre_hook(self._module_pre))
            self._module_handles.append(_nn_module.register_module_forward_hook(self._module_post,
                                                                                always_call=True))

    def _remove_module_hooks(self) -> None:
        self._remove_all(self._module_handles)

    def _remove_global_hooks(self) -> None:
        self._remove_all(self._global_handles)
        self._remove_module_hooks()

    def _guard_watches(self) -> None:
        """What switches each watch off when its bookkeeping fails (``guard.py``); the loop's watches register
        theirs as they are made (``loop/hooks.py``)."""
        g = self.guards
        g.on_stop("optimizer", lambda: self._remove_all(self._global_handles))
        g.on_stop("modules", self._remove_module_hooks)
        g.on_stop("gradients", self._remove_parameter_hooks)
        g.on_stop("rollback", lambda: setattr(self, "rollback", None))
        g.on_stop("sampling", lambda: setattr(self, "_begin_iteration", nothing))
        g.on_stop("compile", self._compile_watch.remove)
        g.on_stop("workers", self._workers.unwrap)
        g.on_stop("recorder", self._recorder_off)

    def _recorder_off(self) -> None:
        """The op recorder's bookkeeping failed: from now on the dispatch mode passes every op straight on."""
        self.dispatch = passed_on  # (the mode looks ``dispatch`` up at each op: the instance's wins)

    def _compile_started(self) -> None:
        """torch.compile starts compiling (dynamo tracing a frame, or a backward compiled lazily): the
        doctor steps aside, so that it compiles exactly what it would compile without the doctor.
        Global module hooks would be traced into the graph (graph breaks: other kernels)."""
        self._remove_global_hooks()
        self._unpatch_training()

    def _compile_ended(self) -> None:
        self._add_global_hooks()
        self._patch_training()

    def stop(self) -> None:
        """Undo everything ``start`` installed, newest first; safe to call twice. A Ctrl-C meanwhile is
        held back and delivered once all is undone."""
        complete(self._teardown)

    def _teardown(self, _: Any = None) -> None:
        self._undo.undo_all()
        self._mode = None
        if self._t0:
            self.trace.duration_s = time.perf_counter() - self._t0
        self.trace.compiles = self._compile_watch.events

    # ---------------------------------------------------------------- namespace
    def _scan_namespace(self) -> None:
        """What the namespace holds before the step (what cannot be read is left out and said: the step runs)."""
        self.elsewhere = elsewhere(self.trace.source, self.namespace)
        modules, optimizers = self.elsewhere.kept(self.namespace, self.trace.notes)
        for name, mod in modules:
            self._scanned(name, self._register_model, mod)
        for name, opt in optimizers:
            self._scanned(name, self._scan_optimizer, name, opt)
        for name, t in ns_mod.tensors(self.namespace):  # (no .grad read here: all counted)
            key = storage_key(t)
            if key is not None:
                self._ns_names.setdefault(key, name)
            self._ledger.track(t, "other")
            if t.grad_fn is not None:
                self.trace.carriers.append(Carrier(variable=name, shape=list(shape_of(t)),
                                                   grad_fn=type(t.grad_fn).__name__, key=key or 0))

    def _scan_optimizer(self, name: str, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self._register_param(p)
        for t in ns_mod.optimizer_state_tensors(opt):
            self._ledger.track(t, "optimizer")
        self.trace.optimizers.append(ns_mod.optimizer_summary(name, opt))  # for OOM predictions

    def _scanned(self, name: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            if not doctors_own(exc):
                raise
            self.trace.notes.append(f"`{name}` could not be read before the step ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:120] if str(exc) else ''}): what it holds is "
                                    "not counted as existing before the step")

    def _forget_zeroed_grads(self) -> None:
        """Gradients zeroed since their step (e.g. by zero_grad in another cell) are not stale."""
        marks = self.history.stepped_grads
        grads = list(marks.keys())
        for grad, nonzero in zip(grads, _any_each(grads)):
            if not nonzero:
                marks.pop(grad, None)
            else:  # (an unrecorded step tells by its version whether this run's backward added to it)
                self._mark_versions[id(grad)] = grad._version

    # ---------------------------------------------------------------- hooks
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        # (another thread's model is not this run's; while dynamo traces this hook into a graph, asking for the thread
        # would break the graph: is_compiling() is constant there, and the trace is the run's thread's)
        if not torch.compiler.is_compiling() and threading.get_ident() != self._thread:
            return
        try:
            if id(module) not in self._modules:
                self._register_module(module)
            if not self._module_stack:  # (a model called from user code: once per forward, not per op)
                self._modes.entered(self, module)
            self._module_stack.append(id(module))
            self._stack_key = tuple(self._module_stack)
        except Exception as exc:  # (the watch's own failure: it stops, the module runs, ``guard.py``)
            if not self.guards.failed("modules", exc):
                raise

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling() and threading.get_ident() != self._thread:
            return
        try:
            stack = self._module_stack
            if stack and stack[-1] == id(module):
                stack.pop()
            elif id(module) in stack:  # an exception skipped inner post-hooks
                del stack[stack.index(id(module)):]
            self._stack_key = tuple(stack)
            self._modes.left(self)  # (the outermost call's end)
        except Exception as exc:
            if not self.guards.failed("modules", exc):
                raise

    # ---------------------------------------------------------------- per op
    def _caller(self) -> Any:
        """The frame that called the op: above our dispatch and torch's wrappers of ``__torch_dispatch__``."""
        f = sys._getframe(3)  # 0 _caller, 1 _where, 2 dispatch
        skip = self._skip_codes
        while f is not None:
            s = skip.get(f.f_code)
            if s is None:
                name = f.f_code.co_filename
                s = skip[f.f_code] = name.startswith(_PKG_DIR) or name.endswith(_WRAPPER_FILES)
            if not s:
                return f
            f = f.f_back
        return None

    def _where(self, cached: bool = False) -> Where:
        """Where the user was for this op. ``cached``: backward/optimizer ops, whose calling frame
        stays alive through the whole backward()/step() call, reuse the walk of the same call site."""
        f = self._caller()
        if cached:
            key = (id(f), f.f_code, f.f_lasti) if f is not None else None
            w = self._where_cache.get(key)
            if w is None:
                w = self._where_cache[key] = self._frames.where(f)
            return w
        w = self._frames.where(f)
        # One Where object per position and module stack: a forward op does not keep a new one.
        key = (w.line, w.file, w.cell_line, w.lasti, w.compiled, self._stack_key)
        got = self._where_intern.get(key)
        if got is None:
            got = self._where_intern[key] = w
            if self._stack_key:
                self._where_stacks.append((w, self._stack_key))
        return got

    def photograph_workers(self, exc: BaseException | None = None) -> None:
        """A hang: the stacks of the DataLoader workers started in the run, before the main thread is
        interrupted (the watchdog), or after a Ctrl-C or a loader's own timeout ended it (``exc``)."""
        if exc is None:
            self._workers.photograph()
        else:
            self._workers.after_run(exc)

    # ---------------------------------------------------------------- results
    def record_exception(self, exc: BaseException) -> None:
        """Turn the cell's exception into text and evidence (keeps no frame or tensor)."""
        from .end.finish import record_exception

        record_exception(self, exc)
        # (stopped inside a loop: the iteration that was running, the first one included)
        self._note_loop_values(self.trace.iterations.steps)
        if self.rollback is not None and self._asleep and isinstance(exc, Exception) \
                and not isinstance(exc, NameError) and not self.trace.timed_out \
                and "out of memory" not in str(exc).lower() and "device-side assert" not in str(exc) \
                and "DataLoader worker" not in str(exc):  # (the loader's next batch: not the body's to replay)
            # An error in an iteration the recorder did not record: that iteration can be replayed
            # (its weights are still those it began with unless its optimizer step already ran). A name the
            # code misspelt would only fail again: no state is copied for it. (Nor after a device-side assert: the
            # CUDA context is lost, nothing more runs on it.)
            self.rollback.went_wrong(self.trace.iterations.steps, exc, self.trace)  # (not after the loop)

    def finish(self) -> Trace:
        """Resolve names, downsample the timeline, decide what NaN/Inf reached; returns the trace."""
        from .end.finish import finish

        if self.watches is not None:
            self.watches.finish(self.namespace)
        if self._unhooked:
            self._unfrozen()
        return finish(self)
