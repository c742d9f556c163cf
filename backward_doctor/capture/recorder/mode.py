"""The private dispatch mode: a thin shim that hands every aten op to a recorder.

Kept separate (as PyTorch does for FlopCounterMode/ModuleTracker) so the public
context manager (:class:`backward_doctor.capture.Capture`) owns all state and the
mode itself owns none.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

_FLAGS = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
          "old_without_ignore_compile_internals_dispatch_mode_flags")


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


def take_off(mode: TorchDispatchMode) -> list[str]:
    """Take ``mode`` off torch's dispatch-mode stack wherever it is; returns the class names of the modes
    above it, which stay on in their order (a mode the cell entered and never left: the cell's own, it
    stays). ``mode.__exit__`` would pop the top of the stack, the cell's mode, and leave the doctor's on
    for good.

    >>> class M(TorchDispatchMode):
    ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    ...         return func(*args, **(kwargs or {}))
    >>> ours, theirs = M(), M()
    >>> _ = ours.__enter__(); _ = theirs.__enter__()
    >>> take_off(ours), torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1) is theirs
    (['M'], True)
    >>> theirs.__exit__(None, None, None); torch._C._len_torch_dispatch_stack()
    0
    """
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    if not any(m is mode for m in stack):
        return []
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return []
    above = []
    while True:
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    # The mode just above took its "was a mode on before me" flags from this one's being on: hand it what
    # was there before this one (torch restores those flags when that mode exits), and drop this one's.
    for name in _FLAGS:
        ours, theirs = getattr(mode, name, None), getattr(above[-1], name, None)
        if ours and theirs:
            theirs[-1] = ours.pop()
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)
    return [type(m).__name__ for m in reversed(above)]
