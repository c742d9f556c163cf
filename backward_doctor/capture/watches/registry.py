"""The training watches, registered in one ordered list, and the capture's one way of telling them what happens.

A watch follows the training beyond the ops: the loop's series, the ``backward()`` and ``zero_grad()`` calls per
optimizer step, the GradScaler and clipping, the learning-rate schedulers, the frozen parameters. It is made for
one run by its factory (:func:`register`), from a :class:`WatchContext` (the trace it writes into, the run's
counters and guards), and declares in ``events`` which of the loop's events it listens to; the capture tells the
events to :class:`Watches` (``capture.watches.step_began(opt, args, kwargs)``), never to a watch by name, and a
watch reads no other watch's fields nor the capture's: what one says to another goes through an event too (a
GradScaler's skipped step, :meth:`WatchContext.tell`).

The events, in the order of a step (the method a listening watch defines has the event's name):

* ``backward_began(loss) -> bool``: ``backward()`` is about to run (any thread); True when it is the loss's own
  (this run's thread, not a reentrant checkpoint's inner ``backward()``): the watches that count it say so;
* ``saw_backward(loss)``: then, when one said so, a counted ``backward()`` is about to run on ``loss`` (told by
  the same call: one frame less at every iteration);
* ``backward_ended(counted)``: it returned or raised;
* ``step_began(opt, args, kwargs)``: the outermost ``optimizer.step()`` begins (before its closure, if any),
  recorded or slept through;
* ``before_step(opt)``: the outermost step's update is about to use the gradients (after its closure);
* ``recorded_update(opt, step)``: the same, at every recorded step (nested ones too), with where it was called;
* ``recorded_step_ended(iteration)``: that step returned;
* ``skipped_step()``: a GradScaler skipped the step (the window ends without one);
* ``iteration_ended()``: the outermost step returned, before the iteration is counted;
* ``zeroed_first() -> bool``: asked, not told: were this window's gradients cleared before its first
  ``backward()`` (nobody knowing: False);
* ``finish(namespace)``: the run is over.

Each call runs under the watch's guard (``guard.py``): its failure switches that watch alone off (its ``off()``,
then ``cleared(trace)``: a half-written record is dropped) and the user's call goes on. The callers are written
out at install, one ``try`` per listening watch in the order of the registry (``_dispatcher``): the asleep
iteration of a long loop pays no loop and no lookup of the list, and each watch's method is looked up at each call
(a watch swaps in C functions, or ``nothing`` once off).

>>> class Steps(Watch):
...     events = ("iteration_ended",)
...     n = 0
...     def iteration_ended(self): self.n += 1
>>> ws = Watches([("loop", Steps())], Guards([]))
>>> ws.iteration_ended(); ws.iteration_ended(); ws.member("loop").n
2
"""
from __future__ import annotations

import dataclasses
import linecache
from typing import Any, Callable, ContextManager, Iterable

from ..guard import GUARDED, Guards, nothing

#: event -> its parameters, and whether the callers' answers are combined (any True) into one
EVENTS: dict[str, tuple[str, bool]] = {
    "backward_began": ("loss", True), "saw_backward": ("loss", False),  # (saw_backward: told by backward_began)
    "backward_ended": ("counted", False),
    "step_began": ("opt, args, kwargs", False), "before_step": ("opt", False),
    "recorded_update": ("opt, step", False), "recorded_step_ended": ("iteration", False),
    "skipped_step": ("", False), "iteration_ended": ("", False), "zeroed_first": ("", True),
    "finish": ("namespace", False),
}


class Watch:
    """A member of the registry (see the module docstring): ``events`` it listens to, ``patches`` (a
    :class:`~backward_doctor.capture.watches.patches.Patches`, or None) installed while the run records and removed while
    torch.compile compiles, :meth:`off` and :meth:`cleared` when its guard stops it."""

    events: tuple[str, ...] = ()
    patches: Any = None

    def off(self) -> None:
        """Switched off for the rest of the run (its bookkeeping failed): its calls do nothing from now on."""

    def cleared(self, trace: Any) -> None:
        """What it wrote into ``trace`` taken back (it stopped half way: no record beats a wrong one)."""


@dataclasses.dataclass
class WatchContext:
    """What a watch is made from: the trace it writes into and the run it watches, read through these only."""

    trace: Any                                  #: the run's Trace
    frames: Any                                 #: the capture's UserFrames (where the user's line is)
    guards: Guards                              #: the run's (each watch's bookkeeping under its own)
    iteration: Callable[[], int]                #: optimizer steps completed so far
    backwards: Callable[[], int]                #: the run's counted backward() calls so far
    quiet: Callable[[], ContextManager[Any]]    #: the doctor's own ops, neither recorded nor in any graph
    params: Callable[[], list[Any]]             #: the parameters the capture knows
    scalar: Callable[[Any], float | None]       #: a one-element tensor's value, read in place (None: not readable)
    loop: Any = None                            #: the per-iteration series (the capture's ``LoopWatch``)
    counter: Any = None                         #: the native recorder's ``AccumCounter`` type, or None
    tell: Callable[[str], Any] = nothing        #: an event to every watch listening (filled in by Watches)
    #: whether the namespace value at a path (``bg.model``) is left alone: another thread may be training it, and
    #: reading its gradients then can crash the process (``elsewhere.py``)
    left_alone: Callable[[str], bool] = lambda path: False


