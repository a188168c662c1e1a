"""JAX's Explicit axes' types: what a value's type is, how a DTensor's is read, and whether
this thread types ops by them.

A value's type (:class:`ArrayType`) is its shape, dtype, the mesh axes splitting each dim
(major first) and the axes over which it is a pending sum (JAX's *unreduced*); it is read
from a DTensor's placements once per layout (:func:`array_type`) and printed as JAX prints
it (:func:`str_type`); :func:`typeof` is JAX's ``jax.typeof``. Inside
:func:`~meshstate.explicit` (:data:`state`), ops on DTensors are typed by JAX's rules
(:mod:`~meshstate.jax.explicit`), and ``shard_map`` refuses an in-spec that disagrees with
its argument's type.

Example (mesh ``(dp, tp) = (2, 4)``, ``x`` a ``(8, 16)`` float32 DTensor on ``P("dp", "tp")``)::

    str(typeof(x))            # 'float32[8@dp,16@tp]'
    array_type(x).dims        # (('dp',), ('tp',))
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from meshstate.core import compat as _compat
from meshstate.errors import MeshStateError
from meshstate.jax.sharding import P, entry_axes, spec_of

__all__ = ["ArrayType", "ExplicitType", "ShardingTypeError", "typeof"]

Entry = tuple[str, ...]
"""The axes splitting one dim, major first; ``()`` where nothing splits it."""
SizedAxes = tuple[tuple[str, int], ...]
"""The mesh's axes and sizes, in mesh order."""

KEPT = 1024
"""Past this many entries (shapes vary, say with sequence length) a table of types or of
fast ops starts over."""


class ShardingTypeError(MeshStateError):
    """An op on explicitly sharded values that JAX's Explicit axes refuse (JAX's
    ``ShardingTypeError``, with its message): raised on every rank before anything is
    sent, naming what to write instead (``out_sharding``, ``meshstate.reshard``,
    ``meshstate.auto_axes``)."""


@dataclass(frozen=True)
class ArrayType:
    """A value's JAX type: ``shape``, numpy-style ``dtype`` name, the axes of each dim
    (``dims``, one entry per dim) and the ``unreduced`` axes."""

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[Entry, ...]
    unreduced: frozenset[str] = frozenset()

    @property
    def split_axes(self) -> frozenset[str]:
        return frozenset(axis for entry in self.dims for axis in entry)


def str_type(t: ArrayType, axes: SizedAxes, short: bool = False) -> str:
    """``t`` as JAX prints it: ``float32[8@dp,128@(dp,tp)]{U:tp}`` (``f32[...]`` short)."""
    dtype = _SHORT.get(t.dtype, t.dtype) if short else t.dtype
    sizes = ",".join(
        f"{size}@{_joined(entry)}" if entry else str(size) for size, entry in zip(t.shape, t.dims)
    )
    text = f"{dtype}[{sizes}]"
    if t.unreduced:
        text += "{U:" + _joined(tuple(name for name, _ in axes if name in t.unreduced)) + "}"
    return text


_SHORT = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
          "int32": "i32", "int64": "i64", "int8": "i8", "uint8": "u8", "bool": "bool"}


def _joined(entry: Entry) -> str:
    return entry[0] if len(entry) == 1 else "(" + ",".join(entry) + ")"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@_compat.constant_when_traced
def sized_axes(view: DeviceMesh) -> SizedAxes:
    """``view``'s axes and sizes in mesh order."""
    return tuple(zip(view.mesh_dim_names or (), view.shape))


def array_type(x: DTensor) -> ArrayType:
    """The JAX type of DTensor ``x``, worked out once per placements, shape and dtype."""
    return type_of(x.device_mesh, tuple(x.placements), tuple(x.shape), dtype_name(x.dtype))


@_compat.constant_when_traced
def type_of(
    view: DeviceMesh, placements: tuple[Placement, ...] | None, shape: tuple[int, ...], dtype: str
) -> ArrayType:
    key = (view, placements, shape, dtype)
    found = _TYPES.get(key)
    if found is None:
        if placements is None:
            return ArrayType(shape, dtype, ((),) * len(shape))
        reduced = tuple(Replicate() if p.is_partial() else p for p in placements)
        spec = spec_of(view, reduced)
        if spec is None:
            raise ShardingTypeError(
                f"a DTensor with placements {placements} has no JAX type (a strided layout "
                "no partition spec gives); reshard it first (meshstate.reshard)"
            )
        names = view.mesh_dim_names or ()
        dims = tuple(entry_axes(spec.dims[d]) if d < len(spec.dims) else () for d in range(len(shape)))
        pending = frozenset(n for n, p in zip(names, placements) if p.is_partial())
        if len(_TYPES) >= KEPT:
            _TYPES.clear()
        found = _TYPES[key] = ArrayType(shape, dtype, dims, pending)
    return found


_TYPES: dict[tuple[Any, ...], ArrayType] = {}


@dataclass(frozen=True)
class ExplicitType:
    """A value's JAX type: ``str()`` prints it as JAX does (``float32[8@dp,16@tp]{U:cp}``).

    Example: ``typeof(x).spec`` is ``P('dp', 'tp')``, ``typeof(x).shape`` ``(8, 16)``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: P
    text: str

    @property
    def unreduced(self) -> frozenset[str]:
        """The axes over which the value is a pending sum."""
        return self.spec.unreduced

    def __str__(self) -> str:
        return self.text


def typeof(x: torch.Tensor) -> ExplicitType:
    """``x``'s type as JAX's ``jax.typeof`` gives it: a DTensor's from its placements, a
    plain tensor's unsplit. Example: ``str(typeof(x))`` is ``'float32[8@dp,16@tp]'``."""
    if isinstance(x, DTensor):
        t = array_type(x)
        axes = sized_axes(x.device_mesh)
    else:
        t = ArrayType(tuple(x.shape), dtype_name(x.dtype), ((),) * x.dim())
        axes = ()
    spec = P(*(entry or None for entry in t.dims), unreduced=t.unreduced)
    return ExplicitType(t.shape, x.dtype, spec, str_type(t, axes))


class ExplicitState(threading.local):
    """Whether the explicit mode is on in this thread (``active``: inside ``explicit()``),
    and set aside (``suspended``: inside ``auto_axes``, or while a typed op runs); torch
    keeps modes per thread too."""

    def __init__(self) -> None:
        self.active = False
        self.suspended = False


state = ExplicitState()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """A block in which the explicit mode lets every op through (DTensor's own rules)."""
    before = state.suspended
    state.suspended = True
    try:
        yield
    finally:
        state.suspended = before
