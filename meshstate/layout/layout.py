"""The parallel layout of one config: its dense, expert and HSDP grids, and groups by key.

Pure rank arithmetic: nothing here touches ``torch.distributed``. A
:class:`ParallelLayout` holds the dense view (tp, cp, dp, pp), the expert view
(etp, ep, edp, pp) and the HSDP view of one :class:`~meshstate.layout.config.MeshConfig`
and resolves a key (``"dp-cp"``, any spelling) or a
:class:`~meshstate.layout.derived_groups.DerivedGroup` to its groups. The grids
live in :mod:`meshstate.layout.grid`, the derived groups in
:mod:`meshstate.layout.derived_groups`; both are importable from here too.

Groups, the order of ranks inside a group and the order of the groups equal
megatron-core's ``RankGenerator``: inside a group the axis that comes first in
the order string varies fastest, and groups are enumerated with the remaining
axes, again first-in-order fastest.

Example (8 ranks, tp=2, pp=2, so dp=2)::

    >>> layout = ParallelLayout(MeshConfig(8, tp=2, pp=2))
    >>> layout.groups("dp").tolist()
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> layout.group_ranks(5, "tp-dp")
    (4, 5, 6, 7)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from meshstate.layout.config import MeshConfig, sizes_text
from meshstate.layout.derived_groups import (
    Chunks,
    DerivedGroup,
    Instances,
    Level,
    Pick,
    Split,
    hierarchical_levels,
)
from meshstate.errors import AxisError
from meshstate.layout.grid import Grid, ListedGrid

__all__ = [
    "DENSE_AXES", "DENSE_KINDS", "EXPERT_AXES", "EXPERT_KINDS", "GROUP_KINDS", "HSDP_AXES",
    "HSDP_KINDS", "Chunks", "DerivedGroup", "Grid", "Instances", "Key", "Level", "ListedGrid",
    "KeyedLayout", "MeshLayout",
    "ParallelLayout", "Pick", "Split", "hierarchical_levels", "spellings", "splits_dp",
]


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
    return grid if ranks is None else ListedGrid(grid.axes_fastest_first, grid.sizes, grid.rank_offset, ranks)


def _expert_grid(config: MeshConfig, rank_offset: int = 0) -> Grid:
    sizes = config.expert_sizes()
    order_axes = tuple(a for a in config.order_axes if a != "cp")
    names = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    return Grid(
        tuple(names[a] for a in order_axes), tuple(sizes[a] for a in order_axes), rank_offset
    )


Key = str | DerivedGroup
"""What names a group of a mesh: a key such as ``"dp-cp"``, or a :class:`DerivedGroup`."""


class MeshLayout(Protocol):
    """What a mesh asks of its layout: Megatron's :class:`ParallelLayout`, or the caller's
    axes (:class:`~meshstate.layout.named_layout.NamedLayout`, from ``make_mesh``)."""

    @property
    def config(self) -> MeshConfig: ...
    @property
    def dense(self) -> Grid: ...
    @property
    def expert(self) -> Grid: ...
    @property
    def hsdp(self) -> Grid: ...
    @property
    def kinds(self) -> tuple[str, ...]: ...
    def view_name(self, grid: Grid) -> str: ...
    def knows(self, axis: object) -> bool: ...
    def axes_text(self) -> str: ...
    def describe(self) -> str: ...
    def arguments(self) -> dict[str, object]: ...
    def resolve(self, key: str, view: Grid | None = None) -> tuple[str, Grid, tuple[str, ...]]: ...
    def view_of(self, axes: Iterable[str], what: str = "axes") -> Grid: ...
    def resolve_together(self, keys: Sequence[str]) -> list[tuple[str, Grid, tuple[str, ...]]]: ...
    def canonical(self, key: str) -> str: ...
    def groups(self, key: str) -> torch.Tensor: ...
    def group_ranks(self, rank: int, key: str) -> tuple[int, ...]: ...
    def coordinate(self, rank: int) -> dict[str, int]: ...
    def resolve_base(self, base: str | tuple[str, ...]) -> tuple[Grid, tuple[str, ...]]: ...
    def members(self, rank: int, key: Key) -> Sequence[int] | None: ...
    def every_group(self, key: Key) -> list[list[int]]: ...


def spellings(key: Key, *, split_dp: bool = False) -> list[Key]:
    """Every way to write ``key``: a joint key is a set of axes; with ``split_dp``,
    ``dp`` is also written ``dp_replicate-dp_shard``.

    A derived group is also written in its :attr:`~DerivedGroup.lookup` form
    (``DerivedGroup("cp", Level(1))`` for level 1 of any sizes).

    Example: ``spellings("dp-cp") == ["dp-cp", "cp-dp"]``; with ``split_dp=True`` the
    list goes on with ``"dp_replicate-dp_shard-cp"`` and its other orders.
    """
    if isinstance(key, str):
        return list(_joint_spellings(key, split_dp))
    written = [key]
    if isinstance(key.base, str):
        written = [replace(key, base=base) for base in _joint_spellings(key.base, split_dp)]
    return list(dict.fromkeys(written + [spelling.lookup for spelling in written]))


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


class KeyedLayout(ABC):
    """What every layout answers alike from its own :meth:`resolve` and :meth:`view_of`:
    a key's canonical spelling, its groups, and the view of an axis tuple."""

    @abstractmethod
    def resolve(self, key: str, view: Grid | None = None) -> tuple[str, Grid, tuple[str, ...]]:
        """Canonical key, view and mesh-ordered axes of ``key``."""

    @abstractmethod
    def view_of(self, axes: Iterable[str], what: str = "axes") -> Grid:
        """The view whose axes hold every one of ``axes``; ``what`` names the asker."""

    def canonical(self, key: str) -> str:
        """``key`` spelled the one way meshstate uses, e.g. ``"cp-dp"`` -> ``"dp-cp"``."""
        return self.resolve(key)[0]

    def groups(self, key: str) -> torch.Tensor:
        """Every group of ``key`` in the layout's order, one row each."""
        _, grid, axes = self.resolve(key)
        return grid.groups(axes)

    def group_ranks(self, rank: int, key: str) -> tuple[int, ...]:
        """The global ranks of ``rank``'s group of ``key`` (a mesh's ``ranks(key)`` on ``rank``)."""
        _, grid, axes = self.resolve(key)
        return grid.group_ranks(rank, axes)

    def resolve_together(self, keys: Sequence[str]) -> list[tuple[str, Grid, tuple[str, ...]]]:
        """:meth:`resolve` for several keys in one view."""
        return [self.resolve(key) for key in keys]

    def resolve_base(self, base: str | tuple[str, ...]) -> tuple[Grid, tuple[str, ...]]:
        """The view and the major-to-minor axes of a key or an axis tuple."""
        if isinstance(base, str):
            _, grid, axes = self.resolve(base)
            return grid, axes
        self.resolve("-".join(base))  # refuses unknown axes and repeats, as for a key
        return self.view_of(base, f"axes {base!r}"), tuple(base)


