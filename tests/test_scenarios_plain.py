"""Sanity checks of the scenarios themselves, with NO backward_doctor involved.

These prove that every failing scenario really fails the way we claim when
run as a plain ``exec`` (so the findings tests measure the diagnoser, not a
broken scenario), and that every CORRECT step really is correct:

* raising scenarios raise the expected PyTorch exception on the last run
  (and, where the exception is raised at the root-cause line itself, the
  innermost cell / buggy_models.py frame is the expected ``line``);
* nonfinite and silently-broken scenarios satisfy their ``check``;
* oom scenarios: parameters and data fit under ``memory_limit``; every op
  before the one at the expected line together stays under it (counting
  nothing as freed), while the parameters plus that op's output alone
  exceed it, so any sensible accounting of "live tensor bytes" runs out at
  exactly that op;
* hang scenarios are interrupted with SIGALRM after their ``timeout`` (they
  are not left hanging) and must still be stuck at the expected line;
* CORRECT steps run 3 times without error and give finite gradients.
"""

from __future__ import annotations

import collections
import math
import os
import re
import signal
import sys
import time
import traceback

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import scenarios as S

CELL = "<cell>"

# Kinds whose PyTorch exception is raised by the root-cause op itself, so the
# traceback must already point at the expected line.  (inplace-on-saved-tensor
# and no_grad_path raise later, in backward.)
RAISED_AT_ROOT = {"device_mismatch", "dtype_mismatch", "shape_mismatch", "index_out_of_range", "backward_twice",
                  "amp_misuse"}


def run_cell(sc: S.Scenario, ns: dict) -> None:
    exec(compile(sc.source, CELL, "exec"), ns)


def frame_line(frames, file: str | None = None) -> int | None:
    """Line of the innermost of ``frames`` ((filename, lineno), outermost
    first) that lies in ``file``, or in the cell when ``file`` is None."""
    want = os.path.realpath(file) if file else CELL
    lines = [fl for fn, fl in frames if (fn == CELL if want == CELL else os.path.realpath(fn) == want)]
    return lines[-1] if lines else None


def expected_frame_line(sc: S.Scenario, frames) -> int | None:
    """Innermost line in the place ``sc.line`` refers to: buggy_models.py for
    file-side scenarios, the cell otherwise."""
    return frame_line(frames, sc.file)


def tb_frames(exc: BaseException):
    return [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]


def _ids(scs):
    return [s.name for s in scs]


RAISING = [s for s in S.FAILING if s.raises is not None]
CHECKED = [s for s in S.FAILING if s.raises is None and s.kind not in ("oom", "hang")]
OOM = [s for s in S.FAILING if s.kind == "oom"]
HANG = [s for s in S.FAILING if s.kind == "hang"]


# ---------------------------------------------------------------------------
# the catalogue itself
# ---------------------------------------------------------------------------


def test_catalogue_shape():
    names = [s.name for s in S.ALL]
    assert len(names) == len(set(names)), "scenario names must be unique"
    by_kind = collections.Counter(s.kind for s in S.FAILING)
    assert set(by_kind) == set(S.KINDS)
    for kind in S.KINDS:
        assert by_kind[kind] >= 2, kind
        cell_side = [s for s in S.FAILING if s.kind == kind and s.file is None]
        assert cell_side, f"{kind}: needs a scenario whose bug is in the cell"
    # every kind except backward_twice (which always points at the cell's
    # backward() call) has a scenario whose root cause is in buggy_models.py
    for kind in set(S.KINDS) - {"backward_twice"}:
        assert any(s.kind == kind and s.file for s in S.FAILING), kind
    for s in S.FAILING:
        assert (s.raises is None) != (s.kind not in ("oom", "hang") and s.check is None), s.name
        if s.kind == "hang":
            assert 0 < s.kwargs["timeout"] <= 1.5
        if s.kind == "oom":
            assert "memory_limit" in s.kwargs
    assert len(S.CORRECT) >= 8


