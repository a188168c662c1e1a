"""Values that differ between the ranks one process simulates.

Under torch's ``LocalTensorMode`` every rank of a world runs in one process,
so a rank-dependent answer (a rank's position in its group, its coordinate,
its pipeline's first stage) is one value per simulated rank.
:func:`per_rank_int` makes such an integer a ``torch.SymInt`` over
:class:`PerRankIntNode`: torch's own per-rank integer node, whose comparisons
also answer per rank (a ``torch.SymBool`` over :class:`PerRankBoolNode`, made
by :func:`per_rank_bool`). It works in arithmetic, as a tensor op's argument
(``x.narrow(0, 2 * index, 2)`` takes each rank's block) and, where every rank
agrees, in a Python ``if``; a branch the ranks would take differently, or an
``int()`` of a value they do not share, raises :class:`SimulationError`.
:class:`PerRankRanks` is a group's members, one group per rank,
:class:`PerRankParts` the parts ``chunk`` gives, which a per-rank int indexes,
:func:`value_on` reads any of these (and tensors) as one rank sees it, and
:func:`per_rank_value` makes one value of each rank's.

Example, simulating 4 ranks with ``tp=2``::

    tp_rank = per_rank_int({0: 0, 1: 1, 2: 0, 3: 1})
    tp_rank + 1                   # per rank {0: 1, 1: 2, 2: 1, 3: 2}
    value_on(tp_rank == 0, 3)     # False
    if tp_rank == 0: ...          # SimulationError: the ranks would branch apart
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast, overload

import torch
from torch.distributed import ProcessGroup

from meshstate.layout.ranks import ranks_text
from meshstate.simulation import local_compat
from meshstate.simulation.local_compat import describe
from meshstate.simulation.the_body import failing_an_assert, the_bodys_line
from meshstate.errors import OTHER_WORLDS, SimulationError

V = TypeVar("V")


def _on(value: object, rank: int) -> Any:
    """``value`` (an int or bool, a ``SymInt``, a ``SymBool`` or their node) as ``rank`` sees it."""
    node: Any = value.node if isinstance(value, (torch.SymInt, torch.SymBool)) else value
    if isinstance(node, (PerRankIntNode, PerRankBoolNode)):
        return node.values[rank]
    if isinstance(value, torch.SymBool) or isinstance(node, bool):
        return bool(value)  # a constant: torch unwraps the others before they get here
    if not isinstance(node, int) and node.is_bool():
        return node.bool_()  # torch's constant bool node
    return local_compat.int_on_rank(node, rank)



class PerRankIntNode(local_compat.LocalIntNode):
    """torch's per-rank integer node, whose arithmetic and comparisons stay per rank.

    torch's ``LocalIntNode`` answers ``==`` with whether every rank's values
    are equal and has no ``int()``; this one answers ``==``, ``<`` and the rest
    with a per-rank :class:`PerRankBoolNode` and refuses ``int()`` with a
    :class:`SimulationError` that names the values. Make one with
    :func:`per_rank_int`, which gives a plain ``int`` where every rank agrees.
    """

    @property
    def values(self) -> dict[int, int]:
        """Each simulated rank's value."""
        return local_compat.local_ints(self)

    def _each(self, other: object, combine: Callable[[int, Any], Any]) -> Any:
        return PerRankIntNode({rank: combine(mine, _on(other, rank)) for rank, mine in self.values.items()})

    def add(self, other: object) -> Any:
        return self._each(other, operator.add)

    def sub(self, other: object) -> Any:
        return self._each(other, operator.sub)

    def mul(self, other: object) -> Any:
        return self._each(other, operator.mul)

    def floordiv(self, other: object) -> Any:
        return self._each(other, operator.floordiv)

    def int_floordiv(self, other: object) -> Any:
        return self._each(other, operator.floordiv)

    def mod(self, other: object) -> Any:
        return self._each(other, operator.mod)

    def sym_max(self, other: object) -> Any:
        return self._each(other, max)

    def sym_min(self, other: object) -> Any:
        return self._each(other, min)

    def neg(self) -> Any:
        return PerRankIntNode({rank: -mine for rank, mine in self.values.items()})

    def _compare(self, other: object, compare: Callable[[int, Any], bool]) -> Any:
        return _bool_node({rank: compare(mine, _on(other, rank)) for rank, mine in self.values.items()})

    def eq(self, other: object) -> Any:
        return self._compare(other, operator.eq)

    def ne(self, other: object) -> Any:
        return self._compare(other, operator.ne)

    def lt(self, other: object) -> Any:
        return self._compare(other, operator.lt)

    def le(self, other: object) -> Any:
        return self._compare(other, operator.le)

    def gt(self, other: object) -> Any:
        return self._compare(other, operator.gt)

    def ge(self, other: object) -> Any:
        return self._compare(other, operator.ge)

    def int_(self) -> int:
        raise SimulationError(
            f"int() or bool() of a value that differs between the simulated ranks "
            f"({describe(self.values)}){the_bodys_line()}; "
            f"use it in tensor ops (it reaches each rank's op as that rank's value), or {OTHER_WORLDS}"
        )

    def guard_int(self, file: str, line: int) -> int:
        return self.int_()

    def sym_float(self) -> Any:
        raise SimulationError(
            f"a float of a value that differs between the simulated ranks "
            f"({describe(self.values)}){the_bodys_line()}: torch's simulation has no per-rank floats; make it a "
            f"tensor first (torch.full((), value)), or {OTHER_WORLDS}"
        )

    def _str(self) -> str:
        return f"per rank ({describe(self.values)})"


