"""Pure rank arithmetic: which global ranks form the groups of an axis set.

Nothing here touches ``torch.distributed``. A :class:`Grid` lays ranks out on
named axes with the first axis fastest-varying, the convention of Megatron's
order string; a :class:`ParallelLayout` holds the dense view (tp, cp, dp, pp)
and the expert view (etp, ep, edp, pp) of one :class:`~meshstate.core.config.MeshConfig`;
a :class:`DerivedGroup` describes, by value, a group carved out of the groups of
a key (a hierarchical level, an instance, a gloo twin, ...).

Groups, the order of ranks inside a group and the order of the groups equal
megatron-core's ``RankGenerator``: inside a group the axis that comes first in
the order string varies fastest, and groups are enumerated with the remaining
axes, again first-in-order fastest.

Example (8 ranks, tp=2, pp=2, so dp=2)::

    >>> layout = ParallelLayout(MeshConfig(8, tp=2, pp=2))
    >>> layout.groups("dp").tolist()
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> layout.group_of(5, "tp-dp")
    (4, 5, 6, 7)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NoReturn

import einops
import torch

from meshstate.core.config import MeshConfig
from meshstate.core.errors import AxisError, ConfigError
from meshstate.core.ranks import Ranks, listed_if_small

DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")
HSDP_AXES = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
"""The HSDP view: the dense axes with ``dp`` split into ``dp_replicate`` (outer) x ``dp_shard``."""

DENSE_KINDS = ("tp", "cp", "dp", "pp", "tp-cp", "dp-cp", "tp-dp", "tp-dp-cp", "tp-pp")
"""Megatron's dense group kinds, in the order ``meshstate plan`` lists them."""
EXPERT_KINDS = ("ep", "etp", "etp-ep", "etp-ep-pp", "edp")
"""Megatron's expert group kinds, in the order ``meshstate plan`` lists them."""
GROUP_KINDS = DENSE_KINDS + EXPERT_KINDS
HSDP_KINDS = ("dp_replicate", "dp_shard", "dp_shard-cp")
"""The keys a mesh with ``dp_replicate > 1`` adds: FSDP2's replicate, shard and shard+cp groups."""

