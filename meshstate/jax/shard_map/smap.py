"""``smap``, JAX's one-axis shard_map.

``smap(f, in_axes=, out_axes=, axis_name=)`` is ``shard_map`` manual over one axis, its
specs written as ``vmap``'s axes: argument ``i`` split on dim ``in_axes[i]`` over
``axis_name`` (``None``: not split; default: read from its layout, :mod:`~meshstate.jax.shard_map.infer`),
each result on dim ``out_axes``.

Example (8 ranks, ``init_mesh(tp=2, cp=2)``; ``x`` a DTensor, rows split over dp)::

    smap(lambda v: v * 2, in_axes=0, out_axes=0, axis_name="dp")(x)   # rows doubled
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshstate.errors import ArgumentTypeError, ConfigError
from meshstate.jax.shard_map.infer import Infer, InferFromArgs, inferred_specs
from meshstate.jax.shard_map.mapped import shard_map
from meshstate.jax.sharding import P

__all__ = ["smap"]


def smap(
    f: Callable[..., Any] | None = None,
    /,
    *,
    in_axes: int | None | InferFromArgs | tuple[int | None, ...] = Infer,
    out_axes: Any,
    axis_name: str,
) -> Callable[..., Any]:
    """``f`` mapped over the mesh axis ``axis_name`` one block at a time (JAX's ``jax.smap``):
    ``shard_map`` manual over that axis only, argument ``i`` split on dim ``in_axes[i]``
    (one int or ``None`` for all; ``None``: not split; default: read from its layout), each
    result put on dim ``out_axes`` (an int, ``None``: replicated, or a tuple, list or dict
    of them). Without ``f``, a decorator. The current mesh is the mesh.

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``, ``x`` of 8 rows)::

        smap(lambda v: v * 2, in_axes=0, out_axes=0, axis_name="dp")(x)   # x * 2

    Raises:
        ArgumentTypeError: ``axis_name`` is not one axis name, or an axis is not an int.
    """
    if not isinstance(axis_name, str):
        raise ArgumentTypeError(f"smap axis_name should be one axis name (a str), got {axis_name!r}")
    if f is None:
        def decorate(g: Callable[..., Any]) -> Callable[..., Any]:
            return smap(g, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)
        return decorate
    out_specs = _out_specs(out_axes, axis_name)
    mapped_f = f

    def mapped(*args: Any) -> Any:
        in_specs = _in_specs(in_axes, args, axis_name)
        return shard_map(mapped_f, in_specs=in_specs, out_specs=out_specs,
                         axis_names={axis_name})(*args)

    return mapped


def _in_specs(in_axes: Any, args: tuple[Any, ...], axis_name: str) -> tuple[P | None, ...]:
    """Each argument's in-spec: split on its dim of ``in_axes`` over ``axis_name``."""
    if isinstance(in_axes, InferFromArgs):
        return inferred_specs(args, frozenset({axis_name}))
    per_arg = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    if len(per_arg) != len(args):
        raise ConfigError(f"smap in_axes has {len(per_arg)} entries for {len(args)} arguments")
    return tuple(
        _split_on(axis, x.dim(), axis_name, "in_axes") if isinstance(x, torch.Tensor) else None
        for axis, x in zip(per_arg, args)
    )


def _split_on(axis: int | None, ndim: int | None, axis_name: str, what: str) -> P:
    """The spec that splits dim ``axis`` (of ``ndim``; negative from the end) over
    ``axis_name``; ``P()`` for ``None``."""
    if axis is None:
        return P()
    if not isinstance(axis, int):
        raise ArgumentTypeError(f"smap {what} must be ints or None, got {axis!r}")
    if axis < 0:
        if ndim is None:
            raise ConfigError(f"smap {what}={axis}: a negative out axis needs the result's rank; "
                              "give it from the front")
        axis += ndim
    return P(*([None] * axis), axis_name)


def _out_specs(out_axes: Any, axis_name: str) -> Any:
    """``out_axes`` as a spec tree."""
    if isinstance(out_axes, dict):
        return {key: _out_specs(value, axis_name) for key, value in out_axes.items()}
    if isinstance(out_axes, (tuple, list)):
        return type(out_axes)(_out_specs(value, axis_name) for value in out_axes)
    return _split_on(out_axes, None, axis_name, "out_axes")
