"""A mesh's answers: its tables by key (:class:`Table`) and by attribute (:class:`Facts`).

The ``rank_in``, ``size_of``, ``group_of`` and ``ranks_of`` tables are made once
with the mesh, and its ``facts`` from them; ``destroy()`` empties the tables and
forgets every :class:`Facts` made from them, after which each read names where.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from meshstate.core.errors import NotInitializedError, SimulationError
from meshstate.core.layout import Key

V = TypeVar("V")

FIELDS = ("rank", "size", "group", "ranks")
"""A fact's field, in the order of the tables: ``tp_rank`` is ``rank_in["tp"]``."""


class Table(dict[Key, V]):
    """One of a mesh's tables (``rank_in``, ``size_of``, ``group_of``, ``ranks_of``).

    A dict; ``destroy()`` empties it, and from then on a lookup by ``[]`` raises
    the error that names where the mesh was destroyed.
    """

    __slots__ = ("destroyed",)

    def __init__(self) -> None:
        super().__init__()
        self.destroyed: str | None = None  # why a lookup fails once the mesh is destroyed

    def __missing__(self, key: Key) -> V:
        if self.destroyed is not None:
            raise NotInitializedError(self.destroyed)
        raise KeyError(key)


class Facts:
    """Four tables read by attribute: ``<name>_rank``, ``_size``, ``_group`` and ``_ranks``.

    ``names`` maps each attribute name to its key: for a mesh's own ``facts``
    every key, with ``-`` written ``_``, so ``facts.tp_rank`` is
    ``mesh.rank("tp")`` and ``facts.dp_cp_size`` is ``mesh.size("dp-cp")``.
    Copied once from the tables, so a read is Python's fastest attribute read
    (code that asks one key millions of times, as Megatron's getters do, reads
    these); a key a table lacks has no attribute, unless a subclass answers it.

    Example, on rank 5 of 8 with ``init_mesh(tp=2, pp=2)``::

        mesh.facts.tp_rank, mesh.facts.dp_cp_size   # (1, 2)
    """

    destroyed: str | None = None
    """Once the mesh is destroyed: the message that says where."""

    def __init__(self, names: Mapping[str, Key], tables: tuple[Mapping[Key, Any], ...]) -> None:
        for name, key in names.items():
            for field, table in zip(FIELDS, tables):
                try:
                    present = key in table
                except SimulationError:  # a simulated mesh refuses the key: its read says why
                    continue
                if present:
                    setattr(self, f"{name}_{field}", table[key])

    def forget(self, destroyed: str) -> None:
        """Empty these facts: from now on every read raises ``NotInitializedError(destroyed)``."""
        self.__dict__.clear()
        self.__class__ = _DestroyedFacts
        self.__dict__["destroyed"] = destroyed


class _DestroyedFacts(Facts):
    """A destroyed mesh's facts: every read raises the error naming where.

    ``destroy()`` turns each live :class:`Facts` into one of these (its class is
    swapped, since a façade holds that object): a ``__getattr__`` on
    :class:`Facts` itself would cost every getter its specialised attribute read
    (``facts.tp_rank`` 9.5 ns becomes 30 ns on CPython 3.11), so the swap stays.
    """

    def __getattr__(self, name: str) -> Any:
        raise NotInitializedError(self.destroyed)