#: (guard name, factory), in the order events are told
_REGISTRY: list[tuple[str, Callable[[WatchContext], Watch | None]]] = []
_described: set[str] = set()  # guard names register() added (unregister() takes them back)


def register(name: str, factory: Callable[[WatchContext], Watch | None], *, what: str = "", lost: str = "",
             before: str | None = None) -> None:
    """Add a watch to the registry: ``factory(ctx)`` makes it for a run (None: not for this one), its guard is
    ``name`` (``what`` it is and what the report lacks once it stopped, as ``guard.GUARDED`` says them; a known
    name keeps its words). ``before``: the member it is told events before (else it comes last).

    >>> register("steps", str); register("steps", repr)
    Traceback (most recent call last):
    ValueError: watch 'steps' is registered already
    >>> unregister("steps")
    """
    old = next((i for i, (n, _) in enumerate(_REGISTRY) if n == name), None)
    if old is not None:
        if _origin(_REGISTRY[old][1]) != _origin(factory):
            raise ValueError(f"watch {name!r} is registered already")
        _REGISTRY[old] = (name, factory)  # (the same module imported again, as pytest's doctests do: no change)
        return
    if name not in GUARDED:
        GUARDED[name] = (what or f"the {name} watch", lost or "what it records is missing")
        _described.add(name)
    at = next((i for i, (n, _) in enumerate(_REGISTRY) if n == before), len(_REGISTRY))
    _REGISTRY.insert(at, (name, factory))


def _origin(factory: Any) -> tuple[str, str]:
    code = getattr(factory, "__code__", None)
    return getattr(code, "co_filename", ""), getattr(factory, "__qualname__", repr(factory))


def unregister(name: str) -> None:
    """Take a watch out of the registry (a test's own watch; the next run makes it no more)."""
    _REGISTRY[:] = [(n, f) for n, f in _REGISTRY if n != name]
    if name in _described:
        _described.discard(name)
        GUARDED.pop(name, None)


def registered() -> list[str]:
    """The registry's names, in order (``watches/training.py`` registers the doctor's own)."""
    return [n for n, _ in _REGISTRY]


