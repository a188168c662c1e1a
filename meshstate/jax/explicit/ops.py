"""The torch ops that JAX's Explicit axes type, each handled as JAX lays it out.

Each handler asks :mod:`~meshstate.jax.explicit.plans` for the result's type (a plan
made once per op and operand layouts, a constant to ``torch.compile``), moves its
operands only where JAX moves them (a one-sided contracting split gathered, a
replicated operand cut locally to the result's blocks, a dim about to be merged or
sliced), runs the op (:mod:`~meshstate.jax.explicit.runs`) and lays the result out as
the type says (a reduction's partial sum reduced at once). A refusal is raised before
any operand moves.

Example (inside ``meshstate.explicit()``)::

    HANDLERS[kind_of(torch.Tensor.__add__)]      # elementwise: x + y typed
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import resolve_name

from meshstate.core import compat as _compat
from meshstate.jax.explicit.plans import (
    contraction_plan,
    elementwise_plan,
    jax_name,
    layout_of,
    name_of,
    reduction_plan,
    refuse_if,
    reshape_plan,
    shape_plan,
)
from meshstate.jax.explicit.runs import (
    NOT_FAST,
    FastOp,
    as_dtensor,
    gradients,
    fast_key,
    keep_fast,
    laid_out,
    leaf_typed,
    on_blocks,
    placed,
    remember_fast,
    requires_grad,
    run_fast,
    through_dtensor,
    view_of,
)
from meshstate.jax.plan import contiguous_strides
from meshstate.jax.sharding import P, entry_axes
from meshstate.jax.types.explicit import ShardingTypeError, typeof


def elementwise(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An elementwise op (unary, binary with broadcasting and scalars, in place)."""
    view = view_of(args)
    plan = elementwise_plan(jax_name(func), view, tuple(layout_of(a) for a in args))
    refuse_if(plan.error)
    if _writes(func) and isinstance(args[0], DTensor) and tuple(args[0].placements) != plan.result:
        raise ShardingTypeError(
            f"{name_of(func)} writes a {typeof(args[0])} value but the result would be "
            f"laid out as {plan.result}; write the result to a new value"
        )
    if _writes(func):
        moved = args[:1] + tuple(placed(view, a, p) for a, p in zip(args[1:], plan.operands[1:]))
        return laid_out(func(*moved, **kwargs), plan.result)
    if through_dtensor(args):
        return as_dtensor(func, args, kwargs, view, plan, plan.result)
    result = on_blocks(view, plan, args, lambda *blocks: func(*blocks, **kwargs))
    if not kwargs:
        remember_fast(func, args, plan, result, plan.result)
    return result


@_compat.constant_when_traced
def _writes(func: Callable[..., Any]) -> bool:
    name: str = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


@_compat.constant_when_traced
def matmul_equation(lhs_ndim: int, rhs_ndim: int) -> str:
    """``a @ b`` as an einsum equation (numpy's matmul: a 1-D operand loses its dim), made
    once per pair of ranks. Example: ``matmul_equation(2, 2)`` is ``"xy,yz->xz"``."""
    key = (lhs_ndim, rhs_ndim)
    found = _MATMUL_EQUATIONS.get(key)
    if found is None:
        letters = "abcdefghijklmnopqrstuvw"
        batch = letters[:max(max(lhs_ndim, rhs_ndim) - 2, 0)]
        left = batch[len(batch) - max(lhs_ndim - 2, 0):] + ("xy" if lhs_ndim > 1 else "y")
        right = batch[len(batch) - max(rhs_ndim - 2, 0):] + ("yz" if rhs_ndim > 1 else "y")
        out = batch + ("x" if lhs_ndim > 1 else "") + ("z" if rhs_ndim > 1 else "")
        found = _MATMUL_EQUATIONS[key] = f"{left},{right}->{out}"
    return found


_MATMUL_EQUATIONS: dict[tuple[int, int], str] = {}


def full_equation(equation: str, operands: Sequence[torch.Tensor]) -> str:
    """``equation`` with its output written out (numpy's implicit mode: the labels seen
    once, sorted); only two operands, as JAX's ``dot_general`` takes."""
    if len(operands) != 2:
        raise ShardingTypeError(
            f"einsum of {len(operands)} operands on explicitly sharded values: JAX types "
            "contractions of two; write it as several einsums"
        )
    equation = equation.replace(" ", "")
    if "->" in equation:
        return equation
    labels = equation.replace(",", "")
    return f"{equation}->{''.join(sorted(l for l in set(labels) if labels.count(l) == 1))}"