class PerRankBoolNode:
    """A ``torch.SymBool`` node holding one bool per simulated rank.

    ``&``, ``|``, ``==`` and ``torch.sym_not`` stay per rank; ``bool()`` (an
    ``if``, ``not``, ``and``) raises :class:`SimulationError`, since the ranks
    would take the branch apart. Make one with :func:`per_rank_bool`.
    """

    def __init__(self, values: dict[int, bool]) -> None:
        self.values = values

    def _each(self, other: object, combine: Callable[[bool, Any], bool]) -> Any:
        return _bool_node({rank: combine(mine, _on(other, rank)) for rank, mine in self.values.items()})

    def sym_and(self, other: object) -> Any:
        return self._each(other, operator.and_)

    def sym_or(self, other: object) -> Any:
        return self._each(other, operator.or_)

    def eq(self, other: object) -> Any:
        return self._each(other, operator.eq)

    def ne(self, other: object) -> Any:
        return self._each(other, operator.ne)

    def sym_not(self) -> Any:
        return _bool_node({rank: not mine for rank, mine in self.values.items()})

    def bool_(self) -> bool:
        if failing := failing_an_assert(self.values):  # fails on those ranks, as in processes
            failed = AssertionError(f"{describe(self.values)}{the_bodys_line()}")
            failed.add_note(f"raised on simulated rank{'s' * (len(failing) > 1)} "
                            f"{', '.join(map(str, failing))}")
            raise failed
        raise SimulationError(
            f"a Python branch on a value that differs between the simulated ranks "
            f"({describe(self.values)}){the_bodys_line()}: every simulated rank takes the same branch; "
            f"compute both sides with tensor ops, or {OTHER_WORLDS}"
        )

    def guard_bool(self, file: str, line: int) -> bool:
        return self.bool_()

    def expect_true(self, file: str, line: int) -> bool:
        return self.bool_()

    def statically_known_true(self, file: str, line: int) -> bool:
        return False  # not true on every rank: torch skips a shortcut (a slice of everything)

    def guard_or_false(self, file: str, line: int) -> bool:
        return False  # the same: torch takes the general path (autograd's check of per-rank shapes)

    def wrap_bool(self, value: bool) -> Any:
        return local_compat.constant_bool_node(value)

    def is_bool(self) -> bool:
        return True

    def is_int(self) -> bool:
        return False

    def is_float(self) -> bool:
        return False

    def is_nested_int(self) -> bool:
        return False

    def is_constant(self) -> bool:
        return False

    def is_symbolic(self) -> bool:
        return False

    def maybe_as_bool(self) -> bool | None:
        return None

    def clone(self) -> PerRankBoolNode:
        return self

    def _graph_repr(self) -> str:
        return f"per rank ({describe(self.values)})"

    __str__ = __repr__ = _graph_repr


def _bool_node(values: dict[int, bool]) -> Any:
    first = next(iter(values.values()))
    if all(value == first for value in values.values()):
        return local_compat.constant_bool_node(first)
    return PerRankBoolNode(values)


def per_rank_int(values: Mapping[int, int]) -> int:
    """An integer that is ``values[r]`` on simulated rank ``r``; a plain ``int`` where
    they are all equal.

    Example: ``per_rank_int({0: 0, 1: 1}) + 1`` is 1 on rank 0 and 2 on rank 1.
    """
    first = next(iter(values.values()))
    if all(value == first for value in values.values()):
        return first
    return cast(int, torch.SymInt(PerRankIntNode(dict(values))))  # type: ignore[no-untyped-call, unused-ignore]


