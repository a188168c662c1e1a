"""``SimulatedMesh``: one :class:`~meshstate.core.mesh.ParallelMesh` for every rank of a
world simulated in one process.

:func:`~meshstate.core.build.init_mesh` makes one under torch's
``LocalTensorMode`` (:func:`meshstate.testing.simulated_world` turns it on). The
process is rank 0 of torch's ``fake`` backend and holds rank 0's groups, from
which torch's simulation runs every group's collective; every answer that
depends on the rank (the tables and ``facts``, so Megatron's getters too,
``global_rank``, ``coordinate``, ``ordered(...).index`` and ``.ranks``) holds
each simulated rank's value (:mod:`meshstate.core.per_rank`). A group that only
some ranks are in, or whose collectives torch's simulation would run over
other ranks than the layout's, is refused with a
:class:`~meshstate.core.errors.SimulationError` when it is read.

Example, inside ``simulated_world(8).run`` with ``init_mesh(tp=2, pp=2)``::

    value_on(mesh.rank("tp"), 5)      # 1
    value_on(mesh.next_rank("pp"), 5) # 1
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.core.errors import SimulationError
from meshstate.core.groups import ProcessGroupSet
from meshstate.core.layout import GROUP_KINDS, DerivedGroup, Key, MeshLayout
from meshstate.core.mesh import ParallelMesh
from meshstate.core.ordered import OrderedGroup
from meshstate.core.per_rank import (
    PerRankRanks,
    group_rank,
    per_rank_int,
    positions,
    tiling_mismatch,
)
from meshstate.core.simulation import outside_simulation
from meshstate.core.facts import Facts, Table

V = TypeVar("V")

_LOCAL_WORLD = "run it in processes with meshstate.testing.local_world"


class PerRankTable(Table[V]):
    """A simulated mesh's table: each key's per-rank answer, and the keys it refuses.

    Reading a refused key (by ``[]``, ``get`` or ``in``) raises
    :class:`SimulationError` with the reason, instead of answering for rank 0.
    """

    __slots__ = ("refused",)

    def __init__(self, refused: dict[Key, str]) -> None:
        super().__init__()
        self.refused = refused

    def __missing__(self, key: Key) -> V:
        self._refuse(key)
        return super().__missing__(key)

    def get(self, key: Key, default: Any = None) -> Any:
        self._refuse(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return super().__contains__(key)

    def _refuse(self, key: object) -> None:
        if self.destroyed is None and key in self.refused:
            raise SimulationError(self.refused[key])


class SimulatedMesh(ParallelMesh):
    """A :class:`ParallelMesh` answering for every rank a process simulates.

    Built by ``init_mesh`` under torch's ``LocalTensorMode`` over the whole
    world; see the module docstring.
    """

    def __init__(
        self,
        layout: MeshLayout,
        process_groups: ProcessGroupSet,
        members: Mapping[Key, Sequence[int] | None],
        *,
        device_type: str,
        kinds: tuple[str, ...] = GROUP_KINDS,
        derived: tuple[DerivedGroup, ...] = (),
        simulated: frozenset[int],
    ) -> None:
        super().__init__(
            layout, process_groups, members, device_type=device_type, kinds=kinds, derived=derived
        )
        self.simulated = simulated
        self.global_rank = per_rank_int({rank: rank for rank in simulated})
        refused: dict[Key, str] = {}  # keys whose groups some ranks are not in
        refused_groups: dict[Key, str] = {}  # and keys whose collectives would go wrong
        self._refused_groups = refused_groups
        self._rank_in, self._size_of = PerRankTable[int](refused), PerRankTable[int](refused)
        self._group_of = PerRankTable[dist.ProcessGroup](refused_groups)
        self._ranks_of = PerRankTable[Sequence[int]](refused)
        with outside_simulation():  # the layout's arithmetic, once
            for key in self.keys():
                spellings = [s for s, declared in self._declared.items() if declared == key]
                why = self._add_key(key, spellings)
                if why is not None:
                    refused.update(dict.fromkeys(spellings, why))
                    refused_groups.update(dict.fromkeys(spellings, why))
        self._facts = Facts({key.replace("-", "_"): key for key in self.kinds}, self._tables())

    def _add_key(self, key: Key, spellings: list[Key]) -> str | None:
        """Enter ``key``'s per-rank answers under ``spellings``; else why it is refused."""
        # Each group in the order the mesh keeps it (a derived group's members sorted).
        groups = [self.layout.members(group[0], key) for group in self.layout.every_group(key)]
        index, group_of_rank = positions(group for group in groups if group is not None)
        outside = sorted(self.simulated - index.keys())
        sizes = sorted({len(group) for group in group_of_rank.values()})
        if outside or len(sizes) > 1:
            differs = (
                f"simulated ranks {', '.join(map(str, outside[:8]))}{', …' if len(outside) > 8 else ''} "
                f"are in no {str(key)!r} group" if outside else
                f"the {str(key)!r} groups have {' or '.join(map(str, sizes))} ranks"
            )
            return (
                f"{differs}, so its answers differ in kind between the simulated ranks, which "
                f"one simulated program cannot follow; {_LOCAL_WORLD}"
            )
        group = self._own_group_of[key]
        mismatch = tiling_mismatch(str(key), group, groups)
        if mismatch is None:
            self._group_of.update(dict.fromkeys(spellings, group))
        else:
            self._refused_groups.update(dict.fromkeys(spellings, mismatch))
        rank_in, ranks = per_rank_int(index), PerRankRanks(group_of_rank, sizes[0])
        for spelling in spellings:
            self._rank_in[spelling] = rank_in
            self._size_of[spelling] = sizes[0]
            self._ranks_of[spelling] = ranks
        return None

    @property
    def coordinate(self) -> dict[str, int]:
        """Every simulated rank's position on every dense and expert axis."""
        self._check_alive()
        by_rank = {rank: self.layout.coordinate(rank) for rank in self.simulated}
        axes = by_rank[min(self.simulated)]
        return {axis: per_rank_int({r: c[axis] for r, c in by_rank.items()}) for axis in axes}

    def ordered(self, axes: str | Sequence[str]) -> OrderedGroup:
        """:meth:`ParallelMesh.ordered`, with ``index`` and ``ranks`` per simulated rank."""
        key = axes if isinstance(axes, str) else tuple(axes)
        found = self._ordered_groups.get(key)
        if found is not None:
            return found
        own = super().ordered(axes)
        grid, major_to_minor = self.layout.resolve_base(key)
        with outside_simulation():
            groups = grid.groups(major_to_minor).tolist()
        mismatch = tiling_mismatch("-".join(major_to_minor), own.group, groups)
        if mismatch is not None:
            raise SimulationError(mismatch)
        index, group_of_rank = positions(groups)
        # A sequence like the tuple it stands for, one group per simulated rank.
        ranks = cast(tuple[int, ...], PerRankRanks(group_of_rank, len(own.ranks)))
        found = replace(own, ranks=ranks, index=per_rank_int(index))
        self._ordered_groups[key] = found
        return found

    def _rank_in_group(self, group: dist.ProcessGroup) -> int:
        return group_rank(group)

    def _rank_in_view(self, view: DeviceMesh, dim: int) -> int:
        """Each simulated rank's position on dim ``dim`` of ``view``, read from every copy
        of it in its root at once (torch's own simulated answer looks every rank up
        in the whole world)."""
        with outside_simulation():
            copies = _compat.mesh_copies(view)
            position = torch.arange(copies.numel()).view(copies.shape)
            position = position // math.prod(copies.shape[dim + 2:]) % copies.shape[dim + 1]
            return per_rank_int(dict(zip(copies.flatten().tolist(), position.flatten().tolist())))

    def __repr__(self) -> str:
        return f"ParallelMesh({len(self.simulated)} simulated ranks, {self.layout.describe()})"

