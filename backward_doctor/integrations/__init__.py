"""Callbacks that keep the doctor's watch across a library's training loop, in a script or a notebook.

- :class:`DoctorCallback`: a ``transformers.TrainerCallback`` (``Trainer(callbacks=[DoctorCallback()])``);
- :class:`DoctorLightningCallback`: a Lightning ``Callback`` (``pl.Trainer(callbacks=[...])``).

Each is imported on first use, with its library: importing ``backward_doctor.integrations`` imports
neither ``transformers`` nor Lightning, and asking for a callback whose library is not installed raises an
``ImportError`` that says what to install. A plain script needs no callback:
``python -m backward_doctor run SCRIPT.py [ARGS...]``.

>>> import backward_doctor.integrations as integrations
>>> sorted(integrations.__all__)
['DoctorCallback', 'DoctorLightningCallback', 'LoopDoctor']
"""
from __future__ import annotations

import importlib
from typing import Any

from .watching import LoopDoctor

_LAZY = {"DoctorCallback": ("hf", "transformers"),
         "DoctorLightningCallback": ("lightning", "pytorch-lightning (or lightning)")}
__all__ = ["DoctorCallback", "DoctorLightningCallback", "LoopDoctor"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, package = _LAZY[name]
    try:
        mod = importlib.import_module(f".{module}", __name__)
    except ImportError as exc:
        raise ImportError(f"backward_doctor.integrations.{name} needs {package}: `pip install {package.split()[0]}` "
                          f"({exc})") from exc
    value = getattr(mod, name)
    globals()[name] = value
    return value
