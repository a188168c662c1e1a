"""A mesh's answers, read by key or by attribute: the ``rank_in``, ``size_of``,
``group_of`` and ``ranks_of`` tables and ``facts``, made once with the mesh and
emptied by ``destroy()``, after which every read names where that happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from meshstate.core.errors import NotInitializedError
from meshstate.core.layout import Key

V = TypeVar("V")


class Table(dict[Key, V]):
    """One of a mesh's tables (``rank_in``, ``size_of``, ``group_of``, ``ranks_of``).

    A dict; ``destroy()`` empties it, and from then on a lookup by ``[]`` raises
    the error that names where the mesh was destroyed, so whoever holds the
    table (the Megatron façade does) learns it from the mesh.
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
    """A mesh's tables for its axes and joint keys, read by attribute.

    ``facts.tp_rank`` is ``mesh.rank("tp")``, ``facts.dp_cp_size`` is
    ``mesh.size("dp-cp")`` (a key's ``-`` is ``_``), and likewise ``*_group``
    and ``*_ranks``. Written once, with the tables, when the mesh is made; an
    attribute read costs less than a dict lookup, so code that asks one key
    millions of times (Megatron's getters) reads these.

    Example, on rank 5 of 8 with ``init_mesh(tp=2, pp=2)``::

        mesh.facts.tp_rank, mesh.facts.dp_cp_size   # (1, 2)
    """

    destroyed: str
    """Once the mesh is destroyed: the message that says where."""

    def __init__(
        self,
        keys: Iterable[str],
        rank_in: Mapping[Key, int],
        size_of: Mapping[Key, int],
        group_of: Mapping[Key, dist.ProcessGroup],
        ranks_of: Mapping[Key, Sequence[int]],
    ) -> None:
        for key in keys:
            if key in group_of:
                name = key.replace("-", "_")
                setattr(self, f"{name}_rank", rank_in[key])
                setattr(self, f"{name}_size", size_of[key])
                setattr(self, f"{name}_group", group_of[key])
                setattr(self, f"{name}_ranks", ranks_of[key])

    def forget(self, destroyed: str) -> None:
        """Empty these facts: from now on every read raises ``NotInitializedError(destroyed)``."""
        self.__dict__.clear()
        self.__class__ = _DestroyedFacts
        self.__dict__["destroyed"] = destroyed


class _DestroyedFacts(Facts):
    """A destroyed mesh's ``facts``: every read raises the error naming where.

    ``destroy()`` turns the live ``facts`` object into one of these (its class
    is swapped, since the Megatron façade holds that object): a ``__getattr__``
    on :class:`Facts` itself would cost every getter its specialised attribute
    read (``facts.tp_rank`` 8 ns becomes 24 ns on CPython 3.11), so the swap stays.
    """

    def __getattr__(self, name: str) -> Any:
        raise NotInitializedError(self.destroyed)