# How a joint key is spelled: "dp-cp" not "cp-dp", "etp-ep-pp" not "pp-ep-etp".
_KEY_SPELLING_ORDER = ("tp", "etp", "dp", "dp_replicate", "dp_shard", "cp", "ep", "edp", "pp")
_DP_PARTS = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class Grid:
    """Ranks ``rank_offset .. rank_offset + prod(sizes) - 1`` on named axes.

    ``axes`` and ``sizes`` run fastest-varying first, as in an order string;
    ``mesh_axes``/``mesh_shape`` give the same axes outer to inner, the order of
    a ``DeviceMesh``'s dimensions.

    Example::

        >>> grid = Grid(("tp", "dp"), (2, 3))
        >>> grid.coordinate(5)
        {'tp': 1, 'dp': 2}
        >>> grid.groups(["tp"]).tolist()
        [[0, 1], [2, 3], [4, 5]]
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    rank_offset: int = 0
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.sizes):
            raise ConfigError(
                f"grid has {len(self.axes)} axis names {self.axes} but "
                f"{len(self.sizes)} sizes {self.sizes}"
            )
        if len(set(self.axes)) != len(self.axes):
            raise ConfigError(f"grid axis names {self.axes} repeat a name")
        for axis, size in zip(self.axes, self.sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"size of axis {axis!r} must be a positive integer, got {size!r}")
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int):
            raise ConfigError(f"rank_offset must be an integer, got {self.rank_offset!r}")
        if self.rank_offset < 0:
            raise ConfigError(f"rank_offset must be >= 0, got {self.rank_offset}")
        strides = dict(zip(self.axes, _prefix_products(self.sizes)))
        object.__setattr__(self, "_strides", strides)

    @property
    def world_size(self) -> int:
        """Number of ranks on the grid."""
        return math.prod(self.sizes)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Axis names outer to inner (the order string reversed)."""
        return self.axes[::-1]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Axis sizes outer to inner."""
        return self.sizes[::-1]

    def size(self, axis: str) -> int:
        """Size of one axis."""
        return self.sizes[self.axes.index(self._known(axis))]

    def stride(self, axis: str) -> int:
        """How far apart two ranks one step along ``axis`` are."""
        return self._strides[self._known(axis)]

    def mesh_order(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The given axis set sorted outer to inner, e.g. ``("dp", "cp")``."""
        wanted = {self._known(axis) for axis in axes}
        if not wanted:
            raise AxisError(f"an axis set needs at least one axis; valid axes are {self.axes}")
        return tuple(axis for axis in self.mesh_axes if axis in wanted)

    def coordinate(self, rank: int) -> dict[str, int]:
        """The position of ``rank`` on every axis."""
        local = self._local(rank)
        coordinate = {}
        for axis, size in zip(self.axes, self.sizes):
            local, coordinate[axis] = divmod(local, size)
        return coordinate

    def rank_grid(self) -> torch.Tensor:
        """All ranks as an int tensor of ``mesh_shape``."""
        return torch.arange(self.rank_offset, self.rank_offset + self.world_size).view(
            self.mesh_shape
        )

    def groups(self, axes: Sequence[str]) -> torch.Tensor:
        """Every group of ``axes``, one row each.

        ``axes`` runs major to minor: the last one varies fastest inside a row.
        Rows are enumerated over the other axes, outer to inner.

        Example: ``Grid(("tp", "dp"), (2, 2)).groups(["dp", "tp"])`` is
        ``[[0, 1, 2, 3]]``; ``.groups(["tp", "dp"])`` is ``[[0, 2, 1, 3]]``.
        """
        major_to_minor = self._distinct(axes)
        letters = {axis: f"a{i}" for i, axis in enumerate(self.mesh_axes)}
        others = [letters[a] for a in self.mesh_axes if a not in major_to_minor]
        members = [letters[a] for a in major_to_minor]
        pattern = (
            f"{' '.join(letters.values())} -> ({' '.join(others)}) ({' '.join(members)})"
        )
        return einops.rearrange(self.rank_grid(), pattern).contiguous()

    def group_of(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The group of ``axes`` (major to minor) that contains ``rank``."""
        return tuple(self.lattice_of(rank, axes))

    def lattice_of(self, rank: int, axes: Sequence[str]) -> Ranks:
        """:meth:`group_of` as :class:`~meshstate.core.ranks.Ranks`: strides, no list of members.

        Example: ``Grid(("tp", "dp"), (2, 4)).lattice_of(5, ["dp"]) == (1, 3, 5, 7)``.
        """
        major_to_minor = self._distinct(axes)
        coordinate = self.coordinate(rank)
        base = rank - sum(coordinate[a] * self._strides[a] for a in major_to_minor)
        return Ranks(base, [(self._strides[a], self.size(a)) for a in major_to_minor])

    def members_of(self, rank: int, axes: Sequence[str]) -> Sequence[int]:
        """:meth:`group_of` as a mesh keeps it: strides for more than 4,096 ranks, else a tuple.

        Example: ``Grid(("tp", "dp"), (2, 4)).members_of(5, ["dp"])`` is ``(1, 3, 5, 7)``.
        """
        return listed_if_small(self.lattice_of(rank, axes))

    def members_at(self, rank: int, axes: Sequence[str], positions: range) -> Sequence[int]:
        """The members at ``positions`` of ``rank``'s group of ``axes`` (major to minor), sorted.

        Arithmetic on strides for just those positions, never the whole group: a
        :class:`~meshstate.core.ranks.Ranks` where they form a lattice of more
        than 4,096 ranks, else a tuple (vectorised where they are no lattice).
        Example: ``Grid(("tp", "dp"), (2, 4)).members_at(0, ["dp", "tp"], range(2, 4))``
        is ``(2, 3)``.
        """
        major_to_minor = self._distinct(axes)
        taken = self.lattice_of(rank, major_to_minor).take(positions)
        if taken is not None:
            return listed_if_small(taken.sorted())
        coordinate = self.coordinate(rank)
        base = rank - sum(coordinate[a] * self._strides[a] for a in major_to_minor)
        remaining = torch.arange(positions.start, positions.stop, positions.step)
        members = torch.full_like(remaining, base)
        for axis in reversed(major_to_minor):
            members += remaining % self.size(axis) * self._strides[axis]
            remaining //= self.size(axis)
        found: list[int] = members.sort().values.tolist()
        return tuple(found)

    def index_in_group(self, rank: int, axes: Sequence[str]) -> int:
        """Position of ``rank`` inside its group of ``axes`` (major to minor)."""
        major_to_minor = self._distinct(axes)
        coordinate = self.coordinate(rank)
        index = 0
        for axis in major_to_minor:
            index = index * self.size(axis) + coordinate[axis]
        return index

    def _known(self, axis: str) -> str:
        if axis not in self._strides:
            raise AxisError(f"unknown axis {axis!r}; valid axes are {', '.join(self.axes)}")
        return axis

    def _distinct(self, axes: Sequence[str]) -> tuple[str, ...]:
        if isinstance(axes, str):
            axes = (axes,)
        checked = tuple(self._known(axis) for axis in axes)
        if not checked:
            raise AxisError(f"an axis list needs at least one axis; valid axes are {self.axes}")
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
        >>> grid.group_of(5, ["dp"]), grid.coordinate(7)
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
            raise ConfigError(f"listed ranks must increase from >= 0, got {_shown(self.ranks)}")
        object.__setattr__(self, "_plain", Grid(self.axes, self.sizes))
        object.__setattr__(self, "_position", {rank: i for i, rank in enumerate(self.ranks)})

    def rank_grid(self) -> torch.Tensor:
        """All ranks as an int tensor of ``mesh_shape``."""
        return torch.tensor(self.ranks).view(self.mesh_shape)

    def group_of(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The group of ``axes`` (major to minor) that contains ``rank``."""
        return tuple(self.ranks[i] for i in self._plain.group_of(self._local(rank), axes))

    def lattice_of(self, rank: int, axes: Sequence[str]) -> NoReturn:
        """Refused: listed ranks are no lattice; :meth:`group_of` lists the group."""
        raise ConfigError(f"a grid over listed ranks has no strides; ask group_of({rank}, {axes})")

    def members_of(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The group, listed: listed ranks have no strides to keep."""
        return self.group_of(rank, axes)

    def members_at(self, rank: int, axes: Sequence[str], positions: range) -> tuple[int, ...]:
        """The members at ``positions`` of ``rank``'s group of ``axes``, sorted."""
        local = self._plain.members_at(self._local(rank), axes, positions)
        return tuple(self.ranks[i] for i in local)

    def _local(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"rank must be an integer, got {rank!r}")
        if rank not in self._position:
            raise ConfigError(f"rank {rank} is not one of the grid's ranks {_shown(self.ranks)}")
        return self._position[rank]


def _shown(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 16 else f"{list(ranks[:16])} ... ({len(ranks)} ranks)"


def _prefix_products(sizes: Sequence[int]) -> list[int]:
    products = [1]
    for size in sizes[:-1]:
        products.append(products[-1] * size)
    return products


def _dense_grid(config: MeshConfig, rank_offset: int = 0) -> Grid:
    sizes = config.dense_sizes()
    axes = tuple(a for a in config.order_axes if a != "ep")
    return Grid(axes, tuple(sizes[a] for a in axes), rank_offset)


def _hsdp_grid(config: MeshConfig, rank_offset: int = 0) -> Grid:
    sizes = config.hsdp_sizes()
    axes = tuple(
        part
        for axis in config.order_axes
        if axis != "ep"
        for part in (("dp_shard", "dp_replicate") if axis == "dp" else (axis,))
    )
    return Grid(axes, tuple(sizes[a] for a in axes), rank_offset)


def _listed(grid: Grid, ranks: tuple[int, ...] | None) -> Grid:
    return grid if ranks is None else ListedGrid(grid.axes, grid.sizes, grid.rank_offset, ranks)


def _expert_grid(config: MeshConfig, rank_offset: int = 0) -> Grid:
    sizes = config.expert_sizes()
    order_axes = tuple(a for a in config.order_axes if a != "cp")
    names = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    return Grid(
        tuple(names[a] for a in order_axes), tuple(sizes[a] for a in order_axes), rank_offset
    )


def hierarchical_levels(ranks: Sequence[int], sizes: Sequence[int]) -> list[list[list[int]]]:
    """Split ``ranks`` into hierarchical levels of the given sizes.

    Level ``i`` groups ranks ``prod(sizes[:i])`` apart, ``sizes[i]`` at a time.

    Example: 8 ranks in levels ``[2, 4]`` give ``[[0, 1], [2, 3], ...]`` and
    ``[[0, 2, 4, 6], [1, 3, 5, 7]]``.
    """
    if math.prod(sizes) != len(ranks):
        raise ConfigError(
            f"hierarchical sizes {list(sizes)} multiply to {math.prod(sizes)}, "
            f"not to the {len(ranks)} ranks they split"
        )
    levels = []
    for level, size in enumerate(sizes):
        grouped = einops.rearrange(
            torch.tensor(list(ranks)),
            "(outer size inner) -> (outer inner) size",
            inner=math.prod(sizes[:level]),
            size=size,
            outer=math.prod(sizes[level + 1 :]),
        )
        levels.append(grouped.tolist())
    return levels


@dataclass(frozen=True)
class Chunks:
    """Consecutive parts of ``size`` ranks.

    Example: ``Chunks(2).parts([0, 4, 8, 12]) == [[0, 4], [8, 12]]``.
    """

    size: int

    def parts(self, ranks: Sequence[int]) -> list[list[int]]:
        """The parts of one base group."""
        if self.size < 1 or len(ranks) % self.size:
            raise ConfigError(f"{len(ranks)} ranks do not split into {self}")
        return [list(ranks[start : start + self.size]) for start in range(0, len(ranks), self.size)]

    def part_of(self, position: int, base_size: int) -> range:
        """The positions in a base group of ``base_size`` of the part holding ``position``."""
        if self.size < 1 or base_size % self.size:
            raise ConfigError(f"{base_size} ranks do not split into {self}")
        start = position - position % self.size
        return range(start, start + self.size)

    def __str__(self) -> str:
        return f"chunks of {self.size}"


@dataclass(frozen=True)
class Instances:
    """``count`` instances of consecutive ranks: each instance (intra), or the ranks
    at one position in every instance (``inter``).

    ``count`` is the mesh's, not part of the value: ``Instances()`` finds the
    instances a mesh declared, whatever their count.

    Example: ``Instances(2).parts(range(8))`` is ``[[0, 1, 2, 3], [4, 5, 6, 7]]``;
    ``Instances(2, inter=True).parts(range(8))`` is ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
    """

    count: int = field(default=0, compare=False)
    inter: bool = False

    def parts(self, ranks: Sequence[int]) -> list[list[int]]:
        """The parts of one base group."""
        if self.count < 1 or len(ranks) % self.count:
            raise ConfigError(f"{len(ranks)} ranks do not split into {self}")
        per_instance = len(ranks) // self.count
        if self.inter:
            return [list(ranks[start::per_instance]) for start in range(per_instance)]
        return Chunks(per_instance).parts(ranks)

    def part_of(self, position: int, base_size: int) -> range:
        """The positions in a base group of ``base_size`` of the part holding ``position``."""
        if self.count < 1 or base_size % self.count:
            raise ConfigError(f"{base_size} ranks do not split into {self}")
        per_instance = base_size // self.count
        if self.inter:
            return range(position % per_instance, base_size, per_instance)
        return Chunks(per_instance).part_of(position, base_size)

    def __str__(self) -> str:
        count = f" of {self.count}" if self.count else ""
        return f"{'inter' if self.inter else 'intra'}-instance{count}"


@dataclass(frozen=True)
class Level:
    """Level ``level`` of a hierarchy of ``sizes`` (see :func:`hierarchical_levels`).

    ``sizes`` are the mesh's, not part of the value: ``Level(0)`` finds level 0
    of whatever hierarchy a mesh declared.
    """

    level: int
    sizes: tuple[int, ...] = field(default=(), compare=False)

    def parts(self, ranks: Sequence[int]) -> list[list[int]]:
        """The parts of one base group."""
        if not 0 <= self.level < len(self.sizes):
            raise ConfigError(f"{self} needs sizes with at least {self.level + 1} levels")
        return hierarchical_levels(ranks, self.sizes)[self.level]

    def part_of(self, position: int, base_size: int) -> range:
        """The positions in a base group of ``base_size`` of the part holding ``position``."""
        if not 0 <= self.level < len(self.sizes):
            raise ConfigError(f"{self} needs sizes with at least {self.level + 1} levels")
        if math.prod(self.sizes) != base_size:
            raise ConfigError(
                f"hierarchical sizes {list(self.sizes)} multiply to {math.prod(self.sizes)}, "
                f"not to the {base_size} ranks they split"
            )
        inner = math.prod(self.sizes[: self.level])
        block = inner * self.sizes[self.level]
        start = position - position % block + position % inner
        return range(start, start + block, inner)

    def __str__(self) -> str:
        sizes = f" of {'x'.join(map(str, self.sizes))}" if self.sizes else ""
        return f"level {self.level}{sizes}"


@dataclass(frozen=True)
class Pick:
    """The ranks ``ranks_of`` picks from each base group, e.g. a pipeline's first and last stage.

    ``name`` tells picks apart; the function is the mesh's, not part of the value.
    """

    name: str
    ranks_of: Callable[[list[int]], Sequence[int]] | None = field(
        default=None, compare=False, repr=False
    )

    def parts(self, ranks: Sequence[int]) -> list[list[int]]:
        """The one part of one base group, checked to be drawn from it."""
        if self.ranks_of is None:
            raise ConfigError(f"pick {self.name!r} has no ranks_of function")
        picked = [int(rank) for rank in self.ranks_of(list(ranks))]
        if not picked or len(set(picked)) != len(picked) or not set(picked) <= set(ranks):
            raise ConfigError(
                f"pick {self.name!r} chose {picked} from {list(ranks)}; it must choose "
                "distinct ranks of that group, at least one"
            )
        return [picked]

    def __str__(self) -> str:
        return self.name


Split = Chunks | Instances | Level | Pick
"""How a derived group divides one group of its base."""


@dataclass(frozen=True)
class DerivedGroup:
    """A group carved out of the groups of ``base``, named by value.

    ``base`` is a key (``"dp-cp"``) or axes major to minor (``("edp", "pp", "ep",
    "etp")``); ``split`` divides each base group (``None``: the base group
    itself); ``backend`` gives it a communicator of that backend (``"gloo"`` for
    a gloo twin of a key) and ``separate`` one of its own even where another group
    has the same ranks. A mesh creates the derived groups it is given at init
    and answers ``mesh.group(spec)``, ``mesh.rank(spec)`` and so on for them.

    Example::

        >>> hierarchical = DerivedGroup("cp", Level(1, sizes=(2, 2)))
        >>> str(hierarchical)
        'cp/level 1 of 2x2'
        >>> hierarchical == DerivedGroup("cp", Level(1))   # the sizes are the mesh's
        True
        >>> str(DerivedGroup("dp", backend="gloo"))
        'dp[gloo]'
    """

    base: str | tuple[str, ...]
    split: Split | None = None
    backend: str | None = None
    separate: bool = False

    def __post_init__(self) -> None:
        if self.split is None and self.backend is None and not self.separate:
            raise ConfigError(
                f"DerivedGroup({self.base!r}) derives nothing from its base; give it a split, "
                "a backend or separate=True"
            )

    def parts(self, base_group: Sequence[int]) -> list[list[int]]:
        """The sorted groups carved out of one base group, given in base order."""
        parts = [list(base_group)] if self.split is None else self.split.parts(base_group)
        return [sorted(part) for part in parts]

    def __str__(self) -> str:
        base = self.base if isinstance(self.base, str) else f"({', '.join(self.base)})"
        text = base if self.split is None else f"{base}/{self.split}"
        extras = ([self.backend] if self.backend else []) + (["separate"] if self.separate else [])
        return f"{text}[{', '.join(extras)}]" if extras else text


Key = str | DerivedGroup
"""What names a group of a mesh: a key such as ``"dp-cp"``, or a :class:`DerivedGroup`."""


def spellings(key: Key, *, split_dp: bool = False) -> list[Key]:
    """Every way to write ``key``: a joint key is a set of axes; with ``split_dp``,
    ``dp`` is also written ``dp_replicate-dp_shard``.

    Example: ``spellings("dp-cp") == ["dp-cp", "cp-dp"]``; with ``split_dp=True`` the
    list goes on with ``"dp_replicate-dp_shard-cp"`` and its other orders.
    """
    if isinstance(key, str):
        return list(_joint_spellings(key, split_dp))
    if isinstance(key.base, str):
        return [replace(key, base=base) for base in _joint_spellings(key.base, split_dp)]
    return [key]


def splits_dp(keys: Iterable[Key]) -> bool:
    """Whether a key names ``dp_replicate`` or ``dp_shard``: then ``dp`` is also spelled so.

    Example: ``splits_dp(["tp", "dp_shard-cp"])`` is ``True``.
    """
    for key in keys:
        base = key if isinstance(key, str) else key.base
        axes = base.split("-") if isinstance(base, str) else base
        if any(axis in _DP_PARTS for axis in axes):
            return True
    return False


def _joint_spellings(key: str, split_dp: bool) -> Iterable[str]:
    axes = key.split("-")
    written = list(map("-".join, itertools.permutations(axes)))
    if split_dp and "dp" in axes:
        split = [part for axis in axes for part in (_DP_PARTS if axis == "dp" else (axis,))]
        written += map("-".join, itertools.permutations(split))
    return written


@dataclass(frozen=True)
class ParallelLayout:
    """The dense, expert and HSDP views of one config, and their groups by key.

    A key names one axis (``"tp"``) or a joint group of several axes of one view
    (``"dp-cp"``). A joint key is a set: ``"cp-dp"`` is the same group as
    ``"dp-cp"``, and ``"dp_replicate-dp_shard"`` the same as ``"dp"``. Ranks
    inside a joint group run in mesh order, the axis first in the order string
    fastest, exactly as megatron-core builds them. The HSDP view (``hsdp``) is
    the dense one with ``dp`` split into ``dp_replicate`` (outer) x ``dp_shard``
    (inner), torchtitan's ``[pp, dp_replicate, dp_shard, cp, tp]`` for the
    default order. ``rank_offset`` shifts every rank: a layout over ranks
    ``rank_offset .. rank_offset + world_size - 1`` of a larger world;
    ``ranks`` (increasing) puts local rank ``i`` on global rank ``ranks[i]`` instead.
    """

    config: MeshConfig
    rank_offset: int = 0
    ranks: tuple[int, ...] | None = None
    dense: Grid = field(init=False, repr=False)
    expert: Grid = field(init=False, repr=False)
    hsdp: Grid = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, view in (("dense", _dense_grid), ("expert", _expert_grid), ("hsdp", _hsdp_grid)):
            grid = view(self.config, self.rank_offset)
            object.__setattr__(self, name, _listed(grid, self.ranks))

    def resolve(self, key: str, view: Grid | None = None) -> tuple[str, Grid, tuple[str, ...]]:
        """Canonical key, view and mesh-ordered axes of ``key``.

        ``view`` resolves it in that view (``"tp"`` in ``layout.hsdp``), where it
        has all the key's axes; ``dp`` there is ``dp_replicate`` and ``dp_shard``.

        Example: ``resolve("cp-dp")`` gives ``("dp-cp", layout.dense, ("dp", "cp"))``
        for the default order; ``resolve("dp_shard-dp_replicate")`` gives ``("dp",
        layout.dense, ("dp",))``.
        """
        if not isinstance(key, str):
            raise AxisError(f"a group key is a string such as 'tp' or 'dp-cp', got {key!r}")
        names = key.split("-")
        hsdp = self.config.dp_replicate > 1
        valid = ", ".join(DENSE_AXES + EXPERT_AXES[:-1] + (_DP_PARTS if hsdp else ()))
        unknown = [n for n in names if n not in DENSE_AXES + EXPERT_AXES + _DP_PARTS]
        if unknown:
            raise AxisError(f"unknown axis {unknown[0]!r} in key {key!r}; valid axes are {valid}")
        if len(set(names)) != len(names):
            raise AxisError(f"key {key!r} names an axis twice")
        if "dp" in names and any(n in _DP_PARTS for n in names):
            raise AxisError(f"key {key!r} names dp and a part of it ({', '.join(_DP_PARTS)})")
        if set(_DP_PARTS) <= set(names):
            names = [n for n in names if n not in _DP_PARTS] + ["dp"]
        canonical = "-".join(n for n in _KEY_SPELLING_ORDER if n in names)
        if view is self.hsdp and "dp" in names:
            names = [n for n in names if n != "dp"] + list(_DP_PARTS)
        if view is not None:
            grid = view
        elif all(n in DENSE_AXES for n in names):
            grid = self.dense
        elif all(n in EXPERT_AXES for n in names):
            grid = self.expert
        elif all(n in HSDP_AXES for n in names):
            grid = self.hsdp
        else:
            views = f"the dense axes {', '.join(DENSE_AXES)}"
            if hsdp or any(n in _DP_PARTS for n in names):
                views += f", the HSDP axes {', '.join(HSDP_AXES)}"
            views += f" or the expert axes {', '.join(EXPERT_AXES)}"
            raise AxisError(f"key {key!r} mixes dense and expert axes; a joint group uses {views}")
        return canonical, grid, grid.mesh_order(names)

    def resolve_together(self, keys: Sequence[str]) -> list[tuple[str, Grid, tuple[str, ...]]]:
        """:meth:`resolve` for several keys in one view: the HSDP one if a key needs it.

        Example: ``resolve_together(["dp_replicate", "tp"])`` resolves both in ``layout.hsdp``.
        """
        resolved = [self.resolve(key) for key in keys]
        if any(grid is self.hsdp for _, grid, _ in resolved):
            resolved = [self.resolve(key, self.hsdp) for key in keys]
        return resolved

    def canonical(self, key: str) -> str:
        """``key`` spelled the one way meshstate uses, e.g. ``"cp-dp"`` -> ``"dp-cp"``."""
        return self.resolve(key)[0]

    def groups(self, key: str) -> torch.Tensor:
        """Every group of ``key`` in megatron-core's order, one row each."""
        _, grid, axes = self.resolve(key)
        return grid.groups(axes)

    def group_of(self, rank: int, key: str) -> tuple[int, ...]:
        """The group of ``key`` that contains ``rank``."""
        _, grid, axes = self.resolve(key)
        return grid.group_of(rank, axes)

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s position on every dense and expert axis (HSDP too if dp_replicate > 1)."""
        hsdp = self.hsdp.coordinate(rank) if self.config.dp_replicate > 1 else {}
        return {**self.dense.coordinate(rank), **self.expert.coordinate(rank), **hsdp}

    def resolve_base(self, base: str | tuple[str, ...]) -> tuple[Grid, tuple[str, ...]]:
        """The view and the major-to-minor axes of a key or an axis tuple."""
        if isinstance(base, str):
            _, grid, axes = self.resolve(base)
            return grid, axes
        grid = self.resolve("-".join(base))[1]
        if not set(base) <= set(grid.axes):  # dp's parts, which name dp as a key
            grid = self.hsdp
        return grid, tuple(base)

    def members(self, rank: int, key: Key) -> Sequence[int] | None:
        """The group of ``key`` that contains ``rank`` (``None`` if a derived group has none).

        A tuple, or for a group of more than 4,096 ranks that is a lattice, its
        strides (:class:`~meshstate.core.ranks.Ranks`): a group of a million-rank
        world costs no list of its members.
        """
        if isinstance(key, str):
            _, grid, axes = self.resolve(key)
            return grid.members_of(rank, axes)
        grid, axes = self.resolve_base(key.base)
        split = key.split
        if split is None or isinstance(split, (Chunks, Instances, Level)):
            base_size = math.prod(grid.size(axis) for axis in axes)
            position = grid.index_in_group(rank, axes)
            positions = range(base_size) if split is None else split.part_of(position, base_size)
            return grid.members_at(rank, axes, positions)
        for part in key.parts(grid.group_of(rank, axes)):
            if rank in part:
                return tuple(part)
        return None

    def every_group(self, key: Key) -> list[list[int]]:
        """Every group of ``key``, base group by base group."""
        if isinstance(key, str):
            groups: list[list[int]] = self.groups(key).tolist()
            return groups
        grid, axes = self.resolve_base(key.base)
        return [part for base in grid.groups(axes).tolist() for part in key.parts(base)]
