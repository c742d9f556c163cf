"""Cells that do what long-lived kernels do (issue 27, items 4, 5, 7, 8, 12, 14): their own SIGALRM time
limit, a SIGINT handler that does not raise, their own wrapper of ``torch.autograd.backward``, a
``KeyboardInterrupt`` raised by a hook, a dispatch mode left on, reads of ``.grad`` on non-leaves. The
doctor swallows none of their exceptions, removes none of their globals, leaves none of its own behind,
prints nothing a plain run does not, and says what it saw. Both engines.
"""
from __future__ import annotations

import functools
import signal
import sys
import warnings

import pytest
import torch
from torch import nn

import backward_doctor as bd
import fault_injection as fi


# A loop whose iteration 3 has a long forward (2,000 small ops: tens of ms even plainly); the cell starts a
# one-shot SIGALRM timer there, whose handler raises TimeoutError: a plain run stops inside that forward,
# before iteration 3 changes any weight.
ALARM_CELL = """\
for i in range(6):
    opt.zero_grad()
    if i == 3:
        start_alarm()
    h = x
    for _ in range(2000 if i == 3 else 1):
        h = h * 1.0001
    loss = model(h).pow(2).mean()
    loss.backward()
    opt.step()
"""


def _alarm_namespace(start_alarm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(5, 4),
            "start_alarm": start_alarm}


class _Alarm:
    """The cell's own time limit: SIGALRM raises TimeoutError (as ``signal.alarm``-based limits do)."""

    def __init__(self) -> None:
        self.previous = None

    def __enter__(self) -> "_Alarm":
        def on_alarm(signum, frame):
            raise TimeoutError("the cell's own time limit")
        self.previous = signal.signal(signal.SIGALRM, on_alarm)
        return self

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def _weights(ns):
    return [p.detach().clone() for p in ns["model"].parameters()]


