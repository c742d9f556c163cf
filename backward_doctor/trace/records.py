"""The inert record of one diagnosed run: plain dataclasses that round-trip through JSON.

Capture (``capture.py``) fills a :class:`Trace`; rules read it; renderers draw it.
Nothing here references a tensor, a module or a frame: only strings and numbers
taken at record time, so keeping a trace never keeps the user's memory alive.

>>> t = Trace(source="loss.backward()")
>>> Trace.from_dict(t.to_dict()) == t
True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..util.serde import from_dict, to_dict
from .accumulation import Accumulation
from .frozen import FrozenUpdate
from .precision import Precision
from .schedules import SchedulerRecord
from .spikes import LossSpike
from .ties import UntiedWeights
from .stacks import FrameInfo, LoaderRecord, ThreadStack
from .orphans import UnoptimizedModule
from .parts import (Carrier, Compilation, CompileCheck, GraphHolder, Iterations, LossInfo, NonFiniteScalar, OomInfo,
                    OptimizerStep, OptimizerSummary, ParameterTotals, RunHistory, SourceExcerpt, StaleStep,
                    StorageEvents)

#: Memory categories, in the order they are stacked in reports and plots.
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")
PHASES = ("forward", "backward", "optimizer")


@dataclass(slots=True)
class TensorStats:
    """A tensor's values in a few numbers, lovely-tensors style: counts of NaN/+Inf/-Inf, and min/max/mean
    over the finite values only (None when there are none), so one NaN does not hide the range."""

    numel: int
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def text(self) -> str:
        """The numbers for a report, counts in words ("-inf!105" reads as code).

        >>> TensorStats(numel=4, nan=1, min=-1.25, max=3.5, mean=1.0).text()
        'min=-1.25 max=3.5 mean=1, 1 NaN'
        """
        parts = [f"min={self.min:.4g} max={self.max:.4g} mean={self.mean:.4g}" if self.min is not None
                 else "no finite values"]
        parts += [f"{n:,} {what}" for n, what in ((self.nan, "NaN"), (self.posinf, "+Inf"), (self.neginf, "-Inf"))
                  if n]
        return ", ".join(parts)


@dataclass(slots=True)
class TensorMeta:
    """Shape, dtype and device of one tensor argument, optionally with value statistics."""

    shape: list[int]
    dtype: str
    device: str
    requires_grad: bool = False
    stats: TensorStats | None = None

    def short(self) -> str:
        """``float32[4, 10]`` (device added when it is not the CPU)."""
        dev = "" if self.device == "cpu" else f"@{self.device}"
        return f"{self.dtype}{list(self.shape)}{dev}"


@dataclass(slots=True)
class Where:
    """Where user code was when something happened.

    ``line``/``file``: the innermost user frame (``file`` None means the cell);
    ``cell_line``: the innermost frame in the cell itself, if any.
    """

    line: int | None = None
    file: str | None = None
    cell_line: int | None = None
    module: str | None = None
    function: str | None = None
    lasti: int = -1  # bytecode offset in the user frame: tells apart two calls on one line
    compiled: bool = False  # inside code torch.compile made (its fused kernels are not seen one by one)


@dataclass(slots=True)
class OpRecord:
    """One aten op as it ran. Backward ops point at the forward op via ``fwd_index``."""

    index: int
    op: str
    phase: str
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    where: Where
    fwd_index: int | None = None
    duration_us: float = 0.0
    grad_enabled: bool = True
    in_keys: list[int] = field(default_factory=list)
    out_keys: list[int] = field(default_factory=list)
    live_bytes: int = 0
    start_us: float = 0.0  # when it started, in microseconds since the capture started


@dataclass
class MemoryTimeline:
    """Live bytes by category after each recorded op (downsampled when long)."""

    op_index: list[int] = field(default_factory=list)
    by_category: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    peak_bytes: int = 0
    peak_index: int | None = None
    peak_by_category: dict[str, int] = field(default_factory=dict)
    baseline_bytes: int = 0
    limit_bytes: int | None = None
    device_total_bytes: int | None = None
    cuda: dict[str, Any] | None = None  # allocator + NVML figures when a GPU was used
    #: every storage counted and freed, in order (what a memory_viz snapshot replays)
    storages: StorageEvents = field(default_factory=StorageEvents)


@dataclass
class NonFiniteEvent:
    """An op whose output held NaN/Inf. ``origin`` is the op index that first made it."""

    index: int
    op: str
    phase: str
    where: Where
    origin: int
    is_origin: bool
    kind: str  # "op" (made here), "input" (non-finite data came in) or "weights" (already in the parameters)
    variable: str | None = None
    output: TensorMeta | None = None
    inputs: list[TensorMeta] = field(default_factory=list)
    fwd_op: str | None = None
    fwd_index: int | None = None
    reached: bool = False


@dataclass
class InplaceEvent:
    """A write into an existing tensor during forward (``add_``, ``relu_``, ``+=``)."""

    index: int
    op: str
    key: int
    version: int
    shape: list[int]
    requires_grad: bool
    where: Where
    producer_index: int | None = None
    producer_op: str | None = None
    #: the write went through a view (``h[:, 0] = 0.0`` fills a ``select`` of ``h``): the shape of the view's
    #: base, the tensor autograd saved and PyTorch's error names; None when the written tensor is no view
    base_shape: list[int] | None = None


@dataclass
class IndexCheck:
    """An index argument outside its valid range: which argument, the valid range and why (``what``),
    the first few bad values, how many there were, and the range observed."""

    argument: str
    what: str
    valid: list[int]
    bad: list[int]
    bad_count: int
    min: int
    max: int


@dataclass
class FailedOp:
    """The op that raised inside the dispatcher, with evidence taken before unwinding."""

    index: int
    op: str
    phase: str
    inputs: list[TensorMeta]
    where: Where
    error: str
    fwd_index: int | None = None
    index_check: IndexCheck | None = None


@dataclass
class ExceptionInfo:
    """The cell's exception, as text plus the frames it went through."""

    type: str
    message: str
    frames: list[FrameInfo] = field(default_factory=list)
    where: Where = field(default_factory=Where)
    in_backward: bool = False
    loss: LossInfo | None = None  # a failing backward(): the tensor it was called on
    oom: OomInfo | None = None    # out of memory: live bytes where it ran out
    #: raised by a ``raise`` statement in code (a hook's ``raise KeyboardInterrupt``), not delivered by a signal
    #: (Ctrl-C, the watchdog's interrupt, a signal handler's exception lands at an arbitrary instruction)
    raised: bool = False

    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type  # "KeyboardInterrupt", no colon


