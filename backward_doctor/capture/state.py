"""The state of one capture, owned by one object: what the recorders write during the step and
``finish`` reads after it.

:class:`CaptureState` declares every field in one place (the per-op record arrays, the interned
strings, the ledger, module and parameter registries, NaN/Inf origins); the per-op hot path
(``recorder/record.py``, :class:`~backward_doctor.capture.recorder.record.OpRecorder`) fills it, the context manager
(``context.py``) installs and removes the hooks around it, ``end/finish.py`` turns it into a trace.

>>> s = CaptureState(source="x = 1")
>>> s.trace.source, s.parameters()
('x = 1', [])
"""
from __future__ import annotations

import collections
import itertools
import threading
import weakref
from array import array
from typing import TYPE_CHECKING, Any, Callable

import torch

from .frames import UserFrames
from .elsewhere import Elsewhere
from .guard import Guards
from .recorder.memory import MemoryLedger, Timeline, grad_of
from ..util.process import UndoStack
from .end.ties import tied_now
from ..trace.parts import NonFiniteScalar, OomInfo
from ..trace.records import Trace, Where

if TYPE_CHECKING:
    from .history import CellHistory

_run_ids = itertools.count(1)
_sequence_nr = torch._C._autograd._get_sequence_nr
#: ints per kept op in ``_rec_ints`` (see recorder/record.py), and the phases their phase ids stand for
REC_WIDTH = 10
PHASES = ("forward", "backward", "optimizer")
_NODE_BUDGET = 10_000  # backward ops per run whose autograd node is looked up (see record.dispatch)


