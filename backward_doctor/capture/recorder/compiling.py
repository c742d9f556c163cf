"""Noticing ``torch.compile`` compiling during a step, so the doctor can step aside while it does.

Dynamo calls its compilation callbacks (``torch._dynamo.callback.callback_handler``) when it starts
and ends compiling a frame or a backward compiled lazily. While it compiles, whatever the doctor
adds would change what gets compiled: global module hooks are traced into the graph (graph breaks,
other kernels), and the ops dynamo and inductor run on fake tensors are not the step's work. The
capture removes its global hooks and pauses its recorder between the two callbacks, and the report
says how many compilations ran and how long they took.

>>> watch = CompileWatch(lambda: None, lambda: None)
>>> watch.install(); watch.remove()
>>> watch.events
[]
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Callable

from ...trace.parts import Compilation
from .dynamo_skip import DoctorSkipped, uncompiled

log = logging.getLogger(__name__)


def _handler() -> Any:
    try:
        from torch._dynamo.callback import callback_handler
    except Exception:  # a torch without dynamo's callbacks: nothing to watch
        log.info("torch.compile's callbacks unavailable: compiled code is not told apart", exc_info=True)
        return None
    return callback_handler


# torch.compile'd modules warn that global module hooks fire an extra time for them: the doctor's
# hooks, which the user did not register and which handle the extra call. Muted during the step only.
_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class CompileWatch:
    """Calls ``on_start``/``on_end`` around each compilation on the installing thread; keeps
    ``events``: one :class:`~backward_doctor.trace.parts.Compilation` per compilation."""

    def __init__(self, on_start: Callable[[], None], on_end: Callable[[], None]) -> None:
        self._on_start, self._on_end = on_start, on_end
        self.events: list[Compilation] = []
        self._thread: int | None = None
        self._t0: float | None = None
        self._installed = False
        self._skipped = DoctorSkipped()  # (the doctor's frames a compiled function calls: never compiled)

    def install(self) -> None:
        handler = _handler()
        if handler is None or self._installed:
            return
        warnings.filterwarnings("ignore", message=_HOOK_WARNING, category=UserWarning)
        self._filter, self._filters = warnings.filters[0], warnings.filters
        self._thread = threading.get_ident()
        handler.register_start_callback(self._start)
        handler.register_end_callback(self._end)
        self._skipped.install()
        self._installed = True

    def remove(self) -> None:
        """Unregister both callbacks (safe to call twice); a compilation still open is closed."""
        if not self._installed:
            return
        self._installed = False
        self._skipped.remove()
        # Exactly our entry, from the list it went into and from the one in place now (a
        # `warnings.catch_warnings()` swaps the list for a copy while it runs): the cell's own filters stay.
        for filters in {id(f): f for f in (self._filters, warnings.filters)}.values():
            while self._filter in filters:
                filters.remove(self._filter)
        try:
            warnings._filters_mutated()
        except AttributeError:
            pass
        handler = _handler()
        for callbacks, fn in ((handler.start_callbacks, self._start), (handler.end_callbacks, self._end)):
            while fn in callbacks:
                callbacks.remove(fn)
        if self._t0 is not None:
            self._end(None)

    def _start(self, args: Any) -> None:
        if threading.get_ident() != self._thread or self._t0 is not None:
            return  # another thread compiling is not this step's
        self._t0 = time.perf_counter()
        self._trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO").lower()
        with uncompiled():  # (called inside a compiled function's frames: what it runs is not dynamo's to trace)
            self._on_start()

    def _end(self, args: Any) -> None:
        if threading.get_ident() != self._thread or self._t0 is None:
            return
        self.events.append(Compilation(trigger=self._trigger, seconds=round(time.perf_counter() - self._t0, 3)))
        self._t0 = None
        with uncompiled():
            self._on_end()