def on_any_rank(value: bool) -> bool:
    """Whether a per-rank bool (or a plain one) is true on some simulated rank."""
    node = value.node if isinstance(value, torch.SymBool) else value
    return any(node.values.values()) if isinstance(node, PerRankBoolNode) else bool(value)


def per_rank_bool(values: Mapping[int, bool]) -> bool:
    """A bool that is ``values[r]`` on simulated rank ``r``; a plain ``bool`` where
    they are all equal.

    Example: ``value_on(per_rank_bool({0: True, 1: False}), 1)`` is ``False``.
    """
    node = _bool_node(dict(values))
    return cast(bool, node if isinstance(node, bool) else torch.SymBool(node))  # type: ignore[no-untyped-call, unused-ignore]


class PerRankRanks(Sequence[int]):
    """The members of a group, one group per simulated rank (``mesh.ranks("dp")``).

    Every group has the same size. ``ranks[i]`` (``i`` an int or a per-rank
    int) is the ``i``-th member of each rank's group, as a per-rank int;
    ``in`` and ``index`` answer per rank too; ``on(rank)`` is one rank's group.

    Example, simulating 4 ranks with ``tp=2``: ``ranks[0]`` is 0 on ranks 0
    and 1 and 2 on ranks 2 and 3; ``ranks.on(3) == (2, 3)``.
    """

    def __init__(self, group_of_rank: Mapping[int, Sequence[int]], size: int) -> None:
        self.group_of_rank = group_of_rank
        self.size = size

    def on(self, rank: int) -> tuple[int, ...]:
        """The group simulated rank ``rank`` is in."""
        return tuple(self.group_of_rank[rank])

    def groups(self) -> list[list[int]]:
        """Every group once, ordered by first member: ``[[0, 1], [2, 3]]`` above."""
        distinct = {group[0]: list(group) for group in self.group_of_rank.values()}
        return [distinct[first] for first in sorted(distinct)]

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self.size)))
        return per_rank_int(
            {rank: group[_on(index, rank)] for rank, group in self.group_of_rank.items()}
        )

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(self.size))

    def __contains__(self, rank: object) -> bool:
        return per_rank_bool(
            {r: _on(rank, r) in group for r, group in self.group_of_rank.items()}
        )

    def index(self, rank: object, start: int = 0, stop: int | None = None) -> int:
        """Per rank: ``rank``'s position in its group; a ``ValueError`` where no group holds it,
        a :class:`SimulationError` where only some do."""
        sought = {r: _on(rank, r) for r in self.group_of_rank}
        missing = sorted(r for r, group in self.group_of_rank.items() if sought[r] not in group)
        if not missing:
            return per_rank_int({r: list(group).index(sought[r])
                                 for r, group in self.group_of_rank.items()})
        shown = f"({describe(sought)})" if len(set(sought.values())) > 1 else sought[missing[0]]
        if len(missing) == len(self.group_of_rank):
            raise ValueError(f"rank {shown} is in no group of {self!r}")
        raise SimulationError(
            f"rank {shown} is in the group of some simulated ranks only (not of ranks "
            f"{ranks_text(missing)}), so they would go apart; {OTHER_WORLDS}"
        )

    def __eq__(self, other: object) -> bool:
        """Per rank: whether its group equals ``other`` as that rank sees it (a tuple, a
        list of per-rank ints, another ``PerRankRanks``)."""
        if not isinstance(other, Sequence):
            return NotImplemented
        return per_rank_bool({
            rank: tuple(group) == tuple(value_on(other, rank))
            for rank, group in self.group_of_rank.items()
        })

    __hash__ = None  # type: ignore[assignment]  # equal per rank, so no one hash

    def __repr__(self) -> str:
        shown = describe({rank: self.on(rank) for rank in sorted(self.group_of_rank)[:8]})
        return f"PerRankRanks({shown}{'; …' if len(self.group_of_rank) > 8 else ''})"


