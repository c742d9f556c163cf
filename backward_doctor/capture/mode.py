"""The private dispatch mode: a thin shim that hands every aten op to a recorder.

Kept separate (as PyTorch does for FlopCounterMode/ModuleTracker) so the public
context manager (:class:`backward_doctor.capture.Capture`) owns all state and the
mode itself owns none.
"""
from __future__ import annotations

from typing import Any, Protocol

from torch._ops import HigherOrderOperator, OpOverload
from torch.utils._python_dispatch import TorchDispatchMode


class _Recorder(Protocol):
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any: ...


class _DoctorMode(TorchDispatchMode):
    """Forwards each op to ``recorder.dispatch``, which must call ``func`` exactly once."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """``torch.compile`` compiles as it would without the doctor (the mode is off while it traces),
        and the compiled code runs compiled, its kernels unseen; the ops it dispatches still come here.
        (False would make dynamo fall back to eager under the mode: other kernels, other results.)"""
        return True

    #: Higher-order operators (``auto_functionalized_v2``: a compiled graph calling a custom op that mutates
    #: its input) come here too, rather than failing with "no rule registered for HigherOrderOperator":
    #: they run as they would without the doctor (torch has popped this mode for the call), unrecorded,
    #: like the compiled code around them.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401 - torch API
        __tracebackhide__ = True  # IPython hides frames that set this: the user's traceback stays theirs
        if type(func) is not OpOverload and isinstance(func, HigherOrderOperator):  # (aten ops: one `is`)
            return func(*args, **(kwargs or {}))
        return self._recorder.dispatch(func, args, kwargs or {})
