"""How a planned op of JAX's Explicit axes runs on DTensors.

An op runs on the local blocks (:func:`on_blocks`: no DTensor propagation), or as
DTensor's own where autograd records it or a trace sees it (:func:`as_dtensor`); an op
seen before on the same layouts runs from the :data:`FAST` table without its plan
(:func:`run_fast`). Gradients reaching a leaf are laid out as the leaf (:func:`leaf_typed`).

Example (inside ``meshstate.explicit()``)::

    laid_out(x + y, plan.result)          # the result as JAX types it
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from meshstate.core import compat as _compat
from meshstate.jax.explicit.plans import OpPlan
from meshstate.jax.plan import contiguous_strides
from meshstate.jax.types.explicit import KEPT, suspended


def placed(view: DeviceMesh, operand: Any, placements: tuple[Placement, ...] | None) -> Any:
    """``operand`` laid out as ``placements`` (a plain tensor first made a replicated
    DTensor: the same value on every rank, as an unsharded JAX array)."""
    if placements is None or not isinstance(operand, torch.Tensor):
        return operand
    if not isinstance(operand, DTensor):
        operand = DTensor.from_local(operand, view, [Replicate()] * view.ndim, run_check=False)
    if tuple(operand.placements) != placements:
        operand = operand.redistribute(view, placements)
    return leaf_typed(operand)


def laid_out(result: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    if tuple(result.placements) != placements:
        result = result.redistribute(result.device_mesh, placements)
    return result


def leaf_typed(x: DTensor) -> DTensor:
    """``x``; a leaf that requires grad gets its gradient laid out as itself once it is
    accumulated, as JAX's cotangents carry their value's type (DTensor would leave a
    pending sum where the leaf was replicated over an axis that split the work)."""
    if x.is_leaf and x.requires_grad and not getattr(x, _TYPED_GRADIENT, False):
        if not _compat.tracing():
            x.register_post_accumulate_grad_hook(_lay_out_gradient)  # type: ignore[no-untyped-call]
            setattr(x, _TYPED_GRADIENT, True)
    return x


_TYPED_GRADIENT = "_meshstate_typed_gradient"


def _lay_out_gradient(leaf: torch.Tensor) -> None:
    leaf.grad = typed_like(leaf.grad, leaf)


def typed_like(grad: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor | None:
    """``grad`` laid out as ``value``, its primal: JAX's cotangent type."""
    if isinstance(grad, DTensor) and isinstance(value, DTensor):
        if tuple(grad.placements) != tuple(value.placements):
            return grad.redistribute(value.device_mesh, value.placements)
    return grad


def gradients(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.autograd.grad``: each gradient typed as its input, as ``.grad`` is after
    ``backward()`` and as JAX types a cotangent (DTensor would hand back a gradient
    gathered whole where the input was split)."""
    found = func(*args, **kwargs)
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple(typed_like(grad, value) for grad, value in zip(found, inputs, strict=True))


def requires_grad(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``requires_grad_``: the leaf's gradient will carry its type."""
    return leaf_typed(func(*args, **kwargs))


def view_of(args: Sequence[Any]) -> DeviceMesh:
    for value in args:
        if isinstance(value, DTensor):
            return value.device_mesh
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, DTensor):
                    return item.device_mesh
    raise AssertionError("a typed op without a DTensor operand")


def on_blocks(
    view: DeviceMesh, plan: OpPlan, operands: Sequence[Any], run: Callable[..., torch.Tensor]
) -> DTensor:
    """``run`` on the operands' local blocks (laid out as ``plan`` says first): the result's
    block, made a DTensor of the plan's result layout without asking DTensor's propagation,
    which enumerates every mesh dim's strategies (0.3 s a new op on a 4-D mesh)."""
    blocks = []
    for operand, placements, grads in zip(operands, plan.operands, plan.grads):
        if isinstance(operand, torch.Tensor) and placements is not None:
            operand = placed(view, operand, placements).to_local(grad_placements=grads)
        blocks.append(operand)
    return DTensor.from_local(run(*blocks), view, plan.result, run_check=False,
                              shape=torch.Size(plan.shape), stride=contiguous_strides(plan.shape))