@pytest.mark.parametrize("sc", S.FAILING, ids=_ids(S.FAILING))
def test_expected_location_is_real_code(sc):
    assert sc.runs >= 1
    if sc.file is None:
        lines = sc.source.splitlines()
        assert 1 <= sc.line <= len(lines)
        assert lines[sc.line - 1].strip() and S.ROOT_MARKER in lines[sc.line - 1]
    else:
        assert os.path.isabs(sc.file) and os.path.exists(sc.file)
        with open(sc.file, encoding="utf-8") as fh:
            text = fh.read().splitlines()[sc.line - 1]
        assert "# BUG:" in text
    if sc.module is not None:
        assert re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", sc.module)
        root = sc.module.split(".")[0]
        assert isinstance(sc.setup()[root], nn.Module), f"{root} must be a module in the namespace"


def test_setup_is_deterministic():
    """Two setups give bit-identical parameters (needed by the bit-identical test)."""
    for sc in S.CORRECT:
        a, b = sc.setup(), sc.setup()
        pa, pb = dict(S.module_params(a)), dict(S.module_params(b))
        assert pa.keys() == pb.keys()
        for k in pa:
            assert torch.equal(pa[k], pb[k]), (sc.name, k)


# ---------------------------------------------------------------------------
# failing scenarios, plain
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sc", RAISING, ids=_ids(RAISING))
def test_failing_scenario_raises(sc):
    ns = sc.setup()
    for _ in range(sc.runs - 1):
        run_cell(sc, ns)  # earlier runs must succeed
    exc_type, fragment = sc.raises
    with pytest.raises(exc_type, match=re.escape(fragment)) as info:
        run_cell(sc, ns)
    if sc.kind in RAISED_AT_ROOT or sc.raises is S.LEAF_INPLACE:
        assert expected_frame_line(sc, tb_frames(info.value)) == sc.line


@pytest.mark.parametrize("sc", CHECKED, ids=_ids(CHECKED))
def test_silent_scenario_is_really_broken(sc):
    ns = sc.setup()
    for _ in range(sc.runs):
        run_cell(sc, ns)  # raises nothing ...
    assert sc.check is not None
    assert sc.check(ns)  # ... but the step is broken


@pytest.mark.parametrize("sc", [s for s in S.FAILING if s.mentions], ids=lambda s: s.name)
def test_nonfinite_input_variable_is_nonfinite_before_the_step(sc):
    ns = sc.setup()
    for name in sc.mentions:
        assert not torch.isfinite(ns[name]).all(), name


# ---------------------------------------------------------------------------
# oom: where would a simulated device of ``memory_limit`` bytes run out?
# ---------------------------------------------------------------------------


def limit_bounds(limit) -> tuple[float, float]:
    """(smallest, largest) byte count the limit can mean ("12MB": 10**6 or 2**20 based)."""
    if isinstance(limit, int):
        return limit, limit
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B\s*", limit, re.I)
    assert m, limit
    n, prefix, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(prefix) + 1 if prefix else 0
    dec, bin_ = n * 1000**power, n * 1024**power
    return (bin_, bin_) if binary else (min(dec, bin_), max(dec, bin_))


def _storages(value, out: dict, depth=0):
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            st = value.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    elif isinstance(value, nn.Module):
        for t in list(value.parameters()) + list(value.buffers()):
            _storages(t, out)
    elif isinstance(value, torch.optim.Optimizer):
        for state in value.state.values():
            _storages(state, out, depth + 1)
    elif isinstance(value, (list, tuple, dict)) and depth < 2:
        for v in value.values() if isinstance(value, dict) else value:
            _storages(v, out, depth + 1)
    return out


class _AllocationTrace(TorchDispatchMode):
    """Records, per dispatched op, the bytes of storages it newly created and
    the (file, line) stack it ran under.  Never frees anything: the running
    sum is an upper bound of live bytes."""

    def __init__(self, known: dict):
        super().__init__()
        self.known = set(known)
        self.ops = []  # (name, new_bytes, frames)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = 0
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in self.known and st.nbytes():
                    self.known.add(st.data_ptr())
                    new += st.nbytes()
        frames, f = [], sys._getframe()
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno))
            f = f.f_back
        self.ops.append((func._schema.name, new, frames[::-1]))
        return out


