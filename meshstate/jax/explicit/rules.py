"""JAX's Explicit-axes typing rules, as pure arithmetic on types (no data, no groups).

Each rule takes its operands' types (:class:`~meshstate.jax.types.explicit.ArrayType`:
shape, dtype, the mesh axes splitting each dim, major first, and the axes over which it is
a pending sum, JAX's *unreduced*) and gives the result's, or raises
:class:`ShardingTypeError` with JAX 0.10's message; :mod:`meshstate.jax.explicit`
runs the values. Where eager JAX and ``jax.jit`` differ (slicing a split dim),
the rules follow ``jit``.

Example (mesh ``(dp, tp) = (2, 4)``)::

    x = ArrayType((8, 16), "float32", (("dp",), ("tp",)))
    reduce_dims(x, (0,), keepdim=False).dims    # (('tp',),): summed over dp at once
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshstate.jax.types.explicit import ArrayType, SizedAxes, Entry, ShardingTypeError, str_type


def spec_text(dims: Sequence[Entry]) -> str:
    """Dims as JAX's messages print a spec: ``('dp', None)``, ``(('dp', 'tp'), None)``."""
    return repr(tuple(None if not entry else entry[0] if len(entry) == 1 else entry
                      for entry in dims))


def elementwise(name: str, operands: Sequence[ArrayType | None], axes: SizedAxes) -> ArrayType:
    """The type of an elementwise op of ``operands`` (``None``: a Python number), numpy's
    broadcasting: each dim takes the axes of the operand that splits it; the others must
    leave it unsplit (or split it alike). ``name`` is JAX's (``add``, ``mul``, ``sin``)."""
    typed = [t for t in operands if t is not None]
    _unreduced_elementwise(name, operands, axes)
    ndim = max(len(t.shape) for t in typed)
    shape, dims = [], []
    for dim in range(-ndim, 0):
        present = [t for t in typed if len(t.shape) >= -dim]
        size = max(t.shape[dim] for t in present)
        entries = {t.dims[dim] for t in present if t.dims[dim]}
        if len(entries) > 1:
            shown = ", ".join(spec_text(t.dims) for t in typed)
            raise ShardingTypeError(f"{name} got incompatible shardings for broadcasting: {shown}.")
        shape.append(size)
        dims.append(next(iter(entries), ()))
    result = ArrayType(tuple(shape), typed[0].dtype, tuple(dims), typed[0].unreduced)
    _require_legal(f"{name} operation", typed, result, axes)
    return result


_LINEAR = frozenset({"add", "sub"})
_BILINEAR = frozenset({"mul", "div"})


def _unreduced_elementwise(
    name: str, operands: Sequence[ArrayType | None], axes: SizedAxes
) -> None:
    """JAX's rules for pending sums in an elementwise op: ``add``/``sub`` of operands
    pending over the same axes; nothing else."""
    pending = [frozenset() if t is None else t.unreduced for t in operands]
    if not any(pending):
        return
    typed = [t for t in operands if t is not None]
    if name in _LINEAR and len(operands) == 2:
        if pending[0] == pending[1]:
            return
        side, other = ("lhs", "rhs") if pending[0] else ("rhs", "lhs")
        raise ShardingTypeError(
            f"{side} is unreduced while {other} is not. `{name}` operation does not allow this "
            f"because there will be implicit communication. Please reduce {side} via `reshard` "
            f"before calling `{name}`."
        )
    if name in _BILINEAR and len(operands) == 2:
        if pending[0] and pending[1]:
            raise ShardingTypeError(
                f"lhs and rhs to `{name}` cannot be unreduced since {name} is bilinear. "
                f"Got lhs={pending[0]}, rhs={pending[1]}"
            )
        lhs, rhs = (operands[0], operands[1]) if pending[0] else (operands[1], operands[0])
        shown = "float32[]" if rhs is None else str_type(rhs, axes)
        raise ShardingTypeError(
            "RHS should be reduced along the same axes LHS is unreduced on. "
            f"Got lhs={str_type(lhs, axes) if lhs else ''} and rhs={shown}"
        )
    if len(operands) == 1:
        raise ShardingTypeError(
            f"{name} is a non-linear operation and cannot accept input that is unreduced. "
            f"Got {str_type(typed[0], axes)}"
        )
    raise ShardingTypeError(
        f"{name} is a non-linear operation and cannot accept inputs that are unreduced. "
        f"Got ({', '.join(str_type(t, axes) for t in typed)})"
    )


