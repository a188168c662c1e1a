"""Which types a call of the JAX layer runs under, asked in one place.

A collective, ``axis_index`` and ``shard_map`` run in one of four modes: plain code (the
data move alone, the fast path), inside a typed ``shard_map`` body (JAX's types), under
torchtitan's type checker, or both. This module asks which, once per call, and
is the one place that puts the two type systems together. Each is a
:class:`~meshstate.jax.types.system.TypeSystem` (JAX's rule:
:mod:`meshstate.jax.types.in_body`; the checker's: :mod:`meshstate.jax.types.spmd_checker`);
each collective is described once (:class:`~meshstate.jax.types.system.CollectiveRule`),
and its data move is :mod:`meshstate.jax.torch_calls`'.

Inside a partial-manual body (``shard_map(..., axis_names={"tp"})``) a value is a block over
the manual axes and global over the others: a DTensor on the mesh of the other axes (or a
plain tensor, replicated over them). A collective or ``axis_index`` over an axis that is not
manual is refused with JAX 0.12's words (:func:`refuse_unbound`); one over manual axes moves
the DTensor's local block and wraps the result again (:func:`on_local`).

Example (what ``psum`` does)::

    group = ordered_group(mesh, "tp")
    collective(PSUM, x, "tp", None, group, summed)   # plain: summed(x, group)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

from meshstate.core import compat as _compat
from meshstate.core.mesh import ParallelMesh
from meshstate.core.ordered import OrderedGroup
from meshstate.errors import MeshStateError
from meshstate.jax.types import spmd_checker
from meshstate.jax.torch_calls import Axes, recorded, summed_gradient
from meshstate.jax.types.in_body import JAX_TYPES
from meshstate.jax.types.system import (
    ALL_GATHER, ALL_GATHER_INVARIANT, ALL_TO_ALL, PMAX, PMEAN, PMIN, PPERMUTE, PSUM,
    PSUM_SCATTER, PVARY, CollectiveRule, Move, TypeSystem,
)
from meshstate.jax.types.vma import (
    NO_AXES, VaryingAxesError, VaryingTypes, axes_text, body, every_op_typed, plug_outside_types,
    type_text, typed, vma,
)

__all__ = [
    # the seam's own
    "UnboundAxisError", "axis_names", "collective", "global_value", "on_local", "ordered_group",
    "refuse_unbound",
    # each collective, described once (meshstate.jax.types.system)
    "ALL_GATHER", "ALL_GATHER_INVARIANT", "ALL_TO_ALL", "PMAX", "PMEAN", "PMIN", "PPERMUTE",
    "PSUM", "PSUM_SCATTER", "PVARY", "CollectiveRule",
    # JAX's types (meshstate.jax.types), which the layers above reach through the seam
    "NO_AXES", "VaryingAxesError", "VaryingTypes", "axes_text", "body", "every_op_typed",
    "type_text", "typed", "vma",
]

_JAX_ALONE: tuple[TypeSystem, ...] = (JAX_TYPES,)
_CHECKER_ALONE: tuple[TypeSystem, ...] = (spmd_checker.CHECKER_TYPES,)
_BOTH: tuple[TypeSystem, ...] = (JAX_TYPES, spmd_checker.CHECKER_TYPES)
"""The answers of :func:`_applying`: the type systems a call runs under, the innermost first."""


@_compat.constant_when_traced
def ordered_group(mesh: ParallelMesh, axes: Axes) -> OrderedGroup:
    """``mesh.ordered(axes)``, the group a call runs on. To ``torch.compile`` a constant,
    made while tracing (a first use creates its group there, outside the graph) and
    guarded by the mesh's identity, so a compiled call under another mesh traces again."""
    return mesh.ordered(axes)


@_compat.constant_when_traced
def axis_names(axes: Axes) -> frozenset[str]:
    """The mesh axes a collective names: ``"dp-cp"`` and ``("cp", "dp")`` name dp and cp."""
    names = _names_of.get(axes)
    if names is None:
        spelled = axes.split("-") if isinstance(axes, str) else "-".join(axes).split("-")
        names = _names_of[axes] = frozenset(spelled)
    return names


_names_of: dict[Axes, frozenset[str]] = {}


checker_on = spmd_checker.checking
"""Whether the checker types this thread's torch calls now."""