def matmul(a: torch.Tensor, b: torch.Tensor, out_sharding: P | None = None) -> DTensor:
    """``a @ b`` typed, resharded to ``out_sharding`` (JAX's ``jnp.matmul(a, b,
    out_sharding=...)``): any spec, or the contracting axes ``unreduced`` to keep the sum
    pending. Example: ``matmul(x, w, out_sharding=P("dp", None))``."""
    return contracted(None, (a, b), out_sharding, torch.matmul, matmul=True)


def einsum(equation: str, *operands: torch.Tensor, out_sharding: P | None = None) -> DTensor:
    """``torch.einsum(equation, *operands)`` of two operands, typed as JAX's ``dot_general``
    and resharded to ``out_sharding``. Example: ``einsum("ij,jk->ik", x, w)``."""
    return contracted(
        full_equation(equation, operands), tuple(operands), out_sharding,
        functools.partial(torch.einsum, equation), matmul=False,
    )


def contracted(
    equation: str | None, operands: tuple[torch.Tensor, ...], out_sharding: P | None,
    run: Callable[..., Any], matmul: bool,
) -> DTensor:
    """``run(*operands)``, a contraction of ``equation`` (``None``: ``a @ b``'s), typed as
    JAX's ``dot_general`` (called as ``meshstate.matmul``, with the explicit mode on: it
    runs with no torch function, which would see each read and op of its own)."""
    with _compat.torch_functions_off():
        if equation is None:
            equation = matmul_equation(operands[0].dim(), operands[1].dim())
        return _contracted(equation, operands, out_sharding, run, matmul)


def _contracted(
    equation: str, operands: tuple[torch.Tensor, ...], out_sharding: P | None,
    run: Callable[..., Any], matmul: bool,
) -> DTensor:
    view = view_of(operands)
    out = None if out_sharding is None else (
        tuple(entry_axes(e) for e in out_sharding.dims), out_sharding.unreduced)
    head = ("contraction", equation, out, matmul)  # a fast op's key, in place of ``run``
    if not _compat.tracing() and not through_dtensor(operands):
        known = run_fast(run, operands, view, head)
        if known is not NOT_FAST:
            return known  # type: ignore[no-any-return]
    plan = contraction_plan(equation, view, tuple(layout_of(x) for x in operands), out, matmul)
    refuse_if(plan.error)
    if through_dtensor(operands):
        return as_dtensor(run, operands, {}, view, plan, plan.final)
    result = on_blocks(view, plan, operands, run)
    remember_fast(run, operands, plan, result, plan.final, head)
    return laid_out(result, plan.final)


