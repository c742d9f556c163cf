"""Attributes replaced for the length of a run and put back after it (the training watches' wrappers of
``zero_grad``, ``GradScaler`` and clipping: removed while torch.compile compiles, reinstalled after), and a
wrapper named and documented as what it wraps.

>>> p = Patches(); p.installed
False
"""
from __future__ import annotations

from typing import Any, Callable


class Patches:
    """Attributes replaced for the run: installed, removed (while torch.compile compiles) and put back.

    >>> class A:
    ...     def f(self): return 1
    >>> p = Patches(); p.add(A, "f", lambda real: lambda self: real(self) + 1); p.install()
    >>> A().f(), p.remove(), A().f()
    (2, None, 1)
    """

    def __init__(self) -> None:
        self._items: list[tuple[Any, str, Any, Any]] = []
        self.installed = False
        self.disabled = False  # (its watch was switched off: never installed again this run)

    def add(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        real = getattr(owner, name)
        self._items.append((owner, name, real, make(real)))

    def install(self) -> None:
        if self.disabled:
            return
        for owner, name, _, replacement in self._items:
            setattr(owner, name, replacement)
        self.installed = True

    def remove(self) -> None:
        for owner, name, real, _ in reversed(self._items):
            setattr(owner, name, real)
        self.installed = False

    def disable(self) -> None:
        """Removed for good (their watch failed): :meth:`install` does nothing from now on."""
        self.disabled = True
        if self.installed:
            self.remove()


def named_like(wrapper: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` named and documented as ``real`` (what ``help()`` and tracebacks show).

    >>> def zero_grad(self):
    ...     "Reset the gradients."
    >>> named_like(lambda self: None, zero_grad).__name__, zero_grad.__doc__
    ('zero_grad', 'Reset the gradients.')
    """
    wrapper.__wrapped__ = real  # type: ignore[attr-defined]
    wrapper.__doc__, wrapper.__name__ = real.__doc__, real.__name__
    wrapper.__qualname__ = getattr(real, "__qualname__", real.__name__)
    return wrapper


__all__ = ["Patches", "named_like"]
