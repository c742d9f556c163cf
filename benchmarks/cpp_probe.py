"""What a C++ first tier would cost: a probe for the plan in RESULTS.md (not part of the product).

The doctor's first tier runs a Python ``TorchDispatchMode``; an empty one already costs
1.15-1.2x on the benchmark workloads, so the 1.25x budget cannot be met from Python.
This probe compiles (``torch.utils.cpp_extension.load_inline``, ~1 minute the first
time, cached after) a ``RecordFunction`` observer that records, for every op and
autograd node, what the first tier records: name, autograd sequence number, scope,
nesting depth, grad mode, start/end time, and for each input and output tensor its
sizes, dtype, device, storage identity, bytes and requires_grad; plus every CPU
allocation and free (live bytes after each op), through the allocator's memory
reporting hook. With ``frames=True`` it also takes the GIL at each top-level forward
op and records the Python call stack (code object and bytecode offset of up to 16
frames), which is what resolving the user's source line needs.

    python benchmarks/cpp_probe.py          # times plain / Python mode / probe on the workloads

It keeps everything in C++ vectors until ``stop()``, which returns counts only: a
probe of the recording cost, not a trace. It needs a C++ compiler and ninja.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

_SRC = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <Python.h>
#include <chrono>
#include <vector>

namespace {

struct TensorRec {
  int64_t sizes[6]; int8_t ndim; int8_t dtype; int8_t device; bool requires_grad;
  const void* storage; int64_t nbytes;
};

struct OpRec {
  const char* name; int64_t seq; int8_t scope; int16_t depth; bool grad_enabled;
  int64_t t0, t1; int64_t live_after; uint32_t first_tensor, n_in, n_out;
  uint32_t first_frame, n_frames;
};

struct State {
  std::vector<OpRec> ops;
  std::vector<TensorRec> tensors;
  std::vector<std::pair<const void*, int>> frames;
  std::vector<size_t> open;  // op index of each RecordFunction still running (nesting)
  int64_t live = 0, peak = 0, allocs = 0;
  bool frames_on = false;
  at::CallbackHandle handle = 0;
};
State* S = nullptr;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

void add_tensor(const at::Tensor& t) {
  TensorRec r{};
  r.ndim = (int8_t)std::min<int64_t>(t.dim(), 6);
  auto sz = t.sizes();
  for (int i = 0; i < r.ndim; ++i) r.sizes[i] = sz[i];
  r.dtype = (int8_t)t.scalar_type();
  r.device = (int8_t)t.device().type();
  r.requires_grad = t.requires_grad();
  if (t.has_storage()) {
    r.storage = t.storage().unsafeGetStorageImpl();
    r.nbytes = (int64_t)t.storage().nbytes();
  }
  S->tensors.push_back(r);
}

uint32_t add_ivalues(c10::ArrayRef<const c10::IValue> vs) {
  uint32_t n = 0;
  for (const auto& v : vs) {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (t.defined()) { add_tensor(t); ++n; }
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) { if (t.defined()) { add_tensor(t); ++n; } }
    }
  }
  return n;
}

void add_frames(OpRec& r) {
  // Only where the GIL can be taken cheaply: a forward op called from Python.
  if (!Py_IsInitialized()) return;
  PyGILState_STATE g = PyGILState_Ensure();
  PyFrameObject* f = PyEval_GetFrame();
  r.first_frame = (uint32_t)S->frames.size();
  int n = 0;
  if (f) Py_INCREF(f);
  while (f && n < 16) {
    PyCodeObject* code = PyFrame_GetCode(f);
    S->frames.emplace_back((const void*)code, PyFrame_GetLasti(f));
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
    ++n;
  }
  if (f) Py_DECREF(f);
  r.n_frames = n;
  PyGILState_Release(g);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!S) return nullptr;
  OpRec r{};
  r.name = fn.name();
  r.seq = fn.seqNr();
  r.scope = (int8_t)fn.scope();
  r.depth = (int16_t)S->open.size();
  r.grad_enabled = at::GradMode::is_enabled();
  r.first_tensor = (uint32_t)S->tensors.size();
  r.n_in = add_ivalues(fn.inputs());
  if (S->frames_on && r.depth == 0 && fn.scope() == at::RecordScope::FUNCTION) add_frames(r);
  r.t0 = now_ns();
  S->open.push_back(S->ops.size());
  S->ops.push_back(r);
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!S || S->open.empty()) return;
  size_t i = S->open.back();
  S->open.pop_back();
  OpRec& r = S->ops[i];
  r.t1 = now_ns();
  // Outputs are appended after later (nested) ops' tensors: remember where they start.
  uint32_t first_out = (uint32_t)S->tensors.size();
  const auto& outs = fn.outputs();
  r.n_out = add_ivalues(c10::ArrayRef<const c10::IValue>(outs.data(), outs.size()));
  (void)first_out;
  r.live_after = S->live;
}

struct Reporter : public c10::MemoryReportingInfoBase {
  void reportMemoryUsage(void*, int64_t size, size_t, size_t, c10::Device) override {
    if (!S) return;
    S->live += size;
    S->allocs += size > 0;
    if (S->live > S->peak) S->peak = S->live;
  }
  bool memoryProfilingEnabled() const override { return S != nullptr; }
};

}  // namespace

void start(bool frames) {
  S = new State();
  S->frames_on = frames;
  S->ops.reserve(1 << 14);
  S->tensors.reserve(1 << 16);
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, std::make_shared<Reporter>());
  S->handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_start, on_end)
          .needsInputs(true)
          .needsOutputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

std::vector<int64_t> stop() {
  at::removeCallback(S->handle);
  c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  int64_t top = 0;
  for (const auto& r : S->ops) top += r.depth == 0;
  std::vector<int64_t> out{(int64_t)S->ops.size(), top, (int64_t)S->tensors.size(),
                           (int64_t)S->frames.size(), S->peak, S->allocs};
  delete S;
  S = nullptr;
  return out;
}
"""

