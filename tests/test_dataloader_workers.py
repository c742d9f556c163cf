"""DataLoader workers (``num_workers > 0``): a worker's own error, line and dataset index; a stuck worker
told from a stuck main process; a batch lost to a tensor requiring grad; a worker that died; and the
correct loaders beside them silent and bit-identical (persistent workers, a padding collate, pin_memory,
a custom ``worker_init_fn``, the ``spawn``/``forkserver`` start methods), on both engines, in plain loops
and inside ``transformers.Trainer``, Lightning ``fit`` and an Accelerate loop.

Every hang is bounded by the diagnosis's ``timeout``; worker processes a test leaves are ended by the
``no_stray_workers`` fixture (the test process's own children, by pid).
"""
from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import backward_doctor as bd
import library_loops as ll

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATASETS = """\
import os
import torch
import torch.nn.functional as F


class Numbers(torch.utils.data.Dataset):
    '''n samples (x, y) made from the index (x: d numbers, y: a class), so any worker makes the same sample.'''

    def __init__(self, n=32, d=16, classes=5, bad=(), lock=None, encoder=None, no_grad=False, ragged=False,
                 die_at=None):
        self.n, self.d, self.classes, self.bad, self.lock = n, d, classes, set(bad), lock
        self.encoder, self.no_grad, self.ragged, self.die_at = encoder, no_grad, ragged, die_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"sample {i} is corrupt")  # <-- raises
        if i == self.die_at:
            os.kill(os.getpid(), 9)  # <-- dies
        if self.lock is not None:
            with self.lock:  # <-- waits
                pass
        x = torch.linspace(-1, 1, self.d) * (i + 1) / self.n
        if self.encoder is not None and self.no_grad:
            with torch.no_grad():
                x = self.encoder(x)
        elif self.encoder is not None:
            x = self.encoder(x)  # <-- graph
        if self.ragged:
            x = x[: self.d - i % 3]
        return x, torch.tensor(i % self.classes)


def stack_collate(batch):
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.stack(ys)


def pad_collate(batch):
    xs, ys = zip(*batch)
    width = max(len(x) for x in xs)
    return torch.stack([F.pad(x, (0, width - len(x))) for x in xs]), torch.stack(ys)
"""

