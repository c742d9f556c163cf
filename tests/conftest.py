"""Shared fixtures. The GPU tier is marked ``gpu`` and skipped without CUDA."""
from __future__ import annotations

import sys

import pytest
import torch

torch.set_num_threads(1)  # deterministic, and fair on a shared 2-core machine


@pytest.fixture(params=["native", "python"])
def engine(request):
    """Both engines, for a test that takes ``engine``; the native one where its recorder builds here (a
    machine without a compiler has only the Python tier)."""
    if request.param == "native":
        skip_without_native()
    return request.param


def skip_without_native() -> None:
    """Skip (saying why) where the native recorder cannot be built or loaded here."""
    from backward_doctor import native
    from backward_doctor.capture.native_capture import native_available

    if not native_available(build=True):
        pytest.skip(f"native recorder unavailable: {native.status()['reason']}")


@pytest.fixture
def native_engine() -> str:
    """``"native"`` for a test that needs the native recorder alone (skipped where it is unavailable)."""
    skip_without_native()
    return "native"


@pytest.fixture(autouse=True)
def nothing_left_running():
    """Every test ends with no capture installed: one left running (a frontend that failed to close its watch)
    would record every later test and make the native recorder look unavailable to them. It is stopped here
    and the test that left it fails."""
    yield
    from backward_doctor import native
    from backward_doctor.capture.runner import running_captures

    left = list(running_captures)
    ext = native.ready()
    recording = ext is not None and ext.running()
    for capture in reversed(left):
        try:
            capture.stop()
        finally:
            if capture in running_captures:
                running_captures.remove(capture)
    if ext is not None and ext.running():
        ext.stop()
    assert not left and not recording, f"the test left a capture running: {left or 'the native recorder'}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    """Build (or load the cached) native recorder once, so ``engine="auto"`` runs on it in every test;
    ``BACKWARD_DOCTOR_NATIVE=0`` runs the whole suite on the Python tier instead."""
    from backward_doctor import native

    if native.enabled() and native.load() is None:
        print(f"\nbackward_doctor: native recorder unavailable ({native.status()['reason']}); "
              "tests run on the Python tier", file=sys.stderr)
