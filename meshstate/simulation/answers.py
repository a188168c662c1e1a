"""Each simulated rank's answers to the runtime's per-rank questions: the
:class:`~meshstate.core.world.Simulation` this package plugs into the seam.

A simulated world runs every rank in one process (torch's ``LocalTensorMode``
over the fake backend); the process is rank 0 and holds rank 0's groups, from
which torch's simulation runs every group's collective. A mesh built there is a
:class:`~meshstate.core.mesh.ParallelMesh` like any other: what depends on the
rank (its tables, so Megatron's getters too, ``global_rank``, ``coordinate``,
``ordered(...).index`` and ``.ranks``, a group's rank, a DeviceMesh's local rank)
holds each simulated rank's value (:mod:`meshstate.simulation.per_rank`), asked
through the seam. A group that only some ranks are in, or whose collectives
torch's simulation would run over other ranks than the layout's, is refused with a
:class:`~meshstate.errors.SimulationError` when it is read.

Example, inside ``simulated_world(8).run`` with ``init_mesh(tp=2, pp=2)``::

    value_on(mesh.rank("tp"), 5)      # 1
    value_on(mesh.next_rank("pp"), 5) # 1
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.core.ordered import OrderedGroup
from meshstate.errors import OTHER_WORLDS, SimulationError
from meshstate.layout.layout import Key, MeshLayout
from meshstate.simulation import local_compat
from meshstate.simulation.per_rank import (
    PerRankRanks,
    group_rank,
    of_simulated_ranks,
    on_any_rank,
    per_rank_int,
    positions,
    tiling_mismatch,
)

V = TypeVar("V")



class PerRankTable(dict[Key, V]):
    """A simulated mesh's table: each key's per-rank answer, and the keys it refuses.

    Reading a refused key (by ``[]``, ``get`` or ``in``) raises
    :class:`SimulationError` with the reason, instead of answering for rank 0.
    Emptied (the mesh destroyed), it refuses nothing.
    """

    __slots__ = ("refused",)

    def __init__(self, refused: dict[Key, str]) -> None:
        super().__init__()
        self.refused = refused

    def __missing__(self, key: Key) -> V:
        self._refuse(key)
        raise KeyError(key)

    def get(self, key: Key, default: Any = None) -> Any:
        self._refuse(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return super().__contains__(key)

    def clear(self) -> None:
        super().clear()
        self.refused.clear()

    def _refuse(self, key: object) -> None:
        if key in self.refused:
            raise SimulationError(self.refused[key])


class LocalTensorSimulation:
    """The answers of a world simulated under torch's ``LocalTensorMode``, for every rank."""

    def ranks(self) -> frozenset[int] | None:
        return local_compat.enabled_ranks()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return local_compat.simulation_paused()

    def on_any_rank(self, value: bool) -> bool:
        return on_any_rank(value)

    def each_rank(self, function: Callable[..., Any], *args: Any) -> Any:
        return local_compat.run_for_each_rank(function, *args)

    def tables(
        self, layout: MeshLayout, keys: Sequence[Key], declared: Mapping[Key, Key],
        own_group_of: Mapping[Key, dist.ProcessGroup], ranks: frozenset[int],
    ) -> tuple[int, dict[Key, int], dict[Key, int], dict[Key, dist.ProcessGroup],
               dict[Key, Sequence[int]]]:
        """The mesh's global rank and four tables, each answer per simulated rank; a key
        whose answers differ in kind between the ranks (a group only some are in), or
        whose collectives torch would run over other ranks, is refused when read."""
        refused: dict[Key, str] = {}  # keys whose groups some ranks are not in
        refused_groups: dict[Key, str] = {}  # and keys whose collectives would go wrong
        tables = (PerRankTable[int](refused), PerRankTable[int](refused),
                  PerRankTable[dist.ProcessGroup](refused_groups),
                  PerRankTable[Sequence[int]](refused))
        with local_compat.simulation_paused():  # the layout's arithmetic, once
            for key in keys:
                spellings = [spelling for spelling, of in declared.items() if of == key]
                why = _enter_key(layout, key, spellings, own_group_of.get(key), ranks, tables,
                                 refused_groups)
                if why is not None:
                    refused.update(dict.fromkeys(spellings, why))
                    refused_groups.update(dict.fromkeys(spellings, why))
        return (per_rank_int({rank: rank for rank in ranks}), *tables)

    def coordinate(self, layout: MeshLayout, ranks: frozenset[int]) -> dict[str, int]:
        """Every simulated rank's position on every axis."""
        by_rank = {rank: layout.coordinate(rank) for rank in ranks}
        axes = by_rank[min(ranks)]
        return {axis: per_rank_int({r: c[axis] for r, c in by_rank.items()}) for axis in axes}

    def ordered(self, name: str, own: OrderedGroup, groups: list[list[int]]) -> OrderedGroup:
        """``own`` with ``index`` and ``ranks`` per simulated rank."""
        mismatch = tiling_mismatch(name, own.group, groups)
        if mismatch is not None:
            raise SimulationError(mismatch)
        every_index, every_group_of_rank = positions(groups)
        index, group_of_rank = of_simulated_ranks(every_index), of_simulated_ranks(every_group_of_rank)
        # A sequence like the tuple it stands for, one group per simulated rank.
        ranks = cast(tuple[int, ...], PerRankRanks(group_of_rank, len(own.ranks)))
        return replace(own, ranks=ranks, index=per_rank_int(index))

    def group_rank(self, group: dist.ProcessGroup) -> int:
        return group_rank(group)

    def view_rank(self, view: DeviceMesh, dim: int) -> int:
        """Each simulated rank's position on dim ``dim`` of ``view``, read from every copy
        of it in its root at once (torch's own simulated answer looks every rank up
        in the whole world)."""
        with local_compat.simulation_paused():
            copies = _compat.mesh_copies(view)
            position = torch.arange(copies.numel()).view(copies.shape)
            position = position // math.prod(copies.shape[dim + 2:]) % copies.shape[dim + 1]
            return per_rank_int(of_simulated_ranks(
                dict(zip(copies.flatten().tolist(), position.flatten().tolist()))
            ))

    def tiling_mismatch(
        self, name: str, group: dist.ProcessGroup | None, groups: Sequence[Sequence[int] | None]
    ) -> str | None:
        return tiling_mismatch(name, group, groups)


