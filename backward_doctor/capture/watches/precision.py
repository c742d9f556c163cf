"""Mixed precision as it ran (``trace.precision``): each gradient clip against the GradScaler's state at
that moment, the scaler's steps (taken or skipped, with the scale), and how much of an optimizer step on
bf16/fp16 weights survived rounding.

For the run, ``GradScaler.scale``/``step``/``update`` and ``torch.nn.utils.clip_grad._clip_grads_with_norm_``
(what ``clip_grad_norm_`` calls, however the user imported it) are wrapped, and put back afterwards
(and while torch.compile compiles). Nothing is dispatched: the scale is read from its CPU storage in
place, and weights are sampled the same way, a few hundred values per low-precision parameter, before
and after the first steps that update such weights. A loop without a scaler or low-precision weights
pays one dictionary read per optimizer step.

>>> import torch
>>> from backward_doctor.trace.precision import Precision
>>> w = PrecisionWatch(rec := Precision(), frames=None, iteration=lambda: 0)
>>> p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16)); p.grad = torch.ones_like(p)
>>> opt = torch.optim.SGD([p], lr=1e-4)
>>> w.step_began(opt); opt.step(); w.iteration_ended()
>>> rec.updates[0].sampled, rec.updates[0].unchanged   # 1 - 1e-4 rounds back to 1.0 in bfloat16
(8, 8)
"""
from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from .accumulation import number
from ..guard import Guards, nothing
from .registry import Watch
from .patches import Patches, named_like
from ..recorder.memory import storage_key
from .scaler_pairing import Pairing, stage
from ...trace.precision import ClipCall, LowPrecisionUpdate, ParamUpdate, Precision, ScalerStep

_LOW = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_BITS = {torch.bfloat16: (ctypes.c_uint16, 0x7FFF), torch.float16: (ctypes.c_uint16, 0x7FFF),
         torch.float32: (ctypes.c_uint32, 0x7FFFFFFF)}
_PER_PARAM = 256      # values sampled per low-precision parameter
_SAMPLES = 16384      # at most, per step
_UPDATES = 3          # steps sampled per run
_STEPS_KEPT = 64
_CLIPS_KEPT = 16
#: libraries whose own code scales the user's loss with a GradScaler (``accelerator.backward(loss)``); their
#: fix for clipping is their own clip, which unscales first
_DRIVERS = ("accelerate",)


def _view(t: torch.Tensor) -> tuple[Any, int] | None:
    """The bits of a contiguous CPU tensor as a ctypes array over its memory (nothing copied), and the
    mask that keeps all but the sign (a value is zero when its bits under the mask are)."""
    kind = _BITS.get(t.dtype)
    if kind is None or t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
        return None
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no storage (a fake tensor)
        return None
    if not ptr or t.numel() == 0:
        return None
    return (kind[0] * t.numel()).from_address(ptr), kind[1]