def _require_legal(what: str, operands: Sequence[ArrayType], result: ArrayType, axes: SizedAxes) -> None:
    used = [axis for entry in result.dims for axis in entry]
    if len(used) != len(set(used)):
        inputs = ", ".join(str_type(t, axes, short=True) for t in operands)
        raise ShardingTypeError(
            f"{what} with inputs: {inputs} produces an illegally sharded result: "
            f"{str_type(result, axes, short=True)}"
        )


@dataclass(frozen=True)
class Contraction:
    """How a ``dot_general`` runs: each operand's dims as it must be laid out first (one
    side's split of a contracting dim gathered, a batch dim split on one side cut on the
    other), the result's type as those operands give it (pending over the contracting
    axes split on both sides) and the type asked for."""

    operands: tuple[tuple[Entry, ...], ...]
    natural: ArrayType
    result: ArrayType


def contract(
    equation: str, lhs: ArrayType, rhs: ArrayType, out: tuple[tuple[Entry, ...], frozenset[str]] | None,
    axes: SizedAxes, matmul: bool,
) -> Contraction:
    """JAX's ``dot_general`` typing for ``einsum(equation, lhs, rhs)`` (labels one letter a
    dim; ``matmul`` for ``@``, whose batch dims must match). ``out`` is the
    ``out_sharding``'s dims and unreduced axes."""
    if lhs.unreduced or rhs.unreduced:
        raise ShardingTypeError(
            "lhs or rhs passed to dot_general cannot be unreduced. "
            f"Got lhs=ShapedArray({str_type(lhs, axes)}) and rhs=ShapedArray({str_type(rhs, axes)})"
        )
    inputs, output = equation.split("->")
    left, right = inputs.split(",")
    sizes = {**dict(zip(right, rhs.shape)), **dict(zip(left, lhs.shape))}
    left_entry, right_entry = dict(zip(left, lhs.dims)), dict(zip(right, rhs.dims))
    contracting = [label for label in left if label in right and label not in output]
    lhs_spec = tuple(left_entry[label] for label in contracting)
    rhs_spec = tuple(right_entry[label] for label in contracting)
    both = [label for label in contracting if left_entry[label] and right_entry[label]]
    batch = [label for label in left if label in right and label in output]
    lhs_batch = tuple(left_entry[label] for label in batch)
    rhs_batch = tuple(right_entry[label] for label in batch)
    if out is None and not matmul and lhs_batch != rhs_batch:  # matmul's own words below
        raise ShardingTypeError(
            "dot_general requires lhs batch dimensions and rhs batch dimensions to have the "
            f"same sharding, got {spec_text(lhs_batch)} and {spec_text(rhs_batch)}."
        )
    if both and out is None:
        raise ShardingTypeError(
            "Contracting dimensions are sharded and it is ambiguous how the output should be "
            "sharded. Please specify the output sharding via the `out_sharding` parameter. "
            f"Got lhs_contracting_spec={spec_text(lhs_spec)} and "
            f"rhs_contracting_spec={spec_text(rhs_spec)}"
        )
    for label in both:
        if left_entry[label] != right_entry[label]:
            raise ShardingTypeError(
                "dot_general requires contracting dimensions to have consistent sharding, "
                f"got {spec_text(lhs_spec)} and {spec_text(rhs_spec)}."
            )
    pending = frozenset(axis for label in both for axis in left_entry[label])
    if out is not None and out[1] and out[1] != pending:
        raise ShardingTypeError(
            "out_sharding's unreduced axes should be equal to the contracting specs. "
            f"Got unreduced axes={out[1]} and contracting spec={spec_text(lhs_spec)}"
        )
    chosen: dict[str, Entry] = {}
    for label in output:
        entries = {e for e in (left_entry.get(label, ()), right_entry.get(label, ())) if e}
        if len(entries) > 1 or (matmul and label in left_entry and label in right_entry
                                and left_entry[label] != right_entry[label]):
            raise ShardingTypeError(
                f"Incompatible types for matmul arguments: {str_type(lhs, axes)} and "
                f"{str_type(rhs, axes)}"
            )
        chosen[label] = next(iter(entries), ())
    for label in contracting:
        chosen[label] = left_entry[label] if label in both else ()
    natural = ArrayType(tuple(sizes[label] for label in output), lhs.dtype,
                        tuple(chosen[label] for label in output), pending)
    _require_legal("dot_general operation", (lhs, rhs), natural, axes)
    result = natural if out is None else _typed(natural.shape, lhs.dtype, out, axes)
    operands = (tuple(chosen[label] for label in left), tuple(chosen[label] for label in right))
    return Contraction(operands, natural, result)