def _groups_of(layout: MeshLayout, key: Key) -> list[Sequence[int] | None]:
    """Each group of ``key`` in the order a mesh keeps it (a derived group's members sorted)."""
    return [layout.members(group[0], key) for group in layout.every_group(key)]


def _enter_key(
    layout: MeshLayout, key: Key, spellings: list[Key], group: dist.ProcessGroup | None,
    ranks: frozenset[int],
    tables: tuple[dict[Key, int], dict[Key, int], dict[Key, dist.ProcessGroup],
                  dict[Key, Sequence[int]]],
    refused_groups: dict[Key, str],
) -> str | None:
    """Enter ``key``'s per-rank answers under ``spellings``; else why it is refused. A group
    torch's simulation would run collectives over other ranks of is refused alone."""
    groups = _groups_of(layout, key)
    index, group_of_rank = positions(group for group in groups if group is not None)
    outside = sorted(ranks - index.keys())
    index, group_of_rank = of_simulated_ranks(index), of_simulated_ranks(group_of_rank)
    sizes = sorted({len(members) for members in group_of_rank.values()})
    if outside or len(sizes) > 1:
        differs = (
            f"simulated ranks {', '.join(map(str, outside[:8]))}{', …' if len(outside) > 8 else ''} "
            f"are in no {str(key)!r} group" if outside else
            f"the {str(key)!r} groups have {' or '.join(map(str, sizes))} ranks"
        )
        return (
            f"{differs}, so its answers differ in kind between the simulated ranks, which "
            f"one simulated program cannot follow; {OTHER_WORLDS}"
        )
    rank_in, size_of, group_of, ranks_of = tables
    mismatch = tiling_mismatch(str(key), group, groups)  # a message where group is None
    if mismatch is None:
        group_of.update(dict.fromkeys(spellings, cast(dist.ProcessGroup, group)))
    else:
        refused_groups.update(dict.fromkeys(spellings, mismatch))
    by_rank, members = per_rank_int(index), PerRankRanks(group_of_rank, sizes[0])
    for spelling in spellings:
        rank_in[spelling], size_of[spelling], ranks_of[spelling] = by_rank, sizes[0], members
    return None