class PerRankParts(tuple[torch.Tensor, ...]):
    """The parts ``torch.chunk``, ``split``, ``tensor_split`` or ``unbind`` cut ``whole`` into
    along ``dim``, in a simulated world: indexed by a per-rank int, each rank's own part (a
    view, as ``narrow`` or ``select`` gives), where a tuple would need one index for all.

    Example, simulating 4 ranks with ``tp=2``: ``W.chunk(2, 1)[mesh.rank("tp")]`` is
    ``W[:, :3]`` on ranks 0 and 2 and ``W[:, 3:]`` on ranks 1 and 3.
    """

    whole: torch.Tensor | None
    dim: int
    unbound: bool

    def __new__(
        cls, parts: Iterable[torch.Tensor], whole: torch.Tensor | None = None, dim: int = 0,
        unbound: bool = False,
    ) -> PerRankParts:
        made = super().__new__(cls, parts)
        made.whole, made.dim, made.unbound = whole, dim, unbound
        return made

    @overload  # type: ignore[override]
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[torch.Tensor, ...]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.whole is None or not holds_per_rank(index):
            return super().__getitem__(index)
        indices = local_compat.local_ints(cast(Any, index).node)
        picked = {rank: at % len(self) for rank, at in indices.items()
                  if -len(self) <= at < len(self)}
        if len(picked) < len(indices):
            raise SimulationError(
                f"a part index ({describe(indices)}) out of range for {len(self)} parts on some "
                f"simulated ranks; {OTHER_WORLDS}"
            )
        if self.unbound:
            return self.whole.select(self.dim, per_rank_int(picked))
        sizes = {rank: [_on(part.size(self.dim), rank) for part in self] for rank in picked}
        start = per_rank_int({rank: sum(sizes[rank][:at]) for rank, at in picked.items()})
        length = per_rank_int({rank: sizes[rank][at] for rank, at in picked.items()})
        return self.whole.narrow(self.dim, start, length)


local_compat.tree_node_like_tuple(PerRankParts)


