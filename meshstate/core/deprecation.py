"""Old names that keep working, each with a ``DeprecationWarning`` saying what to use.

Example::

    class Grid:
        axes = Renamed("axes_fastest_first")     # grid.axes warns, then reads the new name

    __getattr__ = moved_names(__name__, {"HybridGrid": "meshstate.core.hybrid_grid"})
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


def warn_deprecated(old: str, new: str) -> None:
    """Warn, at the caller's caller, that ``old`` is deprecated in favour of ``new``."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


class Renamed(Generic[T]):
    """An attribute's old name: reading it warns and reads ``new`` (the name that says what
    it holds, e.g. the order of a sequence of axes)."""

    def __init__(self, new: str, advice: str | None = None) -> None:
        self.new = new
        self.advice = advice

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = f"{owner.__name__}.{name}"
        self.advice = self.advice or f"{owner.__name__}.{self.new}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Renamed[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> T | Renamed[T]:
        if obj is None:
            return self
        assert self.advice is not None
        warnings.warn(f"{self.old} is deprecated; use {self.advice}", DeprecationWarning,
                      stacklevel=2)
        value: T = getattr(obj, self.new)
        return value


def moved_names(module: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving names that moved to ``homes`` (name -> module),
    with a warning naming the new home; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to {home}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    return __getattr__
