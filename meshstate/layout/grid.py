"""Grids: ranks on named axes, and the arithmetic of their coordinates and groups.

Pure: nothing here touches ``torch.distributed``. A :class:`Grid` lays ranks out
on named axes with the first axis fastest-varying, the convention of Megatron's
order string; a :class:`ListedGrid` does the same over listed global ranks.
Inside a group of several axes the last one given varies fastest; groups are
enumerated over the other axes, outer to inner.

Example::

    >>> Grid(("tp", "dp"), (2, 4)).group_ranks(5, ["dp"])
    (1, 3, 5, 7)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import einops
import torch

from meshstate.errors import AxisError, ConfigError
from meshstate.layout.ranks import Ranks, listed_if_small, ranks_text


@dataclass(frozen=True)
class Grid:
    """Ranks ``rank_offset .. rank_offset + prod(sizes) - 1`` on named axes.

    ``axes_fastest_first`` and ``sizes`` run fastest-varying first, as in an order
    string; ``axes_mesh_order``/``mesh_shape`` give the same axes outer to inner, the order of
    a ``DeviceMesh``'s dimensions.

    Example::

        >>> grid = Grid(("tp", "dp"), (2, 3))
        >>> grid.coordinate(5)
        {'tp': 1, 'dp': 2}
        >>> grid.groups(["tp"]).tolist()
        [[0, 1], [2, 3], [4, 5]]
    """

    axes_fastest_first: tuple[str, ...]
    sizes: tuple[int, ...]
    rank_offset: int = 0
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.axes_fastest_first) != len(self.sizes):
            raise ConfigError(
                f"grid has {len(self.axes_fastest_first)} axis names {self.axes_fastest_first} but "
                f"{len(self.sizes)} sizes {self.sizes}"
            )
        if len(set(self.axes_fastest_first)) != len(self.axes_fastest_first):
            raise ConfigError(f"grid axis names {self.axes_fastest_first} repeat a name")
        for axis, size in zip(self.axes_fastest_first, self.sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"size of axis {axis!r} must be a positive integer, got {size!r}")
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int):
            raise ConfigError(f"rank_offset must be an integer, got {self.rank_offset!r}")
        if self.rank_offset < 0:
            raise ConfigError(f"rank_offset must be >= 0, got {self.rank_offset}")
        strides = dict(zip(self.axes_fastest_first, _prefix_products(self.sizes)))
        object.__setattr__(self, "_strides", strides)

    @property
    def world_size(self) -> int:
        """Number of ranks on the grid."""
        return math.prod(self.sizes)

    @property
    def axes_mesh_order(self) -> tuple[str, ...]:
        """Axis names outer to inner (the order string reversed)."""
        return self.axes_fastest_first[::-1]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Axis sizes outer to inner."""
        return self.sizes[::-1]

    def size(self, axis: str) -> int:
        """Size of one axis."""
        return self.sizes[self.axes_fastest_first.index(self._known(axis))]

    def stride(self, axis: str) -> int:
        """How far apart two ranks one step along ``axis`` are."""
        return self._strides[self._known(axis)]

    def mesh_order(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The given axis set sorted outer to inner, e.g. ``("dp", "cp")``."""
        wanted = {self._known(axis) for axis in axes}
        if not wanted:
            raise AxisError(f"an axis set needs at least one axis; valid axes are {self.axes_fastest_first}")
        return tuple(axis for axis in self.axes_mesh_order if axis in wanted)

    def coordinate(self, rank: int) -> dict[str, int]:
        """The position of ``rank`` on every axis."""
        local = self._local(rank)
        coordinate = {}
        for axis, size in zip(self.axes_fastest_first, self.sizes):
            local, coordinate[axis] = divmod(local, size)
        return coordinate

    def rank_grid(self) -> torch.Tensor:
        """All ranks as an int tensor of ``mesh_shape``."""
        return torch.arange(self.rank_offset, self.rank_offset + self.world_size).view(
            self.mesh_shape
        )

    def groups(self, major_to_minor: Sequence[str]) -> torch.Tensor:
        """Every group of ``major_to_minor``, one row each.

        ``major_to_minor`` runs major to minor: the last one varies fastest inside a row.
        Rows are enumerated over the other major_to_minor, outer to inner.

        Example: ``Grid(("tp", "dp"), (2, 2)).groups(["dp", "tp"])`` is
        ``[[0, 1, 2, 3]]``; ``.groups(["tp", "dp"])`` is ``[[0, 2, 1, 3]]``.
        """
        major_to_minor = self._distinct(major_to_minor)
        letters = {axis: f"a{i}" for i, axis in enumerate(self.axes_mesh_order)}
        others = [letters[a] for a in self.axes_mesh_order if a not in major_to_minor]
        members = [letters[a] for a in major_to_minor]
        pattern = (
            f"{' '.join(letters.values())} -> ({' '.join(others)}) ({' '.join(members)})"
        )
        return einops.rearrange(self.rank_grid(), pattern).contiguous()

    def group_ranks(self, rank: int, major_to_minor: Sequence[str]) -> tuple[int, ...]:
        """The global ranks of the group of ``major_to_minor`` (major to minor) that holds ``rank``."""
        return tuple(self.lattice_of(rank, major_to_minor))

    def lattice_of(self, rank: int, major_to_minor: Sequence[str]) -> Ranks:
        """:meth:`group_ranks` as :class:`~meshstate.layout.ranks.Ranks`: strides, no list of members.

        Example: ``Grid(("tp", "dp"), (2, 4)).lattice_of(5, ["dp"]) == (1, 3, 5, 7)``.
        """
        major_to_minor = self._distinct(major_to_minor)
        coordinate = self.coordinate(rank)
        base = rank - sum(coordinate[a] * self._strides[a] for a in major_to_minor)
        return Ranks(base, [(self._strides[a], self.size(a)) for a in major_to_minor])

    def members_of(self, rank: int, major_to_minor: Sequence[str]) -> Sequence[int]:
        """:meth:`group_ranks` as a mesh keeps it: strides for more than 4,096 ranks, else a tuple.

        Example: ``Grid(("tp", "dp"), (2, 4)).members_of(5, ["dp"])`` is ``(1, 3, 5, 7)``.
        """
        return listed_if_small(self.lattice_of(rank, major_to_minor))

    def members_at(self, rank: int, major_to_minor: Sequence[str], positions: range) -> Sequence[int]:
        """The members at ``positions`` of ``rank``'s group of ``major_to_minor`` (major to minor), sorted.

        Arithmetic on strides for just those positions, never the whole group: a
        :class:`~meshstate.layout.ranks.Ranks` where they form a lattice of more
        than 4,096 ranks, else a tuple (vectorised where they are no lattice).
        Example: ``Grid(("tp", "dp"), (2, 4)).members_at(0, ["dp", "tp"], range(2, 4))``
        is ``(2, 3)``.
        """
        major_to_minor = self._distinct(major_to_minor)
        group = self.lattice_of(rank, major_to_minor)
        taken = group.take(positions)
        if taken is not None:
            return listed_if_small(taken.sorted())
        remaining = torch.arange(positions.start, positions.stop, positions.step)
        members = torch.full_like(remaining, group.base)
        for axis in reversed(major_to_minor):
            members += remaining % self.size(axis) * self._strides[axis]
            remaining //= self.size(axis)
        found: list[int] = members.sort().values.tolist()
        return tuple(found)

    def index_in_group(self, rank: int, major_to_minor: Sequence[str]) -> int:
        """Position of ``rank`` inside its group of ``major_to_minor`` (major to minor)."""
        major_to_minor = self._distinct(major_to_minor)
        coordinate = self.coordinate(rank)
        index = 0
        for axis in major_to_minor:
            index = index * self.size(axis) + coordinate[axis]
        return index

    def _known(self, axis: str) -> str:
        if axis not in self._strides:
            raise AxisError(f"unknown axis {axis!r}; valid axes are {', '.join(self.axes_fastest_first)}")
        return axis

    def _distinct(self, axes: Sequence[str]) -> tuple[str, ...]:
        if isinstance(axes, str):
            axes = (axes,)
        checked = tuple(self._known(axis) for axis in axes)
        if not checked:
            raise AxisError(f"an axis list needs at least one axis; valid axes are {self.axes_fastest_first}")
        if len(set(checked)) != len(checked):
            raise AxisError(f"axis list {checked} names an axis twice")
        return checked

    def _local(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"rank must be an integer, got {rank!r}")
        local = rank - self.rank_offset
        if not 0 <= local < self.world_size:
            raise ConfigError(
                f"rank {rank} is outside the grid's ranks "
                f"{self.rank_offset}..{self.rank_offset + self.world_size - 1}"
            )
        return local


@dataclass(frozen=True)
class ListedGrid(Grid):
    """A :class:`Grid` over listed global ranks: local rank ``i`` is ``ranks[i]``.

    ``ranks`` increase, so groups keep the global order a process group numbers
    its members in. Every answer is the plain grid's, each rank mapped.

    Example::

        >>> grid = ListedGrid(("tp", "dp"), (2, 2), ranks=(1, 3, 5, 7))
        >>> grid.group_ranks(5, ["dp"]), grid.coordinate(7)
        ((1, 5), {'tp': 1, 'dp': 1})
    """

    ranks: tuple[int, ...] = ()
    _plain: Grid = field(init=False, repr=False, compare=False)
    _position: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank_offset:
            raise ConfigError(f"listed ranks take no rank_offset, got {self.rank_offset}")
        if len(self.ranks) != self.world_size:
            raise ConfigError(
                f"a grid of sizes {self.sizes} needs {self.world_size} ranks, "
                f"got {len(self.ranks)}"
            )
        if any(b <= a for a, b in zip(self.ranks, self.ranks[1:])) or self.ranks[0] < 0:
            raise ConfigError(f"listed ranks must increase from >= 0, got {ranks_text(self.ranks)}")
        object.__setattr__(self, "_plain", Grid(self.axes_fastest_first, self.sizes))
        object.__setattr__(self, "_position", {rank: i for i, rank in enumerate(self.ranks)})

    def rank_grid(self) -> torch.Tensor:
        """All ranks as an int tensor of ``mesh_shape``."""
        return torch.tensor(self.ranks).view(self.mesh_shape)

    def group_ranks(self, rank: int, major_to_minor: Sequence[str]) -> tuple[int, ...]:
        """The global ranks of the group of ``major_to_minor`` (major to minor) that holds ``rank``."""
        return tuple(self.ranks[i] for i in self._plain.group_ranks(self._local(rank), major_to_minor))

    def lattice_of(self, rank: int, major_to_minor: Sequence[str]) -> NoReturn:
        """Refused: listed ranks are no lattice; :meth:`group_ranks` lists the group."""
        raise ConfigError(
            f"a grid over listed ranks has no strides; ask group_ranks({rank}, {major_to_minor})"
        )

    def members_of(self, rank: int, major_to_minor: Sequence[str]) -> tuple[int, ...]:
        """The group, listed: listed ranks have no strides to keep."""
        return self.group_ranks(rank, major_to_minor)

    def members_at(self, rank: int, major_to_minor: Sequence[str], positions: range) -> tuple[int, ...]:
        """The members at ``positions`` of ``rank``'s group of ``major_to_minor``, sorted."""
        local = self._plain.members_at(self._local(rank), major_to_minor, positions)
        return tuple(self.ranks[i] for i in local)

    def _local(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"rank must be an integer, got {rank!r}")
        if rank not in self._position:
            raise ConfigError(f"rank {rank} is not one of the grid's ranks {ranks_text(self.ranks)}")
        return self._position[rank]


def _prefix_products(sizes: Sequence[int]) -> list[int]:
    products = [1]
    for size in sizes[:-1]:
        products.append(products[-1] * size)
    return products
