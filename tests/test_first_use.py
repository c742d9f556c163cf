"""A newcomer's first minutes: the native recorder is built once per torch version and then simply there,
whatever ninja or shell the next process finds, and loading it prints nothing; ``make lab`` starts
JupyterLab with the venv first on PATH, as root too, without another app's banner.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from backward_doctor import native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD = ("import logging; logging.basicConfig()\n"  # a notebook whose libraries set up logging shows warnings
        "from backward_doctor import native\n"
        "m = native.load()\n"
        "import sys\n"
        "print(m is not None, native.status()['build_s'], native.status()['reason'],\n"
        "      'torch.utils.cpp_extension' in sys.modules)\n")


def _without_venv_path() -> str:
    """PATH as a shell outside the venv has it: the system's ninja (if any) found first, not pip's."""
    venv_bin = os.path.dirname(sys.executable)
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)


@pytest.mark.skipif(not native.enabled() or native.load() is None, reason="the native recorder is not built here")
def test_the_cached_recorder_loads_silently_with_another_ninja_and_a_cuda_home(tmp_path):
    """Two ninjas (the venv's pip one, 1.13; Debian's, 1.11) hash build commands differently, so letting ninja
    decide rebuilt the recorder each time the other one ran. The cached build is now loaded by Python's
    importer: nothing is rebuilt, nothing printed, also with a CUDA_HOME (where a CUDA wheel's
    ``cpp_extension`` logs "No CUDA runtime is found" on a machine without a GPU)."""
    so = native.built_file()
    before = os.stat(so).st_mtime_ns
    cuda_home = tmp_path / "cuda"
    cuda_home.mkdir()
    env = {**os.environ, "PATH": _without_venv_path(), "CUDA_HOME": str(cuda_home)}
    proc = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Loaded, not built, no reason, and torch's build helper never imported: on a CUDA wheel its import logs
    # "No CUDA runtime is found" on a machine without a GPU.
    assert proc.stdout.split() == ["True", "None", "None", "False"], proc.stdout
    assert proc.stderr == ""                                              # no "compiling", no CUDA line
    assert os.stat(so).st_mtime_ns == before


def test_the_build_directory_depends_on_torch_and_the_source_not_on_the_shell(tmp_path):
    """The same key from a process whose PATH has no venv and whose working directory is elsewhere; a
    different recorder source gets its own directory (a stale binary is never loaded for new source)."""
    code = "from backward_doctor import native; print(native.cache_key())"
    keys = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PATH": path}, capture_output=True,
                           text=True, timeout=300, cwd=cwd).stdout.strip()
            for path, cwd in ((os.environ.get("PATH", ""), ROOT), (_without_venv_path(), str(tmp_path)))}
    assert keys == {native.cache_key()}
    other = tmp_path / "recorder.cpp"
    other.write_text("// another recorder\n")
    code = f"from backward_doctor import native; native._SOURCE = {str(other)!r}; print(native.cache_key())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300).stdout.strip() != native.cache_key()


def test_a_first_build_says_what_it_will_take_and_records_what_it_took(monkeypatch, tmp_path, capfd):
    """In the main thread a build announces itself once with the time the last build here took; a build
    that fails leaves its last error line as the reason, and nothing of the compiler's output."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    native._write_stamp(71.2)
    monkeypatch.setattr(native, "_SOURCE", str(tmp_path / "broken.cpp"))
    (tmp_path / "broken.cpp").write_text("#error broken on purpose\n")
    for name, value in (("_module", None), ("_reason", None), ("_build_s", None)):
        monkeypatch.setattr(native, name, value)
    assert native.needs_build()
    assert native.load() is None
    err = capfd.readouterr().err
    assert err.count("compiling the native recorder (once per torch version; the last build on this machine "
                     "took 71 s)") == 1
    assert "#error" not in err and "c++ -MMD" not in err
    assert native.status()["reason"] == ("RuntimeError: Error building extension 'backward_doctor_native' "
                                         "(broken.cpp:1:2: error: #error broken on purpose)")
    assert native.last_build_seconds() == 71.2                          # a failed build records no time


def test_make_lab_serves_with_the_venv_first_on_path_without_the_classic_banner(tmp_path):
    """``make lab LAB_ARGS=--no-browser`` as a newcomer types it: it runs as root (``--allow-root`` added
    there), JupyterLab's own lines come first (no classic-Notebook upgrade banner), and the server (so its
    kernels) has the venv's bin first on PATH, where pip's ninja is."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "lab.log"
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "PATH": _without_venv_path(), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    with open(log, "w") as out:
        # -o setup: the venv is the one running this test; make must not reinstall it.
        proc = subprocess.Popen(["make", "-s", "-o", "setup", f"VENV={venv}", "lab",
                                 f"LAB_ARGS=--no-browser --port={port} --ServerApp.port_retries=0"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "is running at" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert "is running at" in text, text[-3000:]
        assert "Use --allow-root" not in text and "migration plan" not in text
        server = subprocess.run(["pgrep", "-s", str(proc.pid), "-f", "jupyter"], capture_output=True, text=True)
        pids = server.stdout.split()
        assert pids, text[-2000:]
        environ = open(f"/proc/{pids[-1]}/environ", "rb").read().split(b"\0")
        path = next(e for e in environ if e.startswith(b"PATH=")).decode()[5:]
        assert path.split(os.pathsep)[0] == os.path.join(venv, "bin")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