def cuda_in_use() -> bool:
    """The process has a CUDA context (it has used the GPU); never starts one.

    >>> isinstance(cuda_in_use(), bool)
    True
    """
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class CaptureState:
    """Every field one capture records into (see the module doc); no hooks, nothing installed."""

    def __init__(self, namespace: dict[str, Any] | None = None, *, cell_file: str = "<cell>",
                 source: str = "", memory_limit: int | None = None, max_ops: int = 50_000,
                 tail_ops: int = 10_000, check_indices: bool | None = None,
                 history: "CellHistory | None" = None, detail: bool = True, cuda_history: bool = True) -> None:
        self.namespace = namespace if namespace is not None else {}
        self.memory_limit = memory_limit
        self.check_indices = check_indices
        #: True: screen every op's output for NaN/Inf (finds the origin). False: the cheap first
        #: tier, which screens scalar outputs only and says when a detailed run is needed.
        self.detail = detail
        self.history = history
        self.trace = Trace(source=source, cell_file=cell_file, torch_version=torch.__version__)
        self.trace.memory.limit_bytes = memory_limit
        self._run_id = next(_run_ids)
        self.trace.run_id = self._run_id
        #: each watch's switch (``guard.py``): its bookkeeping failing switches it off, with a note
        self.guards = Guards(self.trace.notes)
        #: the thread that runs the step: the process-wide hooks ignore every other (a background thread training
        #: its own model runs exactly as without the doctor, and is not counted in this run)
        self._thread = threading.get_ident()
        self._frames = UserFrames(cell_file)
        self._ledger = MemoryLedger()
        self._ledger.on_free = self._on_free
        self._ledger.clock = self._op_clock
        self._timeline = Timeline()
        # Per-op records as ints in flat arrays (see _record.py), turned into OpRecords by finish().
        self._rec_ints, self._rec_io, self._rec_us = array("q"), array("q"), array("d")
        self._rec_t0 = array("d")  # each kept op's start, microseconds since the capture started
        #: the native recorder's ledger log (bytes of 5-int events) and its dropped count; None: the ledger's own
        self._storage_log: tuple[bytes, int] | None = None
        self._n_kept = 0
        self._names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self._metas: list[tuple] = []      # (shape, dtype, device, requires_grad)
        self._meta_ids: dict[tuple, int] = {}
        self._wheres: list[Where] = []     # every Where a record points to (kept: ids stay valid)
        self._where_ids: dict[int, int] = {}
        self._where_intern: dict[tuple, Where] = {}  # one Where per (position, module stack)
        self._max_ops, self._tail = max_ops, collections.deque(maxlen=tail_ops)
        self._tail_t0: collections.deque[float] = collections.deque(maxlen=tail_ops)  # (the tail's starts)
        self._tail_count = 0  # records that went to the ring buffer (some since overwritten)
        self._count = 0
        self._unrecorded = 0  # ops whose results could not be recorded (they ran as usual)
        self._op_totals: dict[str, list[float]] = {}
        self._peak, self._peak_index, self._peak_by_category = 0, None, {}
        self._seq_map: dict[int, int] = {}  # autograd sequence number -> forward op index
        self._node_budget, self._budget_noted = _NODE_BUDGET, False
        self._seq_start = self._last_seq = _sequence_nr()
        self._iter_seq = array("q")  # the autograd sequence number at which each iteration after the first began
        self._handles: list[Any] = []  # hooks on parameters
        #: parameters frozen when seen (no hook can go on them yet): id -> (weak ref, their gradient's id and version)
        self._unhooked: dict[int, tuple[weakref.ref, tuple[int, int] | None]] = {}
        self._undo = UndoStack()       # what start() installed, to undo in stop()
        self._global_handles: list[Any] = []  # optimizer hooks (off while torch.compile compiles)
        self._module_handles: list[Any] = []  # module hooks (off while compiling, and in unsampled iterations)
        self._modules: dict[int, tuple[weakref.ref, str]] = {}
        self._module_stack: list[int] = []
        self._stack_key: tuple[int, ...] = ()
        self._skip_codes: dict[Any, bool] = {}  # our frames and torch's wrappers around __torch_dispatch__
        self._where_cache: dict[tuple, Where] = {}  # call site -> Where, within one backward()/step()
        self._where_stacks: list[tuple[Where, tuple[int, ...]]] = []
        self._params: dict[int, weakref.ref] = {}
        self._got_grad: set[int] = set()  # ids of parameters autograd accumulated into
        self._mark_versions: dict[int, int] = {}  # id -> version at the start of gradients earlier runs stepped
        self._stale_checked: set[int] = set()  # optimizers an unrecorded step checked (loop/optimizer.py)
        self._stepped_params: set[int] = set()  # ids of parameters an optimizer step of this run held
        self._stepped_opts: dict[int, weakref.ref] = {}  # optimizers of steps the recorder slept through
        self._opt_depth = 0
        self._writer: dict[int, int] = {}      # storage key -> last op that wrote it
        self._nf_origin: dict[int, int] = {}   # storage key -> op index that first made its NaN/Inf
        self._nf_by_index: dict[int, int] = {}
        #: first tier: forward ops whose scalar output was NaN/Inf (op index -> where), the first few.
        #: Only one that reached the loss or a variable of the cell calls for the detailed run: the
        #: ``-inf`` scalars attention masks are built from are intended.
        self._nf_scalars: dict[int, NonFiniteScalar] = {}
        self._detail_budget = 8  # non-finite origins that get full statistics
        self._ns_names: dict[int, str] = {}    # storage key -> variable name (at start)
        self.elsewhere = Elsewhere()            # what other threads held when the step began (elsewhere.py)
        self._tied_before: set[tuple[int, tuple[str, ...]]] = set()  # conditional ties held then (end/ties.py)
        self._last_phase = "forward"
        self._roots: list[int | None] = []  # forward op of each backward's root node
        self._oom: OomInfo | None = None
        #: live bytes at the out-of-memory point by the op that made them (-1: before the step); ``finish``
        #: turns them into ``OomInfo.by_module`` once modules have names
        self._oom_producers: dict[int, int] | None = None
        # CUDA figures (the allocator, its history, NVML) when the process is using the GPU: a CPU step on a
        # machine that has one (CUDA never initialised) is a CPU step, and the doctor must not start a CUDA
        # context for it (seen on an H200 box: CPU loops' memory series read from the idle GPU allocator).
        self._cuda = cuda_in_use()
        self._cuda_history_wanted = cuda_history
        self._cuda_history = False  # the allocator's history is being recorded (cuda.start)
        self._cuda_alloc = array("q")
        self._cuda_allocated: Callable[[], int] = torch.cuda.memory_allocated  # (cuda.start: a cheaper reader)
        self._t0 = self._t_last = 0.0  # start, and end of the latest op (what a failed step took)
        self._loop_names: list[str] | None = None  # the cell's loop variables (found when first needed)
        self._library: Any = None  # a library's training loop the cell calls (``trainers.LibraryLoop``)
        self._asleep = False  # the native recorder is off for an unsampled iteration (native_capture.py)
        self._first_recorded = True  # iteration 0 is recorded (always on's cost budget: not)
        #: set by the run (``run/iteration_replay.py``): told when each iteration begins and when NaN/Inf
        #: shows in one the recorder did not record, so that iteration can be replayed from its state
        self.rollback: Any = None
        self._watch: Any = None  # the per-iteration series (``loop/series.py``: the loop watch, made with the hooks)
        #: the run's training watches (``watches/registry.py``), told the loop's events; made with the hooks
        self.watches: Any = None
        self._training_closed = False  # the watches' wrappers were put back for good (the capture stopped)


    def _guarded(self, name: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, the doctor's bookkeeping of watch ``name``, under its guard (``guard.py``); None if it
        failed (the watch is off)."""
        try:
            return fn(*args)
        except Exception as exc:
            if not self.guards.failed(name, exc):
                raise
            return None

    def _op_clock(self) -> int:
        return self._count

    def _on_free(self, key: int) -> None:
        self._writer.pop(key, None)
        self._nf_origin.pop(key, None)

    def _register_model(self, mod: torch.nn.Module) -> None:
        """A model the namespace holds before the step: registered, and the conditional ties it holds now
        remembered (``if tie: self.head.weight = ...``: one the step then separates was wanted, ``end/ties.py``)."""
        self._register_module(mod)
        self._tied_before |= tied_now([("", mod)])

    def _register_module(self, mod: torch.nn.Module) -> None:
        for sub in mod.modules():
            if id(sub) in self._modules:
                continue
            self._modules[id(sub)] = (weakref.ref(sub), type(sub).__name__)
            # (its own parameters, as ``parameters(recurse=False)`` lists them, without its generator machinery:
            # a third of this scan on T5's 103 modules; a parameter met twice is registered once)
            for p in sub._parameters.values():
                if p is not None:
                    self._register_param(p)

    def _register_param(self, p: torch.Tensor) -> None:
        if id(p) in self._params:
            return
        self._params[id(p)] = weakref.ref(p)
        if not self._ledger.track(p, "parameters") or self._t0:
            # A model the cell builds itself: the ops that made its weights counted them as "other" until its first
            # forward registers it here (the natively recorded ones too); without this, a fix's before column
            # said "parameters 0 B" (issue 47, item 7).
            self._ledger.reclassify(p, "parameters")
        grad = grad_of(p)
        if grad is not None:
            self._ledger.track(grad, "gradients")
        if not self._asleep:  # (the native recorder asleep: hooked when it wakes, ``_hook_parameters``)
            self._hook_parameter(p)

    def _hook_parameter(self, p: torch.Tensor) -> None:
        # A parameter that is no longer a leaf (an in-place update with grad on attached a graph to it)
        # gets no gradient and takes no hook: the rules report it (``nonleaf_param``).
        if p.requires_grad and p.is_leaf and hasattr(p, "register_post_accumulate_grad_hook") \
                and not self.guards.stopped("gradients"):
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        elif not p.requires_grad and p.is_leaf and id(p) not in self._unhooked:  # (frozen: ``_unfrozen``)
            grad = grad_of(p)
            self._unhooked[id(p)] = (weakref.ref(p), (id(grad), grad._version) if grad is not None else None)

    def _unfrozen(self) -> None:
        """Parameters frozen when first seen that require grad now (fine-tuning unfreezes a backbone mid-run):
        those whose gradient this run made or added to got one (no hook could say it), and they are hooked for
        the rest of the run. (At each recorded optimizer step and at the end: not per op or module.)"""
        for key, (ref, before) in list(self._unhooked.items()):
            p = ref()
            if p is not None and not p.requires_grad:
                continue
            del self._unhooked[key]
            if p is None:
                continue
            grad = grad_of(p)
            if grad is not None and (id(grad), grad._version) != before:
                self._got_grad.add(key)
            self._hook_parameter(p)

    def _hook_parameters(self) -> None:
        """Every known parameter hooked again (after an asleep stretch of a loop, which runs without them)."""
        for ref in list(self._params.values()):
            p = ref()
            if p is not None:
                self._hook_parameter(p)

    def _accumulated(self, param: torch.Tensor) -> None:
        try:
            self._got_gradient(param)
        except Exception as exc:  # (the watch's own failure: it stops, backward goes on, ``guard.py``)
            if not self.guards.failed("gradients", exc):
                raise

    def _got_gradient(self, param: torch.Tensor) -> None:
        self._got_grad.add(id(param))
        grad = grad_of(param)
        if grad is not None:
            self._ledger.reclassify(grad, "gradients")

    def release(self) -> None:
        """Let go of the user's objects once the trace is finished. A capture is a cycle of its own (its
        ledger and watches call back into it), so what it refers to lives until the garbage collector runs:
        the namespace (a model, a batch, an optimizer's state) must not wait for that (seen on an H200: a
        diagnosed OOM's namespace held 270 MB on the device after the call returned)."""
        self.namespace = {}
        self.rollback = None  # (the state an iteration is replayed from: the caller holds it as long as needed)

    def parameters(self) -> list[torch.Tensor]:
        """The live parameters seen during the run (strong refs only for the caller's use)."""
        return [p for p in (r() for r in self._params.values()) if p is not None]

    # ---------------------------------------------------------------- reading the records
    def kept_records(self):
        """Every kept op as (index, name, phase, fwd index or None, grad mode, Where, [(meta, key) of
        inputs], [(meta, key) of outputs], live bytes, microseconds); meta = (shape, dtype, device,
        requires_grad)."""
        ints, io, us = self._rec_ints, self._rec_io, self._rec_us
        names, wheres, metas = self._names, self._wheres, self._metas
        for r in range(self._n_kept):
            (index, name_id, phase, fwd, grad, where_id, n_in, n_out, off,
             live) = ints[r * REC_WIDTH:(r + 1) * REC_WIDTH]
            pairs = [(metas[io[off + 2 * j]], io[off + 2 * j + 1]) for j in range(n_in + n_out)]
            yield (index, names[name_id], PHASES[phase], None if fwd < 0 else fwd, bool(grad), wheres[where_id],
                   pairs[:n_in], pairs[n_in:], live, us[r])
        yield from self.tail_records()

    def tail_records(self):
        """:meth:`kept_records` of the ring buffer of ops past ``max_ops`` only."""
        names, wheres, metas = self._names, self._wheres, self._metas
        for (index, name_id, phase, fwd, grad, where_id, n_in, flat, live, t) in self._tail:
            pairs = [(metas[flat[2 * j]], flat[2 * j + 1]) for j in range(len(flat) // 2)]
            yield (index, names[name_id], PHASES[phase], None if fwd < 0 else fwd, bool(grad), wheres[where_id],
                   pairs[:n_in], pairs[n_in:], live, t)

    def _op_name(self, index: int | None) -> str | None:
        if index is None:
            return None
        if index < self._n_kept and self._rec_ints[index * REC_WIDTH] == index:
            return self._names[self._rec_ints[index * REC_WIDTH + 1]]
        return next((self._names[r[1]] for r in self._tail if r[0] == index), None)
