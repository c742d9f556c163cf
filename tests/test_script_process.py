"""``python -m backward_doctor run SCRIPT.py`` as a process, where the doctor's side meets a hostile place
(issue 46, items 6, 11, 12, 15): a report that cannot be written, a home where the native recorder's cache
cannot be made, the script's own ``sys.excepthook``, a Ctrl-C, SIGTERM/SIGHUP with DataLoader workers
running, and the globals and ``sys.argv`` the script sees, each compared with ``python SCRIPT.py``.

Every subprocess is bounded by a generous timeout; every wait is a bounded poll, nothing asserts on wall time.
"""
from __future__ import annotations

import glob
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
LIMIT_S = 600

TRAIN = """\
import sys, torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(16, 4)
def main(n, bad):
    for i in range(n):
        opt.zero_grad()
        out = model(x)
        if i == bad:
            out = torch.log(out - out.max())   # <-- NaN
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
    if bad == -2:
        raise ValueError("the data ran out")
    print("done", sys.argv[1:], model[0].weight.sum().item())
if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
"""


def _env(**extra: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, cwd=cwd, env=env or _env(), **kw)


def _doctor(script: Path, *args: str, out: Path | None = None, **kw) -> subprocess.CompletedProcess:
    extra = ["--output-dir", str(out)] if out is not None else []
    return _run([sys.executable, "-m", "backward_doctor", "run", *extra, str(script), *args], script.parent, **kw)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN, encoding="utf-8")
    return path


# ------------------------------------------------------------------ 6. the report cannot be written
def _folder_in_the_way(out: Path) -> dict:
    (out / "backward_doctor-report.json").mkdir(parents=True)
    return {}


def _disk_full(out: Path) -> dict:
    """No file may grow past 2 KiB (RLIMIT_FSIZE: the write fails with EFBIG, as on a full disk or a quota;
    Python ignores SIGXFSZ, so it is an OSError). The script writes no file, the pipes are not files."""
    out.mkdir()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
    return {"preexec_fn": limit}


@pytest.mark.parametrize("place", [_folder_in_the_way, _disk_full], ids=["a folder in the way", "disk full"])
@pytest.mark.parametrize("case", ["raises", "nan"])
def test_a_report_that_cannot_be_written_is_shown_and_the_scripts_outcome_stands(script, tmp_path, place, case):
    out = tmp_path / "reports"
    kw = place(out)
    args = ("5", "-2") if case == "raises" else ("20", "13")
    plain = _run([sys.executable, str(script), *args], tmp_path, **kw)
    done = _doctor(script, *args, out=out, **kw)
    assert done.returncode == plain.returncode == (1 if case == "raises" else 0), done.stderr[-3000:]
    assert done.stdout == plain.stdout
    head = "backward_doctor: PROBLEM - " + ("ValueError" if case == "raises" else "NaN/Inf created here at train.py")
    assert done.stderr.startswith(head), done.stderr[-3000:]
    said = [ln for ln in done.stderr.splitlines() if "not saved" in ln or "saved only in part" in ln]
    # (a folder at the JSON's name leaves the page written: the line says which file is there)
    head = (f"backward_doctor: the report above is saved only in part: {out / 'backward_doctor-report.html'} was "
            "written, the rest could not be (" if place is _folder_in_the_way else
            f"backward_doctor: the report above is not saved: it could not be written to {out} (")
    assert len(said) == 1 and said[0].startswith(head), done.stderr[-3000:]
    assert ("Is a directory" if place is _folder_in_the_way else "File too large") in said[0]
    if case == "raises":  # the script's own traceback, last and whole, as python printed it
        report, _, trace = done.stderr.partition("Traceback (most recent call last):")
        assert trace == plain.stderr.partition("Traceback (most recent call last):")[2]
        assert trace.rstrip().endswith("ValueError: the data ran out") and "backward_doctor" not in trace
    else:
        assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ 11. no cache folder for the recorder
def _home_is_a_file(tmp: Path) -> dict:
    (tmp / "home").write_text("not a folder")
    return {"HOME": str(tmp / "home"), "XDG_CACHE_HOME": None}


def _cache_is_a_file(tmp: Path) -> dict:
    (tmp / "cache").write_text("not a folder")
    return {"XDG_CACHE_HOME": str(tmp / "cache")}


