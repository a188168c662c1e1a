"""JAX's rule for a collective inside a typed ``shard_map`` body (``check_vma=True``):
the input is cast up to vary over the collective's axes (``pvary`` where it does not), a
reduction over axes it varies over only some of is refused in JAX 0.12's words, and the
result is typed: varying over the axes (``all_gather``) or not (``psum``). One of the two
:class:`~meshstate.jax.types.system.TypeSystem` s the seam asks.

Example (inside a typed body, ``x`` invariant over tp)::

    run = JAX_TYPES.around(PSUM, "tp", frozenset({"tp"}), None, summed, (0,), False)
    vma(run(x, group))   # frozenset(): x was pvary'd over tp, then summed over it
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshstate.core import compat as _compat
from meshstate.core.mesh import ParallelMesh
from meshstate.core.ordered import OrderedGroup
from meshstate.core.which_mesh import current_mesh
from meshstate.errors import ArgumentTypeError
from meshstate.jax.torch_calls import Axes
from meshstate.jax.types.system import PVARY, CollectiveRule, Move
from meshstate.jax.types.vma import VaryingAxesError, axes_text, type_text, typed, vma

Pvary = Callable[[torch.Tensor, frozenset[str], ParallelMesh], torch.Tensor]
"""The cast of a value to vary over more axes, under every type system that applies."""


class JaxTypes:
    """JAX's types, while a typed ``shard_map`` body runs in this thread."""

    def __init__(self) -> None:
        self._pvary: Pvary | None = None

    def plug_pvary(self, pvary: Pvary) -> None:
        """The cast the rule inserts (the seam's: it also types for the checker)."""
        self._pvary = pvary

    def refuse(self, rule: CollectiveRule, x: torch.Tensor, axes: Axes, names: frozenset[str]) -> None:
        _refuse_partly_varying_reduction(rule, x, axes, names, vma(x))

    def around(
        self, rule: CollectiveRule, axes: Axes, names: frozenset[str], mesh: ParallelMesh | None,
        move: Move, dims: tuple[int, ...], tiled: bool,
    ) -> Move:
        def typed_move(x: torch.Tensor, group: OrderedGroup) -> torch.Tensor:
            if rule is PVARY:
                return self._pvary_in_body(x, axes, names, mesh)
            with _compat.torch_functions_off():
                x, before = self._cast_up(x, axes, names, mesh, rule)
                return typed(move(x, group), before | names if rule.keeps_axes else before - names)

        return typed_move

    def _cast_up(
        self, x: torch.Tensor, axes: Axes, names: frozenset[str], mesh: ParallelMesh | None,
        rule: CollectiveRule,
    ) -> tuple[torch.Tensor, frozenset[str]]:
        """``x`` made to vary over the collective's axes (pvary'd where it does not), and
        its type before. A reduction over axes ``x`` varies over only some of is refused."""
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"{rule.name} takes a torch.Tensor, got {type(x).__name__}")
        before = vma(x)
        if names & before == names:
            return x, before
        _refuse_partly_varying_reduction(rule, x, axes, names, before)
        return self._cast(x, names - before, mesh), before

    def _pvary_in_body(
        self, x: torch.Tensor, axes: Axes, names: frozenset[str], mesh: ParallelMesh | None
    ) -> torch.Tensor:
        """``pvary`` with JAX's rule: an axis ``x`` varies over already is refused."""
        varying = names & vma(x)
        if varying and names - varying:
            raise _mixed_state("pvary", x, axes, f"pvary over {tuple(sorted(names - varying))!r} alone")
        if varying:
            raise VaryingAxesError(
                f"meshstate.pvary: x of type {type_text(x)} already varies over "
                f"{axes_text(varying)}; pvary only casts invariant axes to varying "
                "(JAX: Unsupported pcast from=varying, to='varying')"
            )
        with _compat.torch_functions_off():
            return self._cast(x, names, mesh)

    def _cast(self, x: torch.Tensor, names: frozenset[str], mesh: ParallelMesh | None) -> torch.Tensor:
        assert self._pvary is not None, "the seam plugs its pvary in when it is imported"
        return self._pvary(x, names, current_mesh() if mesh is None else mesh)


def _refuse_partly_varying_reduction(
    rule: CollectiveRule, x: torch.Tensor, axes: Axes, names: frozenset[str], before: frozenset[str]
) -> None:
    """Refuse a reduction over ``names`` where ``x`` (of type ``before``) varies over only
    some of them, as JAX 0.12 does."""
    if rule.reduces and names & before and names - before:
        raise _mixed_state(rule.name, x, axes, f"pvary the input over "
                           f"{tuple(sorted(names - before))!r} or reduce over "
                           f"{tuple(sorted(names & before))!r} alone")


def _mixed_state(name: str, x: torch.Tensor, axes: Axes, instead: str) -> VaryingAxesError:
    """JAX 0.12's refusal of a collective over axes ``x`` varies over only some of."""
    return VaryingAxesError(
        f"meshstate.{name} can only accept axis_name which corresponds to one of varying, "
        f"unreduced, reduced or invarying state of the input. Got input type: {type_text(x)}, "
        f"axes: {axes!r} and input state: {{'invarying', 'varying'}}; {instead}"
    )


JAX_TYPES = JaxTypes()
