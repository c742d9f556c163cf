"""Closing a capture: the exception as evidence, names for modules, what NaN reached.

Split from ``capture.py`` so the per-op hot path stays in one short module.
"""
from __future__ import annotations

import dis
import inspect
import os
from array import array
from typing import TYPE_CHECKING

import torch
from torch import nn

from .excerpts import keep_excerpts, trace_places
from ..recorder.memory import grad_of, shape_of, storage_events, storage_key
from ..namespace import module_paths
from ..state import PHASES, REC_WIDTH
from ..namespace import tensors as ns_tensors
from ...util.process import doctors_own
from ..recorder.stats import screen_nonfinite
from ..recorder.stats import dtype_name
from ...trace.queries import skipped_amp_steps
from ...trace.parts import STORAGE_EVENTS_CAP, LossInfo, NonFiniteScalar, ParameterTotals, RunHistory
from ...trace.records import CATEGORIES, ExceptionInfo, OpRecord, TensorMeta, Trace
from ...util.units import allocator_request

if TYPE_CHECKING:
    from ..recorder.record import OpRecorder

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_sequence_nr = torch._C._autograd._get_sequence_nr


_RAISE = dis.opmap["RAISE_VARARGS"]


def raised_by_code(exc: BaseException) -> bool:
    """``exc`` came from a ``raise`` statement (its innermost frame stopped at one), not from a signal: a
    signal's exception (Ctrl-C's ``KeyboardInterrupt``, a handler's) is raised wherever the interpreter
    checked for signals, which is never a ``raise``.

    >>> try:
    ...     raise KeyboardInterrupt
    ... except KeyboardInterrupt as e:
    ...     raised_by_code(e)
    True
    """
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code.co_code
    return 0 <= tb.tb_lasti < len(code) and code[tb.tb_lasti] == _RAISE


def record_exception(cap: "OpRecorder", exc: BaseException) -> None:
    frames = cap._frames.from_traceback(exc.__traceback__)
    info = ExceptionInfo(type=type(exc).__name__, message=str(exc).strip(), frames=frames)
    info.where = cap._frames.where_in(frames)
    modules: list[int] = []
    eval_mode = False
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        in_torch = os.path.abspath(code.co_filename).startswith(_TORCH_DIR)
        if code.co_name in ("_engine_run_backward", "run_backward") or (in_torch and code.co_name == "backward"):
            info.in_backward = True
        if code.co_flags & inspect.CO_OPTIMIZED:  # a function frame: f_locals is a snapshot
            local_vars = frame.f_locals
            owner = local_vars.get("self")
            if type(local_vars) is dict:
                # Before 3.13 the snapshot stays cached on the frame, and frame.clear() (IPython
                # after an OOM) does not empty it: drop our copy of the user's locals now.
                local_vars.clear()
            del local_vars
            if isinstance(owner, nn.Module):
                cap._register_module(owner)
                if not modules:  # the outermost module the step was in: evaluating (eval mode) or training
                    eval_mode = not owner.training
                modules.append(id(owner))
            elif isinstance(owner, torch.Tensor) and in_torch and code.co_name == "backward" and info.loss is None:
                key = storage_key(owner)
                info.loss = LossInfo(shape=list(shape_of(owner)), requires_grad=bool(owner.requires_grad),
                                     grad_fn=type(owner.grad_fn).__name__ if owner.grad_fn is not None else None,
                                     key=key or 0, writer=cap._writer.get(key) if key else None)
        del frame
        tb = tb.tb_next
    if modules:
        cap._where_stacks.append((info.where, tuple(modules)))
    if isinstance(exc, torch.OutOfMemoryError):
        # (asleep, always on's sampling: no recorded op ran out; the allocator's message says what was asked for)
        info.oom = cap._oom or cap._memory_breakdown(None if cap._asleep else cap._count, allocator_request(str(exc)))
        info.oom.eval_mode = eval_mode
    info.raised = raised_by_code(exc)
    cap.trace.exception = info
    cap.trace.completed = False
    if cap._t_last > cap._t0 and not isinstance(exc, KeyboardInterrupt):
        # The step ended at its last op; IPython's traceback rendering after it is not the step's time.
        cap.trace.duration_s = cap._t_last - cap._t0


