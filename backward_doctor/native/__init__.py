"""The native first tier's recorder: a C++ ``RecordFunction`` observer, compiled on first use.

The Python dispatch mode costs 1.15-1.2x a step before it records anything
(benchmarks/RESULTS.md); the same records taken from C++ cost a few percent. The
recorder is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are
needed), once per torch version: the build is cached under ``TORCH_EXTENSIONS_DIR`` (or, as
torch does, ``$XDG_CACHE_HOME/torch_extensions``, ``~/.cache/torch_extensions``) in a directory
named by what the binary depends on (the recorder's source, torch's version and build, the
Python ABI), and a cached build is loaded
by Python's own importer, without ninja: two ninjas (pip's in a venv, the system's) hash
build commands differently, and letting either decide would rebuild after the other. The
compile runs in a child process whose output is kept (torch's compiler banners, "No CUDA
runtime is found"), so loading the recorder prints nothing. Where it cannot be built (no compiler, or
no cache folder: a home that is read-only, a file, missing), or with ``BACKWARD_DOCTOR_NATIVE=0``, the
doctor uses the Python first tier and says why in ``status()``.

>>> status()["reason"] is None or isinstance(status()["reason"], str)
True
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder.cpp")
_NAME = "backward_doctor_native"
_FLAGS = ["-O3", "-DNDEBUG"]
_lock = threading.Lock()
_module: Any = None
_reason: str | None = None
_build_s: float | None = None
_thread: threading.Thread | None = None
_keys: dict[str, str] = {}  # source path -> cache key (hashed once per process)
_probed = False  # the cache folder was tried once (``_probe``)


def enabled() -> bool:
    """False when switched off with ``BACKWARD_DOCTOR_NATIVE=0``."""
    return os.environ.get("BACKWARD_DOCTOR_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _root() -> str:
    """Where torch's ``cpp_extension`` keeps builds: ``TORCH_EXTENSIONS_DIR``, else the user's cache folder
    (``XDG_CACHE_HOME`` when set to an absolute path, else ``~/.cache``)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(cache, "torch_extensions")


def _cache_words(exc: OSError) -> str:
    """Why the cache folder cannot be used, in one line (the reason ``status()`` gives).

    >>> print(_cache_words(NotADirectoryError(20, "Not a directory", "/home/me")))  # doctest: +ELLIPSIS
    its cache folder cannot be made (NotADirectoryError: Not a directory: '/home/me'); set ...
    """
    what = exc.strerror or str(exc) or "error"
    where = f": {exc.filename!r}" if exc.filename else ""
    return (f"its cache folder cannot be made ({type(exc).__name__}: {what}{where}); "
            "set TORCH_EXTENSIONS_DIR to a writable folder")


def _probe() -> None:
    """Once per process: the build directory made (a home that is a file, missing or read-only, an
    unwritable cache folder fail here); where it cannot be, that is the reason and the Python tier records."""
    global _probed, _reason
    if _probed or _module is not None or _reason is not None or not enabled():
        return
    _probed = True
    try:
        _build_dir()
    except OSError as exc:
        _reason = _cache_words(exc)
        log.info("native recorder unavailable (%s); the Python tier records the ops", _reason)


def cache_key() -> str:
    """What the compiled recorder depends on, hashed: its source, torch's version and build, the Python ABI
    and machine, the compiler flags. Not the ninja, the shell, the venv's path or torch's location: a
    second venv with the same torch reuses the build.

    >>> len(cache_key())
    12
    """
    import torch

    if _SOURCE not in _keys:
        digest = hashlib.sha1()
        with open(_SOURCE, "rb") as fh:
            digest.update(fh.read())
        digest.update(f"{torch.__version__}|{getattr(torch.version, 'git_version', '')}|"
                      f"{sys.implementation.cache_tag}|{platform.machine()}|{' '.join(_FLAGS)}".encode())
        _keys[_SOURCE] = digest.hexdigest()[:12]
    return _keys[_SOURCE]