_ext = None


def load():
    """Compile (first call, ~1 min) and import the observer; raises if there is no toolchain."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load_inline

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _ext = load_inline(name="backward_doctor_cpp_probe", cpp_sources=[_SRC],
                               functions=["start", "stop"], extra_cflags=["-O2", "-DNDEBUG"], verbose=False)
    return _ext


def probe(step, frames: bool = False) -> list[int]:
    """Run ``step`` under the observer; returns [callbacks, top-level ops, tensors, frames, peak, allocs]."""
    ext = load()
    ext.start(frames)
    try:
        step()
    finally:
        counts = ext.stop()
    return counts


def main() -> None:
    sys.path[:0] = [os.path.dirname(HERE), HERE]
    from torch.utils._python_dispatch import TorchDispatchMode
    from workloads import WORKLOADS

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    t = time.perf_counter()
    load()
    print(f"# compiled (or loaded) the observer in {time.perf_counter() - t:.1f} s; 1 thread, 15 rounds, medians")
    cell = compile("step()", "<benchmark-cell>", "exec")
    for name, make in WORKLOADS.items():
        step = make()

        def plain(step=step):
            exec(cell, {"step": step})

        def empty(step=step):
            with Empty():
                exec(cell, {"step": step})

        modes = {"plain": plain, "python_mode": empty,
                 "cpp_observer": lambda: probe(plain), "cpp_observer+frames": lambda: probe(plain, frames=True)}
        for fn in modes.values():
            fn()
        times = {m: [] for m in modes}
        for _ in range(15):
            for m, fn in modes.items():
                t = time.perf_counter()
                fn()
                times[m].append(time.perf_counter() - t)
        med = {m: statistics.median(v) for m, v in times.items()}
        counts = probe(plain, frames=True)
        print(f"{name:<12} plain {med['plain'] * 1e3:6.2f} ms  " +
              "  ".join(f"{m} {med[m] / med['plain']:.3f}x" for m in modes if m != "plain") +
              f"  ({counts[0]} callbacks, {counts[1]} top-level, {counts[2]} tensors, {counts[3]} frames)")


if __name__ == "__main__":
    main()
