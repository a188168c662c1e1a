"""A mesh's answers by key (:class:`MeshTables`, read through :class:`TableView`) and
by attribute (:class:`Facts`, for code that asks one key millions of times).

A mesh makes its four tables (rank, size, group and ranks by key) once;
``destroy()`` empties them and calls ``forget`` on the :class:`Facts` a façade
made from them, after which every read raises the error that names where.
"""

from __future__ import annotations

import sys

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from meshstate.errors import NotInitializedError, SimulationError
from meshstate.layout.layout import Key

V = TypeVar("V")

FIELDS = ("rank", "size", "group", "ranks")
"""A fact's field, in the order of the tables: ``tp_rank`` is ``rank_in["tp"]``."""


class MeshTables(NamedTuple):
    """A mesh's answers by key, read-only (``ParallelMesh.tables``): each spelling of each
    key whose group holds the calling rank -> its answer. A destroyed mesh's raise the
    error that names where."""

    rank: Mapping[Key, int]
    size: Mapping[Key, int]
    group: Mapping[Key, dist.ProcessGroup]
    ranks: Mapping[Key, Sequence[int]]


class TableView(Mapping[Key, V]):
    """One of a mesh's tables, read-only; once the mesh is destroyed a read that finds
    nothing raises the error naming where (``check_alive``)."""

    __slots__ = ("_table", "_check_alive")

    def __init__(self, table: Mapping[Key, V], check_alive: Callable[[], None]) -> None:
        self._table, self._check_alive = table, check_alive

    def __getitem__(self, key: Key) -> V:
        try:
            return self._table[key]
        except KeyError:
            self._check_alive()
            raise

    def __contains__(self, key: object) -> bool:
        return key in self._table

    def __iter__(self) -> Iterator[Key]:
        self._check_alive()
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class Facts:
    """Four tables read by attribute: ``<name>_rank``, ``_size``, ``_group`` and ``_ranks``.

    ``names`` maps each attribute name to its key (``tp_cp`` -> ``"tp-cp"``), so
    ``facts.tp_cp_size`` is ``mesh.size("tp-cp")``. Copied once from the tables,
    so a read is Python's fastest attribute read (Megatron's getters read these);
    a key a table lacks has no attribute, unless a subclass answers it.

    Example, on rank 5 of 8 with ``init_mesh(tp=2, pp=2)``::

        facts = Facts({"tp": "tp", "dp_cp": "dp-cp"}, tuple(mesh.tables))
        facts.tp_rank, facts.dp_cp_size   # (1, 2)
    """

    destroyed: str | None = None
    """Once the mesh is destroyed: the message that says where."""

    def __init__(self, names: Mapping[str, Key], tables: tuple[Mapping[Key, Any], ...]) -> None:
        self.__dict__.update(answered(names, tables))

    def forget(self, destroyed: str) -> None:
        """Empty these facts: from now on every read raises ``NotInitializedError(destroyed)``."""
        self.__dict__.clear()
        self.__class__ = _DestroyedFacts
        self.__dict__["destroyed"] = destroyed


def answered(names: Mapping[str, Key], tables: tuple[Mapping[Key, Any], ...]) -> dict[str, Any]:
    """Each attribute ``<name>_<field>`` the tables answer, with its answer: ``tp_rank`` is
    ``tables[0]["tp"]`` where ``names`` maps ``tp`` to ``"tp"``. A key a simulated mesh
    refuses is left out (its read then says why)."""
    answers = {}
    for name, key in names.items():
        for field, table in zip(FIELDS, tables):
            try:
                present = key in table
            except SimulationError:
                continue
            if present:  # interned, as the names in code are: CPython's fast read compares identity
                answers[sys.intern(f"{name}_{field}")] = table[key]
    return answers


class _DestroyedFacts(Facts):
    """A destroyed mesh's facts: every read raises the error naming where.

    ``destroy()`` turns each live :class:`Facts` into one of these (its class is
    swapped, since a façade holds that object): a ``__getattr__`` on
    :class:`Facts` itself would cost every getter its specialised attribute read
    (``facts.tp_rank`` 9.5 ns becomes 30 ns on CPython 3.11), so the swap stays.
    """

    def __getattr__(self, name: str) -> Any:
        raise NotInitializedError(self.destroyed)
