"""A rank's log of collectives: every ``torch.distributed`` collective the script calls, every DDP forward
and ``backward()`` that issues one, with the process group's sequence number, sizes and the user's line.

DDP's gradient all-reduces are launched by its C++ reducer, out of Python's sight; the process group's
sequence number (a counter read in well under a microsecond) says how many a ``backward()`` issued, so
ranks can be lined up collective by collective. After each DDP ``backward()`` the parameters whose
gradient autograd did not touch are noted (DDP waits for them forever, or fails at the next forward).

Every global patched here is put back exactly (the same objects), also on exceptions and Ctrl-C: the
patches are attribute swaps undone in ``__exit__``, as a stack would (``process.patch``: a wrapper the script
put on top of the doctor's stays). The wrappers call the originals with the same
arguments and return their results untouched; nothing the user computes changes. Each entry is also
appended to a log file as it starts and ends (a rank that aborts inside a collective, as gloo does on a
size mismatch, leaves its log behind).

>>> import torch.distributed as dist
>>> before = dist.all_reduce
>>> with CollectiveRecorder() as rec:
...     patched = dist.all_reduce is not before
>>> patched, dist.all_reduce is before, rec.collectives
(True, True, [])
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..guard import Guards
from ...util.process import doctors_own, patch
from ...trace.distributed import DDP_BACKWARD, DDP_FORWARD, Collective, UnusedParams

#: The collective functions of ``torch.distributed`` (those that exist in this torch are wrapped).
NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
         "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "gather",
         "scatter", "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list",
         "gather_object", "scatter_object_list", "all_reduce_coalesced",
         "all_gather_single", "reduce_scatter_single")  # (FSDP2's, torch >= 2.12: absent ones are skipped)
# Frames in these are not the user's: torch, the doctor, the standard library, installed packages.
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))),  # the package
              os.path.dirname(os.__file__), sysconfig.get_paths()["purelib"])
_MAX_SIZES = 8  # a call over a long tensor list keeps its first few shapes (a bounded record)


def _shapes(args: Any, out: list[list[int]], dtypes: list[str]) -> None:
    """Shapes of the tensors in ``args`` (nested lists too), first ``_MAX_SIZES``."""
    for a in args:
        if len(out) >= _MAX_SIZES:
            return
        if isinstance(a, torch.Tensor):
            out.append(list(a.shape))
            dtypes.append(str(a.dtype).replace("torch.", ""))
        elif isinstance(a, (list, tuple)):
            _shapes(a, out, dtypes)


def _group(kwargs: dict[str, Any], args: tuple) -> Any:
    """The process group a call uses (default: the world), or None before ``init_process_group``."""
    g = kwargs.get("group")
    if g is None:
        g = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if g is None and dist.is_initialized():
        g = dist.distributed_c10d._get_default_group()
    return g


def _seq(group: Any) -> int | None:
    try:
        return int(group._get_sequence_number_for_group()) if group is not None else None
    except Exception as exc:  # a backend without sequence numbers: the calls are still logged in order
        if not doctors_own(exc):
            raise
        return None


class CollectiveRecorder:
    """Context manager: while active, log collectives (see module doc) into ``collectives`` and DDP
    parameters without a gradient into ``unused``. ``cell_file``: the script's filename as compiled
    (its lines are reported without a file); ``source``: its text (for the loop variables' names);
    ``log_path``: the file each entry is written to as JSON lines (None: memory only), started afresh with
    ``header`` (what run wrote it) as its first line."""

    def __init__(self, cell_file: str = "", source: str = "", log_path: str | None = None,
                 header: dict[str, Any] | None = None) -> None:
        self.cell_file = cell_file
        self.collectives: list[Collective] = []
        self.unused: list[UnusedParams] = []
        self._loop_names = _loop_names(source)
        self._log = open(log_path, "w", encoding="utf-8", buffering=1) if log_path else None
        self._log_lock = threading.Lock()  # (a rank's progress thread writes too)
        if header is not None:
            self.write(header)
        self._saved: list[Callable[[], None]] = []  # undo steps
        self._local = threading.local()
        self._ddp_pending: dict[int, tuple[weakref.ref, Collective]] = {}
        self._backwards = 0
        #: the log's own failure stops it (``guard.py``): the rank's calls go on, and these notes say so
        self.notes: list[str] = []
        self.guards = Guards(self.notes)
        self.guards.on_stop("collectives", self._off)

    # ------------------------------------------------------------------ install / restore
    def __enter__(self) -> "CollectiveRecorder":
        try:
            modules = [dist, dist.distributed_c10d]
            for name in NAMES:
                for mod in modules:
                    fn = getattr(mod, name, None)
                    if fn is not None:
                        self._swap(mod, name, self._wrap(name, fn))
            self._swap(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
            ddp = torch.nn.parallel.DistributedDataParallel
            self._swap(ddp, "forward", self._wrap_ddp_forward(ddp.forward))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _swap(self, owner: Any, name: str, new: Any) -> None:
        # Put back as a stack would (process.patch): a wrapper the script puts on top of ours stays.
        self._saved.append(patch(owner, name, lambda original: new))

    def _off(self) -> None:
        """Every wrapper put back (each forwards to the original from now on: ``process.patch``)."""
        while self._saved:
            self._saved.pop()()

    def __exit__(self, *exc: Any) -> bool:
        self._off()
        with self._log_lock:
            if self._log is not None:
                self._log.close()
                self._log = None
        return False

    # ------------------------------------------------------------------ entries
    def _where(self) -> tuple[int | None, str | None, dict[str, int]]:
        """The user's innermost line (file None: the script) and the script's int loop variables."""
        frame = sys._getframe(2)
        line = file = None
        loop: dict[str, int] = {}
        while frame is not None:
            name = frame.f_code.co_filename
            if name == self.cell_file:
                if line is None:
                    line, file = frame.f_lineno, None
                if self._loop_names and not loop:
                    ns = frame.f_globals if frame.f_code.co_name == "<module>" else frame.f_locals
                    loop = {n: ns[n] for n in self._loop_names if type(ns.get(n)) is int}
                if loop or frame.f_code.co_name == "<module>":
                    break
            elif line is None and not name.startswith(_SKIP_DIRS) and not name.startswith("<"):
                line, file = frame.f_lineno, name
            frame = frame.f_back
        del frame
        return line, file, loop

    def _begin(self, op: str, args: tuple, kwargs: dict[str, Any]) -> tuple[Collective, Any]:
        sizes: list[list[int]] = []
        dtypes: list[str] = []
        _shapes(args, sizes, dtypes)
        _shapes(kwargs.values(), sizes, dtypes)
        line, file, loop = self._where()
        group = _group(kwargs, args)
        c = Collective(index=len(self.collectives), op=op, seq=_seq(group), sizes=sizes,
                       dtype=dtypes[0] if dtypes else "", line=line, file=file, loop=loop,
                       group="" if group is None or group is dist.group.WORLD else str(getattr(group, "group_name", "")),
                       start_s=time.time())
        self.collectives.append(c)
        self.write({"start": c.__dict__})
        return c, group

    def _end(self, c: Collective, group: Any, error: BaseException | None, keep_empty: bool = True) -> None:
        after = _seq(group if group is not None else _group({}, ()))
        c.end_s = time.time()
        c.count = (after - c.seq) if (after is not None and c.seq is not None) else 1
        if error is not None:
            c.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        if c.count == 0 and not keep_empty and not c.error:
            # A DDP forward/backward that issued nothing: not a collective, not worth a line.
            if self.collectives and self.collectives[-1] is c:
                self.collectives.pop()
            self.write({"drop": c.index})
            return
        self.write({"end": c.index, "count": c.count, "error": c.error, "end_s": c.end_s})

    def write(self, entry: dict[str, Any]) -> None:
        """Append one entry to the log file (a line of JSON), from any thread."""
        with self._log_lock:
            if self._log is not None:
                try:
                    self._log.write(json.dumps(entry) + "\n")
                except (OSError, ValueError):  # a full disk must not fail the user's step
                    pass

    def _call(self, op: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
              keep_empty: bool = True) -> Any:
        local = self._local
        if getattr(local, "depth", 0):  # all_gather_object calls all_gather: log the outer call only
            return fn(*args, **kwargs)
        if op not in (DDP_FORWARD, DDP_BACKWARD) and not dist.is_initialized():
            return fn(*args, **kwargs)  # torch raises its own "not initialized" error
        try:
            c, group = self._begin(op, args, kwargs)
        except Exception as exc:  # (the log's own failure: it stops, the collective runs)
            if not self.guards.failed("collectives", exc):
                raise
            return fn(*args, **kwargs)
        local.depth = 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            local.depth = 0
            self._ended(c, group, e, keep_empty)
            raise
        local.depth = 0
        self._ended(c, group, None, keep_empty)
        return result

    def _ended(self, c: Collective, group: Any, error: BaseException | None, keep_empty: bool) -> None:
        try:
            self._end(c, group, error, keep_empty)
        except Exception as exc:
            if not self.guards.failed("collectives", exc):
                raise

    # ------------------------------------------------------------------ wrappers
    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, fn, args, kwargs)
        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        collective.__name__ = getattr(fn, "__name__", name)
        collective.__doc__ = fn.__doc__
        return collective

    def _wrap_ddp_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        rec = self

        def ddp_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            if not dist.is_initialized():
                return forward(module, *args, **kwargs)
            result = rec._call(DDP_FORWARD, forward, (module, *args), kwargs, keep_empty=False)
            try:  # remembered for the backward that follows: where the forward was called
                line, file, loop = rec._where()
                rec._ddp_pending[id(module)] = (weakref.ref(module), Collective(index=-1, op="forward", line=line,
                                                                                 file=file, loop=loop))
            except Exception as exc:
                if not rec.guards.failed("collectives", exc):
                    raise
            return result
        ddp_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return ddp_forward

    def _wrap_backward(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        rec = self

        def autograd_backward(*args: Any, **kwargs: Any) -> Any:
            if not dist.is_initialized() or not rec._ddp_pending:
                return backward(*args, **kwargs)
            try:
                watched = rec._grads_before()
            except Exception as exc:
                if not rec.guards.failed("collectives", exc):
                    raise
                return backward(*args, **kwargs)
            try:
                return rec._backward(backward, args, kwargs)
            finally:
                try:
                    rec._check_unused(watched)
                except Exception as exc:
                    if not rec.guards.failed("collectives", exc):
                        raise
        autograd_backward.__wrapped__ = backward  # type: ignore[attr-defined]
        autograd_backward.__doc__ = backward.__doc__
        return autograd_backward

    def _backward(self, backward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        # Sizes are those of the gradients' owners, not of the loss: a DDP backward's record is its count.
        def call(*_: Any, **__: Any) -> Any:
            return backward(*args, **kwargs)
        return self._call(DDP_BACKWARD, call, (), {}, keep_empty=False)

    def _grads_before(self) -> list[tuple[Any, Collective, list[tuple[str, Any, int, int]]]]:
        """Each pending DDP module's parameters with (id, version) of their gradient before backward."""
        watched = []
        for key, (ref, fwd) in list(self._ddp_pending.items()):
            module = ref()
            if module is None or getattr(module, "find_unused_parameters", False) \
                    or not getattr(module, "require_backward_grad_sync", True):
                continue  # find_unused_parameters=True (DDP copes) or no_sync() (no all-reduce now)
            params = [(n, p, id(p.grad), p.grad._version if p.grad is not None else -1)
                      for n, p in module.module.named_parameters() if p.requires_grad]
            watched.append((module, fwd, params))
        self._ddp_pending.clear()
        return watched

    def _check_unused(self, watched: list) -> None:
        line, file, loop = self._where()
        for module, fwd, params in watched:
            names = [n for n, p, gid, ver in params
                     if p.grad is None or (id(p.grad) == gid and p.grad._version == ver)]
            if len(names) == len(params):
                # This backward did not go through the module at all (a GAN's discriminator step on a
                # detached fake): its own backward is still to come.
                self._ddp_pending.setdefault(id(module), (weakref.ref(module), fwd))
                continue
            if names:
                self.unused.append(UnusedParams(names=names, module=type(module.module).__name__,
                                                backward_index=self._backwards, forward_line=fwd.line,
                                                forward_file=fwd.file, backward_line=line, loop=fwd.loop,
                                                total=len(params)))
        self._backwards += 1


def fill_from_flight_recorder(collectives: list[Collective]) -> int:
    """Give the calls whose collectives were launched in C++ (DDP's bucket all-reduces and broadcasts)
    their sizes from PyTorch's Flight Recorder, when it ran (``TORCH_FR_BUFFER_SIZE`` set before the
    process group was made; the launcher sets it). Matched by sequence number; returns how many calls
    got sizes (0 without a recorder).

    >>> fill_from_flight_recorder([])
    0
    """
    wanted = [c for c in collectives if c.op in (DDP_BACKWARD, DDP_FORWARD) and c.seq is not None and c.count]
    if not wanted or not os.environ.get("TORCH_FR_BUFFER_SIZE") or not dist.is_initialized():
        return 0
    try:
        import pickle

        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    except Exception:  # an older torch or a backend without it: the counts still say enough
        return 0
    by_seq = {}
    for e in dump.get("entries", []):
        if not e.get("is_p2p") and (e.get("process_group") or ("0",))[0] == "0":
            by_seq[int(e["collective_seq_id"])] = e  # 1-based: the sequence number after the call
    filled = 0
    for c in wanted:
        entries = [by_seq.get(c.seq + k + 1) for k in range(c.count or 0)]
        if all(entries):
            c.sizes = [list(s) for e in entries for s in e.get("input_sizes", [])][:_MAX_SIZES]
            c.dtype = str(entries[0].get("input_dtypes", [""])[0]).lower()
            filled += 1
    return filled


def _loop_names(source: str) -> list[str]:
    """Names bound by the script's loops (``for step in ...``): read as the ranks' positions."""
    if not source:
        return []
    try:
        from ...util.loops import outer_loops

        return sorted({n for _, _, names in outer_loops(source) for n in names})
    except SyntaxError:
        return []
