"""Always on with the Python recorder: a loop's iterations sampled within the cost budget, as the native
recorder samples them (``loop/sampling.py``, ``loop/choosing.py``).

Where the native recorder is not used (CUDA: it does not see backward on autograd's device threads, see
``docs/gpu-validation.md``), the Python tier recorded every op of every iteration that always on watched: 7-8x
a plain CUDA loop. Asleep, it takes its dispatch mode off torch's stack (``mode.__exit__``, as torch's own
modes leave: torch's flags restored) and its module and parameter hooks out, and puts them back for the
iterations the budget records. What still runs at every step: the optimizer hooks (an iteration's end), the
``backward()`` wrapper (the loss), the loop watch. Asleep on CUDA the watch reads the loss as a number at
``backward()`` (one synchronisation an iteration, which a loop that logs ``loss.item()`` makes anyway), so
that the iteration that goes NaN/Inf keeps its state for the replay, and the memory series is the CUDA
allocator's count (the Python tier's ledger sees only the ops it records; CPU tensors made asleep are not in
that series). Asleep, indices are not checked before kernels launch: an out-of-range index is a device-side
assert, as without the doctor, and the report says so (``%%backward_doctor`` checks every op).

>>> issubclass(SampledCapture, LoopSampling)
True
"""
from __future__ import annotations

from typing import Any

import torch

from .context import Capture
from .loop.sampling import LoopSampling
from .loop.series import LoopWatch, read_scalar
from .loop.choosing import Sampling
from .state import cuda_in_use


def samples_here() -> bool:
    """Whether always on samples with the Python recorder: once the process uses CUDA (elsewhere the native
    recorder samples; where it cannot be built, the Python tier records every op, its ledger the memory count).

    >>> isinstance(samples_here(), bool)
    True
    """
    return cuda_in_use()


def trains_on_cuda(params: list[Any]) -> bool:
    """Whether the step's parameters (those the namespace holds) live on CUDA; none found (a library keeps them
    out of reach) counts as yes. A CPU step in a process that uses CUDA is recorded in full, as before: asleep,
    the Python tier could not count its memory (the CUDA allocator's count is not its).

    >>> trains_on_cuda([torch.zeros(1)]), trains_on_cuda([])
    (False, True)
    """
    return not params or any(p.is_cuda for p in params)


class ModeSwitch:
    """The Python tier's recorder switch for :class:`LoopSampling` (the native recorder's module has the same
    four calls): asleep is the doctor's dispatch mode off torch's stack.

    >>> ModeSwitch(None).set_optimizer_depth(1) is None
    True
    """

    def __init__(self, capture: Any) -> None:
        self._capture = capture
        self._depth = -1  # the dispatch stack's length when the mode was taken off

    def sleep(self) -> bool:
        """Take the mode off, if it is on top (a mode the cell entered above it stays, and so does ours)."""
        mode = self._capture._mode
        n = torch._C._len_torch_dispatch_stack()
        if mode is None or n == 0 or torch._C._get_dispatch_stack_at(n - 1) is not mode:
            return False
        mode.__exit__(None, None, None)
        self._depth = n - 1
        return True

    def can_wake(self) -> bool:
        """Only onto the stack as it was left: above a mode the cell entered since, that mode's own exit would
        pop ours."""
        return self._capture._mode is not None and torch._C._len_torch_dispatch_stack() == self._depth

    def wake(self) -> None:
        self._capture._mode.__enter__()

    def op_count(self) -> int:
        return self._capture._count

    def set_optimizer_depth(self, depth: int) -> None:
        pass  # (the Python tier reads ``_opt_depth`` itself)


def cuda_scalar(t: Any) -> float | None:
    """A one-element tensor's value, CPU or CUDA (CUDA: a synchronisation; the doctor's dispatch mode does not see
    the read).

    >>> cuda_scalar(torch.tensor(2.5)), cuda_scalar(torch.ones(2))
    (2.5, None)
    """
    if t.device.type != "cuda":
        return read_scalar(t)
    if t.numel() != 1 or not t.dtype.is_floating_point:
        return None
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return float(t.detach())


class SampledCapture(LoopSampling, Capture):
    """:class:`Capture` whose loop iterations are sampled by ``sampling`` (always on's :class:`CostBudget`, the
    library callbacks' :class:`PowersOfTwo`)."""

    def __init__(self, *args: Any, sampling: Sampling, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_sampling(sampling)
        self._ext = ModeSwitch(self)

    def _install(self) -> None:
        super()._install()
        self._start_sampling()

    def _make_watch(self) -> LoopWatch:
        """On CUDA: the allocator's live bytes (it counts while the mode is off) and the loss read on the device."""
        # (made once the namespace's parameters are registered: whether this step may sleep at all)
        if not trains_on_cuda([p for p in (r() for r in self._params.values()) if p is not None]):
            self._sampling = None  # (every iteration recorded: the Python tier as it always was)
            return super()._make_watch()
        if not self._cuda:
            return super()._make_watch()
        self.trace.iterations.live_kind = "cuda"
        # (read through the capture: cuda.start installs the cheap reader after the watch is made)
        return LoopWatch(self.trace.iterations, live=lambda: self._cuda_allocated(), scalar=cuda_scalar,
                         on_nonfinite=self._went_nonfinite)

    def _wake(self) -> None:
        if self._ext.can_wake():
            super()._wake()

    def _set_stack(self) -> None:
        pass  # (the Python tier's module stack is read at each op)

    def record_exception(self, exc: BaseException) -> None:
        super().record_exception(exc)
        if self._asleep and "device-side assert" in str(exc):
            self.trace.notes.append(
                "the iteration that failed ran with always on's recorder asleep: indices are checked before the "
                "kernel runs (an out-of-range index raised as an IndexError, the CUDA context alive) only in the "
                "iterations it records. The CUDA context is now unusable: restart the kernel, then run the cell "
                "under `%%backward_doctor`, which checks the indices of every op before it launches")

    def finish(self):
        self._mark_unmarked()
        self._sampling_note()
        return super().finish()


__all__ = ["SampledCapture", "ModeSwitch", "cuda_scalar", "samples_here", "trains_on_cuda"]