class Watches:
    """One run's watches (``members``: (name, watch) in the registry's order) and a caller per event (an
    attribute of the event's name) that tells every member listening to it, each under its guard."""

    def __init__(self, members: Iterable[tuple[str, Watch]], guards: Guards, trace: Any = None) -> None:
        self._members = list(members)
        self._guards = guards
        for name, watch in self._members:
            guards.on_stop(name, watch.off)
            if trace is not None and hasattr(watch, "cleared"):
                guards.on_stop(name, lambda w=watch: w.cleared(trace))
        for event in EVENTS:
            setattr(self, event, _dispatcher(event, self._members, guards))
        #: ``step_began`` then ``before_step``, in one call: a step with no closure (its gradients are there as it
        #: begins), as an asleep iteration of a long loop takes it at every step
        self.step_began_and_before_step = _chained("step_began_and_before_step", ("step_began", "before_step"),
                                                   self._members, guards)

    @classmethod
    def made(cls, ctx: WatchContext) -> "Watches":
        """Every registered watch made for the run of ``ctx`` (``ctx.tell`` set to tell them events)."""
        made = [(name, w) for name, w in ((name, factory(ctx)) for name, factory in _REGISTRY) if w is not None]
        watches = cls(made, ctx.guards, ctx.trace)
        # (told by a watch while the run goes on, never while the watches are made: a late binding is enough)
        ctx.tell = lambda event, *args: getattr(watches, event)(*args)
        return watches

    def backward_wrapper(self, real: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.autograd.backward`` (``real``) wrapped to tell the watches ``backward_began`` (and
        ``saw_backward``) with the loss before it runs and ``backward_ended`` after it returned or raised, written
        out as the callers are: the user's ``backward()`` itself outside every ``try``.

        >>> class Count(Watch):
        ...     events, n = ("backward_began",), 0
        ...     def backward_began(self, loss): self.n += 1; return True
        >>> ws = Watches([("accumulation", Count())], Guards([]))
        >>> ws.backward_wrapper(lambda tensors: "ran")([3]), ws.member("accumulation").n
        ('ran', 1)
        """
        env: dict[str, Any] = {"failed": self._guards.failed, "real": real, "SEQUENCES": (tuple, list)}
        began = _listening("backward_began", self._members)
        seen = _listening("saw_backward", self._members)
        ended = _listening("backward_ended", self._members)
        lines = ["def backward(*args, **kwargs):",
                 "    loss = args[0] if args else kwargs.get('tensors')",
                 "    if isinstance(loss, SEQUENCES) and len(loss) == 1:  # (the loss, once for every watch)",
                 "        loss = loss[0]",
                 "    answer = False"]
        lines += _calls("backward_began", began, env, "    ", True)
        if seen:  # (a counted backward(): the loss's own, not a reentrant checkpoint's inner one nor another thread's)
            lines += ["    if answer:"] + _calls("saw_backward", seen, env, "        ", False, first=len(began))
        if ended:
            lines += ["    try:", "        return real(*args, **kwargs)", "    finally:",
                      "        counted = answer"] + _calls("backward_ended", ended, env, "        ", False,
                                                           first=len(began) + len(seen))
        else:
            lines += ["    return real(*args, **kwargs)"]
        return _compiled("backward", lines, env)

    def member(self, name: str) -> Any:
        """The watch registered as ``name`` (None: not in this run)."""
        return next((w for n, w in self._members if n == name), None)

    def patches(self) -> list[Any]:
        """The members' patches, in the registry's order (removed in the reverse one)."""
        return [w.patches for _, w in self._members if w.patches is not None]


def _dispatcher(event: str, members: list[tuple[str, Watch]], guards: Guards) -> Callable[..., Any]:
    """The caller of ``event``: straight-line code with one ``try`` per listening member (written out here and
    compiled once a run: the asleep path runs it at every iteration; a loop over the members costs more
    bytecodes than the calls themselves). Under this file's name, so the doctor's frames are recognised."""
    params, combined = EVENTS[event]
    listening = _listening(event, members)
    lines = [f"def {event}({params}):"]
    if combined:
        lines.append("    answer = False")
    env: dict[str, Any] = {"failed": guards.failed}
    lines += _calls(event, listening, env, "    ", combined)
    if event == "backward_began":  # (then saw_backward, when it is the loss)
        seen = [(name, w) for name, w in members if "saw_backward" in getattr(w, "events", ())]
        if seen:
            lines += ["    if answer:"] + _calls("saw_backward", seen, env, "        ", False, first=len(listening))
    lines.append("    return answer" if combined else "    return None")
    return _compiled(event, lines, env)


def _chained(name: str, events: tuple[str, ...], members: list[tuple[str, Watch]],
             guards: Guards) -> Callable[..., Any]:
    """One caller telling ``events`` (none of them answering) in turn, their parameters those of the first."""
    env: dict[str, Any] = {"failed": guards.failed}
    lines, first = [f"def {name}({EVENTS[events[0]][0]}):"], 0
    for event in events:
        listening = _listening(event, members)
        lines += _calls(event, listening, env, "    ", False, first=first)
        first += len(listening)
    lines.append("    return None")
    return _compiled(name, lines, env)


def _listening(event: str, members: list[tuple[str, Watch]]) -> list[tuple[str, Watch]]:
    return [(name, w) for name, w in members if event in getattr(w, "events", ())]


def _compiled(name: str, lines: list[str], env: dict[str, Any]) -> Callable[..., Any]:
    """The function ``name`` that ``lines`` define, its globals ``env``: under a file name of its own whose source
    is in linecache (a traceback through it shows these lines; the doctor's frames are told apart by it)."""
    source = "\n".join(lines) + "\n"
    filename = f"<backward_doctor watches: {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = _CODE.get(source)
    if code is None:  # (compiling is most of a run's set-up here: ~0.15 ms a caller, 21 callers; the text depends
        if len(_CODE) >= 256:  # only on the members' names and order, so a process compiles each text once)
            _CODE.clear()
        code = _CODE[source] = compile(source, filename, "exec")
    exec(code, env)  # noqa: S102 - the code is this module's own
    return env[name]


#: the compiled callers by their source text (bounded: the texts are as many as the registry's orders of members)
_CODE: dict[str, Any] = {}


def _calls(event: str, listening: list[tuple[str, Watch]], env: dict[str, Any], indent: str, combined: bool,
           first: int = 0) -> list[str]:
    """The lines calling ``event`` of each of ``listening``, each in a ``try`` of its own (its watch in ``env``)."""
    params, _ = EVENTS[event]
    lines = []
    for i, (name, watch) in enumerate(listening, first):
        env[f"w{i}"] = watch
        call = f"w{i}.{event}({params})"
        lines += [f"{indent}try:", f"{indent}    answer = {call} or answer" if combined else f"{indent}    {call}",
                  f"{indent}except Exception as exc:", f"{indent}    if not failed({name!r}, exc):",
                  f"{indent}        raise"]
    return lines


__all__ = ["EVENTS", "Watch", "WatchContext", "Watches", "register", "registered", "unregister"]