@dataclass
class ParamInfo:
    """One parameter's part in the step (for starved-parameter and stale-gradient checks)."""

    name: str
    key: int
    requires_grad: bool
    got_grad: bool          # autograd accumulated a gradient into it during this run
    stepped: bool           # it belongs to an optimizer that stepped during this run
    numel: int = 0
    grad_fn: str | None = None  # a parameter that is no longer a leaf: the node it hangs from
    nbytes: int = 0         # its bytes (numel x element size)
    in_run_model: bool = False  # it belongs to a model whose forward ran in this step (its outermost module)


@dataclass
class ModuleMode:
    """A model (an outermost module call) as it ran: its ``training`` flag and the gradient mode, with its
    dropout (p > 0) and batch-norm modules and how many of those were in training mode; the op range of that
    forward pass (``start`` to ``end``, op indices) and the optimizer steps completed before it
    (``capture/recorder/module_modes.py``: the first calls of each combination only).

    >>> t = Trace(module_modes=[ModuleMode("model", training=True, grad_enabled=False, start=54, end=66, dropout=1)])
    >>> Trace.from_dict(t.to_dict()).module_modes == t.module_modes
    True
    """

    module: str
    training: bool
    grad_enabled: bool
    start: int = 0
    end: int = 0
    where: Where = field(default_factory=Where)
    dropout: int = 0
    dropout_active: int = 0
    batchnorm: int = 0
    batchnorm_training: int = 0
    iteration: int = 0


@dataclass
class SampledRun:
    """The loop's own run, kept when :attr:`Trace.ops` are one iteration replayed after it
    (``iterations.replayed``: ``run/iteration_replay.py``): the ops of the iterations that run recorded
    (``iterations.recorded``, beginning at the op indices ``iterations.starts``), so that an export shows
    every iteration recorded, not only the replay.

    >>> t = Trace(sampled=SampledRun(started_at=1.5))
    >>> Trace.from_dict(t.to_dict()).sampled
    SampledRun(ops=[], started_at=1.5)
    """

    ops: list[OpRecord] = field(default_factory=list)
    started_at: float = 0.0  # that run's start, seconds since the epoch (the replay's is ``Trace.started_at``)


