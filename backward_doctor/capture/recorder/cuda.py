"""CUDA extras, used only when a GPU is present: allocator figures, memory history, NVML.

Everything here is feature-detected; on a CPU-only machine no function is called.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .record import OpRecorder

log = logging.getLogger(__name__)

_HISTORY_ENTRIES = 100_000  # bounded: the allocator keeps at most this many events
#: the allocator's history is kept in the trace (for the memory_viz export) up to this many pickled bytes
_SNAPSHOT_BYTES = 16 << 20


def _nvml() -> dict[str, Any] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            return {"total": int(mem.total), "used": int(mem.used), "gpu_util": int(util.gpu),
                    "processes": [{"pid": p.pid, "used": int(p.usedGpuMemory or 0)} for p in procs]}
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing or not permitted: say so, do not fail
        return {"error": f"{type(exc).__name__}: {exc}"}


def allocated_reader() -> Callable[[], int]:
    """``torch.cuda.memory_allocated()`` of the current device, without its cost. That function flattens and sorts
    every allocator statistic into a dict to return one number: 71 us a call on an H200's host (9.7 us read
    here), and read after every op it made the Python tier about twice as slow per op on CUDA
    (``benchmarks/gpu_validation.py``). The allocator's nested statistics are read directly instead, where this
    torch has the binding.

    >>> callable(allocated_reader())
    True
    """
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None or not torch.cuda.is_available():
        return torch.cuda.memory_allocated
    device = torch.cuda.current_device()

    def allocated() -> int:
        return stats(device)["allocated_bytes"]["all"]["current"]

    return allocated


def start(cap: "OpRecorder") -> None:
    torch.cuda.reset_peak_memory_stats()
    cap._cuda_allocated = allocated_reader()
    cap._cuda_history = False
    if cap._cuda_history_wanted:
        try:
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES, stacks="python")
            cap._cuda_history = True
        except Exception:
            log.info("CUDA memory history unavailable", exc_info=True)
    cap.trace.memory.device_total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _allocator_snapshot() -> str | None:
    """The allocator's own snapshot and history of the step (``torch.cuda.memory._snapshot()``), pickled as
    PyTorch's ``_dump_snapshot`` writes it, base64 for the JSON report; None when larger than the bound."""
    import base64
    import pickle

    try:
        data = pickle.dumps(torch.cuda.memory._snapshot(), protocol=4)
    except Exception:  # an allocator without history (another backend): the ledger's snapshot is exported
        log.info("CUDA allocator snapshot unavailable", exc_info=True)
        return None
    return base64.b64encode(data).decode("ascii") if len(data) <= _SNAPSHOT_BYTES else None


def stop(cap: "OpRecorder") -> None:
    snapshot = _allocator_snapshot() if getattr(cap, "_cuda_history", False) else None
    if getattr(cap, "_cuda_history", False):
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:
            log.warning("CUDA memory history could not be switched off", exc_info=True)
    cap.trace.device = f"cuda:{torch.cuda.current_device()}"
    cap.trace.memory.cuda = {
        "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
        "allocated_per_op": cap._cuda_alloc.tolist()[-20_000:], "nvml": _nvml(),
    }
    if snapshot is not None:
        cap.trace.memory.cuda["allocator_snapshot"] = snapshot