@functools.lru_cache(maxsize=None)
def _plain_stops(k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The weights of a plain run stopped in iteration ``k`` before its optimizer step, and just after it:
    where a signal lands in that iteration decides which."""
    out = []
    for stop_after_step in (False, True):
        ns = _alarm_namespace(lambda: None)
        cell = ALARM_CELL.replace("    opt.step()\n", f"    if i == {k} and not {stop_after_step}:\n        raise TimeoutError\n"
                                  f"    opt.step()\n    if i == {k}:\n        raise TimeoutError\n")
        with pytest.raises(TimeoutError):
            exec(cell, ns)
        out.append(_weights(ns))
    return out[0], out[1]


def _stopped_like_a_plain_run(ns) -> bool:
    """The doctored run stopped where the exception came, as a plain run stopped there would have."""
    got = _weights(ns)
    return any(all(torch.equal(a, b) for a, b in zip(want, got)) for want in _plain_stops(ns["i"]))


def test_a_cells_own_sigalrm_time_limit_surfaces_with_a_real_timer(engine):
    """A real one-shot ``setitimer``: the TimeoutError lands wherever the main thread is, the doctor's per-op
    code included. It must surface, and the weights be those of a plain run stopped the same way."""
    def start_alarm():
        signal.setitimer(signal.ITIMER_REAL, 0.002)

    with _Alarm():
        ns = _alarm_namespace(start_alarm)
        with pytest.raises(TimeoutError):
            exec(ALARM_CELL, ns)  # (plainly, the alarm stops the long forward of iteration 3)
        assert ns["i"] == 3 and _stopped_like_a_plain_run(ns)
        for attempt in range(5):  # (where the alarm lands varies: several runs, every one must surface)
            ns = _alarm_namespace(start_alarm)
            report = bd.diagnose(ALARM_CELL, ns, engine=engine)
            assert report.trace.exception is not None and report.trace.exception.type == "TimeoutError", \
                (attempt, str(report))
            assert ns["i"] == 3 and _stopped_like_a_plain_run(ns), attempt  # where a plain run stops, no further


def _inject_alarm_at(n: int):
    """A tracer running the SIGALRM handler at the ``n``-th line the doctor runs once the cell called
    start_alarm(): its TimeoutError is raised in the handler's frame at exactly that line, as when a timer
    fires there (a trace function's exception propagates into the traced frame)."""
    state = {"armed": False, "count": 0, "fired": False}
    pkg = bd.__file__.rsplit("/", 1)[0]

    def local(frame, event, arg):
        if event == "line" and state["armed"] and not state["fired"]:
            state["count"] += 1
            if state["count"] == n:
                state["fired"] = True
                signal.getsignal(signal.SIGALRM)(signal.SIGALRM, frame)
        return local

    def trace(frame, event, arg):
        return local if state["armed"] and frame.f_code.co_filename.startswith(pkg) else None

    def start_alarm():
        state["armed"] = True
    return trace, start_alarm, state


def test_a_signal_handlers_exception_is_never_swallowed_at_any_point_of_the_doctors_per_op_code(engine):
    """The same, deterministically: SIGALRM raised at the n-th line of the doctor's own code run during the
    long forward, for many n."""
    with _Alarm():
        for n in range(1, 400, 7):
            trace, start_alarm, state = _inject_alarm_at(n)
            ns = _alarm_namespace(start_alarm)
            sys.settrace(trace)
            try:
                report = bd.diagnose(ALARM_CELL, ns, engine=engine)
            finally:
                sys.settrace(None)
            if not state["fired"]:
                break  # fewer lines than n: all of them were tried
            assert report.trace.exception is not None and report.trace.exception.type == "TimeoutError", \
                (n, str(report))
            assert _stopped_like_a_plain_run(ns), n
            # grad mode as the cell had it, even when the exception landed where the doctor had it off
            assert torch.is_grad_enabled(), n
        assert n > 50  # (the doctor did run code of its own during that forward)


# --------------------------------------------------------------------------- 5. Ctrl-C in set-up, a handler that does not raise
NAN_CELL = "opt.zero_grad()\nloss = (model(x) * 0).log().mean()\nloss.backward()\nopt.step()\n"


def test_ctrl_c_during_set_up_with_a_non_raising_handler_runs_the_cell_under_the_capture(engine):
    """A "stop after this epoch" flag (or SIG_IGN under nohup): the Ctrl-C must not make the cell run
    without the capture; it is handed to the cell's handler, and the report says so."""
    import _thread  # noqa: F401  (fault_injection delivers the Ctrl-C with _thread.interrupt_main)

    ns = fi.make_namespace()
    bd.diagnose(NAN_CELL, ns, engine=engine)  # warm-up
    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda s, f: noted.append(s))
    try:
        points = fi.count_points(lambda: bd.diagnose(NAN_CELL, fi.make_namespace(), engine=engine))
        tried = 0
        for k in range(1, points + 1, max(1, points // 40)):
            ns = fi.make_namespace()
            fired, report = fi.interrupt_at(k, lambda: bd.diagnose(NAN_CELL, ns, engine=engine))
            if not fired:
                continue
            tried += 1
            assert isinstance(report, bd.Report), (k, report)
            # The cell ran (the handler did not stop it) and it ran under the capture: its NaN is found.
            assert report.findings and report.findings[0].kind == "nonfinite", (k, str(report))
            assert report.trace.op_count > 0, k
        assert tried > 10
        assert noted  # the Ctrl-Cs reached the cell's handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_held_during_set_up_is_handed_to_the_cells_handler_and_said(engine, monkeypatch):
    """A Ctrl-C noted while the doctor set itself up reaches the cell's handler before its first line; the
    report says so (and, with the default handler, that the cell did not run)."""
    from backward_doctor.util import process

    real = process.interrupts_allowed

    def with_pending():  # a Ctrl-C arrived during set-up (held back by the doctor)
        process.HOLD.pending = process.HOLD.active or process.HOLD.pending
        return real()

    monkeypatch.setattr(process, "interrupts_allowed", with_pending)
    import backward_doctor.capture.runner as runner

    monkeypatch.setattr(runner, "interrupts_allowed", with_pending)
    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda s, f: noted.append(s))
    try:
        report = bd.diagnose(NAN_CELL, fi.make_namespace(), engine=engine)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert noted and report.findings[0].kind == "nonfinite"
    assert any("Ctrl-C" in n and "ran under" in n for n in report.trace.notes), report.trace.notes
    report = bd.diagnose(NAN_CELL, fi.make_namespace(), engine=engine)
    assert report.trace.exception.type == "KeyboardInterrupt" and report.trace.op_count == 0
    assert any("did not run" in n for n in report.trace.notes), report.trace.notes


# --------------------------------------------------------------------------- 7. the cell's own wrapper stays
def test_the_cells_own_wrapper_of_autograd_backward_stays(engine):
    real = torch.autograd.backward
    cell = ("import torch\norig = torch.autograd.backward\ncalls = []\n"
            "def mine(*a, **k):\n    calls.append(1)\n    return orig(*a, **k)\n"
            "torch.autograd.backward = mine\n"
            "w = torch.ones(3, requires_grad=True)\n(w * 2).sum().backward()\n")
    ns: dict = {}
    try:
        report = bd.diagnose(cell, ns, engine=engine)
        assert report.ok, str(report)
        assert torch.autograd.backward is ns["mine"]  # what the cell installed is still there
        (torch.ones(2, requires_grad=True) * 3).sum().backward()  # and it still works, through ours inert
        assert len(ns["calls"]) == 2
    finally:
        torch.autograd.backward = real
    report = bd.diagnose("import torch\nw = torch.ones(3, requires_grad=True)\n(w * 2).sum().backward()\n", {},
                         engine=engine)
    assert report.ok and torch.autograd.backward is real


def test_the_collective_recorder_leaves_the_scripts_own_wrapper_too():
    from backward_doctor.capture.recorder.collectives import CollectiveRecorder

    real = torch.autograd.backward

    def mine(*a, **k):
        return inner(*a, **k)
    try:
        with CollectiveRecorder():
            inner = torch.autograd.backward
            torch.autograd.backward = mine
        assert torch.autograd.backward is mine
    finally:
        torch.autograd.backward = real
    with CollectiveRecorder():
        pass
    assert torch.autograd.backward is real


# --------------------------------------------------------------------------- 8. a KeyboardInterrupt a hook raises
def test_a_keyboard_interrupt_raised_by_a_tensor_hook_is_not_a_hang(engine):
    cell = ("def stop(grad):\n    raise KeyboardInterrupt('stop here')\n"
            "w = torch.ones(3, requires_grad=True)\nh = w * 2\nh.register_hook(stop)\nh.sum().backward()\n")
    report = bd.diagnose(cell, {"torch": torch}, engine=engine)
    assert report.trace.exception.type == "KeyboardInterrupt"
    assert report.findings and report.findings[0].kind != "hang", str(report)
    assert report.findings[0].line == 2, str(report)  # the line that raised it
    assert "hang" not in str(report).split("\n")[0].lower()


def test_a_real_ctrl_c_is_still_a_hang(engine):
    cell = "import time\nwhile True:\n    time.sleep(0.01)\n"
    report = bd.diagnose(cell, {}, engine=engine, timeout=1)
    assert report.findings[0].kind == "hang"


# --------------------------------------------------------------------------- 12. a dispatch mode left on
class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_the_cell_leaves_on_stays_on_and_the_doctors_goes(engine):
    before = torch._C._len_torch_dispatch_stack()
    cell = "mode = Mode()\nmode.__enter__()\nw = torch.ones(3, requires_grad=True)\n(w * 2).sum().backward()\n"

    def stack():
        return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]

    def leave_modes() -> None:
        # (each mode the cell left on leaves through its __exit__: popped raw, torch's module-level "a dispatch
        # mode is on" flags would stay set, and every later torch.compile in this process would run eagerly)
        while torch._C._len_torch_dispatch_stack() > before:
            torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1).__exit__(None, None, None)

    plain = {"torch": torch, "Mode": _Counting}
    try:
        exec(cell, plain)
    finally:
        leave_modes()
    ns = {"torch": torch, "Mode": _Counting}
    try:
        report = bd.diagnose(cell, ns, engine=engine)
        assert stack()[before:] == [ns["mode"]], stack()  # the user's mode is on, the doctor's is gone
        assert ns["mode"].ops == plain["mode"].ops  # it saw the cell's ops, and none of the doctor's
        torch.ones(2)
        assert ns["mode"].ops == plain["mode"].ops + 1  # and it sees what runs after the cell
        assert report.ok, str(report)
        if engine == "python":
            assert any("dispatch mode" in n for n in report.trace.notes), report.trace.notes
    finally:
        leave_modes()
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    assert not is_in_torch_dispatch_mode()  # (the doctor handed torch's flags on when it left from under the mode)


