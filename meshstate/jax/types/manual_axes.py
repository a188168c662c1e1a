"""The axes a partial-manual ``shard_map`` body is manual over, and its global values.

Inside ``shard_map(f, ..., axis_names={"tp"})`` a value is a block over the manual axes
and global over the others: a DTensor on the mesh of the other axes (or a plain tensor,
replicated over them). A collective or ``axis_index`` over an axis that is not manual is
refused with JAX 0.12's words (:func:`refuse_unbound`); one over manual axes moves the
DTensor's local block and wraps the result again (:func:`on_local`).

Example (inside ``shard_map(f, in_specs=P(None, "tp"), ..., axis_names={"tp"})`` on
dp=2, tp=2, ``x`` rows split over dp)::

    psum(x, "tp")     # a DTensor over dp: each rank's local rows summed over tp
    psum(x, "dp")     # UnboundAxisError: Found an unbound axis name: dp. ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

from meshstate.core import compat as _compat
from meshstate.errors import MeshStateError
from meshstate.jax.types.vma import body, typed, vma

__all__ = ["UnboundAxisError", "global_value", "on_local", "refuse_unbound"]

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
