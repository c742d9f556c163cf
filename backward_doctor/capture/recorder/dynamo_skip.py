"""The doctor's own code is never compiled by ``torch.compile`` (while a capture is installed).

A compiled *function* keeps dynamo's frame hook on for every frame it calls, to its end: a training step compiled
as a whole (``torch.compile(train_step)``) calls ``backward()``, ``scaler.step`` and the optimizer from its
resumed frames after each graph break, and with them the doctor's wrappers and hooks, whose frames dynamo would
then trace and compile as if they were the user's. One of them is the compile watch's own end callback: dynamo
compiling it from inside its callback handler waits on the handler's lock forever (a compiled step function that
compiled its backward lazily hung). The package's directory is put on dynamo's list of skipped directories for the
run (its frames run as plain Python, as torch's own do) and taken off again afterwards; and the compile callbacks
run with dynamo's frame hook off (:func:`uncompiled`), since torch's own functions they call (the optimizer's hook
registry) are ones dynamo traces.

>>> skip = DoctorSkipped(); skip.install(); skip.remove(); skip.remove()
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

log = logging.getLogger(__name__)

#: the package's directory, as dynamo matches a file against it (a prefix of the code's file name)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # backward_doctor/


def _rules() -> Any:
    try:
        from torch._dynamo import trace_rules
    except Exception:  # noqa: BLE001 - a torch without dynamo: nothing compiles the doctor's frames
        return None
    if not isinstance(getattr(trace_rules, "SKIP_DIRS", None), list) or not callable(
            getattr(trace_rules, "_recompile_re", None)):
        log.info("torch._dynamo.trace_rules has no SKIP_DIRS: the doctor's frames are not kept out of torch.compile")
        return None
    return trace_rules


class DoctorSkipped:
    """Adds the package's directory to ``trace_rules.SKIP_DIRS`` on :meth:`install` (unless it is there already)
    and removes exactly that entry on :meth:`remove` (safe to call twice), the matching regex put back as it was."""

    def __init__(self) -> None:
        self._added = False
        self._prior: tuple[Any, tuple[str, ...]] | None = None

    def install(self) -> None:
        rules = _rules()
        if rules is None or self._added or _PACKAGE in rules.SKIP_DIRS:
            return
        dirs = tuple(rules.SKIP_DIRS)
        self._prior = (rules.SKIP_DIRS_RE, dirs)
        rules.SKIP_DIRS.append(_PACKAGE)
        self._added = True
        # (torch rebuilds the regex from every directory, each made a posix path: ~0.6 ms, twice a run; the same
        # list gives the same regex, so a process builds it once)
        regex = _REGEXES.get(dirs)
        if regex is None:
            rules._recompile_re()
            _REGEXES.clear()
            _REGEXES[dirs] = rules.SKIP_DIRS_RE
        else:
            rules.SKIP_DIRS_RE = regex

    def remove(self) -> None:
        if not self._added:
            return
        self._added = False
        rules = _rules()
        if rules is not None and _PACKAGE in rules.SKIP_DIRS:
            rules.SKIP_DIRS.remove(_PACKAGE)
            prior, dirs = self._prior or (None, None)
            if prior is not None and tuple(rules.SKIP_DIRS) == dirs:
                rules.SKIP_DIRS_RE = prior  # (the regex object that was there: nobody changed the list meanwhile)
            else:
                rules._recompile_re()
        self._prior = None


#: the regex with the package's directory, by the list it was added to (one entry: the list seldom changes)
_REGEXES: dict[tuple[str, ...], Any] = {}


@contextlib.contextmanager
def uncompiled() -> Iterator[None]:
    """Dynamo's frame hook off in this thread for the block (what ``torch._dynamo.disable`` does around a call),
    the hook in place before put back after it.

    >>> with uncompiled():
    ...     pass
    """
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except Exception:  # noqa: BLE001 - no dynamo: nothing to switch off
        yield
        return
    prior = set_eval_frame(None)
    try:
        yield
    finally:
        set_eval_frame(prior)


__all__ = ["DoctorSkipped", "uncompiled"]