def _resolve_modules(cap: "OpRecorder") -> None:
    paths = module_paths(cap.namespace)
    cache: dict[tuple[int, ...], str] = {}
    for where, stack in cap._where_stacks:
        name = cache.get(stack)
        if name is None:
            inner = stack[-1]
            name = paths.get(inner)
            if name is None:
                name = cap._modules.get(inner, (None, "module"))[1]
            cache[stack] = name
        where.module = name
    oom = cap.trace.exception.oom if cap.trace.exception else None
    if oom is not None and cap._oom_producers is not None:
        by_module: dict[str, int] = {}
        producers, cap._oom_producers = cap._oom_producers, None
        for producer, nbytes in producers.items():
            rec = cap.trace.op(producer) if producer >= 0 else None
            label = (rec.where.module or "(outside modules)") if rec else "(existing before the step)"
            if rec and rec.phase == "backward":
                label = "(gradients in backward)"
            by_module[label] = by_module.get(label, 0) + nbytes
        oom.by_module = dict(sorted(by_module.items(), key=lambda kv: -kv[1]))


def _timeline(cap: "OpRecorder") -> None:
    mem = cap.trace.memory
    index, totals = cap._timeline.samples()
    mem.op_index = index
    mem.by_category = {c: [t[i] for t in totals] for i, c in enumerate(CATEGORIES)}
    mem.peak_bytes, mem.peak_index, mem.peak_by_category = cap._peak, cap._peak_index, cap._peak_by_category
    log, dropped = cap._storage_log or (cap._ledger.log, cap._ledger.dropped)
    mem.storages = storage_events(log if log is not None else array("q"), dropped)
    if dropped:
        cap.trace.notes.append(f"memory history: the first {STORAGE_EVENTS_CAP} storage events are kept for "
                               f"exports (memory_viz), {dropped} later ones are not")
    if cap._timeline.stride > 1:
        cap.trace.notes.append(f"memory timeline: one point per {cap._timeline.stride} ops "
                               f"({len(index)} points for {cap._count} ops; peaks kept)")


_DEVICES: dict[torch.device, str] = {}


def _meta(m: tuple, shared: dict[tuple, TensorMeta]) -> TensorMeta:
    # Steps repeat a few shapes thousands of times: records share one TensorMeta per
    # distinct (shape, dtype, device, requires_grad), which keeps long traces small.
    got = shared.get(m)
    if got is None:
        shape, dtype, device, requires_grad = m
        dev = _DEVICES.get(device)
        if dev is None:
            dev = _DEVICES[device] = str(device)
        got = shared[m] = TensorMeta(list(shape), dtype_name(dtype), dev, requires_grad)
    return got


def _build_ops(cap: "OpRecorder") -> None:
    """Turn the compact per-op records into :class:`OpRecord` (once, after the step)."""
    trace = cap.trace
    ops = trace.ops
    shared: dict[tuple, TensorMeta] = {}
    metas = [_meta(m, shared) for m in cap._metas]  # by meta id
    names, wheres = cap._names, cap._wheres
    ints, io, us, t0s = cap._rec_ints, cap._rec_io, cap._rec_us, cap._rec_t0
    for r in range(cap._n_kept):  # the flat arrays read directly (kept_records() makes tuples per op)
        (index, name_id, phase, fwd, grad, where_id, n_in, n_out, off,
         live) = ints[r * REC_WIDTH:(r + 1) * REC_WIDTH]
        pairs = io[off:off + 2 * (n_in + n_out)]
        mids, keys = pairs[0::2], pairs[1::2]
        ops.append(OpRecord(index, names[name_id], PHASES[phase], [metas[m] for m in mids[:n_in]],
                            [metas[m] for m in mids[n_in:]], wheres[where_id], None if fwd < 0 else fwd,
                            us[r], bool(grad), keys[:n_in].tolist(), keys[n_in:].tolist(), live, t0s[r]))
    for (index, name, phase, fwd, grad, where, ins, outs, live, t), start in zip(cap.tail_records(), cap._tail_t0):
        ops.append(OpRecord(index=index, op=name, phase=phase, inputs=[_meta(m, shared) for m, _ in ins],
                            outputs=[_meta(m, shared) for m, _ in outs], where=where, fwd_index=fwd,
                            duration_us=t, grad_enabled=grad, in_keys=[k for _, k in ins],
                            out_keys=[k for _, k in outs], live_bytes=live, start_us=start))
    _cuda_seen(cap, metas)
    cap._rec_ints, cap._rec_io, cap._rec_us, cap._tail, cap._rec_t0 = None, None, None, None, None
    cap._n_kept = 0
    cap._metas, cap._meta_ids = [], {}
    trace.op_count = cap._count
    trace.op_totals = cap._op_totals


