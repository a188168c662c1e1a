"""What a typed op of JAX's Explicit axes does, planned from its operands' layouts before
anything moves (no data, no groups: a constant to ``torch.compile``).

Each operand's type is read from its layout (:mod:`~meshstate.jax.types.explicit`); an
:class:`OpPlan` says how an op's operands are laid out first and its result after, or JAX's refusal;
each kind of op has its plan maker here (:func:`elementwise_plan`,
:func:`contraction_plan`, :func:`reduction_plan`, :func:`reshape_plan`,
:func:`shape_plan`), which asks :mod:`~meshstate.jax.explicit.rules` for the type.

Example (mesh ``(dp, tp) = (2, 4)``, ``x`` an ``(8, 16)`` float32 DTensor on ``P("dp", "tp")``)::

    layout_of(x)        # ((Shard(dim=0), Shard(dim=1)), (8, 16), 'float32'): what a plan reads
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.overrides import resolve_name

from meshstate.core import compat as _compat
from meshstate.jax.explicit import rules
from meshstate.jax.sharding import P, to_placements
from meshstate.jax.types.explicit import (
    Entry, ShardingTypeError, dtype_name, sized_axes, str_type, type_of,
)

Layout = tuple[tuple[Placement, ...] | None, tuple[int, ...], str] | None
"""An operand as a plan sees it: its placements (``None``: a plain tensor, replicated),
shape and dtype name; ``None`` for a Python number."""


def placements_of(view: DeviceMesh, dims: Sequence[Entry], unreduced: frozenset[str]) -> tuple[Placement, ...]:
    return to_placements(P(*(entry or None for entry in dims), unreduced=unreduced), view)


def layout_of(value: Any) -> Layout:
    if isinstance(value, DTensor):
        return tuple(value.placements), tuple(value.shape), dtype_name(value.dtype)
    if isinstance(value, torch.Tensor):
        return None, tuple(value.shape), dtype_name(value.dtype)
    return None


@dataclass(frozen=True)
class OpPlan:
    """What a typed op does: each operand's placements before it runs (``None``: as it
    is), the result's placements and global ``shape``, or the refusal (``error``: JAX's
    text); run on blocks, each operand block's gradient placements (``grads``); a
    contraction's result laid out as ``final`` after it runs."""

    operands: tuple[tuple[Placement, ...] | None, ...] = ()
    result: tuple[Placement, ...] = ()
    local_shape: tuple[int, ...] = ()
    error: str = ""
    shape: tuple[int, ...] = ()
    grads: tuple[tuple[Placement, ...] | None, ...] = ()
    final: tuple[Placement, ...] = ()


def with_grads(plan: OpPlan) -> OpPlan:
    """``plan`` with the placements of each operand's local gradient when the op runs on
    local blocks: a pending sum's cotangent is replicated; where an operand is replicated
    over an axis that splits the result, each rank's gradient is a part of the sum."""
    grads: list[tuple[Placement, ...] | None] = []
    for operand in plan.operands:
        if operand is None:
            grads.append(None)
            continue
        grads.append(tuple(
            Replicate() if mine.is_partial()
            else Partial() if mine.is_replicate() and not theirs.is_replicate() else mine
            for mine, theirs in zip(operand, plan.result)
        ))
    return replace(plan, grads=tuple(grads))


def planned(make: Callable[[], OpPlan]) -> OpPlan:
    try:
        return make()
    except ShardingTypeError as refusal:
        return OpPlan(error=str(refusal))


def refuse_if(error: str) -> None:
    """Raise JAX's refusal ``error`` where there is one: while tracing too, where
    ``torch.compile`` lets it out as itself, or under ``fullgraph=True`` inside its
    "Observed exception" error, which quotes it."""
    if error:
        raise ShardingTypeError(error)


# --- each kind of op's plan ---------------------------------------------------------

_JAX_NAMES = {"truediv": "div", "true_divide": "div", "divide": "div", "multiply": "mul",
              "subtract": "sub", "maximum": "max", "minimum": "min", "negative": "neg",
              "rsub": "sub", "rtruediv": "div", "rdiv": "div", "to": "convert_element_type"}


@_compat.constant_when_traced
def name_of(func: Callable[..., Any]) -> str:
    """``func``'s name as torch writes it: ``torch.Tensor.__add__``, ``torch.sin``."""
    return resolve_name(func) or str(getattr(func, "__name__", func))


@_compat.constant_when_traced
def jax_name(func: Callable[..., Any]) -> str:
    """``func``'s JAX primitive name: ``Tensor.__radd__`` -> ``add``, ``torch.sin`` -> ``sin``."""
    name = name_of(func).rsplit(".", 1)[-1]
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in _OPERATORS:
            name = name[1:]
    name = name.rstrip("_")
    return str(_JAX_NAMES.get(name, name))


_OPERATORS = frozenset({"add", "sub", "mul", "truediv", "pow", "matmul"})


