"""The smaller records a :class:`~backward_doctor.trace.records.Trace` holds: one typed dataclass per
fact the capture writes and the rules, renderers and fixes read (optimizer steps, graphs kept alive,
the out-of-memory breakdown, ...).

Field names are the JSON keys (``util/serde.py`` converts by the type hints), so a report saved when
these were plain dicts loads into them unchanged.

>>> from backward_doctor.util.serde import from_dict, to_dict
>>> from_dict(Compilation, {"trigger": "dynamo", "seconds": 1.5})
Compilation(trigger='dynamo', seconds=1.5)
>>> to_dict(StaleStep(index=3, optimizer="SGD", id=1, line=4, params=2, since_run=1))["params"]
2
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class OptimizerStep:
    """One ``optimizer.step()`` during the run, where the cell called it."""

    index: int          # op count when the step started: its ops are those from here on
    optimizer: str      # the optimizer's class name (``Adam``)
    id: int             # ``id()`` of the optimizer object during the run (which steps are the same optimizer)
    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    function: str | None = None  # the user's function that called it (``LitModel.training_step``)


@dataclass
class StaleStep(OptimizerStep):
    """An optimizer step on gradients an earlier run's step had already used (``zero_grad()`` missing)."""

    params: int = 0                   # how many of its parameters had such a gradient
    since_run: int = 0                # the earliest run whose step used them
    previous_line: int | None = None  # the line of that earlier step


@dataclass
class OptimizerSummary:
    """An optimizer in the namespace at the start, in the sizes that decide its step's memory."""

    name: str           # its variable in the namespace
    type: str           # its class name (``Adam``)
    param_bytes: int = 0  # its trainable parameters' bytes
    largest: int = 0      # the bytes of its largest parameter
    state_bytes: int = 0  # its state (moments, momentum buffers) before the step
    momentum: bool = False
    foreach: bool | None = None  # ``foreach=`` as given (None: PyTorch picks, foreach on CUDA)
    device: str = "cpu"          # its first parameter's device


@dataclass
class Carrier:
    """A namespace tensor that already carried an autograd graph when the run started."""

    variable: str
    shape: list[int]
    grad_fn: str        # the class name of its ``grad_fn`` node
    key: int = 0        # its storage key (0: none), to tell whether this run's ops read it


@dataclass
class GraphHolder:
    """A tensor reachable from the namespace after the run that still carries an autograd graph."""

    path: str                     # how to reach it: ``history[3]``, ``model.cache``, ``f.<closure h>``
    shape: list[int]
    bytes: int                    # its own storage's bytes
    grad_fn: str                  # the class name of its ``grad_fn`` node
    contained: bool = False       # held inside a container or an object, not bound to a variable itself
    earlier_runs: list[int] = field(default_factory=list)  # run ids of this cell whose nodes its graph holds
    own_run: int | None = None    # this run's id when this run made its grad_fn
    own_index: int | None = None  # the forward op that made its grad_fn (this run only)
    module: str | None = None     # the module whose attribute holds it
    store_file: str | None = None  # where the statement storing it is, outside the cell
    store_line: int | None = None
    store: str = "cell"           # what stored it: "cell", "module" (an attribute) or "closure"
    graph_bytes: int = 0          # bytes its graph still saves for a backward (only with earlier_runs)
    target: list[str] | None = None  # the cell variable to look for the storing line (with earlier_runs, or
    #                                   a graph kept from an earlier iteration of this run's loop)
    iteration: int | None = None       # the iteration of this run's loop that made its grad_fn
    from_iteration: int | None = None  # the oldest iteration whose nodes its graph holds (``total += loss``)


@dataclass
class SourceExcerpt:
    """A few lines of a file outside the cell (a module of the user's, a library), copied when the run was
    recorded, so that a report shows its code on any machine without reading that machine's files."""

    file: str
    first: int                                       # the line number of ``lines[0]``
    lines: list[str] = field(default_factory=list)


@dataclass
class Compilation:
    """One ``torch.compile`` compilation during the step (not recorded as ops)."""

    trigger: str        # what compiled: "dynamo" (a frame) or a lazily compiled backward
    seconds: float


