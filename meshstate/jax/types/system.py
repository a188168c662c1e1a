"""What a collective tells a type system, and what a type system answers.

Each collective is described once (:class:`CollectiveRule`). Two systems implement
:class:`TypeSystem`: JAX's types in a typed ``shard_map`` body
(:mod:`meshstate.jax.types.in_body`) and torchtitan's checker
(:mod:`meshstate.jax.types.spmd_checker`). The seam (:mod:`meshstate.jax.typing`) answers
which apply to the call being made now (JAX's in a typed body, the checker while it
checks); those wrap the collective's data move (:data:`Move`) in their rule, JAX's innermost.

Example (what the seam does with a ``psum`` that some system types)::

    run = move
    for system in (JAX_TYPES, CHECKER_TYPES):   # those that apply, JAX's innermost
        run = system.around(PSUM, "tp", frozenset({"tp"}), None, run, (0,), False)
    run(x, group)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from meshstate.core.mesh import ParallelMesh
from meshstate.core.ordered import OrderedGroup
from meshstate.jax.torch_calls import Axes

Move = Callable[[torch.Tensor, OrderedGroup], torch.Tensor]
"""A collective's data move on one rank: its input and its group."""


@dataclass(frozen=True)
class CollectiveRule:
    """What the types need to know of a collective, said once: its ``name`` in messages,
    its row of the checker's table (``checker_kind``), whether JAX refuses it over axes the
    value varies over only some of (``reduces``), and whether its result varies over its
    axes (``keeps_axes``: ``all_gather``) or not (``psum``)."""

    name: str
    checker_kind: str
    reduces: bool = False
    keeps_axes: bool = True


PSUM = CollectiveRule("psum", "sum", reduces=True, keeps_axes=False)
PMEAN = CollectiveRule("pmean", "sum", reduces=True, keeps_axes=False)
PMAX = CollectiveRule("pmax", "extreme", reduces=True, keeps_axes=False)
PMIN = CollectiveRule("pmin", "extreme", reduces=True, keeps_axes=False)
ALL_GATHER = CollectiveRule("all_gather", "gather")
ALL_GATHER_INVARIANT = CollectiveRule("all_gather_invariant", "gather_invariant", keeps_axes=False)
PSUM_SCATTER = CollectiveRule("psum_scatter", "scatter", reduces=True)
ALL_TO_ALL = CollectiveRule("all_to_all", "exchange")
PPERMUTE = CollectiveRule("ppermute", "permute")
PVARY = CollectiveRule("pvary", "convert")
"""The cast itself: inside a typed body it refuses an axis the value varies over already."""


class TypeSystem(Protocol):
    """A type system a collective may run under, where the seam finds it applies."""

    def refuse(self, rule: CollectiveRule, x: torch.Tensor, axes: Axes, names: frozenset[str]) -> None:
        """Refuse ``x`` for ``rule`` over ``axes`` (naming mesh axes ``names``) where this
        system's reference refuses it before it looks the axes up (a partial-manual body
        asks this first)."""

    def around(
        self, rule: CollectiveRule, axes: Axes, names: frozenset[str], mesh: ParallelMesh | None,
        move: Move, dims: tuple[int, ...], tiled: bool,
    ) -> Move:
        """``move`` (a collective ``rule`` over ``axes``, naming mesh axes ``names``, on
        ``mesh`` or the current mesh) under this system's rule; ``dims``: with ``tiled``,
        the dims the axes split."""