@pytest.mark.parametrize("sc", OOM, ids=_ids(OOM))
def test_oom_scenario_crosses_limit_at_expected_line(sc):
    lo, hi = limit_bounds(sc.kwargs["memory_limit"])
    ns = sc.setup()
    baseline = sum(_storages(list(ns.values()), {}).values())  # params, buffers, data, optimizer state
    params = sum(_storages([v for v in ns.values() if isinstance(v, nn.Module)], {}).values())
    assert baseline < lo, f"parameters + data ({baseline} B) must fit under the limit"
    trace = _AllocationTrace(_storages(list(ns.values()), {}))
    with trace:
        run_cell(sc, ns)  # runs fine without a limit
    running = baseline  # upper bound of live bytes: nothing is ever freed
    for name, new, frames in trace.ops:
        if running + new >= lo:  # the first op that *could* cross the limit ...
            # ... surely crosses: the parameters plus its own output are over the limit
            assert params + new > hi, f"{name}: params {params} B + output {new} B must exceed the limit"
            assert expected_frame_line(sc, frames) == sc.line, name
            break
        running += new
    else:
        pytest.fail(f"never crossed: total {running} B")


# ---------------------------------------------------------------------------
# hang: interrupt after ``timeout`` and look where the main thread is stuck
# ---------------------------------------------------------------------------


class _Alarm(BaseException):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
@pytest.mark.parametrize("sc", HANG, ids=_ids(HANG))
def test_hang_scenario_is_stuck_at_expected_line(sc):
    timeout = sc.kwargs["timeout"]
    ns = sc.setup()
    code = compile(sc.source, CELL, "exec")
    old = signal.signal(signal.SIGALRM, _raise_alarm)
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            exec(code, ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Alarm as exc:
        frames = tb_frames(exc)
    else:
        pytest.fail("the cell finished: it does not hang")
    finally:
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 >= timeout * 0.9
    assert expected_frame_line(sc, frames) == sc.line


# ---------------------------------------------------------------------------
# correct steps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sc", S.CORRECT, ids=_ids(S.CORRECT))
def test_correct_scenario_runs_and_has_finite_grads(sc):
    ns = sc.setup()
    for _ in range(3):
        run_cell(sc, ns)
        grads = [(name, p.grad) for name, p in S.module_params(ns) if p.requires_grad]
        assert any(g is not None for _, g in grads), "no parameter got a gradient"
        for name, g in grads:
            assert g is None or torch.isfinite(g).all(), name
        loss = ns.get("loss")
        assert isinstance(loss, torch.Tensor) and math.isfinite(loss.item())


# ---------------------------------------------------------------------------
# nonfinite: where does the first non-finite value appear?
# ---------------------------------------------------------------------------


def _nonfinite(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())


class _FirstNonFinite(TorchDispatchMode):
    """Remembers the first op whose output holds NaN/Inf: its name, whether
    any of its inputs already did, and the (file, line) stack."""

    def __init__(self):
        super().__init__()
        self.first = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None and any(_nonfinite(t) for t in tree_leaves(out)):
            inputs_bad = any(_nonfinite(t) for t in tree_leaves((args, kwargs or {})))
            frames, f = [], sys._getframe()
            while f is not None:
                frames.append((f.f_code.co_filename, f.f_lineno))
                f = f.f_back
            self.first = (func._schema.name, inputs_bad, frames[::-1])
        return out


NONFINITE = [s for s in S.FAILING if s.kind == "nonfinite"]


@pytest.mark.parametrize("sc", NONFINITE, ids=_ids(NONFINITE))
def test_nonfinite_first_bad_value(sc):
    """Forward-made NaN/Inf: the first op producing it (from finite inputs) is
    ``op`` at ``line``.  Bad input data: the first op producing a non-finite
    output already had a non-finite input, at ``line``.  Backward-only: the
    forward stays finite and the first non-finite value is made during
    ``backward()``, while ``op`` did run at ``line`` in the forward."""
    ns = sc.setup()
    mode = _FirstNonFinite()
    with mode:
        run_cell(sc, ns)
    assert mode.first is not None
    name, inputs_bad, frames = mode.first
    if sc.mentions:  # non-finite input data
        assert inputs_bad, name
        assert expected_frame_line(sc, frames) == sc.line
    elif "backward_only" in sc.name:
        backward_line = S.cell_line(sc.source, "backward()")
        assert frame_line(frames) == backward_line
        assert not inputs_bad
    else:
        assert not inputs_bad, name
        assert name == sc.op
        assert expected_frame_line(sc, frames) == sc.line