@dataclass
class CompileCheck:
    """A step that used ``torch.compile`` and went NaN/Inf or raised, replayed eagerly from the same state
    (``run/compile_replay.py``): whether eager agrees and, where it does not, the first op whose result
    differs in the compiled region (``run/compile_graphs.py``)."""

    #: what the compiled step did: "nonfinite", "diverged", "exception" or "skipping" (its GradScaler skipped step
    #: after step: inf/NaN gradients every time)
    trigger: str
    eager_agrees: bool
    compiled: str = ""              # how the compiled step ended: "NaN/Inf in the loss", "RuntimeError: ..."
    eager: str = ""                 # how the eager replay ended
    region: str = ""                # the compiled region compared op by op: "model (Net.forward, backend aot_eager)"
    op: str = ""                    # the first op whose result differs ('' none isolated)
    line: int | None = None         # its user line (file None: the cell)
    file: str | None = None
    function: str = ""
    code: str = ""
    detail: str = ""                # the two results there: "compiled: 2 of 6 values NaN/Inf; eager: 0"
    max_diff: float | None = None
    stage: str = ""                 # where it differs: "forward", "backward", '' unknown
    dropped: str = ""               # a custom op before it that a compiler drops (no result, no declared mutation)
    ops_compared: int = 0
    why_not: str = ""               # why no op was isolated


@dataclass
class NonFiniteScalar:
    """First tier: a forward op whose scalar output was NaN/Inf (its line, not yet its origin)."""

    index: int
    line: int | None = None
    file: str | None = None


@dataclass
class ParameterTotals:
    """Every parameter the capture knew of (modules and optimizers in the namespace), in totals."""

    count: int = 0
    trainable: int = 0  # of them, those with requires_grad
    bytes: int = 0


@dataclass
class RunHistory:
    """The cell's runs so far in this namespace (this one last), in numbers; empty without a history."""

    runs: int = 0
    live_bytes_end: list[int] = field(default_factory=list)  # live tensor bytes at the end of each run
    run_ids: list[int] = field(default_factory=list)
    amp_skipped: list[int] = field(default_factory=list)     # optimizer steps GradScaler skipped, per run


@dataclass
class LossInfo:
    """The tensor a failing ``backward()`` was called on."""

    shape: list[int]
    requires_grad: bool
    grad_fn: str | None = None  # the class name of its ``grad_fn`` node (None: a leaf, or no graph)
    key: int = 0                # its storage key (0: none)
    writer: int | None = None   # the op that last wrote its storage: where the loss was made


@dataclass
class OomInfo:
    """Live tensor bytes where memory ran out, from the capture's ledger."""

    index: int | None = None        # the op during which it ran out (None: outside any recorded op)
    requested: int | None = None    # bytes the failing allocation asked for, when known
    live: int = 0                   # live tensor bytes then (requested included for a simulated device)
    by_category: dict[str, int] = field(default_factory=dict)  # CATEGORIES -> bytes
    #: open-ended: module path -> bytes made by its ops, plus labels in parentheses for the rest
    #: ("(existing before the step)", "(gradients in backward)", "(outside modules)"); largest first
    by_module: dict[str, int] = field(default_factory=dict)
    simulated: bool = False         # ``memory_limit`` ran out, not a device
    #: the outermost module running when memory ran out was in eval mode (``model.eval()``)
    eval_mode: bool = False


@dataclass
class LrSetting:
    """Where the learning rate a loop trained with was set, as far as the user's sources tell."""

    value: float | None = None  # the learning rate (the optimizer's initial one)
    file: str | None = None     # None: the cell that ran
    line: int | None = None
    code: str = ""              # the statement, on one line
    keyword: str = ""           # "learning_rate" (TrainingArguments) or "lr"


@dataclass
class StorageEvents:
    """The memory ledger's own history while ops were recorded, for exporters that replay memory block by
    block (a memory_viz snapshot): every storage it began counting, stopped counting (freed) or moved to
    another category, in order. Five plain ints per event in ``flat``: action (1 counted, 0 freed, 2 moved),
    storage number (a new one each time a storage is counted), bytes, category (an index into
    ``CATEGORIES``) and op (counted: the op that made it, -1 made before the step; else how many ops had
    started then). The log is bounded: past :data:`STORAGE_EVENTS_CAP` events it stops, ``dropped`` counts
    the rest.

    >>> StorageEvents(flat=[1, 0, 64, 3, 0, 0, 0, 64, 3, 2]).events()
    [(1, 0, 64, 3, 0), (0, 0, 64, 3, 2)]
    """

    flat: list[int] = field(default_factory=list)
    dropped: int = 0

    def events(self) -> list[tuple[int, int, int, int, int]]:
        """``flat`` as (action, storage, bytes, category, op) tuples."""
        f = self.flat
        return [tuple(f[i:i + 5]) for i in range(0, len(f) - 4, 5)]  # type: ignore[misc]