def _cuda_seen(cap: "OpRecorder", metas: list[TensorMeta]) -> None:
    """A step that first used the GPU inside the cell (no CUDA context when it began, so none of the allocator's
    figures were taken): the trace names the device its ops ran on and says what was not recorded."""
    if cap._cuda:
        return
    device = next((m.device for m in metas if m.device.startswith("cuda")), None)
    if device is not None:
        cap.trace.device = device if ":" in device else f"{device}:0"
        cap.trace.notes.append("CUDA was first used inside this cell: the allocator's figures, its memory history and "
                               "NVML's view were not recorded for it (they are from the next run on)")


def _step_keys(trace: Trace) -> set[int]:
    """Storages this step's recorded ops read or wrote."""
    keys: set[int] = set()
    for op in trace.ops:
        keys.update(op.in_keys)
        keys.update(op.out_keys)
    keys.discard(0)
    return keys


def _final_tensors(cap: "OpRecorder") -> list[tuple[torch.Tensor, str]]:
    """What this step leaves behind that NaN/Inf must not reach: the parameters it used or updated and
    the gradients it made, and the gradients of the cell's own leaf tensors. Only what the step touched:
    NaN an earlier cell left on another model is not this step's doing."""
    touched = _step_keys(cap.trace)
    got_grad, stepped = cap._got_grad, cap._stepped_params
    out = []
    params = {id(p): p for p in cap.parameters()}
    try:  # (the weights of steps the recorder slept through: an optimizer the namespace need not hold)
        for ref in cap._stepped_opts.values():
            opt = ref()
            for p in (p for g in (opt.param_groups if opt is not None else ()) for p in g["params"]):
                params.setdefault(id(p), p)
                stepped.add(id(p))
    except Exception as exc:  # (param_groups of the user's that cannot be read: checked as far as they were)
        if not doctors_own(exc):
            raise
    for p in params.values():
        if storage_key(p) in touched or id(p) in got_grad or id(p) in stepped:
            out.append((p, "parameters"))
        g = grad_of(p)
        if g is not None and (id(p) in got_grad or storage_key(g) in touched):
            out.append((g, "gradients"))
    for name, t in ns_tensors(cap.namespace):
        if cap.elsewhere.leaves(name):  # (another thread may write its .grad now: not read, ``elsewhere.py``)
            continue
        if t.is_leaf and t.grad is not None and storage_key(t.grad) in touched:
            out.append((t.grad, "gradients"))
    return out


def _nonfinite_reach(cap: "OpRecorder") -> None:
    """Which NaN/Inf origins reached the loss, a gradient or a parameter (the others were intended,
    like the ``-inf`` of a mask that softmax turns into zeros, also when checkpointing recomputes it in
    backward)."""
    trace = cap.trace
    reached: set[int] = set()
    flags = {"loss": False, "gradients": False, "parameters": False}
    for root in cap._roots:
        if root is not None and root in cap._nf_by_index:
            reached.add(cap._nf_by_index[root])
            flags["loss"] = True
    with torch.no_grad():
        finals = [(t, what) for t, what in _final_tensors(cap) if screen_nonfinite(t)]
    for t, what in finals:
        flags[what] = True
        key = storage_key(t)
        if key in cap._nf_origin:
            reached.add(cap._nf_origin[key])
    del finals
    if flags["gradients"] and not reached:
        # Non-finite gradients whose storage the screen did not follow: every origin in backward is a suspect.
        reached.update(ev.origin for ev in trace.nonfinite if ev.phase == "backward")
    for ev in trace.nonfinite:
        ev.reached = ev.origin in reached
    trace.nonfinite_reached = flags
    if not cap.detail:
        hint = _scalar_that_mattered(cap)
        if hint is not None or flags["gradients"] or flags["parameters"]:
            # The first tier saw NaN/Inf but screened too little to say where it was born.
            trace.needs_detail = "nonfinite"
            trace.nonfinite_hint = hint or next(iter(cap._nf_scalars.values()), None)
            if hint is not None:
                flags["loss"] = True


def _scalar_that_mattered(cap: "OpRecorder") -> NonFiniteScalar | None:
    """First tier: the NaN/Inf scalar that was a loss backward started from, or that the cell kept in a
    variable (None when every one was an intermediate value, like a mask's ``-inf``)."""
    flagged = cap._nf_scalars
    if not flagged:
        return None
    for root in cap._roots:
        if root in flagged:
            return flagged[root]
    for _, t in ns_tensors(cap.namespace):
        writer = cap._writer.get(storage_key(t) or 0)
        if writer in flagged:
            return flagged[writer]
    return None


