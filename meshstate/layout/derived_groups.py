"""Derived groups: a group carved out of the groups of a key, named by value.

Pure: nothing here touches ``torch.distributed``. A :class:`DerivedGroup` names
its base (a key or an axis tuple) and a split of each base group: consecutive
:class:`Chunks`, distributed-optimizer :class:`Instances`, a hierarchical
:class:`Level` or a :class:`Pick` of some ranks; or a twin of the base group
with its own backend. Two derived groups are equal when every field is: the
form a mesh also answers to, without the mesh's count, sizes or function, is
:attr:`DerivedGroup.lookup`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import einops
import torch

from meshstate.errors import ConfigError


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

    @property
    def lookup(self) -> Chunks:
        """The split as a mesh is asked for it: itself, as nothing about it is the mesh's."""
        return self

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

    ``Instances()`` (no count) is the :attr:`lookup` form: a mesh that declared
    ``Instances(4)`` answers to it too.

    Example: ``Instances(2).parts(range(8))`` is ``[[0, 1, 2, 3], [4, 5, 6, 7]]``;
    ``Instances(2, inter=True).parts(range(8))`` is ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
    """

    count: int = 0
    inter: bool = False

    @property
    def lookup(self) -> Instances:
        """The split without the mesh's count."""
        return Instances(inter=self.inter)

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

    ``Level(0)`` (no sizes) is the :attr:`lookup` form: a mesh that declared
    level 0 of any hierarchy answers to it too.
    """

    level: int
    sizes: tuple[int, ...] = ()

    @property
    def lookup(self) -> Level:
        """The split without the mesh's sizes."""
        return Level(self.level)

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

    Two picks are equal when their names are and their functions are the same
    object (a function has no other equality); ``Pick(name)`` (no function) is
    the :attr:`lookup` form a mesh that declared the pick answers to.
    """

    name: str
    ranks_of: Callable[[list[int]], Sequence[int]] | None = field(
        default=None, compare=False, repr=False
    )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pick):
            return NotImplemented
        return self.name == other.name and self.ranks_of is other.ranks_of

    def __hash__(self) -> int:
        return hash((self.name, id(self.ranks_of)))

    @property
    def lookup(self) -> Pick:
        """The split without the mesh's function."""
        return Pick(self.name)

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
    and answers ``mesh.group(spec)``, ``mesh.rank(spec)`` and so on for them,
    and for their :attr:`lookup` form, which leaves out the mesh's count,
    sizes or function. Equality and hash take every field.

    Example::

        >>> hierarchical = DerivedGroup("cp", Level(1, sizes=(2, 2)))
        >>> str(hierarchical)
        'cp/level 1 of 2x2'
        >>> hierarchical == DerivedGroup("cp", Level(1, sizes=(4, 1)))
        False
        >>> hierarchical.lookup                  # what a mesh with any sizes answers to
        DerivedGroup(base='cp', split=Level(level=1, sizes=()), backend=None, separate=False)
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

    @property
    def lookup(self) -> DerivedGroup:
        """This group without what a mesh supplies (an instance count, hierarchy sizes,
        a pick's function): the value a mesh that declared it also answers to."""
        return self if self.split is None else replace(self, split=self.split.lookup)

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