def _matmul(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a, b = args[:2]
    if func is _T.__rmatmul__:
        a, b = b, a
    equation = matmul_equation(a.dim(), b.dim())
    view = view_of((a, b))
    plan = contraction_plan(equation, view, (layout_of(a), layout_of(b)), None, True)
    refuse_if(plan.error)
    if through_dtensor((a, b)):
        return as_dtensor(func, args, kwargs, view, plan, plan.final)
    result = contracted(equation, (a, b), None, torch.matmul, True)
    if not kwargs:
        remember_fast(func, args, plan, result, plan.final)
    return result


def _einsum(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return contracted(full_equation(equation, operands), tuple(operands), None,
                      lambda *xs: torch.einsum(equation, *xs), False)


def _reduction(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A reduction, reduced at once over the split dims it reduces: on the local block and
    then all-reduced where nothing is recorded for autograd, else DTensor's op (whose
    gradients a partial max or mean of blocks would not give)."""
    x = args[0]
    given = {**dict(zip(("dim", "keepdim"), args[1:])), **kwargs}
    dim = given.get("dim")
    if func in _WITH_INDICES and dim is not None:
        raise ShardingTypeError(
            f"{name_of(func)}(x, dim) on an explicitly sharded value gives indices, which "
            "JAX's Explicit axes do not type; take torch.amax/amin (the values), or "
            "reshard first (meshstate.reshard)")
    dims = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    name = jax_name(func).removeprefix("a")
    plan = reduction_plan(name, x.device_mesh, layout_of(x), dims, bool(given.get("keepdim", False)))
    refuse_if(plan.error)
    if _compat.recorded_or_traced(x):
        return laid_out(func(leaf_typed(x), *args[1:], **kwargs), plan.final)
    local = func(_compat.local_tensor(x), *args[1:], **kwargs)
    spec = _compat.even_spec(x.device_mesh, plan.result, local)
    found = None if kwargs else fast_key(func, args)
    if found is not None:
        keep_fast(found[0], FastOp(func, x.device_mesh, spec, plan.final))
    return laid_out(_compat.dtensor_of(local, spec), plan.final)


def _reshape(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if "flatten" in name_of(func):
        given = {**dict(zip(("start_dim", "end_dim"), args[1:])), **kwargs}
        start, end = given.get("start_dim", 0) % max(x.dim(), 1), given.get("end_dim", -1) % max(x.dim(), 1)
        requested: list[int] = [*x.shape[:start], math.prod(x.shape[start:end + 1]), *x.shape[end + 1:]]
    else:
        sizes = args[1:] if len(args) > 2 or not isinstance(args[1], (list, tuple, torch.Size)) else args[1]
        requested = list(sizes) if sizes else list(kwargs.get("shape", ()))
    if -1 in requested:
        known = math.prod(size for size in requested if size != -1)
        requested[requested.index(-1)] = x.numel() // max(known, 1)
    shape = tuple(requested)
    plan = reshape_plan(x.device_mesh, layout_of(x), shape)
    refuse_if(plan.error)
    moved = placed(x.device_mesh, x, plan.operands[0])
    local = moved.to_local().reshape(plan.local_shape)
    return DTensor.from_local(local, x.device_mesh, plan.result, run_check=False,
                              shape=torch.Size(shape), stride=contiguous_strides(shape))


def _permute(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, name = args[0], name_of(func)
    order = list(range(x.dim()))
    if name.endswith(("transpose", "swapaxes", "swapdims")):
        d0, d1 = (a % x.dim() for a in args[1:3])
        order[d0], order[d1] = order[d1], order[d0]
    elif name.endswith("permute"):
        order = list(args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    else:  # t, T, mT
        order = order[:-2] + order[-2:][::-1]
    if not name.endswith("__get__"):
        return _shaped(func, args, kwargs, "permute", tuple(order))
    # .T and .mT as torch.permute: a property's getter called by hand is what torch.compile
    # cannot trace.
    result = _shaped(torch.permute, (x, tuple(order)), {}, "permute", tuple(order))
    plan = shape_plan("permute", x.device_mesh, (layout_of(x),), tuple(order))
    if not through_dtensor(args):
        remember_fast(func, args, plan, result, plan.result)
    return result


def _unsqueeze(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _shaped(func, args, kwargs, "unsqueeze", (args[1] if len(args) > 1 else kwargs["dim"],))


def _cat(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    view = view_of(tensors)
    plan = shape_plan("cat", view, tuple(layout_of(t) for t in tensors), (dim,))
    refuse_if(plan.error)
    moved = [placed(view, t, p) for t, p in zip(tensors, plan.operands)]
    return laid_out(func(moved, dim), plan.result)


def _getitem(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, key = args
    keys = _static_keys(x, key)
    return _shaped(func, args, kwargs, "take", keys)


def _static_keys(x: torch.Tensor, key: Any) -> tuple[tuple[int, int] | None, ...]:
    items = key if isinstance(key, tuple) else (key,)
    keys: list[tuple[int, int] | None] = []
    for dim, item in enumerate(items):
        if isinstance(item, int) and not isinstance(item, bool):
            keys.append(None)
        elif isinstance(item, slice) and item.step in (None, 1):
            start, stop, _ = item.indices(x.shape[dim])
            keys.append((start, max(start, stop)))
        else:
            raise ShardingTypeError(
                f"indexing an explicitly sharded value with {item!r}: JAX's Explicit axes type "
                "static slices and ints here; reshard first (meshstate.reshard)"
            )
    return tuple(keys)


def _shaped(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            kind: str, arguments: tuple[Any, ...]) -> Any:
    x = args[0]
    plan = shape_plan(kind, x.device_mesh, (layout_of(x),), arguments)
    refuse_if(plan.error)
    if kind in ("permute", "unsqueeze") and through_dtensor(args):
        return as_dtensor(func, args, kwargs, x.device_mesh, plan, plan.result)
    if kind in ("permute", "unsqueeze"):  # a view of each block
        result = on_blocks(x.device_mesh, plan, [x], lambda block: func(block, *args[1:], **kwargs))
        if not kwargs:
            remember_fast(func, args, plan, result, plan.result)
        return result
    moved = placed(x.device_mesh, x, plan.operands[0])
    return laid_out(func(moved, *args[1:], **kwargs), plan.result)


# --- the table --------------------------------------------------------------------------

_T = torch.Tensor
_INDEX = getattr(_T.__getitem__, "__wrapped__", _T.__getitem__)
"""torch's own indexing, also where this module is first imported inside a simulated
world (whose indexing says what it wraps)."""
_UNARY: list[Callable[..., Any]] = [torch.sin, torch.cos, torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.relu,
          torch.sqrt, torch.rsqrt, torch.abs, torch.neg, torch.square, torch.nn.functional.gelu,
          torch.nn.functional.relu, torch.nn.functional.silu, torch.nn.functional.sigmoid,
          _T.sin, _T.cos, _T.exp, _T.log, _T.tanh, _T.sigmoid, _T.relu, _T.sqrt, _T.rsqrt,
          _T.abs, _T.neg, _T.__neg__, _T.square, _T.clone, _T.contiguous, _T.to, _T.float,
          _T.double, _T.half, _T.bfloat16, _T.type_as]


_BINARY: list[Callable[..., Any]] = [torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.maximum,
           torch.minimum, torch.pow, torch.where, _T.add, _T.sub, _T.mul, _T.div, _T.pow,
           _T.maximum, _T.minimum, _T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__,
           _T.__mul__, _T.__rmul__, _T.__truediv__, _T.__rtruediv__, _T.__pow__, _T.__rpow__,
           _T.add_, _T.sub_, _T.mul_, _T.div_, _T.__iadd__, _T.__isub__, _T.__imul__,
           _T.__itruediv__]


_WITH_INDICES: tuple[Callable[..., Any], ...] = (torch.max, torch.min, _T.max, _T.min)
"""Reductions that, given a dim, also give indices: typed only over every dim."""


_REDUCTIONS: list[Callable[..., Any]] = [
    torch.sum, torch.mean, torch.amax, torch.amin, _T.sum, _T.mean, _T.amax, _T.amin,
    *_WITH_INDICES]


_RESHAPES: list[Callable[..., Any]] = [torch.reshape, torch.flatten, _T.reshape, _T.view, _T.flatten]


_PERMUTES: list[Callable[..., Any]] = [torch.permute, torch.transpose, torch.t, _T.permute, _T.transpose, _T.t,
             _T.T.__get__, _T.mT.__get__]  # type: ignore[attr-defined]


_KINDS: dict[Callable[..., Any], str] = {
    **dict.fromkeys(_UNARY + _BINARY, "elementwise"),
    **dict.fromkeys([torch.matmul, torch.mm, torch.bmm, _T.matmul, _T.mm, _T.bmm,
                     _T.__matmul__, _T.__rmatmul__], "matmul"),
    torch.einsum: "einsum",
    **dict.fromkeys(_REDUCTIONS, "reduction"),
    **dict.fromkeys(_RESHAPES, "reshape"),
    **dict.fromkeys(_PERMUTES, "permute"),
    **dict.fromkeys([torch.unsqueeze, _T.unsqueeze], "unsqueeze"),
    **dict.fromkeys([torch.cat, torch.concat, torch.concatenate], "cat"),
    _INDEX: "getitem",
    _T.requires_grad_: "requires_grad",
    **dict.fromkeys([
        _T.size, _T.dim, _T.numel, _T.stride, _T.__len__, _T.backward,
        _T.retain_grad, _T.register_hook, _T.__repr__, _T.__format__, _T.detach,
        _T.is_contiguous, _T.element_size, _T.data_ptr, _T.__hash__, _T.storage_offset,
        _T.untyped_storage, _T._is_view, _T.is_complex, _T.is_floating_point, _T.is_conj,
        _T.is_neg, _T.as_strided,  # as_strided: how a compiled function rebuilds a view it returns
        torch.autograd.backward], "passes"),
    torch.autograd.grad: "gradients",
}
"""Each torch function JAX's Explicit axes type here, by its kind (torch's own functions);
``passes``: those that read a value without computing on it (and autograd)."""


_BY_NAME = {resolve_name(func): kind for func, kind in _KINDS.items() if resolve_name(func)}


@_compat.constant_when_traced
def kind_of(func: Callable[..., Any]) -> str:
    """The kind of torch function ``func`` (by itself, its name, or what it wraps: a
    simulated world's replacement), ``passes`` for a property read, else ``untyped``;
    found once per function (torch's name lookup costs 10 us)."""
    found = _KINDS.get(func) or _FOUND.get(func)
    if found is None:
        name = resolve_name(func) or ""
        found = _BY_NAME.get(name) or _KINDS.get(getattr(func, "__wrapped__", None))  # type: ignore[arg-type]
        found = found or ("passes" if name.endswith((".__get__", ".__set__")) else "untyped")
        _FOUND[func] = found
    return found


_FOUND: dict[Callable[..., Any], str] = {}
"""The kinds :func:`kind_of` found by name, by function."""


HANDLERS: dict[str, Callable[..., Any]] = {
    "elementwise": elementwise, "matmul": _matmul, "einsum": _einsum, "reduction": _reduction,
    "reshape": _reshape, "permute": _permute, "unsqueeze": _unsqueeze, "cat": _cat,
    "getitem": _getitem, "requires_grad": requires_grad, "gradients": gradients,
}
"""Each kind's handler."""
