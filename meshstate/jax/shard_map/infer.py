"""In-specs read from the arguments (JAX's ``Infer``), for ``shard_map`` and ``smap``.

``shard_map(f, out_specs=...)`` without ``in_specs`` (or with ``in_specs=Infer``) reads
each positional argument's spec from its layout: a DTensor's placements (its Explicit
type, :func:`~meshstate.typeof`), a plain tensor's ``P()``; manual over some axes
(``axis_names``), the spec keeps those axes only. Inside :func:`~meshstate.explicit`, an
in-spec that disagrees with its argument's type is refused in JAX 0.12's words; outside,
meshstate redistributes the argument (JAX's Auto axes).

Example (8 ranks, ``init_mesh(tp=2, cp=2)``; ``x`` a DTensor, rows split over dp)::

    shard_map(lambda v: psum(v, "dp"), out_specs=P())(x)                # in_specs: P("dp")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Partial

from meshstate.errors import ConfigError
from meshstate.jax.sharding import DimAxes, P, entry_axes
from meshstate.jax.types.explicit import state as explicit_state, typeof

__all__ = ["Infer", "InferFromArgs", "inferred_specs", "refuse_disagreeing", "spec_of"]


class InferFromArgs:
    """The type of :data:`Infer`: read the in-specs from the arguments (JAX's)."""

    def __repr__(self) -> str:
        return "Infer"


Infer: Final = InferFromArgs()
"""``shard_map``'s and ``smap``'s default ``in_specs``/``in_axes``: read from the arguments."""


def spec_of(x: Any, manual: frozenset[str] | None) -> P | None:
    """``x``'s spec as its layout says, over the ``manual`` axes only (``None``: every
    axis); ``None`` for what is not a tensor. Example: a DTensor split ``Shard(0)`` over dp
    and ``Shard(1)`` over tp gives ``P('dp', 'tp')``; with ``manual={'tp'}``, ``P(None, 'tp')``."""
    if not isinstance(x, torch.Tensor):
        return None
    if not isinstance(x, DTensor):
        return P()
    spec = _placed_spec(x)
    return _trimmed([_kept(entry, manual) for entry in spec.dims],
                    spec.unreduced if manual is None else spec.unreduced & manual)


def _placed_spec(x: DTensor) -> P:
    """``x``'s spec read from its placements: each dim split over the axes that shard it,
    in mesh order; a pending sum's axes unreduced. Plain Python on placements, which
    ``torch.compile`` folds; a dim split against mesh order (torch's strided shard) is
    read by :func:`~meshstate.typeof`."""
    placements = x.placements
    if any(isinstance(p, Shard) and type(p) is not Shard for p in placements):
        return typeof(x).spec
    names = x.device_mesh.mesh_dim_names or ()
    dims: list[list[str]] = [[] for _ in range(x.dim())]
    unreduced = set()
    for mesh_dim, (name, placement) in enumerate(zip(names, placements)):
        if x.device_mesh.size(mesh_dim) == 1:
            continue
        if isinstance(placement, Shard):
            dims[placement.dim].append(name)
        elif isinstance(placement, Partial):
            unreduced.add(name)
    return P(*(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in dims),
             unreduced=frozenset(unreduced))


def _kept(entry: DimAxes, manual: frozenset[str] | None) -> DimAxes:
    axes = tuple(axis for axis in entry_axes(entry) if manual is None or axis in manual)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _trimmed(dims: Sequence[DimAxes], unreduced: frozenset[str]) -> P:
    """``P(*dims)`` without trailing ``None``s, JAX's spelling."""
    dims = list(dims)
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims, unreduced=unreduced)


def inferred_specs(args: tuple[Any, ...], manual: frozenset[str] | None) -> tuple[P | None, ...]:
    """Each positional argument's spec, read from its layout (:func:`spec_of`)."""
    return tuple(spec_of(x, manual) for x in args)


def refuse_disagreeing(spec: P, x: torch.Tensor, manual: frozenset[str] | None) -> None:
    """Inside :func:`~meshstate.explicit`, refuse an in-spec that disagrees with its
    DTensor argument's type, in JAX 0.12's words; outside, nothing (Auto axes)."""
    if not explicit_state.active or explicit_state.suspended or not isinstance(x, DTensor):
        return
    typed_spec = spec_of(x, manual)
    if typed_spec is None or _padded(typed_spec, x.dim()) == _padded(spec, x.dim()):
        return
    raise ConfigError(
        f"in_specs passed to shard_map: {_padded(spec, x.dim())!r} does not match the specs of "
        f"the input: {_padded(typed_spec, x.dim())!r} for arg: {typeof(x)}. `in_specs` is an "
        "optional argument so you can omit specifying it and shard_map will infer the "
        "in_specs from the arguments. If you want to reshard your inputs, you can use "
        "`meshstate.reshard` on the arguments and then pass those args to shard_map."
    )


def _padded(spec: P, ndim: int) -> P:
    """``spec`` with an entry per dim (JAX prints ``P(None, None)`` for a 2-D ``P()``)."""
    dims = [entry_axes(entry) for entry in spec.dims] + [()] * (ndim - len(spec.dims))
    return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims),
             unreduced=spec.unreduced)