@dataclass(frozen=True)
class ParallelLayout(KeyedLayout):
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

    def view_name(self, grid: Grid) -> str:
        """The name of the mesh attribute holding ``grid``'s root DeviceMesh: ``"dense"``,
        ``"expert"`` or ``"hsdp"``."""
        if grid is self.hsdp:
            return "hsdp"
        return "dense" if grid is self.dense else "expert"

    def knows(self, axis: object) -> bool:
        """Whether ``axis`` is an axis of one of the views."""
        return axis in DENSE_AXES + EXPERT_AXES + HSDP_AXES

    def axes_text(self) -> str:
        """The valid axes of each view, for messages."""
        text = f"dense axes {DENSE_AXES}, expert axes {EXPERT_AXES}"
        return text + (f", HSDP axes {HSDP_AXES}" if self.config.dp_replicate > 1 else "")

    def describe(self) -> str:
        """The layout for a repr: ``order='tp-cp-ep-dp-pp', tp=2 cp=1 ...``."""
        return f"order={self.config.order!r}, {sizes_text(self.config.sizes())}"

    def arguments(self) -> dict[str, object]:
        """What every rank of a build agrees on: the config's arguments, ``etp`` written
        only where it is not ``tp`` (its default), so a rank whose ``tp`` differs is told
        so alone."""
        config = self.config
        return {**config.arguments(), "etp": None if config.etp == config.tp else config.etp}

    @property
    def kinds(self) -> tuple[str, ...]:
        """The group kinds every mesh of this layout has: Megatron's, and HSDP's where
        ``dp_replicate > 1``. Example: ``ParallelLayout(MeshConfig(8, tp=2)).kinds ==
        GROUP_KINDS``."""
        return GROUP_KINDS + (HSDP_KINDS if self.config.dp_replicate > 1 else ())

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
        unknown = [n for n in names if n not in DENSE_AXES + EXPERT_AXES + _DP_PARTS]
        if unknown:
            raise AxisError(
                f"unknown axis {unknown[0]!r} in key {key!r}; valid axes are "
                f"{', '.join(self._valid_axes())}"
            )
        if len(set(names)) != len(names):
            raise AxisError(f"key {key!r} names an axis twice")
        if "dp" in names and any(n in _DP_PARTS for n in names):
            raise AxisError(f"key {key!r} names dp and a part of it ({', '.join(_DP_PARTS)})")
        if set(_DP_PARTS) <= set(names):
            names = [n for n in names if n not in _DP_PARTS] + ["dp"]
        canonical = "-".join(n for n in _KEY_SPELLING_ORDER if n in names)
        if view is self.hsdp and "dp" in names:
            names = [n for n in names if n != "dp"] + list(_DP_PARTS)
        grid = view if view is not None else self.view_of(names, f"key {key!r}")
        return canonical, grid, grid.mesh_order(names)

    def view_of(self, axes: Iterable[str], what: str = "axes") -> Grid:
        """The view whose axes hold every one of ``axes``: dense, else expert, else HSDP.

        The one rule for which view an axis set belongs to, for keys, axis tuples,
        DeviceMesh slices, collectives, ``shard_map`` and ``reshard`` alike.
        ``what`` names the asker in the errors.

        Example: ``view_of(["dp", "cp"])`` is ``layout.dense``, ``view_of(["ep"])``
        ``layout.expert``, ``view_of(["dp_shard"])`` ``layout.hsdp``.
        """
        names = set(axes)
        unknown = sorted(names - set(DENSE_AXES + EXPERT_AXES + _DP_PARTS))
        if unknown:
            raise AxisError(
                f"{what} names axis {unknown[0]!r}, which the mesh lacks; valid are "
                f"{', '.join(self._valid_axes())}"
            )
        for grid, view_axes in ((self.dense, DENSE_AXES), (self.expert, EXPERT_AXES),
                                (self.hsdp, HSDP_AXES)):
            if names <= set(view_axes):
                return grid
        views = f"the dense axes {', '.join(DENSE_AXES)}"
        if self.config.dp_replicate > 1 or names & set(_DP_PARTS):
            views += f", the HSDP axes {', '.join(HSDP_AXES)}"
        views += f" or the expert axes {', '.join(EXPERT_AXES)}"
        raise AxisError(f"{what} mixes dense and expert axes; a joint group uses {views}")

    def _valid_axes(self) -> tuple[str, ...]:
        parts = _DP_PARTS if self.config.dp_replicate > 1 else ()
        return DENSE_AXES + EXPERT_AXES[:-1] + parts

    def resolve_together(self, keys: Sequence[str]) -> list[tuple[str, Grid, tuple[str, ...]]]:
        """:meth:`resolve` for several keys in one view: the HSDP one if a key needs it.

        Example: ``resolve_together(["dp_replicate", "tp"])`` resolves both in ``layout.hsdp``.
        """
        resolved = [self.resolve(key) for key in keys]
        if any(grid is self.hsdp for _, grid, _ in resolved):
            resolved = [self.resolve(key, self.hsdp) for key in keys]
        return resolved

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s position on every dense and expert axis (HSDP too if dp_replicate > 1)."""
        hsdp = self.hsdp.coordinate(rank) if self.config.dp_replicate > 1 else {}
        return {**self.dense.coordinate(rank), **self.expert.coordinate(rank), **hsdp}

    def members(self, rank: int, key: Key) -> Sequence[int] | None:
        """The group of ``key`` that contains ``rank`` (``None`` if a derived group has none).

        A tuple, or for a group of more than 4,096 ranks that is a lattice, its
        strides (:class:`~meshstate.layout.ranks.Ranks`): a group of a million-rank
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
        for part in key.parts(grid.group_ranks(rank, axes)):
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