LOOP = """\
torch.manual_seed(0)
model = torch.nn.Linear(16, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = []
for x, y in loader:
    batches.append((x.clone(), y.clone()))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
#: two epochs over a persistent loader (its workers started once), the same step
EPOCHS = LOOP.replace("for x, y in loader:", "for epoch in range(2):\n  for x, y in loader:").replace(
    "\n    ", "\n      ")


@pytest.fixture(autouse=True)
def no_stray_workers():
    """Workers a test leaves (a hang's, a persistent loader's) are ended when it ends: this process's own
    children, terminated by pid, then joined."""
    yield
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(10)




def _datasets() -> dict:
    return ll.define(DATASETS, {}, name="datasets")


def _loader(ds, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 2)
    return torch.utils.data.DataLoader(ds, **kw)


def _line(ns: dict, marker: str) -> int:
    return ll.marked_line(ns, "Numbers", marker)


# ----------------------------------------------------------------------------- a worker raises
def test_worker_error_names_worker_index_and_line(engine):
    d = _datasets()
    ns = {"torch": torch, "loader": _loader(d["Numbers"](bad={6}))}
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=60)
    f = report.findings[0]
    assert f.kind == "dataloader_worker", str(report)
    assert (f.line, f.function) == (_line(d, "# <-- raises"), "Numbers.__getitem__")
    assert f.file.endswith(".py") and f.cell_line == 5                       # called from the cell's `for`
    assert f.evidence["task"] == "dataset[6]" and f.evidence["worker"] == 1  # the exact index, not the batch
    assert "sample 6 is corrupt" in f.message and "Caught ValueError in DataLoader worker process 1" in f.message
    assert report.exception.startswith("ValueError: Caught ValueError")      # the user's error, unchanged
    text = str(report)
    assert "DataLoader workers: DataLoader(Numbers, batch_size=4, num_workers=2)" in text
    assert "Numbers.__getitem__: raise ValueError" in text


def test_default_collate_of_ragged_samples_asks_for_a_padding_collate(engine):
    d = _datasets()
    ns = {"torch": torch, "loader": _loader(d["Numbers"](ragged=True))}
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=60)
    f = report.findings[0]
    assert f.kind == "dataloader_worker" and f.line == 5 and f.file is None  # no line of the user's in the worker
    # In a worker default_collate stacks into shared memory sized for the first sample: torch's words are
    # about a storage that cannot be resized; the finding says what that means.
    assert "resize storage that is not resizable" in f.message and "different sizes" in f.message
    assert "collate_fn=pad_collate" in f.message
    assert f.evidence["task"] == "batch [0, 1, 2, 3]"


def test_correct_persistent_workers_with_padding_collate_are_silent_and_bit_identical(engine):
    d = _datasets()

    def run(doctor: bool):
        torch.manual_seed(0)
        ns = {"torch": torch, "loader": _loader(d["Numbers"](ragged=True), collate_fn=d["pad_collate"],
                                                persistent_workers=True, pin_memory=True)}
        if doctor:
            report = bd.diagnose(EPOCHS, ns, engine=engine, timeout=120)
            assert report.findings == [] and report.exception is None, str(report)
            assert report.trace.loaders == []
        else:
            exec(EPOCHS, ns)
        return ns

    plain, doctored = run(False), run(True)
    assert len(plain["batches"]) == len(doctored["batches"]) == 16
    for (x0, y0), (x1, y1) in zip(plain["batches"], doctored["batches"]):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    for p0, p1 in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p0, p1)


# ----------------------------------------------------------------------------- a worker hangs
def _held_lock():
    """A lock another thread holds (and keeps) while the loader forks its workers."""
    lock, release = threading.Lock(), threading.Event()

    def hold():
        with lock:
            release.wait(120)
    t = threading.Thread(target=hold, name="cache-refresher", daemon=True)
    t.start()
    while not lock.locked():
        pass
    return lock, release


def _diagnose_on_held_lock(engine: str, num_workers: int, before=lambda: None, **kw):
    """The loop over a dataset that takes a lock another thread holds: (the datasets' namespace, report)."""
    d = _datasets()
    lock, release = _held_lock()
    try:
        ns = {"torch": torch, "loader": _loader(d["Numbers"](lock=lock), num_workers=num_workers)}
        before()
        return d, bd.diagnose(LOOP, ns, engine=engine, **kw)
    finally:
        release.set()


def test_worker_stuck_on_a_lock_copied_at_fork_is_named_in_the_worker(engine):
    d, report = _diagnose_on_held_lock(engine, 1, timeout=3)
    f = report.findings[0]
    assert report.trace.timed_out
    assert f.kind == "dataloader_worker", str(report)
    assert (f.line, f.function) == (_line(d, "# <-- waits"), "Numbers.__getitem__")
    assert f.evidence["state"] == "fetching" and f.evidence["task"] == "batch [0, 1, 2, 3]"
    assert "the main process is not the one that hangs" in f.message and "fork" in f.message
    assert report.trace.loaders[0].photographed and report.trace.loaders[0].workers[0].waited_on
    assert "Numbers.__getitem__: with self.lock:" in str(report)


def test_ctrl_c_on_a_stuck_worker_photographs_it_after_the_interrupt(engine):
    """No timeout: the user interrupts the cell (Jupyter's stop button). The workers are still alive after
    the interrupt (the traceback holds the iterator), so they are asked for their stacks then."""
    import _thread

    done = threading.Event()

    def press_stop() -> None:
        """Ctrl-C once the loader's worker exists and the cell has waited on it for a while."""
        while not multiprocessing.active_children() and not done.wait(0.05):
            pass
        if not done.wait(1.5):
            _thread.interrupt_main()
    try:
        d, report = _diagnose_on_held_lock(engine, 1, threading.Thread(target=press_stop, daemon=True).start)
    finally:
        done.set()
    f = report.findings[0]
    assert report.exception.startswith("KeyboardInterrupt") and not report.trace.timed_out
    assert f.kind == "dataloader_worker" and f.line == _line(d, "# <-- waits"), str(report)
    assert report.trace.loaders[0].photographed


def test_the_same_lock_in_the_main_process_is_a_main_process_hang(engine):
    """num_workers=0: the dataset runs in the main process, and the hang is the main thread's."""
    d, report = _diagnose_on_held_lock(engine, 0, timeout=2)
    f = report.findings[0]
    assert f.kind == "hang" and f.line == _line(d, "# <-- waits") and not report.trace.loaders


def test_batch_that_requires_grad_is_lost_and_the_dataset_line_named(engine):
    """A feature extractor run with gradients on in the dataset: the worker cannot send the batch (an
    autograd graph cannot cross processes), multiprocessing drops it, the main process waits forever."""
    d = _datasets()
    torch.manual_seed(0)
    encoder = torch.nn.Linear(16, 16)
    ns = {"torch": torch, "loader": _loader(d["Numbers"](encoder=encoder), collate_fn=d["stack_collate"])}
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=3)
    f = report.findings[0]
    assert f.kind == "dataloader_worker" and f.title == "A DataLoader batch was lost", str(report)
    assert (f.line, f.function) == (_line(d, "# <-- graph"), "Numbers.__getitem__")
    assert "with torch.no_grad(): x = self.encoder(x)" in f.message
    assert f.evidence["state"] == "could not send"


def test_dataset_running_a_module_under_no_grad_is_silent(engine):
    d = _datasets()
    torch.manual_seed(0)
    encoder = torch.nn.Linear(16, 16)
    ns = {"torch": torch, "loader": _loader(d["Numbers"](encoder=encoder, no_grad=True),
                                            collate_fn=d["stack_collate"])}
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=60)
    assert report.findings == [] and report.exception is None, str(report)


