"""The native first tier's recorder: a C++ ``RecordFunction`` observer, compiled on first use.

The Python dispatch mode costs 1.15-1.2x a step before it records anything
(benchmarks/RESULTS.md); the same records taken from C++ cost a few percent. The
recorder is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are
needed; ~40 s once, cached under ``TORCH_EXTENSIONS_DIR``, one directory per torch install). Where it cannot be built,
or with ``BACKWARD_DOCTOR_NATIVE=0``, the doctor uses the Python first tier and says
why in ``status()``.

>>> status()["reason"] is None or isinstance(status()["reason"], str)
True
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any, Iterator

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder.cpp")
_lock = threading.Lock()
_module: Any = None
_reason: str | None = None
_build_s: float | None = None
_thread: threading.Thread | None = None


def enabled() -> bool:
    """False when switched off with ``BACKWARD_DOCTOR_NATIVE=0``."""
    return os.environ.get("BACKWARD_DOCTOR_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _build_dir() -> str:
    """One build directory per torch install and Python (two venvs must not share one), under
    ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``."""
    import hashlib

    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")
    tag = hashlib.sha1(f"{torch.__file__}|{torch.__version__}|{sys.version}".encode()).hexdigest()[:10]
    path = os.path.join(root, f"backward_doctor_native_{tag}")
    os.makedirs(path, exist_ok=True)
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


def load(build: bool = True, retry: bool = False) -> Any:
    """The compiled recorder, building it if needed (blocking); None if it cannot be had.

    A build that failed is not tried again in this process (``retry=True`` does).
    """
    global _module, _reason, _build_s
    if _module is not None or not enabled():
        return _module
    with _lock:
        if _module is not None or (_reason is not None and not retry) or not build:
            return _module
        t = time.perf_counter()
        # Loading a cached build takes a second; compiling takes ~40 s: say so when it is slow.
        notice = threading.Timer(3.0, lambda: print("backward_doctor: compiling the native recorder "
                                                    "(once, ~40 s; cached after)...", file=sys.stderr, flush=True))
        notice.daemon = True
        if threading.current_thread() is threading.main_thread():
            notice.start()
        try:
            from torch.utils.cpp_extension import load as _load

            folder = _build_dir()
            with warnings.catch_warnings(), _build_lock(folder):
                warnings.simplefilter("ignore")
                _module = _load(name="backward_doctor_native", sources=[_SOURCE], build_directory=folder,
                                extra_cflags=["-O3", "-DNDEBUG"], verbose=False)
            _reason = None
        except Exception as exc:  # no compiler, no ninja, no headers: the Python tier does the work
            _reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
            _module = None
            log.info("native recorder unavailable (%s); the Python tier records the ops", _reason)
        finally:
            notice.cancel()
        _build_s = time.perf_counter() - t
    return _module


def built_file() -> str:
    """Where the compiled recorder is cached (it may not exist yet).

    >>> built_file().endswith("backward_doctor_native.so")
    True
    """
    return os.path.join(_build_dir(), "backward_doctor_native.so")


def needs_build() -> bool:
    """True when ``load()`` would have to compile (~40 s) rather than load the cached build (~1 s).

    >>> isinstance(needs_build(), bool)
    True
    """
    return enabled() and _module is None and _reason is None and not os.path.exists(built_file())


def build_in_background() -> threading.Thread | None:
    """Start building the recorder without waiting (``%load_ext`` does this); None if nothing to do.

    The compile runs in a child process whose output is kept (torch's "!! WARNING !!" compiler
    banners, ninja's lines): nothing lands in the notebook. Its last line of errors, if any, is the
    reason ``status()`` gives; otherwise this process then loads the cached build.
    """
    global _thread
    if _module is not None or not enabled() or _reason is not None:
        return None
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_build_then_load, name="backward_doctor-native-build", daemon=True)
        _thread.start()
    return _thread


def _build_then_load() -> None:
    global _reason
    if not os.path.exists(built_file()):
        import subprocess

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (f"import sys; sys.path.insert(0, {root!r}); from backward_doctor import native; "
                "m = native.load(); sys.exit(0 if m is not None else (print(native.status()['reason'], "
                "file=sys.stderr) or 1))")
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as exc:
            _reason = f"the build could not be started: {type(exc).__name__}: {exc}"
            return
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            _reason = lines[-1] if lines else f"the build exited with status {proc.returncode}"
            log.info("native recorder unavailable (%s); the Python tier records the ops", _reason)
            return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load()


def ready() -> Any:
    """The recorder if it is already built (never blocks), else None."""
    if _thread is not None and _thread.is_alive():
        return None
    return _module if enabled() else None


def status() -> dict[str, Any]:
    """What the doctor knows about the native recorder: switched on, built, building, why not."""
    return {"enabled": enabled(), "built": _module is not None, "building": bool(_thread and _thread.is_alive()),
            "reason": _reason if enabled() else "switched off (BACKWARD_DOCTOR_NATIVE=0)", "build_s": _build_s}