def collective(
    rule: CollectiveRule,
    x: torch.Tensor,
    axes: Axes,
    mesh: ParallelMesh | None,
    group: OrderedGroup,
    move: Move,
    dims: tuple[int, ...] = (0,),
    tiled: bool = False,
) -> torch.Tensor:
    """``move(x, group)`` under the types that apply now: plain, JAX's rule inside a typed
    body (``x`` cast up to vary over ``axes`` first, the result typed), the checker's rule
    while its checker runs (``dims``: with ``tiled``, the dims the axes split), or both.
    Inside a partial-manual body, an axis it is not manual over is refused, and a value
    global over the others moves its local block (:func:`on_local`)."""
    # The mode question, once a call: outside a typed body with no torch function mode on
    # (one C call), no type system applies; else _applying says which do.
    plain = body.types is None and not _compat.torch_function_mode_on()
    if body.manual is not None:
        return _in_partial_body(rule, x, axes, mesh, group, move, dims, tiled, plain)
    if plain:
        return move(x, group)
    return _typed(_applying(), rule, axes, axis_names(axes), mesh, move, dims, tiled)(x, group)


def _in_partial_body(
    rule: CollectiveRule, x: torch.Tensor, axes: Axes, mesh: ParallelMesh | None,
    group: OrderedGroup, move: Move, dims: tuple[int, ...], tiled: bool, plain: bool,
) -> torch.Tensor:
    """:func:`collective` inside a partial-manual body. JAX refuses a reduction over axes
    the value varies over only some of before it looks the axes up: so does this."""
    names = axis_names(axes)
    systems = () if plain else _applying()
    for system in systems:
        system.refuse(rule, x, axes, names)
    refuse_unbound(rule.name, names)
    run = _typed(systems, rule, axes, names, mesh, move, dims, tiled)
    return on_local(rule.name, x, lambda local: run(local, group))


def _applying() -> tuple[TypeSystem, ...]:
    """The type systems that type the call being made now, JAX's innermost: JAX's types in
    a typed body, the checker while it checks this thread's calls, both, or none. Asked
    without a loop over the systems: this is the typed body's hot path (a generator over
    each system's own question cost 0.6 us a collective)."""
    if checker_on():
        return _BOTH if body.types is not None else _CHECKER_ALONE
    return _JAX_ALONE if body.types is not None else ()


def _typed(
    systems: tuple[TypeSystem, ...], rule: CollectiveRule, axes: Axes, names: frozenset[str],
    mesh: ParallelMesh | None, move: Move, dims: tuple[int, ...], tiled: bool,
) -> Move:
    """``move`` under each of ``systems`` (those that apply: :func:`_applying`)."""
    run = move
    for system in systems:
        run = system.around(rule, axes, names, mesh, run, dims, tiled)
    return run


_FOUND = frozenset({"psum", "pmean", "pmax", "pmin", "ppermute", "pvary", "axis_index"})
"""What JAX 0.12 refuses with 'Found an unbound axis name' (the others: 'unbound axis name')."""
_SUMS = frozenset({"psum", "pmean", "pmax", "pmin"})
_MOVES_DIMS = frozenset({"all_gather", "all_gather_invariant", "psum_scatter", "all_to_all"})
"""Collectives whose result's shape differs: their input is replicated over the other axes."""
_EXTREMES = frozenset({"pmax", "pmin"})
"""Collectives that are not sums: a partial sum over the other axes is summed first."""


class UnboundAxisError(MeshStateError, NameError):
    """A collective or ``axis_index`` over an axis a partial-manual ``shard_map`` body is
    not manual over (JAX raises ``NameError``)."""


def refuse_unbound(name: str, names: frozenset[str]) -> None:
    """Refuse ``name`` over axes ``names`` where the running body is not manual over one,
    in JAX 0.12's words (a typed body's psum asks for pvary: it casts first)."""
    manual = body.manual
    if manual is None or names <= manual:
        return
    axis = sorted(names - manual)[0]
    if name not in _FOUND:
        raise UnboundAxisError(f"unbound axis name: {axis}. The body is manual over "
                               f"{sorted(manual)} only (shard_map's axis_names)")
    asked = name
    if body.types is not None and name != "axis_index":
        asked = "pvary"
    elif name in _SUMS:
        asked = "psum"
    raise UnboundAxisError(
        f"Found an unbound axis name: {axis}. To fix this, please call {asked} under "
        f"`meshstate.shard_map`. The body is manual over {sorted(manual)} only (shard_map's "
        "axis_names)"
    )