# ----------------------------------------------------------------------------- a worker dies
def test_killed_worker_is_named_with_what_it_was_loading(engine):
    d = _datasets()
    ns = {"torch": torch, "loader": _loader(d["Numbers"](die_at=5))}
    report = bd.diagnose(LOOP, ns, engine=engine, timeout=60)
    f = report.findings[0]
    # (torch says it one of two ways, whichever notices first: its check of the workers while it waits for a
    # batch, "exited unexpectedly", or its SIGCHLD handler, "is killed by signal", raised anywhere in the loop)
    said = "exited unexpectedly" in report.exception or "is killed by signal" in report.exception
    assert f.kind == "dataloader_worker" and said, str(report)
    assert "SIGKILL" in f.message and f.evidence["worker"] == 1 and f.evidence["task"] == "batch [4, 5, 6, 7]"


# ----------------------------------------------------------------------------- nothing changes
def seeded_init(worker_id: int) -> None:
    """A user's worker_init_fn (importable, for spawn): seeds Python's RNG per worker."""
    random.seed(1000 + worker_id)


class Augmented(torch.utils.data.Dataset):
    """Random augmentation drawn in the worker from torch's and Python's RNGs (seeded per worker)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        x = torch.full((16,), float(i)) + torch.rand(16) + random.random()
        return x, torch.tensor(i % 5)


@pytest.mark.parametrize("engine,context", [("native", "fork"), ("python", "fork"), ("native", "spawn"),
                                            ("python", "forkserver")])
def test_batches_and_weights_bit_identical_across_start_methods(engine, context):

    def run(doctor: bool):
        torch.manual_seed(0)
        loader = _loader(Augmented(), num_workers=2, worker_init_fn=seeded_init, persistent_workers=True,
                         multiprocessing_context=context)
        ns = {"torch": torch, "loader": loader}
        if doctor:
            report = bd.diagnose(EPOCHS, ns, engine=engine, timeout=300)
            assert report.findings == [] and report.exception is None, str(report)
        else:
            exec(EPOCHS, ns)
        return ns

    plain, doctored = run(False), run(True)
    assert len(doctored["batches"]) == 8
    for (x0, y0), (x1, y1) in zip(plain["batches"], doctored["batches"]):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    for p0, p1 in zip(plain["model"].parameters(), doctored["model"].parameters()):
        assert torch.equal(p0, p1)


class Probe(torch.utils.data.Dataset):
    """What a worker has installed while it loads: the doctor's dispatch mode or recorder, anomaly mode,
    the watch (faulthandler on SIGUSR2 and the rest, undone together), torch's ExceptionWrapper."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        from torch._utils import ExceptionWrapper

        from backward_doctor import native
        from backward_doctor.capture.workers import worker_side

        recording = native._module is not None and native._module.running()
        return torch.tensor([torch._C._len_torch_dispatch_stack(), int(recording), int(torch.is_anomaly_enabled()),
                             int(worker_side._state is not None),
                             int(ExceptionWrapper.__init__.__module__ != "torch._utils")])


def test_forked_workers_record_nothing_and_persistent_ones_end_up_undiagnosed(engine):
    loader = _loader(Probe(), batch_size=1, num_workers=1, persistent_workers=True)
    ns = {"torch": torch, "loader": loader}
    report = bd.diagnose("during = [b for b in loader]", ns, engine=engine, timeout=60)
    assert report.findings == [], str(report)
    during = torch.cat(ns["during"])
    assert during[:, :2].sum() == 0           # neither the dispatch mode nor the recorder was copied into it
    assert during[:, 2:].all()                # the doctor's watch was in place during the run
    after = torch.cat([b for b in loader])    # the same persistent worker, after the run
    assert after.sum() == 0, after            # everything it had is off again


# ----------------------------------------------------------------------------- the command line
def test_cli_correct_script_with_workers_prints_one_ok_report(tmp_path):
    """Issue 25 item 6: a forked worker's `os._exit` at its end was reported as a PROBLEM, once per worker."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        ds = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
        model = torch.nn.Linear(8, 1)
        for x, y in torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2):
            torch.nn.functional.mse_loss(model(x), y).backward()
    """))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", str(script)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("backward_doctor: OK") and proc.stdout.count("backward_doctor:") == 1, proc.stdout
    assert "PROBLEM" not in proc.stdout and "os._exit" not in proc.stdout


def test_cli_names_the_workers_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch

        class Samples(torch.utils.data.Dataset):
            def __len__(self):
                return 16

            def __getitem__(self, i):
                return torch.ones(4) / (i - 9)  if i != 9 else torch.tensor([1.0])[5]

        for x in torch.utils.data.DataLoader(Samples(), batch_size=4, num_workers=2):
            pass
    """))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "backward_doctor", str(script)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 1
    assert "PROBLEM - IndexError in DataLoader worker 0 at train.py, line 9, in Samples.__getitem__" in proc.stdout, \
        proc.stdout
    assert "loading dataset[9]" in proc.stdout