def _typed(
    shape: tuple[int, ...], dtype: str, spec: tuple[tuple[Entry, ...], frozenset[str]], axes: SizedAxes
) -> ArrayType:
    dims, unreduced = spec
    padded = tuple(dims) + ((),) * (len(shape) - len(dims))
    return ArrayType(shape, dtype, padded, unreduced)


def reduce_dims(t: ArrayType, dims: Sequence[int], keepdim: bool) -> ArrayType:
    """A reduction over ``dims`` (sum, mean, max): split ones are reduced at once, so
    the result is never pending over them; pending axes stay pending."""
    ndim = len(t.shape)
    reduced = {dim % ndim for dim in dims} if dims else set(range(ndim))
    shape, entries = [], []
    for dim, (size, entry) in enumerate(zip(t.shape, t.dims)):
        if dim not in reduced:
            shape.append(size)
            entries.append(entry)
        elif keepdim:
            shape.append(1)
            entries.append(())
    return ArrayType(tuple(shape), t.dtype, tuple(entries), t.unreduced)


def permute(t: ArrayType, order: Sequence[int]) -> ArrayType:
    ndim = len(t.shape)
    order = [dim % ndim for dim in order]
    return replace(t, shape=tuple(t.shape[d] for d in order), dims=tuple(t.dims[d] for d in order))


def unsqueeze(t: ArrayType, dim: int) -> ArrayType:
    dim = dim % (len(t.shape) + 1)
    return replace(t, shape=t.shape[:dim] + (1,) + t.shape[dim:], dims=t.dims[:dim] + ((),) + t.dims[dim:])


def concatenate(operands: Sequence[ArrayType], dim: int, axes: SizedAxes) -> ArrayType:
    """``cat``: operands of one sharding; along a split dim the result stays split."""
    first = operands[0]
    if any((t.dims, t.unreduced) != (first.dims, first.unreduced) for t in operands[1:]):
        shown = ", ".join(f"P{spec_text(t.dims)}" for t in operands)
        raise ShardingTypeError(f"All operands should have the same sharding. Got shardings {shown}")
    dim = dim % len(first.shape)
    size = sum(t.shape[dim] for t in operands)
    return replace(first, shape=first.shape[:dim] + (size,) + first.shape[dim + 1:])


def take(t: ArrayType, keys: Sequence[tuple[int, int] | None], axes: SizedAxes) -> ArrayType:
    """Static indexing: per dim ``(start, stop)`` of a unit-step slice, or ``None`` for an
    int index (the dim goes). A slice of a split dim keeps its axes where the result's
    size divides by them (``jax.jit``'s rule)."""
    sizes = dict(axes)
    shape, entries = [], []
    for dim, (size, entry) in enumerate(zip(t.shape, t.dims)):
        key = keys[dim] if dim < len(keys) else (0, size)
        if key is None:
            if entry:
                raise ShardingTypeError(
                    f"indexing dim {dim} of {str_type(t, axes)} at one position picks one "
                    "shard's element; reshard it unsplit first (meshstate.reshard)"
                )
            continue
        length = key[1] - key[0]
        parts = math.prod(sizes[axis] for axis in entry)
        if entry and length != size and length % parts:
            shown = entry[0] if len(entry) == 1 else "(" + ", ".join(entry) + ")"
            out_shape = tuple(k[1] - k[0] if k else None for k in keys if k is not None)
            raise ShardingTypeError(
                f"slicing on sharded dims where out dim ({length}) is not divisible by mesh "
                f"axes ({parts}) with spec ({shown}) is not implemented. Got input "
                f"type={str_type(t, axes, short=True)} and output shape={out_shape}"
            )
        shape.append(length)
        entries.append(entry)
    return replace(t, shape=tuple(shape), dims=tuple(entries))