class PrecisionWatch(Watch):
    """Writes ``record`` (see the module docstring). ``on_skipped()``: a GradScaler skipped the optimizer
    step (the accumulation watch's window ends there). ``guards``: the run's (``guard.py``): the wrappers' own
    bookkeeping failing switches the watch off (:meth:`off`) and the user's call goes on; without them it
    raises (a unit test's watch)."""

    events = ("step_began", "iteration_ended", "finish")

    def __init__(self, record: Precision, *, frames: Any, iteration: Callable[[], int],
                 on_skipped: Callable[[], None] = lambda: None, guards: Guards | None = None,
                 backwards: Callable[[], int] = lambda: -1) -> None:
        self.record = record
        self._frames, self._iteration, self._on_skipped = frames, iteration, on_skipped
        self._backwards = backwards  # backward() calls of the run so far (the loop watch's count)
        self._thread = threading.get_ident()
        #: id -> (weakref, a loss scaled since its update, the library whose code called ``scale``: '' the user)
        self._scalers: dict[int, tuple[Any, bool, str]] = {}
        self._run = 0                                    # scaler.step calls skipped in a row
        self._run_start: ScalerStep | None = None
        self._low: dict[int, tuple[Any, list[Any]]] = {}  # optimizer id -> (weakref, its low-precision params)
        self._plain: dict[int, Any] = {}  # optimizer id -> weakref, for those with none (every step asks: few reads)
        self._pending: list[tuple[Any, list[int], list[int]]] = []
        self._step: LowPrecisionUpdate | None = None
        self._guards = guards
        self._pairing = Pairing(record.scaler)
        self._paired = False  # the step methods that pair steps with updates swapped in (a loss was scaled)
        self.patches = Patches()
        from torch.amp.grad_scaler import GradScaler
        from torch.nn.utils import clip_grad

        self.patches.add(GradScaler, "scale", self._wrap_scale)
        self.patches.add(GradScaler, "step", self._wrap_step)
        self.patches.add(GradScaler, "update", self._wrap_update)
        self.patches.add(clip_grad, "_clip_grads_with_norm_", self._wrap_clip)

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _where(self) -> Any:
        return self._frames.where(sys._getframe(2)) if self._frames is not None else None

    @staticmethod
    def _place(w: Any) -> dict[str, Any]:
        return {"line": getattr(w, "line", None), "file": getattr(w, "file", None),
                "cell_line": getattr(w, "cell_line", None), "function": getattr(w, "function", None)}

    # ---------------------------------------------------------------- GradScaler
    # (The GradScaler's private state is read only where no public call gives it, and defensively: a disabled
    # scaler never creates ``_scale``; another torch may name it otherwise.)
    def _failed(self, exc: Exception) -> None:
        if self._guards is None or not self._guards.failed("precision", exc):
            raise exc

    def _wrap_scale(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def scale(scaler: Any, outputs: Any) -> Any:
            try:
                if self._mine():
                    self._scalers[id(scaler)] = (weakref.ref(scaler), True, _caller_library(sys._getframe(1)))
                    if not self._paired and _enabled(scaler):
                        self._pair()
            except Exception as exc:
                self._failed(exc)
            return real(scaler, outputs)
        return named_like(scale, real)

    def _wrap_update(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def update(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(scaler, *args, **kwargs)
            try:
                if self._mine():
                    self._scalers[id(scaler)] = (weakref.ref(scaler), False, "")
                    self.record.scaler.scale_last = _scale_of(scaler)
                    self._pairing.updated(scaler)
            except Exception as exc:
                self._failed(exc)
            return out
        return named_like(update, real)

    def _wrap_step(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            mine = False
            opt = args[0] if args else kwargs.get("optimizer")
            try:
                if self._mine():
                    before, scale = self._iteration(), _scale_of(scaler)
                    self._pairing.step_starting(scaler, opt, lambda: self._place(self._where()))
                    mine = True
            except Exception as exc:
                self._failed(exc)
            try:
                out = real(scaler, *args, **kwargs)
            finally:
                if mine:
                    self._pairing.step_left()
            if mine:
                try:
                    entry = self.scaler_stepped(skipped=_enabled(scaler) and self._iteration() == before,
                                                scale=scale)
                    steps = self.record.scaler.steps
                    shown = entry if entry is not None else steps[-1] if steps else None
                    self._pairing.step_done(scaler, opt, before, _place_of(shown))
                except Exception as exc:
                    self._failed(exc)
            return out
        return named_like(step, real)

    def scaler_stepped(self, *, skipped: bool, scale: float | None) -> ScalerStep | None:
        """``scaler.step(optimizer)`` returned; ``skipped``: the optimizer step did not run. The call's record
        when one is kept."""
        rec = self.record.scaler
        call = rec.calls
        rec.calls += 1
        self._run = self._run + 1 if skipped else 0
        entry = None
        if call < _STEPS_KEPT or skipped:
            entry = ScalerStep(call=call, iteration=self._iteration(), skipped=skipped, scale=scale,
                               **self._place(self._where()))
            if call < _STEPS_KEPT:
                rec.steps.append(entry)
        if skipped:
            rec.skipped += 1
            if self._run == 1:
                self._run_start = entry
            if self._run > rec.longest_skipped:
                rec.longest_skipped, rec.run_start, rec.run_end = self._run, self._run_start, entry
            self._on_skipped()
        return entry

    # ---------------------------------------------------------------- steps paired with updates
    def _pair(self) -> None:
        """A scaler scaled a loss: from now on each outermost optimizer step is checked for going around it
        (instance attributes: a run that scales nothing never runs these)."""
        self._paired = True
        self.step_began, self.iteration_ended = self._step_began_paired, self._iteration_ended_paired

    def _step_began_paired(self, opt: torch.optim.Optimizer, args: tuple = (), kwargs: dict | None = None) -> None:
        if not self._pairing.inside:
            for ref, pending, _ in list(self._scalers.values()):
                scaler = ref()
                if scaler is None or not pending or not _enabled(scaler):
                    continue
                if stage(scaler, opt) != "UNSCALED":  # (unscaled by hand: true gradients, only unchecked)
                    where = self._place(self._where()) if self._pairing.wants_place() else {}
                    self._pairing.direct_began(type(opt).__name__, self._iteration(), _scale_of(scaler), where)
                break
        PrecisionWatch.step_began(self, opt, args, kwargs)

    def _iteration_ended_paired(self) -> None:
        self._pairing.direct_ended()
        PrecisionWatch.iteration_ended(self)

    def finish(self, namespace: Any = None) -> None:
        """The run ended: optimizers a scaler stepped and did not update since."""
        self._pairing.finish()

    # ---------------------------------------------------------------- clipping
    def _wrap_clip(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def _clip_grads_with_norm_(*args: Any, **kwargs: Any) -> Any:
            try:
                if self._mine() and len(self.record.clips) < _CLIPS_KEPT:
                    max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
                    self.clipping(float(max_norm) if isinstance(max_norm, (int, float)) else None)
            except Exception as exc:
                self._failed(exc)
            return real(*args, **kwargs)
        return named_like(_clip_grads_with_norm_, real)

    def clipping(self, max_norm: float | None) -> None:
        """Gradients are about to be clipped: did a GradScaler scale them, and unscale them since? (And how
        many ``backward()`` calls came before: clipping inside an accumulation window.)"""
        for ref, pending, by in list(self._scalers.values()):
            scaler = ref()
            if scaler is None or not pending or not _enabled(scaler):
                continue
            states = getattr(scaler, "_per_optimizer_states", None) or {}
            stages = [st.get("stage") for st in states.values() if isinstance(st, dict)]
            unscaled = any(getattr(s, "name", "") == "UNSCALED" for s in stages)
            self.record.clips.append(ClipCall(
                iteration=self._iteration(), scaled=not unscaled, stage="UNSCALED" if unscaled else "READY",
                scale=_scale_of(scaler), max_norm=max_norm, scaled_by=by, backward=self._backwards(),
                **self._place(self._where())))
            return
        # (no GradScaler scaled these gradients: the clip is kept for where it sits in the optimizer step)
        self.record.clips.append(ClipCall(iteration=self._iteration(), max_norm=max_norm, backward=self._backwards(),
                                          **self._place(self._where())))

    # ---------------------------------------------------------------- low-precision weights
    def _low_params(self, opt: torch.optim.Optimizer) -> list[Any]:
        got = self._low.get(id(opt))
        if got is None or got[0]() is not opt:
            params = [weakref.ref(p) for g in opt.param_groups for p in g["params"]
                      if p.dtype in _LOW and p.requires_grad]
            got = self._low[id(opt)] = (weakref.ref(opt), params)
            if not params:
                self._plain[id(opt)] = got[0]
        return got[1]

    def step_began(self, opt: torch.optim.Optimizer, args: tuple = (), kwargs: dict | None = None) -> None:
        """The outermost optimizer step begins: sample its low-precision weights (which of them had a gradient
        is read after the step: a closure computes the gradients inside it)."""
        plain = self._plain.get(id(opt))
        if plain is not None and plain() is opt:  # (the common case: no low-precision weights)
            return
        if len(self.record.updates) >= _UPDATES or not self._low_params(opt):
            return
        total, pending = 0, []
        for ref in self._low_params(opt):
            p = ref()
            view = _view(p.detach()) if p is not None and total < _SAMPLES else None
            if view is None:
                continue
            n = p.numel()
            offsets = list(range(0, n, max(1, n // _PER_PARAM))[:_PER_PARAM])
            pending.append((ref, offsets, [view[0][i] for i in offsets]))
            total += len(offsets)
        if not pending:
            return
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        self._pending = pending
        self._step = LowPrecisionUpdate(iteration=self._iteration(), optimizer=type(opt).__name__,
                                        dtype=_LOW[pending[0][0]().dtype],
                                        lr=float(lr) if isinstance(lr, (int, float)) else None,
                                        **self._place(self._where()))

    def iteration_ended(self) -> None:
        """The step returned: of the sampled values whose gradient is not zero, which it left as they were."""
        if self._step is None:
            return
        step, pending, self._step, self._pending = self._step, self._pending, None, []
        for ref, offsets, before in pending:
            p = ref()
            view = _view(p.detach()) if p is not None else None
            grad = _view(p.grad.detach()) if view is not None and p.grad is not None else None
            if grad is None or p.grad.numel() != p.numel():
                continue
            (bits, _), (gbits, mask) = view, grad
            moved = [(i, b) for i, b in zip(offsets, before) if gbits[i] & mask]
            same = sum(1 for i, b in moved if bits[i] == b)
            step.params.append(ParamUpdate(key=storage_key(p) or 0, numel=p.numel(), sampled=len(moved),
                                           unchanged=same))
            step.sampled += len(moved)
            step.unchanged += same
        if step.sampled:
            self.record.updates.append(step)

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed, ``guard.py``): the wrappers put back for
        good, the optimizer-step calls do nothing."""
        self.patches.disable()
        self._paired = True
        self.step_began = self.iteration_ended = self.finish = nothing  # type: ignore[method-assign]
        self._pending, self._step = [], None

    def cleared(self, trace: Any) -> None:
        trace.precision = Precision()


def _enabled(scaler: Any) -> bool:
    """Whether a GradScaler scales (a disabled one is a pass-through: ``enabled=False``, or fp32/bf16 runs)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else False


def _place_of(rec: Any) -> dict[str, Any]:
    """The place a record keeps (``line``, ``file``, ``cell_line``, ``function``), as keyword arguments."""
    return {k: getattr(rec, k) for k in ("line", "file", "cell_line", "function")} if rec is not None else {}


def _caller_library(frame: Any) -> str:
    """The library (of ``_DRIVERS``) whose module ``frame`` runs in, else '' (the user's code, or any other).
    Read from the frame's globals: no stack walk, one dictionary read per ``scaler.scale``.

    >>> import sys
    >>> _caller_library(sys._getframe())
    ''
    """
    name = frame.f_globals.get("__name__") if frame is not None else None
    top = name.partition(".")[0] if isinstance(name, str) else ""
    return top if top in _DRIVERS else ""


def _scale_of(scaler: Any) -> float | None:
    """A GradScaler's current scale, read from its CPU storage in place (None: disabled, not made yet, unreadable)."""
    scale = getattr(scaler, "_scale", None) if _enabled(scaler) else None
    return number(scale) if scale is not None else None


__all__ = ["PrecisionWatch"]
