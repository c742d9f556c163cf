"""A DataLoader worker's own ``SIGUSR2`` (issue 46, item 13): the doctor asks a stuck worker for its stacks
without running a handler the user installed (in ``worker_init_fn``, in a fetch, or inherited from the main
process by the fork), and such a handler stays the user's, running exactly when the user's code raises the
signal. Both engines; every hang is bounded by the diagnosis's ``timeout``; worker processes a test leaves are
ended by pid when it ends.
"""
from __future__ import annotations

import functools
import os
import signal
import threading

import pytest
import torch

import backward_doctor as bd
import library_loops as ll
from test_dataloader_workers import no_stray_workers  # noqa: F401  (the fixture, autouse)

DATASETS = """\
import os, signal
import torch


def note(path, signum, frame):
    with open(path, "a") as fh:
        fh.write(f"the user's handler ran in {os.getpid()}\\n")


def take_sigusr2(path, worker_id):
    '''A worker_init_fn that installs its own SIGUSR2 handler (a profiler's, a log rotation's).'''
    signal.signal(signal.SIGUSR2, lambda s, f: note(path, s, f))


class Held(torch.utils.data.Dataset):
    '''Samples behind a lock another thread held when the worker was forked (so it waits forever there);
    ``take_at``: the index whose fetch installs the user's SIGUSR2 handler first.'''

    def __init__(self, lock, path, take_at=None, free=()):
        self.lock, self.path, self.take_at, self.free = lock, path, take_at, set(free)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == self.take_at:
            take_sigusr2(self.path, None)
        if i not in self.free:
            with self.lock:  # <-- waits
                pass
        return torch.full((4,), float(i))


class Signalled(torch.utils.data.Dataset):
    '''Each fetch raises SIGUSR2 in its own process and returns how often the user's handler has run there.'''

    count = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGUSR2)
        return torch.full((4,), float(Signalled.count))


def count(signum, frame):
    Signalled.count += 1
"""

LOOP = """\
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
for x in loader:
    seen.append(x.clone())
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
"""


@pytest.fixture
def d():
    return ll.define(DATASETS, {}, name="worker_signal_datasets")


def _held_lock():
    lock, release = threading.Lock(), threading.Event()

    def hold():
        with lock:
            release.wait(120)
    threading.Thread(target=hold, daemon=True).start()
    while not lock.locked():
        pass
    return lock, release


def _stuck(d, engine, tmp_path, **kw):
    """The loop over ``Held`` with one worker, stuck; (report, what the user's handler wrote)."""
    marks = tmp_path / "handler.log"
    lock, release = _held_lock()
    try:
        loader = torch.utils.data.DataLoader(d["Held"](lock, str(marks), **kw.pop("dataset", {})), batch_size=1,
                                             num_workers=1, **kw)
        report = bd.diagnose(LOOP, {"torch": torch, "loader": loader}, engine=engine, timeout=3)
    finally:
        release.set()
    return report, marks.read_text() if marks.exists() else ""


def _photographed_at_the_lock(d, report) -> None:
    f = report.findings[0]
    assert report.trace.timed_out and f.kind == "dataloader_worker", str(report)
    assert (f.line, f.function) == (ll.marked_line(d, "Held", "# <-- waits"), "Held.__getitem__"), str(report)
    assert f.evidence["state"] == "fetching" and report.trace.loaders[0].photographed


def test_a_stuck_worker_whose_init_took_sigusr2_is_photographed_without_running_its_handler(d, engine, tmp_path):
    marks = tmp_path / "handler.log"
    report, ran = _stuck(d, engine, tmp_path, worker_init_fn=functools.partial(d["take_sigusr2"], str(marks)))
    assert ran == ""  # the stack request never ran the user's handler
    _photographed_at_the_lock(d, report)


def test_a_handler_taken_in_a_fetch_moves_the_stack_request_before_the_next_task(d, engine, tmp_path):
    report, ran = _stuck(d, engine, tmp_path, dataset={"take_at": 0, "free": {0}})
    assert ran == ""
    _photographed_at_the_lock(d, report)
    assert len(report.trace.loaders[0].workers) == 1


def test_a_sigusr2_handler_the_workers_inherit_stays_theirs_and_a_hang_is_still_photographed(d, engine, tmp_path):
    marks = tmp_path / "handler.log"
    previous = signal.signal(signal.SIGUSR2, functools.partial(d["note"], str(marks)))
    try:
        report, ran = _stuck(d, engine, tmp_path)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert ran == ""
    _photographed_at_the_lock(d, report)


@pytest.mark.parametrize("where", ["inherited", "worker_init_fn"])
def test_the_users_own_sigusr2_runs_its_handler_in_the_worker_as_without_the_doctor(d, engine, where):
    def run(doctored: bool) -> list[float]:
        kw = {"worker_init_fn": lambda wid: signal.signal(signal.SIGUSR2, d["count"])} if where != "inherited" else {}
        loader = torch.utils.data.DataLoader(d["Signalled"](), batch_size=1, num_workers=1, **kw)
        ns = {"torch": torch, "loader": loader}
        if doctored:
            report = bd.diagnose(LOOP, ns, engine=engine, timeout=120)
            assert report.findings == [], str(report)
        else:
            exec(LOOP, ns)
        return [float(x[0, 0]) for x in ns["seen"]]
    previous = signal.signal(signal.SIGUSR2, d["count"]) if where == "inherited" else None
    try:
        plain, doctored = run(False), run(True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGUSR2, previous)
    assert plain == doctored == [1.0, 2.0, 3.0, 4.0]