def _remember(cap: "OpRecorder") -> None:
    """Add this run to the cell's history and copy the history's numbers into the trace."""
    from ..history import RunSummary

    trace = cap.trace
    exc = trace.exception

    cap.history.add(RunSummary(run_id=cap._run_id, live_bytes_end=cap._ledger.total,
                               seq_start=cap._seq_start, seq_end=_sequence_nr(),
                               stepped=bool(trace.optimizer_steps), amp_skipped=len(skipped_amp_steps(trace)),
                               exception=exc.type if exc else None))
    runs = cap.history.runs
    trace.history = RunHistory(runs=len(runs), live_bytes_end=cap.history.live_bytes(),
                               run_ids=[r.run_id for r in runs], amp_skipped=[r.amp_skipped for r in runs])


def _compiled_notes(trace: Trace) -> None:
    """torch.compile in the step: compiled regions are summed up as regions (their fused kernels are not
    seen one by one), and compilation time is said apart from the step's ops."""
    regions: dict[tuple[str, str | None, int | None], int] = {}
    for op in trace.ops:
        if op.where.compiled:
            key = (op.phase, op.where.module, op.where.cell_line or op.where.line)
            regions[key] = regions.get(key, 0) + 1
    if regions:
        parts = [f"{phase} of {module or 'a compiled function'}"
                 f"{f' (line {line})' if line and phase == 'forward' else ''}: {n} ops dispatched"
                 for (phase, module, line), n in regions.items()]
        trace.notes.append("torch.compile: compiled code ran compiled (" + "; ".join(parts) + "); its fused "
                           "kernels are not seen one by one, so memory and NaN/Inf inside them are seen only "
                           "at the region's edges")
    if trace.compiles:
        total = sum(c.seconds for c in trace.compiles)
        trace.notes.append(f"torch.compile compiled {len(trace.compiles)} time(s) during this step ({total:.1f} s); "
                           "the doctor stepped aside while it compiled (not part of the op trace)")


def finish(cap: "OpRecorder") -> Trace:
    trace = cap.trace
    tail = len(cap._tail)
    trace.ops_dropped = cap._tail_count - tail
    _build_ops(cap)
    if trace.ops_dropped:
        kept = f"the first {cap._max_ops} and the last {tail}" if tail else f"the first {cap._max_ops}"
        trace.notes.append(f"{trace.ops_dropped} ops {'in the middle of' if tail else 'later in'} the step are "
                           f"only counted in the op totals (kept {kept} one by one)")
    _resolve_modules(cap)
    modes = getattr(cap, "_modes", None)  # (each model's train()/eval() at its first calls: capture/recorder/module_modes.py)
    trace.module_modes = modes.resolve(module_paths(cap.namespace)) if modes is not None else []
    _compiled_notes(trace)
    _timeline(cap)
    _nonfinite_reach(cap)
    from .step_state import graph_holders, param_infos
    from .ties import untied_weights

    trace.params = param_infos(cap)
    trace.untied_weights = untied_weights(cap)  # (ties a model declares, read once: ``end/ties.py``)
    if trace.iterations.first_nonfinite is not None:  # a loop that went NaN/Inf: where its learning rate was set
        from ..loop.trainers import locate_lr

        trace.iterations.lr_set = locate_lr(trace, cap.namespace, cap._frames.is_user)
    if trace.precision.updates:  # steps on bf16/fp16 weights: the line that made them so, from the sources
        from .weight_casts import locate_cast

        try:  # (reading the user's sources is an extra: it never costs the report)
            trace.precision.cast = locate_cast(trace, cap.namespace, cap._frames.is_user)
        except Exception as e:  # noqa: BLE001
            trace.notes.append(f"where the weights were made {trace.precision.updates[0].dtype} was not read: "
                               f"{type(e).__name__}")
    trace.graph_holders = graph_holders(cap)
    if cap.history is not None:
        _remember(cap)
    params = cap.parameters()
    trace.parameters = ParameterTotals(count=len(params), trainable=sum(bool(p.requires_grad) for p in params),
                                       bytes=sum(p.numel() * p.element_size() for p in params))
    del params
    keep_excerpts(trace, trace_places(trace))  # the source a report shows, copied now (never read later)
    cap._ledger.close()
    cap._where_stacks.clear()
    return trace