def _home_read_only(tmp: Path) -> dict:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (tmp / "home").mkdir()
    (tmp / "home").chmod(0o500)
    return {"HOME": str(tmp / "home"), "XDG_CACHE_HOME": None}


HOMES = pytest.mark.parametrize("home", [_home_is_a_file, _cache_is_a_file, _home_read_only],
                                ids=["HOME a file", "XDG_CACHE_HOME a file", "HOME read-only"])


def _no_cache_env(tmp_path: Path, home) -> dict[str, str]:
    return _env(TORCH_EXTENSIONS_DIR=None, BACKWARD_DOCTOR_NATIVE=None, IPYTHONDIR=str(tmp_path / "ipython"),
                MPLCONFIGDIR=str(tmp_path / "mpl"), **home(tmp_path))


WHY = "its cache folder cannot be made"


@HOMES
def test_run_without_a_cache_folder_records_on_the_python_tier_and_says_why(script, tmp_path, home):
    env = _no_cache_env(tmp_path, home)
    done = _doctor(script, "5", "-2", out=tmp_path / "reports", env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.startswith("backward_doctor: PROBLEM - ValueError"), done.stderr[-3000:]
    assert done.stderr.count(WHY) == 1 and "recorded by the Python recorder" in done.stderr
    assert done.stderr.rstrip().endswith("ValueError: the data ran out")


DIAGNOSE = """\
import backward_doctor as bd, torch
from backward_doctor import native
ns = {"torch": torch}
r = bd.diagnose("x = torch.ones(3, requires_grad=True)\\n(x * 2).sum().backward()", ns)
print("ENGINE", r.trace.engine, r.ok)
print("REASON", native.status()["reason"])
print(r)
"""


@HOMES
def test_diagnose_without_a_cache_folder_records_on_the_python_tier_and_says_why(tmp_path, home):
    done = _run([sys.executable, "-c", DIAGNOSE], tmp_path, env=_no_cache_env(tmp_path, home))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ENGINE python True" in done.stdout
    assert f"REASON {WHY}" in done.stdout and "set TORCH_EXTENSIONS_DIR to a writable folder" in done.stdout
    assert done.stdout.count(WHY) == 2  # the status, and the report's footer


LOAD_EXT = """\
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "backward_doctor")
ip.run_cell("import torch")
ip.run_cell_magic("backward_doctor", "", "x = torch.ones(3, requires_grad=True)\\n(x * 2).sum().backward()")
import backward_doctor as bd
print("ENGINE", bd.last_report().trace.engine, bd.last_report().ok)
"""


@HOMES
def test_load_ext_without_a_cache_folder_says_why_once_and_cells_run(tmp_path, home):
    done = _run([sys.executable, "-c", LOAD_EXT], tmp_path, env=_no_cache_env(tmp_path, home))
    assert done.returncode == 0, done.stderr[-3000:]
    said = [ln for ln in done.stdout.splitlines() if ln.startswith("backward_doctor: the Python recorder records")]
    assert len(said) == 1 and said[0].startswith("backward_doctor: the Python recorder records the ops here (the "
                                                 f"native one could not be built: {WHY} ("), done.stdout
    assert "ENGINE python True" in done.stdout, done.stdout[-3000:]


# ------------------------------------------------------------------ 12. the script's own sys.excepthook
HOOKED = TRAIN.replace("def main(n, bad):", textwrap.dedent("""\
    def crash_reporter(etype, value, tb):
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        print("CRASH REPORTER", etype.__name__, value, frames, value.__traceback__ is not None, file=sys.stderr)
        print("LAST", sys.last_type.__name__, sys.last_value is value, file=sys.stderr)
    sys.excepthook = crash_reporter
    def main(n, bad):"""))


def test_the_scripts_own_excepthook_is_called_as_python_calls_it(tmp_path):
    path = tmp_path / "hooked.py"
    path.write_text(HOOKED, encoding="utf-8")
    plain = _run([sys.executable, str(path), "5", "-2"], tmp_path)
    done = _doctor(path, "5", "-2", out=tmp_path)
    assert done.returncode == plain.returncode == 1, done.stderr[-3000:]
    assert plain.stderr == ("CRASH REPORTER ValueError the data ran out ['<module>', 'main'] True\n"
                            "LAST ValueError True\n")
    assert done.stderr.startswith("backward_doctor: PROBLEM - ValueError")
    assert done.stderr.endswith(plain.stderr) and "Traceback" not in done.stderr  # the hook, not the default


# ------------------------------------------------------------------ 15a. Ctrl-C
FOREVER = """\
import atexit, sys, torch
atexit.register(lambda: print("the script's atexit", file=sys.stderr, flush=True))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
i = 0
while True:
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    i += 1
    if i == 3:
        print("training", flush=True)
"""


def _interrupted(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """``cmd`` started with SIGINT at its default (as in a terminal, whatever this process inherited), sent
    SIGINT once it trains (the user's Ctrl-C); how it ended and its stderr."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "training", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=LIMIT_S)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def test_ctrl_c_under_run_dies_by_sigint_as_python_does(tmp_path):
    path = tmp_path / "forever.py"
    path.write_text(FOREVER, encoding="utf-8")
    code, plain = _interrupted([sys.executable, str(path)], tmp_path)
    assert code == -signal.SIGINT and plain.rstrip().endswith("KeyboardInterrupt\nthe script's atexit"), plain
    code, doctored = _interrupted([sys.executable, "-m", "backward_doctor", "run", "--output-dir", str(tmp_path),
                                   str(path)], tmp_path)
    assert code == -signal.SIGINT, doctored[-3000:]  # WIFSIGNALED, SIGINT: a shell's loop stops on it
    assert doctored.startswith("backward_doctor: PROBLEM"), doctored[-3000:]
    assert doctored.rstrip().endswith("KeyboardInterrupt\nthe script's atexit")
    assert doctored.count("Traceback (most recent call last):") == 1


# ------------------------------------------------------------------ 15b. SIGTERM / SIGHUP with workers
WORKERS = """\
import time, torch
class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 100000
    def __getitem__(self, i):
        return torch.ones(4) * i
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
loader = torch.utils.data.DataLoader(Numbers(), batch_size=4, num_workers=2)
for k, x in enumerate(loader):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if k == 3:
        print("training", flush=True)
    time.sleep(0.01)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_worker_folders_are_removed_when_run_is_ended_by_a_signal(tmp_path, sig):
    path = tmp_path / "workers.py"
    path.write_text(WORKERS, encoding="utf-8")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    setup = ("import os, signal, sys\n"  # both signals at their default, as in a terminal, then exec the run
             "signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
             "os.execv(sys.executable, [sys.executable, '-m', 'backward_doctor', 'run', sys.argv[1]])\n")
    proc = subprocess.Popen([sys.executable, "-c", setup, str(path)], cwd=tmp_path, env=_env(TMPDIR=str(tmp)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "training", proc.stderr.read()[-3000:]
        folders = glob.glob(str(tmp / "backward_doctor-workers-*"))
        assert len(folders) == 1 and os.path.isdir(folders[0])
        proc.send_signal(sig)
        proc.communicate(timeout=LIMIT_S)
        assert proc.returncode == -sig  # it ends as the signal ends python
        deadline = time.monotonic() + 120
        while os.path.exists(folders[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(folders[0]), os.listdir(folders[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


# ------------------------------------------------------------------ 15c. what the script sees
GLOBALS = """\
import os, sys
g = dict(globals())
for k in sorted(k for k in g if k.startswith("__")):
    v = g[k]
    if k == "__loader__":
        v = (type(v).__name__, v.name, v.path, v.get_filename("__main__"))
    elif k == "__builtins__":
        v = type(v).__name__
    print(k, repr(v))
print("argv", sys.argv)
print("path0", sys.path[0])
print("main", sys.modules["__main__"].__dict__ is globals())
"""


def test_argv0_and_the_main_modules_globals_are_what_python_gives(tmp_path):
    real = tmp_path / "code"
    real.mkdir()
    (real / "show.py").write_text(GLOBALS, encoding="utf-8")
    (tmp_path / "link.py").symlink_to(real / "show.py")  # sys.path[0] is the real script's folder
    for typed in ("code/show.py", "link.py", str(real / "show.py")):
        plain = _run([sys.executable, typed, "a", "--b"], tmp_path)
        done = _run([sys.executable, "-m", "backward_doctor", "run", typed, "a", "--b"], tmp_path)
        assert plain.returncode == done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == plain.stdout, (typed, done.stdout, plain.stdout)
        assert f"argv [{typed!r}, 'a', '--b']" in plain.stdout and "SourceFileLoader" in plain.stdout