def _build_dir() -> str:
    """The build directory of this torch version (``backward_doctor_native_2.13.0_cpu_cpython-311_<key>``);
    a lock left by a process killed while compiling is removed after 10 minutes."""
    import torch

    version = "".join(c if c.isalnum() or c == "." else "_" for c in torch.__version__)
    path = os.path.join(_root(), f"{_NAME}_{version}_{sys.implementation.cache_tag}_{cache_key()}")
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > 600:
            os.remove(lock)
    except OSError:
        pass
    return path


#: How long a build waits for another process building in the same place (a build takes well under a
#: minute, a few on a busy machine); past it, the Python tier records the ops and ``status()`` says why.
WAIT_S = 900.0


@contextlib.contextmanager
def _build_lock(path: str) -> Iterator[None]:
    """The right to build or load in ``path``: an ``flock`` on ``path/build.lock``, which the kernel releases
    when its holder dies, so a build killed mid-compile never blocks the next one. Under it, torch's own
    ``lock`` file (a ``FileBaton`` that a killed build leaves behind, and that every later load then waits on
    forever) can only be a dead process's, and is removed. Waiting for a live builder is bounded
    (:data:`WAIT_S`) and said once on stderr; past it, ``TimeoutError`` naming the folder."""
    try:
        import fcntl
    except ImportError:  # (no flock: torch's own lock as it is)
        yield
        return
    fd = os.open(os.path.join(path, "build.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, said = time.monotonic() + WAIT_S, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has been building the native recorder in {path} for "
                                       f"over {WAIT_S:g} s") from None
                if not said:
                    said = True
                    print("backward_doctor: waiting for another process building the native recorder...",
                          file=sys.stderr, flush=True)
                time.sleep(0.2)
        try:
            os.remove(os.path.join(path, "lock"))  # torch's: left by a build that was killed
        except FileNotFoundError:
            pass
        yield
    finally:
        os.close(fd)  # (releases the flock)


def built_file() -> str:
    """Where the compiled recorder is cached (it may not exist yet).

    >>> built_file().endswith("backward_doctor_native.so")
    True
    """
    return os.path.join(_build_dir(), f"{_NAME}.so")


def _stamp() -> str:
    return os.path.join(_build_dir(), "built.json")


def cached() -> bool:
    """True when a finished build of this recorder, for this torch, is on disk (loading it takes a moment).

    >>> isinstance(cached(), bool)
    True
    """
    try:
        return os.path.exists(_stamp()) and os.path.exists(built_file())
    except OSError:  # (no cache folder can be made: nothing cached)
        return False


def _tool_path() -> str:
    """PATH for the build: this interpreter's own bin first (a venv's pip-installed ninja)."""
    return os.pathsep.join(p for p in (os.path.dirname(sys.executable), os.environ.get("PATH", "")) if p)


def missing_tool() -> str | None:
    """'ninja' or 'a C++ compiler' when one the build needs is not found, else None.

    >>> missing_tool() in (None, "ninja", "a C++ compiler")
    True
    """
    if shutil.which("ninja", path=_tool_path()) is None:
        return "ninja"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "a C++ compiler"
    return None


def last_build_seconds() -> float | None:
    """How long the last build of the recorder took on this machine (any torch version), None if never.

    >>> last_build_seconds() is None or last_build_seconds() > 0
    True
    """
    try:
        with open(os.path.join(_root(), f"{_NAME}_last_build.json")) as fh:
            return float(json.load(fh)["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_time_words() -> str:
    """The build time a person should expect, in words: the last build measured here, or the usual range.

    >>> "s" in build_time_words()
    True
    """
    last = last_build_seconds()
    if last is not None:
        return f"the last build on this machine took {last:.0f} s"
    return "usually 1-2 minutes, up to 6 on a busy machine"


def _compile() -> str | None:
    """Compile the recorder in a child process (its output kept, nothing printed); None, or why it failed."""
    # The child's last line of stderr is the reason: the exception's first line and the compiler's first
    # error (torch's message carries every command line and the whole compiler output).
    code = ("import os, sys, warnings; warnings.simplefilter('ignore')\n"
            "from torch.utils.cpp_extension import load\n"
            "try:\n"
            f"    load(name={_NAME!r}, sources=[{_SOURCE!r}], build_directory={_build_dir()!r}, "
            f"extra_cflags={_FLAGS!r}, verbose=False)\n"
            "except Exception as exc:\n"
            "    lines = str(exc).strip().splitlines() or ['']\n"
            "    first = lines[0].split(': [', 1)[0].strip()\n"
            "    err = next((os.path.basename(ln.strip()) for ln in lines[1:] if ': error:' in ln), '')\n"
            "    print(f'{type(exc).__name__}: {first}' + (f' ({err})' if err else ''), file=sys.stderr)\n"
            "    sys.exit(1)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PATH": _tool_path()})
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the build could not be started: {type(exc).__name__}: {exc}"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else f"the build exited with status {proc.returncode}"
    return None


def _import(path: str) -> Any:
    """The compiled module, loaded the way ``cpp_extension`` loads it, without importing ``cpp_extension``."""
    import importlib.util

    import torch  # noqa: F401 - the recorder links against the libtorch this import loads

    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(build: bool = True, retry: bool = False) -> Any:
    """The compiled recorder, building it if needed (blocking); None if it cannot be had.

    A cached build is loaded without a word. A build that failed is not tried again in this
    process (``retry=True`` does). ``build=False`` never compiles, nor waits for a build
    running in another thread.
    """
    global _module, _reason, _build_s
    if _module is not None or not enabled():
        return _module
    if not _lock.acquire(blocking=build):
        return _module
    try:
        if _module is not None or (_reason is not None and not retry):
            return _module
        _reason = None
        try:
            _build_dir()  # (made here: a home or cache folder where it cannot be is the reason, said once)
        except OSError as exc:
            _reason = _cache_words(exc)
        if _reason is None and not cached():
            if not build:
                return None
            try:
                with _build_lock(_build_dir()):  # (another process may be building it: wait, then load theirs)
                    if not cached():
                        if threading.current_thread() is threading.main_thread():
                            print(f"backward_doctor: compiling the native recorder (once per torch version; "
                                  f"{build_time_words()})...", file=sys.stderr, flush=True)
                        t = time.perf_counter()
                        _reason = _compile()
                        if _reason is None:
                            _build_s = time.perf_counter() - t
                            _write_stamp(_build_s)
            except TimeoutError as exc:
                _reason = str(exc)
            except OSError as exc:  # (a cache folder it can read but not write: the lock, the build)
                _reason = _cache_words(exc)
        if _reason is None:
            try:
                _module = _import(built_file())
            except Exception as exc:  # a cached binary that does not load here: say why, use the Python tier
                _reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        if _reason is not None:
            _module = None
            log.info("native recorder unavailable (%s); the Python tier records the ops", _reason)
    finally:
        _lock.release()
    return _module


def _write_stamp(seconds: float) -> None:
    record = {"seconds": round(seconds, 1), "key": cache_key(), "when": time.time()}
    for path in (_stamp(), os.path.join(_root(), f"{_NAME}_last_build.json")):
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump(record, fh)
            os.replace(path + ".tmp", path)
        except OSError:
            log.debug("could not write %s", path, exc_info=True)


def needs_build() -> bool:
    """True when ``load()`` would have to compile rather than load the cached build.

    >>> isinstance(needs_build(), bool)
    True
    """
    _probe()
    return enabled() and _module is None and _reason is None and not cached()


def build_in_background() -> threading.Thread | None:
    """Start building (or loading) the recorder without waiting (``%load_ext`` does this); None if nothing
    to do. The compile runs in a child process whose output is kept: nothing lands in the notebook; its
    last line of errors, if any, is the reason ``status()`` gives."""
    global _thread
    _probe()
    if _module is not None or not enabled() or _reason is not None:
        return None
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=load, name="backward_doctor-native-build", daemon=True)
        _thread.start()
    return _thread


def ready() -> Any:
    """The recorder if it is already built and loaded (never blocks), else None."""
    if _thread is not None and _thread.is_alive():
        return None
    return _module if enabled() else None


def status() -> dict[str, Any]:
    """What the doctor knows about the native recorder: switched on, built, building, why not, and how long
    this process's build took (None: loaded from the cache, or not built)."""
    _probe()
    return {"enabled": enabled(), "built": _module is not None, "building": bool(_thread and _thread.is_alive()),
            "reason": _reason if enabled() else "switched off (BACKWARD_DOCTOR_NATIVE=0)", "build_s": _build_s}