def reshape(t: ArrayType, shape: Sequence[int], axes: SizedAxes) -> tuple[tuple[Entry, ...], ArrayType]:
    """JAX's reshape typing: the dims ``t`` must be laid out as first (merging moves the
    later dims' axes onto the first, an all-to-all) and the result's type. Merging needs
    the split dims to lead; a split dim gives its axes to the major pieces."""
    sizes = dict(axes)
    groups = _groups(t.shape, tuple(shape))
    if groups is None:
        _refuse_reshape(t, shape, axes)
    before: list[Entry] = []
    after: list[Entry] = []
    for old, new in groups or ():
        entries = [t.dims[dim] for dim in old]
        joint = tuple(axis for entry in entries for axis in entry)
        if not joint or not new or not old:
            before += [()] * len(old)
            after += [()] * len(new)
            continue
        if len(old) > 1 and len(new) > 1:
            _refuse_reshape(t, shape, axes)
        if len(old) > 1 and any(entries[i] == () and any(entries[i + 1:]) for i in range(len(old))):
            _refuse_reshape(t, shape, axes)
        old_sizes = [t.shape[dim] for dim in old]
        new_sizes = [shape[dim] for dim in new]
        laid = _spread(joint, old_sizes, sizes) if len(old) > 1 else [joint]
        spread = _spread(joint, new_sizes, sizes) if len(new) > 1 else [joint]
        if laid is None or spread is None:
            _refuse_reshape(t, shape, axes)
        before += laid or []
        after += spread or []
    return tuple(before), ArrayType(tuple(shape), t.dtype, tuple(after), t.unreduced)


def _spread(joint: Entry, pieces: Sequence[int], sizes: dict[str, int]) -> list[Entry] | None:
    """``joint``'s axes given to ``pieces`` major first, each as far as its size divides;
    ``None`` where they do not fit."""
    given: list[list[str]] = [[] for _ in pieces]
    piece, left = 0, pieces[0] if pieces else 1
    for axis in joint:
        while piece < len(pieces) and left % sizes[axis]:
            if left != 1:
                return None
            piece += 1
            left = pieces[piece] if piece < len(pieces) else 1
        if piece == len(pieces):
            return None
        given[piece].append(axis)
        left //= sizes[axis]
    return [tuple(entry) for entry in given]


def _groups(
    old: tuple[int, ...], new: tuple[int, ...]
) -> list[tuple[list[int], list[int]]] | None:
    """The dims of ``old`` and ``new`` that map onto each other, as consecutive groups of
    equal products (size-1 dims on their own)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(old) or j >= len(new):
            return None
        left, right = [i], [j]
        a, b = old[i], new[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                a *= old[i]
                left.append(i)
                i += 1
            else:
                b *= new[j]
                right.append(j)
                j += 1
        groups.append((left, right))
    return groups


def _refuse_reshape(t: ArrayType, shape: Sequence[int], axes: SizedAxes) -> None:
    raise ShardingTypeError(
        "This reshape is not supported. Please specify the sharding of the output via the "
        "`out_sharding` argument of jax.lax.reshape. Got operand type: "
        f"{str_type(t, axes)}, new sizes: {tuple(shape)}; here, meshstate.reshard the operand "
        "to a sharding this reshape keeps, or run it in meshstate.auto_axes"
    )