def holds_per_rank(value: object) -> bool:
    """Whether ``value`` (inside lists, tuples and dicts too) holds a per-rank int, bool or
    group: what one simulated rank reads with :func:`value_on`, tensors aside."""
    if isinstance(value, (torch.SymInt, torch.SymBool)):
        return isinstance(value.node, (local_compat.LocalIntNode, PerRankBoolNode))
    if isinstance(value, PerRankRanks):
        return True
    if isinstance(value, dict):
        return any(holds_per_rank(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_per_rank(item) for item in value)
    return False


def per_rank_value(values: Mapping[int, Any], what: str) -> Any:
    """One value that is ``values[r]`` on simulated rank ``r`` (:func:`value_on` reads it
    back): tensors (copies), ints and bools per rank, and lists, tuples and dicts of them;
    other values must be alike on every rank, else :class:`SimulationError` names ``what``
    gave them.

    Example: ``per_rank_value({0: {"r": 0}, 1: {"r": 1}}, "all_gather_object")`` is
    ``{"r": per_rank_int({0: 0, 1: 1})}``.
    """
    first = next(iter(values.values()))
    if all(isinstance(value, torch.Tensor) for value in values.values()):
        return local_compat.per_rank_tensor({rank: value.clone() for rank, value in values.items()})
    if all(_alike(value, first) for value in values.values()):
        return first
    if isinstance(first, bool) and all(isinstance(v, bool) for v in values.values()):
        return per_rank_bool(values)
    if isinstance(first, int) and all(type(v) is int for v in values.values()):
        return per_rank_int(values)
    if isinstance(first, dict) and all(
        type(v) is type(first) and v.keys() == first.keys() for v in values.values()
    ):
        return type(first)({
            key: per_rank_value({rank: value[key] for rank, value in values.items()}, what)
            for key in first
        })
    if isinstance(first, (list, tuple)) and all(
        type(v) is type(first) and len(v) == len(first) for v in values.values()
    ):
        items = [per_rank_value({rank: value[at] for rank, value in values.items()}, what)
                 for at in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    raise SimulationError(
        f"{what} gives the simulated ranks values that differ "
        f"({describe({rank: repr(value) for rank, value in values.items()})}), which one "
        "simulated program holds only as tensors, ints and bools (in lists, tuples and "
        f"dicts); {OTHER_WORLDS}"
    )


def _alike(first: object, second: object) -> bool:
    return type(first) is type(second) and (first == second) is True


class GroupMembers(PerRankRanks):
    """A group's members on each simulated rank, which :func:`value_on` reads as a list,
    as ``torch.distributed.get_process_group_ranks`` gives it."""


def positions(groups: Iterable[Sequence[int]]) -> tuple[dict[int, int], dict[int, Sequence[int]]]:
    """Each rank's position in its group, and its group, for disjoint ``groups``.

    Example: ``positions([[0, 2], [1, 3]])[0] == {0: 0, 2: 1, 1: 0, 3: 1}``.
    """
    index: dict[int, int] = {}
    group_of_rank: dict[int, Sequence[int]] = {}
    for group in groups:
        for position, rank in enumerate(group):
            index[rank] = position
            group_of_rank[rank] = group
    return index, group_of_rank


def group_rank(group: ProcessGroup) -> int:
    """Each simulated rank's rank in its group of the family ``group`` belongs to:
    ``torch.distributed.get_rank(group)`` for every simulated rank.

    Raises :class:`SimulationError` where torch's simulation cannot read the
    family from ``group`` (its ranks form no regular grid).
    """
    index, _ = positions(simulated_groups(group))
    return per_rank_int(of_simulated_ranks(index))


def members(group: ProcessGroup) -> GroupMembers:
    """Each simulated rank's group of the family ``group`` belongs to:
    ``torch.distributed.get_process_group_ranks(group)`` for every simulated rank."""
    groups = simulated_groups(group)
    return GroupMembers(of_simulated_ranks(positions(groups)[1]), len(groups[0]))


def of_simulated_ranks(by_rank: dict[int, V]) -> dict[int, V]:
    """``by_rank`` (an answer for every rank of the world) for the ranks this process
    simulates: all of them, or one stage's in a world simulated stage by stage."""
    ranks = local_compat.mode_ranks()
    if ranks is None or len(by_rank) <= len(ranks):
        return by_rank
    return {rank: by_rank[rank] for rank in sorted(ranks) if rank in by_rank}


def simulated_groups(group: ProcessGroup) -> list[tuple[int, ...]]:
    """The rank sets a collective over ``group`` runs on in a simulated world."""
    try:
        return local_compat.collective_groups(group)
    except AssertionError as error:
        raise SimulationError(
            f"torch's simulation cannot run a collective over ranks {_short(group)}: "
            f"they are no regular grid ({error}); {OTHER_WORLDS}"
        ) from None


def tiling_mismatch(
    name: str, group: ProcessGroup | None, groups: Sequence[Sequence[int] | None]
) -> str | None:
    """Why collectives over ``group`` (the process's, rank 0's) would go wrong in a simulated
    world whose groups of ``name`` are ``groups``, or ``None``.

    torch's simulation runs a collective over ``group`` on every shift of it
    across the world; that must be exactly ``groups``, covering every rank.
    Example: ``[[0, 1], [2, 4], [3, 5], [6, 7]]`` is refused (torch would
    pair 2 with 3).
    """
    layout = {frozenset(ranks) for ranks in groups if ranks is not None}
    if group is None:
        return f"rank 0 is in no {name!r} group, so only some ranks are; {OTHER_WORLDS}"
    simulated = {frozenset(ranks) for ranks in simulated_groups(group)}
    if simulated == layout:
        return None
    first = min(simulated - layout, key=min)
    return (
        f"torch's simulation would run collectives over the {name!r} groups on ranks such as "
        f"{sorted(first)}, which are no group of them; {OTHER_WORLDS}"
    )


def _short(group: ProcessGroup) -> str:
    from torch.distributed import get_process_group_ranks

    return ranks_text(get_process_group_ranks(group))


def value_on(value: Any, rank: int) -> Any:
    """``value`` as simulated rank ``rank`` sees it: per-rank tensors, ints, bools and
    groups replaced by that rank's, inside lists, tuples, dicts and sets too.

    Example: ``value_on({"tp": per_rank_int({0: 0, 1: 1})}, 1) == {"tp": 1}``.
    """
    if isinstance(value, (torch.SymInt, torch.SymBool)):
        return _on(value, rank)
    if isinstance(value, torch.Tensor):
        by_rank = local_compat.tensor_by_rank(value)
        if by_rank is None and type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise SimulationError(
                f"a {type(value).__name__} cannot leave a simulated world; return its "
                "local tensor (DTensor.to_local()) or full_tensor() instead"
            )
        return value if by_rank is None else by_rank[rank]
    if isinstance(value, PerRankRanks):
        return list(value.on(rank)) if isinstance(value, GroupMembers) else value.on(rank)
    if isinstance(value, PerRankParts):
        return tuple(value_on(item, rank) for item in value)
    if isinstance(value, dict):
        return type(value)({key: value_on(item, rank) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(value_on(item, rank) for item in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(value_on(item, rank) for item in value)
    return value