@_compat.constant_when_traced
def elementwise_plan(name: str, view: DeviceMesh, layouts: tuple[Layout, ...]) -> OpPlan:
    def make() -> OpPlan:
        axes = sized_axes(view)
        types = [None if layout is None else type_of(view, *layout) for layout in layouts]
        result = rules.elementwise(name, types, axes)
        operands: list[tuple[Placement, ...] | None] = []
        for t in types:
            if t is None:
                operands.append(None)
                continue
            offset = len(result.shape) - len(t.shape)
            dims = tuple(() if size == 1 and result.shape[offset + d] != 1 else result.dims[offset + d]
                         for d, size in enumerate(t.shape))
            operands.append(placements_of(view, dims, t.unreduced))
        return with_grads(OpPlan(tuple(operands), placements_of(view, result.dims, result.unreduced),
                                 shape=result.shape))
    return planned(make)


@_compat.constant_when_traced
def contraction_plan(
    equation: str, view: DeviceMesh, layouts: tuple[Layout, ...],
    out: tuple[tuple[Entry, ...], frozenset[str]] | None, matmul: bool,
) -> OpPlan:
    def make() -> OpPlan:
        axes = sized_axes(view)
        lhs, rhs = (type_of(view, *layout) for layout in layouts if layout is not None)
        c = rules.contract(equation, lhs, rhs, out, axes, matmul)
        operands = tuple(placements_of(view, dims, frozenset()) for dims in c.operands)
        natural = placements_of(view, c.natural.dims, c.natural.unreduced)
        result = placements_of(view, c.result.dims, c.result.unreduced)
        return with_grads(OpPlan(operands, natural, shape=c.natural.shape, final=result))
    return planned(make)


_REDUCE_OPS = {"sum": "sum", "mean": "avg", "max": "max", "min": "min"}


@_compat.constant_when_traced
def reduction_plan(
    name: str, view: DeviceMesh, layout: Layout, dims: tuple[int, ...], keepdim: bool
) -> OpPlan:
    """A reduction: ``result`` as the blocks give it (a partial ``sum``/``avg``/``max``/
    ``min`` over the split dims reduced), ``final`` as JAX types it (those reduced)."""
    def make() -> OpPlan:
        assert layout is not None
        t = type_of(view, *layout)
        if t.unreduced and name not in ("sum", "mean"):
            raise ShardingTypeError(f"unreduced rule for reduce_{name} is not implemented")
        result = rules.reduce_dims(t, dims, keepdim)
        final = placements_of(view, result.dims, result.unreduced)
        reduced = {axis for d in (dims or range(len(t.shape))) for axis in t.dims[d]}
        natural = tuple(Partial(_REDUCE_OPS[name]) if axis in reduced else placement
                        for axis, placement in zip(view.mesh_dim_names or (), final))
        return OpPlan((), natural, shape=result.shape, final=final)
    return planned(make)


@_compat.constant_when_traced
def reshape_plan(view: DeviceMesh, layout: Layout, shape: tuple[int, ...]) -> OpPlan:
    def make() -> OpPlan:
        assert layout is not None
        axes = sized_axes(view)
        t = type_of(view, *layout)
        before, result = rules.reshape(t, shape, axes)
        sizes = dict(axes)
        local = []
        for size, entry in zip(result.shape, result.dims):
            parts = math.prod(sizes[axis] for axis in entry)
            if size % parts:
                raise ShardingTypeError(
                    f"reshaping {str_type(t, axes)} to {shape}: dim of size {size} does "
                    f"not divide by its axes' {parts}; reshard first (meshstate.reshard)"
                )
            local.append(size // parts)
        return OpPlan((placements_of(view, before, t.unreduced),),
                     placements_of(view, result.dims, result.unreduced), tuple(local))
    return planned(make)


@_compat.constant_when_traced
def shape_plan(kind: str, view: DeviceMesh, layouts: tuple[Layout, ...], arguments: tuple[Any, ...]) -> OpPlan:
    def make() -> OpPlan:
        axes = sized_axes(view)
        types = [type_of(view, *layout) for layout in layouts if layout is not None]
        if kind == "permute":
            result = rules.permute(types[0], arguments)
        elif kind == "unsqueeze":
            result = rules.unsqueeze(types[0], arguments[0])
        elif kind == "cat":
            result = rules.concatenate(types, arguments[0], axes)
        else:
            result = rules.take(types[0], arguments, axes)
        if kind in ("permute", "unsqueeze"):
            operand = placements_of(view, types[0].dims, types[0].unreduced)
            return with_grads(OpPlan((operand,), placements_of(view, result.dims, result.unreduced),
                                     shape=result.shape))
        operands: list[tuple[Placement, ...] | None] = []
        for t in types:
            cut = arguments[0] % len(t.shape) if kind == "cat" else None
            unsplit = tuple(() if d == cut or (kind == "take" and _sliced(arguments, d, size))
                            else e for d, (size, e) in enumerate(zip(t.shape, t.dims)))
            operands.append(placements_of(view, unsplit, t.unreduced))
        return OpPlan(tuple(operands), placements_of(view, result.dims, result.unreduced))
    return planned(make)


def _sliced(keys: tuple[Any, ...], dim: int, size: int) -> bool:
    return dim < len(keys) and keys[dim] is not None and tuple(keys[dim]) != (0, size)
