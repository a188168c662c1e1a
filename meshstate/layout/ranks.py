"""The members of a group as arithmetic on strides, never a list of them.

A rank's group in a parallel layout holds ranks ``base + i_1*s_1 + ... +
i_k*s_k`` (``0 <= i_j < c_j``): a lattice. At a million ranks such a group can
hold 131,072 members, so :class:`Ranks` answers ``len``, ``[i]``, ``in`` and
``index`` from the strides in O(k) and materialises nothing; iterating it (or
``tuple(ranks)``) lists the members when someone asks for them.

Pure arithmetic: nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import overload


class Ranks(Sequence[int]):
    """The ranks ``base + sum(i_j * stride_j)`` for ``0 <= i_j < count_j``, first step major.

    ``steps`` are ``(stride, count)`` pairs, major to minor: the last varies
    fastest. A ``Ranks`` equals any sequence holding the same ranks in the same
    order (``Ranks(4, ((1, 2),)) == (4, 5)``); slicing gives a tuple.

    Example::

        >>> ranks = Ranks(4, ((16, 2), (1, 4)))
        >>> list(ranks)
        [4, 5, 6, 7, 20, 21, 22, 23]
        >>> len(ranks), ranks[5], ranks.index(21), 22 in ranks, 8 in ranks
        (8, 21, 5, True, False)
        >>> Ranks(0, ((8, 2), (1, 8))).as_range()
        range(0, 16)
    """

    __slots__ = ("base", "steps", "_length", "_hash", "_decode_order", "_is_nested")

    def __init__(self, base: int, steps: Sequence[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for stride, count in reversed(tuple(steps)):  # minor first
            if count < 1:
                raise ValueError(f"a step's count must be >= 1, got {count}")
            if count == 1:
                continue
            if merged and merged[0][0] * merged[0][1] == stride:
                merged[0] = (merged[0][0], merged[0][1] * count)
            else:
                merged.insert(0, (stride, count))
        self.base = base
        self.steps: tuple[tuple[int, int], ...] = tuple(merged)
        self._length = math.prod(count for _, count in self.steps)
        self._hash: int | None = None
        # Decoding a rank goes from the largest stride down; it is unique when each
        # stride spans every smaller step (always so for a grid's axes).
        self._decode_order = sorted(range(len(self.steps)), key=lambda j: -self.steps[j][0])
        by_stride = sorted(self.steps, reverse=True)
        self._is_nested = all(
            outer >= inner * count for (outer, _), (inner, count) in zip(by_stride, by_stride[1:])
        )

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"index {index} out of range for {self._length} ranks")
        rank = self.base
        for stride, count in reversed(self.steps):
            position, digit = divmod(position, count)
            rank += digit * stride
        return rank

    def __iter__(self) -> Iterator[int]:
        if not self.steps:
            return iter((self.base,))
        *outer, (stride, count) = self.steps
        starts = [self.base]
        for outer_stride, outer_count in outer:
            offsets = range(0, outer_count * outer_stride, outer_stride)
            starts = [start + offset for start in starts for offset in offsets]
        span = count * stride
        return itertools.chain.from_iterable(
            range(start, start + span, stride) for start in starts
        )

    def _digits(self, rank: object) -> list[int] | None:
        """``rank``'s digits, major to minor, or ``None`` if it is not a member."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            return None
        offset = rank - self.base
        if offset < 0:
            return None
        digits = [0] * len(self.steps)
        for position in self._decode_order:
            stride, count = self.steps[position]
            digit = offset // stride
            if digit >= count:
                return None
            digits[position] = digit
            offset -= digit * stride
        return digits if offset == 0 else None

    def __contains__(self, rank: object) -> bool:
        if self._is_nested:
            return self._digits(rank) is not None
        return rank in tuple(self)

    def index(self, rank: object, start: int = 0, stop: int | None = None) -> int:
        """Position of ``rank``, from the strides; a ``ValueError`` if it is not a member."""
        if not self._is_nested or start != 0 or stop is not None:
            return tuple(self).index(rank, start, len(self) if stop is None else stop)
        digits = self._digits(rank)
        if digits is None:
            raise ValueError(f"{rank!r} is not in {self!r}")
        position = 0
        for digit, (_, count) in zip(digits, self.steps):
            position = position * count + digit
        return position

    def count(self, rank: object) -> int:
        return int(rank in self)

    def sorted(self) -> Ranks:
        """The same ranks in increasing order (major step = largest stride)."""
        if not self._is_nested:
            raise ValueError(f"{self!r} has overlapping steps; sort tuple(ranks) instead")
        return Ranks(self.base, sorted(self.steps, reverse=True))

    def as_range(self) -> range | None:
        """The ranks as a ``range`` when they are one progression, else ``None``."""
        if not self.steps:
            return range(self.base, self.base + 1)
        if len(self.steps) == 1:
            stride, count = self.steps[0]
            return range(self.base, self.base + stride * count, stride)
        return None

    def take(self, positions: range) -> Ranks | None:
        """The members at ``positions`` (a range of indices) as ``Ranks``, by strides alone.

        ``None`` where those positions are not a lattice of their own (a run that
        straddles a step's boundary unevenly).
        Example: ``Ranks(0, ((16, 2), (1, 8))).take(range(4, 16, 8)) == (4, 20)``.
        """
        start, step, remaining = positions.start, positions.step, len(positions)
        if remaining == 0 or step < 1 or start < 0 or positions[-1] >= self._length:
            return None
        base = self.base
        taken: list[tuple[int, int]] = []  # minor first
        for stride, count in reversed(self.steps):
            digit = start % count
            if remaining == 1 or step % count == 0:
                base += digit * stride
                start, step = start // count, max(step // count, 1)
            elif digit + (remaining - 1) * step < count:
                base += digit * stride
                taken.append((stride * step, remaining))
                start, step, remaining = start // count, 1, 1
            elif count % step == 0 and digit < step and remaining % (count // step) == 0:
                base += digit * stride
                taken.append((stride * step, count // step))
                start, step, remaining = start // count, 1, remaining // (count // step)
            else:
                return None
        if remaining != 1 or start != 0:
            return None
        return Ranks(base, taken[::-1])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranks):
            return self.base == other.base and self.steps == other.steps
        if isinstance(other, (tuple, list, range)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        # Equal to the tuple of the same ranks, so it hashes like that tuple (once).
        if self._hash is None:
            self._hash = hash(tuple(self))
        return self._hash

    def __repr__(self) -> str:
        return f"Ranks({self.base}, {self.steps})"


LISTED_UP_TO = 4096
"""Groups up to this size are kept as tuples: indexing a tuple is a C call, ``Ranks``'s is
Python (~0.2 us), and a tuple of 4,096 ranks is small whatever the world."""


def listed_if_small(ranks: Ranks) -> Sequence[int]:
    """``ranks`` as a tuple when it holds at most :data:`LISTED_UP_TO` ranks, else as is.

    Example: ``listed_if_small(Ranks(0, ((2, 3),))) == (0, 2, 4)``, a tuple.
    """
    return tuple(ranks) if len(ranks) <= LISTED_UP_TO else ranks


def identity(ranks: Sequence[int]) -> object:
    """A cheap value equal for equal rank sequences: the lattice, or the tuple if small.

    Example: ``identity(Ranks(0, ((1, 4),))) == identity((0, 1, 2, 3))``.
    """
    if isinstance(ranks, Ranks) and len(ranks) > LISTED_UP_TO:
        return (ranks.base, ranks.steps)
    return tuple(ranks)


def ranks_text(ranks: Sequence[int], total: int | None = None) -> str:
    """``ranks`` as a list for a message: at most the first 16, and ``…`` where ``total``
    (default: their number) is more than that.

    Example: ``ranks_text([0, 8], 4) == "[0, 8, …]"``, ``ranks_text(range(3)) == "[0, 1, 2]"``.
    """
    count = len(ranks) if total is None else total
    shown = [int(rank) for rank in ranks[:16]]
    return f"[{', '.join(map(str, shown))}{', …' if count > len(shown) else ''}]"
