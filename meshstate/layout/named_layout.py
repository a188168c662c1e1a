"""The layout of a mesh with the caller's axis names, JAX's ``jax.make_mesh``.

Pure rank arithmetic: nothing here touches ``torch.distributed``. A
:class:`NamedLayout` holds one view, a :class:`~meshstate.layout.grid.Grid` of the
given axes, and answers a key (``"x"``, a joint ``"x-y"`` in any spelling) or an
axis tuple the way :class:`~meshstate.layout.layout.ParallelLayout` answers
Megatron's, so a mesh, its collectives and ``shard_map`` work on it alike.
Axes are given in mesh order, outer first, and the last varies fastest: on
``make_mesh((2, 4), ("x", "y"))`` rank ``5`` sits at ``x=1, y=1``, as JAX
numbers devices.

Example::

    >>> layout = NamedLayout(("x", "y"), (2, 4))
    >>> layout.group_ranks(5, "y"), layout.group_ranks(5, "x")
    ((4, 5, 6, 7), (1, 5))
    >>> layout.canonical("y-x")
    'x-y'
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from meshstate.errors import ArgumentTypeError, AxisError, ConfigError
from meshstate.layout.grid import Grid, ListedGrid
from meshstate.layout.layout import DerivedGroup, Key, KeyedLayout

__all__ = ["NamedLayout"]


@dataclass(frozen=True)
class NamedLayout(KeyedLayout):
    """Ranks on the caller's axes: ``axis_names`` and ``axis_sizes`` in mesh order.

    One view (``dense``, the DeviceMesh of every axis); a key names one axis or
    joins several with ``-`` (a set: ``"y-x"`` is ``"x-y"``). ``rank_offset`` and
    ``ranks`` place it on part of a larger world, as for a ParallelLayout.
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    rank_offset: int = 0
    ranks: tuple[int, ...] | None = None
    dense: Grid = field(init=False, repr=False)

    def __post_init__(self) -> None:
        names, shapes = check_axes(self.axis_sizes, self.axis_names)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "axis_sizes", shapes)
        grid = Grid(names[::-1], shapes[::-1], self.rank_offset)
        if self.ranks is not None:
            grid = ListedGrid(grid.axes_fastest_first, grid.sizes, 0, self.ranks)
        object.__setattr__(self, "dense", grid)

    @property
    def world_size(self) -> int:
        """Number of ranks the layout spans."""
        return self.dense.world_size

    @property
    def kinds(self) -> tuple[str, ...]:
        """The keys every mesh of this layout declares: each axis, in mesh order."""
        return self.axis_names

    @property
    def config(self) -> NoReturn:
        """Refused: a Megatron config belongs to ``init_mesh``'s layouts."""
        raise ConfigError(
            f"a mesh of make_mesh with axes {self.axis_names} has no Megatron config; the "
            "Megatron and torchtitan façades take meshes of meshstate.init_mesh"
        )

    @property
    def expert(self) -> NoReturn:
        """Refused: one view only."""
        raise AxisError(self._one_view("expert"))

    @property
    def hsdp(self) -> NoReturn:
        """Refused: one view only."""
        raise AxisError(self._one_view("HSDP"))

    def _one_view(self, which: str) -> str:
        return (
            f"a mesh of make_mesh has one view, mesh.dense with axes {self.axis_names}, "
            f"and no {which} view"
        )

    def view_name(self, grid: Grid) -> str:
        """``"dense"``: the name of the mesh attribute holding ``grid``'s root DeviceMesh."""
        return "dense"

    def knows(self, axis: object) -> bool:
        """Whether ``axis`` is one of the layout's axes."""
        return axis in self.axis_names

    def axes_text(self) -> str:
        """The valid axes, for messages."""
        return f"axes {self.axis_names}"

    def describe(self) -> str:
        """The layout for a repr: ``axes=('x', 'y') shape=(2, 4)``."""
        return f"axes={self.axis_names} shape={self.axis_sizes}"

    def arguments(self) -> dict[str, object]:
        """What every rank of a build agrees on."""
        return {"axis_names": list(self.axis_names), "axis_sizes": list(self.axis_sizes)}

    def resolve(self, key: str, view: Grid | None = None) -> tuple[str, Grid, tuple[str, ...]]:
        """Canonical key (mesh order), view and mesh-ordered axes of ``key``.

        Example: ``resolve("y-x")`` gives ``("x-y", layout.dense, ("x", "y"))``.
        """
        if not isinstance(key, str):
            raise AxisError(f"a group key is a string such as {self.axis_names[0]!r}, got {key!r}")
        names = key.split("-")
        self._check_known(names, f"key {key!r}")
        if len(set(names)) != len(names):
            raise AxisError(f"key {key!r} names an axis twice")
        axes = self.dense.mesh_order(names)
        return "-".join(axes), self.dense, axes

    def view_of(self, axes: Iterable[str], what: str = "axes") -> Grid:
        """The one view, once every one of ``axes`` is known."""
        self._check_known(list(axes), what)
        return self.dense

    def _check_known(self, names: Sequence[str], what: str) -> None:
        for name in names:
            if name not in self.axis_names:
                raise AxisError(
                    f"{what} names axis {name!r}, which the mesh lacks; valid are "
                    f"{', '.join(self.axis_names)}"
                )

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s position on every axis."""
        return self.dense.coordinate(rank)

    def members(self, rank: int, key: Key) -> Sequence[int] | None:
        """The group of ``key`` that contains ``rank``."""
        if isinstance(key, DerivedGroup):
            raise AxisError(f"a mesh of make_mesh has no derived groups, got {str(key)!r}")
        _, grid, axes = self.resolve(key)
        return grid.members_of(rank, axes)

    def every_group(self, key: Key) -> list[list[int]]:
        """Every group of ``key``."""
        if isinstance(key, DerivedGroup):
            raise AxisError(f"a mesh of make_mesh has no derived groups, got {str(key)!r}")
        groups: list[list[int]] = self.groups(key).tolist()
        return groups


def check_axes(axis_sizes: object, axis_names: object) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``axis_names`` and ``axis_sizes`` checked: as many names as sizes, each name a
    non-empty string without ``-`` (it joins axes in a key) used once, each size a
    positive integer. Example: ``check_axes((2, 4), ("x", "y")) == (("x", "y"), (2, 4))``.
    """
    if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
        raise ArgumentTypeError(
            f"axis_names must be a tuple of axis names such as ('x', 'y'), got {axis_names!r}"
        )
    if isinstance(axis_sizes, (str, bytes)) or not isinstance(axis_sizes, Sequence):
        raise ArgumentTypeError(
            f"axis_sizes must be a tuple of axis sizes such as (2, 4), got {axis_sizes!r}"
        )
    names, shapes = tuple(axis_names), tuple(axis_sizes)
    if len(names) != len(shapes):
        raise ConfigError(
            f"axis_sizes {shapes} has {len(shapes)} sizes but axis_names {names} has "
            f"{len(names)} names"
        )
    if not names:
        raise ConfigError("a mesh needs at least one axis; axis_names is empty")
    for name in names:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"axis_names: {name!r} is not a string")
        if not name or "-" in name:
            raise ConfigError(
                f"axis_names: {name!r} cannot name an axis; a name is non-empty and has "
                "no '-', which joins axes in a key ('x-y')"
            )
        if names.count(name) > 1:
            raise ConfigError(f"axis_names {names} names {name!r} twice")
    checked = []
    for name, size in zip(names, shapes):
        try:
            number = None if isinstance(size, bool) else operator.index(size)
        except TypeError:
            number = None
        if number is None or number < 1:
            raise ConfigError(f"axis_sizes: the size of axis {name!r} must be a positive integer, got {size!r}")
        checked.append(number)
    return names, tuple(checked)