def on_local(name: str, x: torch.Tensor, move: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``move`` (a collective named ``name``) of a value global over the non-manual axes:
    of a DTensor's local block, wrapped again with its mesh and placements and typed as
    ``move``'s result; of a plain tensor, ``move(x)``. A collective that changes the shape
    first replicates ``x`` over the other axes, a ``pmax`` or ``pmin`` sums its partials."""
    if not isinstance(x, DTensor):
        return move(x)
    axes = vma(x)
    with _compat.torch_functions_off():
        x = _ready_for(name, x)
        local = _compat.local_tensor(x)
    result = move(typed(local, axes) if axes else local)
    with _compat.torch_functions_off():
        if result.shape != local.shape:
            wrapped = DTensor.from_local(result, x.device_mesh, x.placements, run_check=False)
        elif result.dtype == x.dtype and not _compat.recorded_or_traced(result):
            wrapped = _compat.dtensor_of(result, _compat.spec_and_block(x)[0])
        else:
            wrapped = DTensor.from_local(result, x.device_mesh, x.placements, run_check=False,
                                         shape=x.shape, stride=x.stride())
    result_axes = vma(result)
    return typed(wrapped, result_axes) if result_axes else wrapped


def _ready_for(name: str, x: DTensor) -> DTensor:
    """``x`` laid out so that collective ``name`` of its local block is its global answer."""
    if name in _MOVES_DIMS:
        wanted = tuple(Replicate() if isinstance(p, Shard) else p for p in x.placements)
    elif name in _EXTREMES:
        wanted = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    else:
        return x
    return x if wanted == tuple(x.placements) else x.redistribute(x.device_mesh, wanted)


def global_value(value: Any) -> Any:
    """``value`` as a partial-manual body's values are: a tensor made inside the body (an
    ``axis_index``) as a DTensor replicated over the other axes, typed as it was; anything
    else, and everything outside such a body, as it is."""
    auto_mesh = body.auto_mesh
    if auto_mesh is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    axes = vma(value)
    with _compat.torch_functions_off():
        wrapped = DTensor.from_local(value, auto_mesh, [Replicate()] * auto_mesh.ndim,
                                     run_check=False)
    return typed(wrapped, axes) if axes else wrapped


def pvary_over(x: torch.Tensor, axes: frozenset[str], parallel_mesh: ParallelMesh) -> torch.Tensor:
    """``x``, typed to vary over ``axes`` too; its gradient is summed over them (JAX's
    ``pvary`` inside a typed body, and what casting an operand up inserts); of a value
    global over a partial-manual body's other axes, of its local block."""
    if isinstance(x, DTensor):
        return on_local("pvary", x, partial(pvary_over, axes=axes, parallel_mesh=parallel_mesh))
    if checker_on():
        spelled = tuple(sorted(axes))
        group = ordered_group(parallel_mesh, spelled)
        call = spmd_checker.CheckedCall(
            PVARY.checker_kind, lambda v, on: pvary_over(v, axes, parallel_mesh), group,
            spmd_checker.axis_groups(parallel_mesh, axes),
        )
        return spmd_checker.checked(x, group, call)
    if not recorded(x):
        return typed(x.view_as(x), vma(x) | axes)
    group = ordered_group(parallel_mesh, tuple(sorted(axes)))
    aliased = x.view_as(x) if len(group.ranks) == 1 else summed_gradient(x, group.group_name)
    return typed(aliased, vma(x) | axes)


def typed_index(
    index: Callable[[torch.device], torch.Tensor], axes: Axes, parallel_mesh: ParallelMesh
) -> torch.Tensor:
    """``axis_index`` inside a typed body: ``index(device)`` typed to vary over ``axes``
    (for the checker too, while it runs)."""
    checking = checker_on()  # asked before torch functions go off: it reads the modes
    with _compat.torch_functions_off():
        value = index(torch.device(parallel_mesh.device_type))
        names = axis_names(axes)
        if checking:
            view_axes = parallel_mesh.layout.view_of(names).axes_fastest_first
            spmd_checker.spmd_typed(value, value, names, view_axes, parallel_mesh)
        return typed(value, names)


def checker_paused() -> contextlib.AbstractContextManager[Any]:
    """A block the checker types nothing in (where it runs; else nothing changes)."""
    return spmd_checker.paused() if checker_on() else contextlib.nullcontext()


def checker_types_block(block: torch.Tensor, argument: torch.Tensor, varying: frozenset[str],
                        view_axes: tuple[str, ...], parallel_mesh: ParallelMesh) -> None:
    """Type a ``shard_map`` block for the checker: varying over ``varying``, ``argument``'s
    own type on the view's other axes."""
    spmd_checker.spmd_typed(block, argument, varying, view_axes, parallel_mesh)


def refuse_legacy_under_checker() -> NoReturn:
    """Refuse ``shard_map(check_vma=False)`` while the checker runs: that mode has no types."""
    spmd_checker.refuse_legacy_shard_map()


def _checker_type(x: torch.Tensor) -> frozenset[str]:
    """The axes the checker types ``x`` ``V``, ``R`` or ``P`` on, named as the current mesh
    names them (outside ``with mesh:``, as the one live mesh that the checker's current mesh
    is made of names them; two such meshes are refused): the axes a JAX value of that type
    varies over. None where it has not typed ``x``."""
    return spmd_checker.varying_axes(x) if spmd_checker.may_have_typed() else NO_AXES


plug_outside_types(_checker_type)
JAX_TYPES.plug_pvary(pvary_over)