#: the most events a trace's :class:`StorageEvents` keeps (CUDA's allocator history keeps as many)
STORAGE_EVENTS_CAP = 100_000


@dataclass
class Iterations:
    """The cell's training loop, counted in optimizer steps, and which iterations were recorded op by op.

    A long loop is sampled: iterations 0, 1, 2 and then each power of two are recorded; the others run
    with the recorder switched off (nothing observed, nothing counted). ``starts[k]`` is the op index at
    which ``recorded[k]`` began.

    >>> it = Iterations(steps=9, recorded=[0, 1, 2, 4, 8], starts=[0, 30, 60, 90, 120])
    >>> it.skipped, it.iteration_of(95), it.unrecorded_before(95)
    (4, 4, (3, 3))
    """

    steps: int = 0
    recorded: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    #: the loop variables' values in an iteration ("i = 20", "xb = float32[12, 8]"), by iteration number
    #: (recorded iterations, and the one running when the cell stopped)
    values: dict[str, str] = field(default_factory=dict)
    #: Per-iteration series, every iteration recorded or not, one entry per ``stride`` iterations (the
    #: stride doubles when a series would pass 4,096 entries: a bounded trace): the loss ``backward()``
    #: was called on (None: non-finite, or not read: CUDA), the gradients' global L2 norm before the
    #: optimizer step (None: non-finite or not read), the first param group's learning rate, and live
    #: bytes at the iteration's end (``live_kind`` says by what count).
    stride: int = 1
    loss: list[float | None] = field(default_factory=list)
    grad_norm: list[float | None] = field(default_factory=list)
    lr: list[float | None] = field(default_factory=list)
    live_bytes: list[int] = field(default_factory=list)
    live_kind: str = ""  # "allocator" (CPU allocator, net since start), "cuda" (memory_allocated), "ledger"
    #: ``backward()`` calls (``torch.autograd.backward``: ``loss.backward()``, ``accelerator.backward(loss)``) in
    #: each iteration, the same points as the series above: more than one is gradient accumulation
    backwards: list[int] = field(default_factory=list)
    #: the first iteration whose loss or gradients were NaN/Inf (seen in every iteration, recorded or not)
    first_nonfinite: int | None = None
    #: what made it non-finite first: "loss" or "gradients"
    first_nonfinite_in: str = ""
    #: the trace's ops are this one iteration, replayed in detail after the run (``run/iteration_replay.py``)
    replayed: int | None = None
    #: a library ran the loop: "transformers" or "lightning" ('' for a loop the cell wrote), from the cell's
    #: call at ``library_line`` (``library_call``: ``trainer.train()``); ``values`` then say the library's
    #: epoch and batch (``capture/loop/trainers.py``)
    library: str = ""
    library_call: str = ""
    library_line: int | None = None
    #: the learning rate the loop began with (the first optimizer step's, before any schedule changed it)
    base_lr: float | None = None
    #: where that learning rate was set (looked up when NaN/Inf showed in the loop)
    lr_set: LrSetting | None = None

    @property
    def skipped(self) -> int:
        """Completed iterations (optimizer steps) that ran unrecorded."""
        return max(0, self.steps - sum(1 for r in self.recorded if r < self.steps))

    def iteration_of(self, op_index: int) -> int | None:
        """The iteration a recorded op belongs to (None when no optimizer step ended in the cell)."""
        if self.replayed is not None:
            return self.replayed
        if not self.starts:
            return None
        return self.recorded[max(0, bisect.bisect_right(self.starts, op_index) - 1)]

    def unrecorded_before(self, op_index: int) -> tuple[int, int] | None:
        """(first, last) of the unrecorded iterations just before the one holding ``op_index``, if any."""
        it = self.iteration_of(op_index)
        if it is None or self.replayed is not None:
            return None
        k = self.recorded.index(it)
        prev = self.recorded[k - 1] if k else -1
        return (prev + 1, it - 1) if it - prev > 1 else None