# --------------------------------------------------------------------------- 14. no warnings of the doctor's own
def test_the_doctor_prints_no_warning_a_plain_run_does_not(engine):
    """Parameters turned into non-leaves (an EMA updated with grad on): PyTorch warns when ``.grad`` of a
    non-leaf is read; the doctor's own reads must not."""
    cell = ("opt.zero_grad()\nloss = (student(x) - teacher(x).detach()).pow(2).mean()\nloss.backward()\nopt.step()\n"
            "for t, s in zip(teacher.parameters(), student.parameters()):\n    t.mul_(0.99).add_(0.01 * s)\n")

    def namespace():
        torch.manual_seed(0)
        student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        for p in teacher.parameters():
            p.requires_grad_(False)
        return {"student": student, "teacher": teacher, "x": torch.randn(8, 4),
                "opt": torch.optim.SGD(student.parameters(), lr=0.1)}

    def caught(run):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            run()
        return sorted({str(w.message)[:80] for w in got})

    ns_plain = namespace()
    plain = caught(lambda: [exec(cell, ns_plain) for _ in range(3)])
    ns = namespace()
    doctored = caught(lambda: [bd.diagnose(cell, ns, engine=engine) for _ in range(3)])
    assert not ns["teacher"][0].weight.is_leaf  # (the situation: parameters that became non-leaves)
    assert doctored == plain