class FastOp:
    """A typed op seen before with operands of the same layouts, eager, each operand laid
    out as the rule wants and the result as the op gives it. Nothing recorded: ``func`` on
    the local blocks, made a DTensor of the spec the first call's result had, reduced to
    ``final`` where JAX reduces (no rule, no DTensor propagation). Recorded for autograd
    (``spec`` None): DTensor's own op, whose cached dispatch and gradients are DTensor's."""

    def __init__(
        self, func: Callable[..., Any], view: DeviceMesh, spec: Any,
        final: tuple[Placement, ...] | None = None,
    ) -> None:
        self.func, self.view, self.spec, self.final = func, view, spec, final

    def __call__(self, args: tuple[Any, ...], blocks: list[Any]) -> DTensor:
        if self.spec is None:
            result = self.func(*args)
        else:
            result = _compat.dtensor_of(self.func(*blocks), self.spec, fresh=True)
        return result if self.final is None else laid_out(result, self.final)


FAST: dict[tuple[Any, ...], FastOp] = {}
"""The fast typed ops, by :func:`fast_key`; each checks its mesh is the operands' (one
destroyed and built again equal gets a new entry)."""


def fast_key(
    func: Callable[..., Any], args: tuple[Any, ...], head: object = None
) -> tuple[tuple[Any, ...], list[Any]] | None:
    """``func``, its operands' layouts (DTensor specs, a float's type, ints and tuples of
    ints as they are: dims) and whether autograd records the call, with the arguments a
    fast op takes (each DTensor's local block); ``None`` where the call cannot be fast
    (a plain tensor operand, a list). ``head`` stands for ``func`` in the key where the
    call is known by more than its function (a contraction by its equation and out_sharding)."""
    key: list[Any] = [func if head is None else head]
    blocks: list[Any] = []
    recorded = False
    for arg in args:
        if isinstance(arg, DTensor):
            recorded = recorded or arg.requires_grad
            spec, block = _compat.spec_and_block(arg)
            key.append(spec)
            blocks.append(block)
            continue
        if isinstance(arg, float):
            key.append(float)
        elif isinstance(arg, int) or (isinstance(arg, tuple) and all(type(a) is int for a in arg)):
            key.append(arg)
        else:
            return None
        blocks.append(arg)
    key.append(recorded and torch.is_grad_enabled())
    return tuple(key), blocks


def run_fast(
    func: Callable[..., Any], args: tuple[Any, ...], view: DeviceMesh, head: object = None
) -> Any:
    """``func(*args)`` as a fast op (kept under ``head``, see :func:`fast_key`), or
    :data:`NOT_FAST`."""
    found = fast_key(func, args, head)
    if found is None:
        return NOT_FAST
    op = FAST.get(found[0])
    if op is None or op.view is not view:
        return NOT_FAST
    return op(args, found[1])


NOT_FAST = object()


def through_dtensor(args: Sequence[Any]) -> bool:
    """Whether an op of ``args`` runs as DTensor's own: where autograd records it, and while
    tracing (so the graph is the DTensor op's, and DTensor's propagation runs once, there)."""
    return _compat.tracing() or torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def as_dtensor(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], view: DeviceMesh,
    plan: OpPlan, final: tuple[Placement, ...],
) -> DTensor:
    """An op autograd records or a trace sees: DTensor's own, on operands laid out as the rule wants (so its
    sharding propagation finds the layout that moves nothing), its result laid out as JAX
    types it; kept fast where the operands came so laid out and DTensor gave that layout."""
    count = len(plan.operands)
    moved = tuple(placed(view, a, p) for a, p in zip(args, plan.operands)) + args[count:]
    with suspended():
        given = func(*moved, **kwargs)
    result = laid_out(given, final)
    if _compat.tracing():
        return result
    as_planned = tuple(given.placements) in (plan.result, final)
    if not kwargs and as_planned and all(m is a for m, a in zip(moved, args)):
        found = fast_key(func, args)
        if found is not None:
            keep_fast(found[0], FastOp(func, view, None, None if final == plan.result else final))
    return result


def remember_fast(
    func: Callable[..., Any], args: tuple[Any, ...], plan: OpPlan, result: DTensor,
    final: tuple[Placement, ...], head: object = None,
) -> None:
    """Keep ``func`` on these layouts fast (under ``head``, see :func:`fast_key`), where
    nothing is recorded and the operands came laid out as the rule wants."""
    if _compat.tracing():
        return
    found = fast_key(func, args, head)
    if found is None or any(
        isinstance(a, DTensor) and tuple(a.placements) != p for a, p in zip(args, plan.operands)
    ):
        return
    local = _compat.local_tensor(result)
    spec = _compat.even_spec(result.device_mesh, plan.result, local)
    if _compat.dtensor_of(local, spec).shape == result.shape:  # an even layout
        keep_fast(found[0], FastOp(func, result.device_mesh, spec,
                                     None if final == plan.result else final))


def keep_fast(key: tuple[Any, ...], op: FastOp) -> None:
    if len(FAST) >= KEPT:
        FAST.clear()
    FAST[key] = op