@dataclass
class Trace:
    """Everything captured while one cell ran (see module docstring)."""

    source: str = ""
    cell_file: str = "<cell>"
    device: str = "cpu"
    torch_version: str = ""
    duration_s: float = 0.0
    started_at: float = 0.0  # the capture's start, seconds since the epoch (ranks of one run share a clock)
    completed: bool = True
    ops: list[OpRecord] = field(default_factory=list)
    op_count: int = 0
    ops_dropped: int = 0
    op_totals: dict[str, list[float]] = field(default_factory=dict)  # op -> [count, total_us]
    memory: MemoryTimeline = field(default_factory=MemoryTimeline)
    nonfinite: list[NonFiniteEvent] = field(default_factory=list)
    nonfinite_reached: dict[str, bool] = field(default_factory=dict)
    inplace: list[InplaceEvent] = field(default_factory=list)
    failed_op: FailedOp | None = None
    exception: ExceptionInfo | None = None
    timed_out: bool = False
    timeout_s: float | None = None
    #: the timeout counted from the latest optimizer step, not from the start (always on, callbacks)
    timeout_stall: bool = False
    threads: list[ThreadStack] = field(default_factory=list)
    carriers: list[Carrier] = field(default_factory=list)  # namespace tensors holding a graph at the start
    backward_calls: list[Where] = field(default_factory=list)
    backward_roots: list[str] = field(default_factory=list)  # autograd node each backward started at
    optimizer_steps: list[OptimizerStep] = field(default_factory=list)
    iterations: Iterations = field(default_factory=Iterations)  # a sampled training loop (see Iterations)
    optimizers: list[OptimizerSummary] = field(default_factory=list)  # in the namespace at the start (sizes)
    parameters: ParameterTotals = field(default_factory=ParameterTotals)
    notes: list[str] = field(default_factory=list)
    run_id: int = 0
    needs_detail: str | None = None  # the cheap first tier found something only a detailed run can place
    engine: str = "python"  # what recorded the ops: "python" (dispatch mode) or "native" (C++ observer)
    nonfinite_hint: NonFiniteScalar | None = None  # first tier: the first NaN/Inf scalar (the loss) it saw
    #: NaN/Inf run again from the state saved before it (a sampled loop's iteration, or the step): True, it came
    #: again (deterministic); False, it did not (transient); None, no replay ran (``run/iteration_replay.py``)
    nonfinite_reproduced: bool | None = None
    params: list[ParamInfo] = field(default_factory=list)
    graph_holders: list[GraphHolder] = field(default_factory=list)
    stale_steps: list[StaleStep] = field(default_factory=list)
    history: RunHistory = field(default_factory=RunHistory)  # earlier runs of this cell, in numbers
    #: torch.compile compilations during the step: not recorded as ops
    compiles: list[Compilation] = field(default_factory=list)
    #: backward() calls per optimizer step, where gradients were zeroed, the measured equivalence check
    accumulation: Accumulation = field(default_factory=Accumulation)
    #: gradient clipping against the GradScaler's state, its skipped steps, low-precision weight updates
    precision: Precision = field(default_factory=Precision)
    #: DataLoaders whose worker processes raised, died or were waited on in a hang (``capture/workers/main_side.py``)
    loaders: list[LoaderRecord] = field(default_factory=list)
    #: a compiled step that went NaN/Inf or raised, replayed eagerly (``run/compile_replay.py``)
    compile_check: CompileCheck | None = None
    #: the lines around each place outside the cell the trace names, copied at record time (renderers and
    #: rules read source only from here and from ``source``, never from the disk of whoever reads the report)
    excerpts: list[SourceExcerpt] = field(default_factory=list)
    #: a loop's iteration replayed in detail: the run's own recorded iterations (``SampledRun``)
    sampled: SampledRun | None = None
    #: each model's ``train()``/``eval()`` and gradient mode at its first calls (``ModuleMode``)
    module_modes: list[ModuleMode] = field(default_factory=list)
    #: frozen parameters (``requires_grad=False``) an optimizer step still changed (``FrozenUpdate``)
    frozen_updates: list[FrozenUpdate] = field(default_factory=list)
    #: learning-rate schedulers stepped during the run, with the order of their steps and the optimizer's
    schedules: list[SchedulerRecord] = field(default_factory=list)
    #: weights a model declares tied (an embedding and its output layer) that were separate tensors (``UntiedWeights``)
    untied_weights: list[UntiedWeights] = field(default_factory=list)
    #: modules of a model an optimizer trains whose parameters no optimizer holds (``UnoptimizedModule``)
    unoptimized: list[UnoptimizedModule] = field(default_factory=list)
    #: the loss jumped far above its recent trend and stayed finite: where, and the probe of its batch (``LossSpike``)
    loss_spike: LossSpike | None = None

    def op(self, index: int | None) -> OpRecord | None:
        """The recorded op with this index, or None (dropped or never recorded)."""
        if index is None:
            return None
        ops = self.ops
        # Records are appended in index order; a ring buffer may drop a middle span.
        if 0 <= index < len(ops) and ops[index].index == index:
            return ops[index]
        lo, hi = 0, len(ops)
        while lo < hi:
            mid = (lo + hi) // 2
            if ops[mid].index < index:
                lo = mid + 1
            else:
                hi = mid
        return ops[lo] if lo < len(ops) and ops[lo].index == index else None

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        return from_dict(cls, data)
