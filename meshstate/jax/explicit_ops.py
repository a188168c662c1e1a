"""The torch ops that JAX's Explicit axes type, each run on DTensors as JAX lays it out.

Each handler asks :mod:`meshstate.jax.explicit_rules` for the result's type (a
plan made once per op and operand layouts, a constant to ``torch.compile``),
moves its operands only where JAX moves them (a one-sided contracting split
gathered, a replicated operand cut locally to the result's blocks, a dim about
to be merged or sliced), runs DTensor's op and lays the result out as the type
says (a reduction's partial sum reduced at once). A refusal is raised before any
operand moves.

Example (inside ``meshstate.explicit()``, mesh ``(dp, tp) = (2, 4)``)::

    HANDLERS[torch.Tensor.__add__]      # the elementwise handler: x + y typed
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.overrides import resolve_name

from meshstate.core import compat as _compat
from meshstate.jax import explicit_rules as rules
from meshstate.jax.explicit_rules import ArrayType, ShardingTypeError
from meshstate.jax.plan import contiguous_strides
from meshstate.jax.reshard import spec_of
from meshstate.jax.sharding import P, to_placements

Layout = tuple[tuple[Placement, ...] | None, tuple[int, ...], str] | None
"""An operand as a plan sees it: its placements (``None``: a plain tensor, replicated),
shape and dtype name; ``None`` for a Python number."""


class ExplicitState(threading.local):
    """The explicit mode running in this thread, if any (torch keeps modes per thread),
    and whether it is set aside (inside ``auto_axes``, or while a typed op runs)."""

    def __init__(self) -> None:
        self.mode: Any = None
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@_compat.constant_when_traced
def axes_of(view: DeviceMesh) -> rules.Axes:
    """``view``'s axes and sizes in mesh order."""
    return tuple(zip(view.mesh_dim_names or (), view.shape))


def array_type(x: DTensor) -> ArrayType:
    """The JAX type of DTensor ``x``, worked out once per placements, shape and dtype."""
    return _type_of(x.device_mesh, tuple(x.placements), tuple(x.shape), dtype_name(x.dtype))


@_compat.constant_when_traced
def _type_of(
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
        dims = tuple(_entry(spec.dims[d]) if d < len(spec.dims) else () for d in range(len(shape)))
        pending = frozenset(n for n, p in zip(names, placements) if p.is_partial())
        found = _TYPES[key] = ArrayType(shape, dtype, dims, pending)
    return found


_TYPES: dict[tuple[Any, ...], ArrayType] = {}


def _entry(entry: object) -> rules.Entry:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)  # type: ignore[arg-type]


def placements_of(view: DeviceMesh, dims: Sequence[rules.Entry], unreduced: frozenset[str]) -> tuple[Placement, ...]:
    return to_placements(P(*(entry or None for entry in dims), unreduced=unreduced), view)


def _layout(value: Any) -> Layout:
    if isinstance(value, DTensor):
        return tuple(value.placements), tuple(value.shape), dtype_name(value.dtype)
    if isinstance(value, torch.Tensor):
        return None, tuple(value.shape), dtype_name(value.dtype)
    return None


@dataclass(frozen=True)
class _Plan:
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


def _with_grads(plan: _Plan) -> _Plan:
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


def _planned(make: Callable[[], _Plan]) -> _Plan:
    try:
        return make()
    except ShardingTypeError as refusal:
        return _Plan(error=str(refusal))


def _refuse_if(error: str) -> None:
    """Raise JAX's refusal ``error`` where there is one: while tracing too, where
    ``torch.compile`` lets it out as itself, or under ``fullgraph=True`` inside its
    "Observed exception" error, which quotes it."""
    if error:
        raise ShardingTypeError(error)


def _typed(view: DeviceMesh, operand: Any, placements: tuple[Placement, ...] | None) -> Any:
    """``operand`` laid out as ``placements`` (a plain tensor first made a replicated
    DTensor: the same value on every rank, as an unsharded JAX array)."""
    if placements is None or not isinstance(operand, torch.Tensor):
        return operand
    if not isinstance(operand, DTensor):
        operand = DTensor.from_local(operand, view, [Replicate()] * view.ndim, run_check=False)
    if tuple(operand.placements) != placements:
        operand = operand.redistribute(view, placements)
    return _leaf_typed(operand)


def _laid_out(result: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    if tuple(result.placements) != placements:
        result = result.redistribute(result.device_mesh, placements)
    return result


def _leaf_typed(x: DTensor) -> DTensor:
    """``x``; a leaf that requires grad gets its gradient laid out as itself once it is
    accumulated, as JAX's cotangents carry their value's type (DTensor would leave a
    pending sum where the leaf was replicated over an axis that split the work)."""
    if x.is_leaf and x.requires_grad and not getattr(x, _TYPED_GRADIENT, False):
        if not torch.compiler.is_compiling():
            x.register_post_accumulate_grad_hook(_lay_out_gradient)  # type: ignore[no-untyped-call]
            setattr(x, _TYPED_GRADIENT, True)
    return x


_TYPED_GRADIENT = "_meshstate_typed_gradient"


def _lay_out_gradient(leaf: torch.Tensor) -> None:
    grad = leaf.grad
    if isinstance(grad, DTensor) and isinstance(leaf, DTensor):
        if tuple(grad.placements) != tuple(leaf.placements):
            leaf.grad = grad.redistribute(leaf.device_mesh, leaf.placements)


def _requires_grad(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``requires_grad_``: the leaf's gradient will carry its type."""
    return _leaf_typed(func(*args, **kwargs))


def _view_of(args: Sequence[Any]) -> DeviceMesh:
    for value in args:
        if isinstance(value, DTensor):
            return value.device_mesh
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, DTensor):
                    return item.device_mesh
    raise AssertionError("a typed op without a DTensor operand")


# --- elementwise -------------------------------------------------------------------

_JAX_NAMES = {"truediv": "div", "true_divide": "div", "divide": "div", "multiply": "mul",
              "subtract": "sub", "maximum": "max", "minimum": "min", "negative": "neg",
              "rsub": "sub", "rtruediv": "div", "rdiv": "div", "to": "convert_element_type"}


@_compat.constant_when_traced
def name_of(func: Callable[..., Any]) -> str:
    """``func``'s name as torch writes it: ``torch.Tensor.__add__``, ``torch.sin``."""
    return resolve_name(func) or str(getattr(func, "__name__", func))


@_compat.constant_when_traced
def _jax_name(func: Callable[..., Any]) -> str:
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
def _elementwise_plan(name: str, view: DeviceMesh, layouts: tuple[Layout, ...]) -> _Plan:
    def make() -> _Plan:
        axes = axes_of(view)
        types = [None if layout is None else _type_of(view, *layout) for layout in layouts]
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
        return _with_grads(_Plan(tuple(operands), placements_of(view, result.dims, result.unreduced),
                                 shape=result.shape))
    return _planned(make)


def _on_blocks(
    view: DeviceMesh, plan: _Plan, operands: Sequence[Any], run: Callable[..., torch.Tensor]
) -> DTensor:
    """``run`` on the operands' local blocks (laid out as ``plan`` says first): the result's
    block, made a DTensor of the plan's result layout without asking DTensor's propagation,
    which enumerates every mesh dim's strategies (0.3 s a new op on a 4-D mesh)."""
    blocks = []
    for operand, placements, grads in zip(operands, plan.operands, plan.grads):
        if isinstance(operand, torch.Tensor) and placements is not None:
            operand = _typed(view, operand, placements).to_local(grad_placements=grads)
        blocks.append(operand)
    return DTensor.from_local(run(*blocks), view, plan.result, run_check=False,
                              shape=torch.Size(plan.shape), stride=contiguous_strides(plan.shape))


class _FastOp:
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
        return result if self.final is None else _laid_out(result, self.final)


FAST: dict[tuple[Any, ...], _FastOp] = {}
"""The fast typed ops, by :func:`fast_key`; each checks its mesh is the operands' (one
destroyed and built again equal gets a new entry)."""
FAST_KEPT = 1024
"""Past this many fast ops (shapes vary, say with sequence length) the table starts over."""


def fast_key(
    func: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[tuple[Any, ...], list[Any]] | None:
    """``func``, its operands' layouts (DTensor specs, a float's type, ints and tuples of
    ints as they are: dims) and whether autograd records the call, with the arguments a
    fast op takes (each DTensor's local block); ``None`` where the call cannot be fast
    (a plain tensor operand, a list)."""
    key: list[Any] = [func]
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


def run_fast(func: Callable[..., Any], args: tuple[Any, ...], view: DeviceMesh) -> Any:
    """``func(*args)`` as a fast op, or :data:`NOT_FAST`."""
    found = fast_key(func, args)
    if found is None:
        return NOT_FAST
    op = FAST.get(found[0])
    if op is None or op.view is not view:
        return NOT_FAST
    return op(args, found[1])


NOT_FAST = object()


def _through_dtensor(args: Sequence[Any]) -> bool:
    """Whether an op of ``args`` runs as DTensor's own: where autograd records it, and while
    tracing (so the graph is the DTensor op's, and DTensor's propagation runs once, there)."""
    return torch.compiler.is_compiling() or torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _as_dtensor(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], view: DeviceMesh,
    plan: _Plan, final: tuple[Placement, ...],
) -> DTensor:
    """An op autograd records or a trace sees: DTensor's own, on operands laid out as the rule wants (so its
    sharding propagation finds the layout that moves nothing), its result laid out as JAX
    types it; kept fast where the operands came so laid out and DTensor gave that layout."""
    count = len(plan.operands)
    moved = tuple(_typed(view, a, p) for a, p in zip(args, plan.operands)) + args[count:]
    with suspended():
        given = func(*moved, **kwargs)
    result = _laid_out(given, final)
    if torch.compiler.is_compiling():
        return result
    as_planned = tuple(given.placements) in (plan.result, final)
    if not kwargs and as_planned and all(m is a for m, a in zip(moved, args)):
        found = fast_key(func, args)
        if found is not None:
            _keep_fast(found[0], _FastOp(func, view, None, None if final == plan.result else final))
    return result


def _remember_fast(
    func: Callable[..., Any], args: tuple[Any, ...], plan: _Plan, result: DTensor,
    final: tuple[Placement, ...],
) -> None:
    """Keep ``func`` on these layouts fast, where nothing is recorded and the operands came
    laid out as the rule wants."""
    if torch.compiler.is_compiling():
        return
    found = fast_key(func, args)
    if found is None or any(
        isinstance(a, DTensor) and tuple(a.placements) != p for a, p in zip(args, plan.operands)
    ):
        return
    local = _compat.local_tensor(result)
    spec = _compat.even_spec(result.device_mesh, plan.result, local)
    if _compat.dtensor_of(local, spec).shape == result.shape:  # an even layout
        _keep_fast(found[0], _FastOp(func, result.device_mesh, spec,
                                     None if final == plan.result else final))


def _keep_fast(key: tuple[Any, ...], op: _FastOp) -> None:
    if len(FAST) >= FAST_KEPT:
        FAST.clear()
    FAST[key] = op


def elementwise(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An elementwise op (unary, binary with broadcasting and scalars, in place)."""
    view = _view_of(args)
    plan = _elementwise_plan(_jax_name(func), view, tuple(_layout(a) for a in args))
    _refuse_if(plan.error)
    if _writes(func) and isinstance(args[0], DTensor) and tuple(args[0].placements) != plan.result:
        raise ShardingTypeError(
            f"{name_of(func)} writes a {_text(args[0])} value but the result would be "
            f"laid out as {plan.result}; write the result to a new value"
        )
    if _writes(func):
        moved = args[:1] + tuple(_typed(view, a, p) for a, p in zip(args[1:], plan.operands[1:]))
        return _laid_out(func(*moved, **kwargs), plan.result)
    if _through_dtensor(args):
        return _as_dtensor(func, args, kwargs, view, plan, plan.result)
    result = _on_blocks(view, plan, args, lambda *blocks: func(*blocks, **kwargs))
    if not kwargs:
        _remember_fast(func, args, plan, result, plan.result)
    return result


@_compat.constant_when_traced
def _writes(func: Callable[..., Any]) -> bool:
    name: str = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _text(x: DTensor) -> str:
    return rules.str_type(array_type(x), axes_of(x.device_mesh))


# --- contractions --------------------------------------------------------------------

@_compat.constant_when_traced
def _contraction_plan(
    equation: str, view: DeviceMesh, layouts: tuple[Layout, ...],
    out: tuple[tuple[rules.Entry, ...], frozenset[str]] | None, matmul: bool,
) -> _Plan:
    def make() -> _Plan:
        axes = axes_of(view)
        lhs, rhs = (_type_of(view, *layout) for layout in layouts if layout is not None)
        c = rules.contract(equation, lhs, rhs, out, axes, matmul)
        operands = tuple(placements_of(view, dims, frozenset()) for dims in c.operands)
        natural = placements_of(view, c.natural.dims, c.natural.unreduced)
        result = placements_of(view, c.result.dims, c.result.unreduced)
        return _with_grads(_Plan(operands, natural, shape=c.natural.shape, final=result))
    return _planned(make)


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


def contracted(
    equation: str, operands: tuple[torch.Tensor, ...], out_sharding: P | None,
    run: Callable[..., Any], matmul: bool,
) -> DTensor:
    """``run(*operands)``, a contraction of ``equation``, typed as JAX's ``dot_general``
    (called as ``meshstate.matmul``, with the explicit mode on: DTensor's redistribution
    runs with no torch function, which would see each of its ops)."""
    with _compat.torch_functions_off():
        return _contracted(equation, operands, out_sharding, run, matmul)


def _contracted(
    equation: str, operands: tuple[torch.Tensor, ...], out_sharding: P | None,
    run: Callable[..., Any], matmul: bool,
) -> DTensor:
    view = _view_of(operands)
    out = None if out_sharding is None else (
        tuple(_entry(e) for e in out_sharding.dims), out_sharding.unreduced)
    key = None
    if not torch.compiler.is_compiling() and not _through_dtensor(operands):
        found = fast_key(run, operands)
        key = None if found is None else (equation, out, matmul, found[0][1:])
        known = _CONTRACTIONS.get(key) if key is not None else None
        if known is not None and known.view is view:
            return known(operands, found[1])  # type: ignore[index]
    plan = _contraction_plan(equation, view, tuple(_layout(x) for x in operands), out, matmul)
    _refuse_if(plan.error)
    if _through_dtensor(operands):
        return _as_dtensor(run, operands, {}, view, plan, plan.final)
    result = _on_blocks(view, plan, operands, run)
    if not torch.compiler.is_compiling() and key is not None and all(
            isinstance(x, DTensor) and tuple(x.placements) == p
            for x, p in zip(operands, plan.operands)):
        spec = _compat.even_spec(view, plan.result, _compat.local_tensor(result))
        if len(_CONTRACTIONS) >= FAST_KEPT:
            _CONTRACTIONS.clear()
        _CONTRACTIONS[key] = _FastOp(run, view, spec, None if plan.final == plan.result else plan.final)
    return _laid_out(result, plan.final)


_CONTRACTIONS: dict[tuple[Any, ...], _FastOp] = {}
"""The contractions ``meshstate.matmul``/``einsum`` ran before on operands laid out as the
rule wants, by equation, out_sharding and the operands' layouts (as :data:`FAST`)."""


def _matmul(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a, b = args[:2]
    if func is _T.__rmatmul__:
        a, b = b, a
    equation = rules.matmul_equation(a.dim(), b.dim())
    view = _view_of((a, b))
    plan = _contraction_plan(equation, view, (_layout(a), _layout(b)), None, True)
    _refuse_if(plan.error)
    if _through_dtensor((a, b)):
        return _as_dtensor(func, args, kwargs, view, plan, plan.final)
    result = contracted(equation, (a, b), None, torch.matmul, True)
    if not kwargs:
        _remember_fast(func, args, plan, result, plan.final)
    return result


def _einsum(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return contracted(full_equation(equation, operands), tuple(operands), None,
                      lambda *xs: torch.einsum(equation, *xs), False)


# --- reductions, shapes ---------------------------------------------------------------

_REDUCE_OPS = {"sum": "sum", "mean": "avg", "max": "max", "min": "min"}


@_compat.constant_when_traced
def _reduction_plan(
    name: str, view: DeviceMesh, layout: Layout, dims: tuple[int, ...], keepdim: bool
) -> _Plan:
    """A reduction: ``result`` as the blocks give it (a partial ``sum``/``avg``/``max``/
    ``min`` over the split dims reduced), ``final`` as JAX types it (those reduced)."""
    def make() -> _Plan:
        assert layout is not None
        t = _type_of(view, *layout)
        if t.unreduced and name not in ("sum", "mean"):
            raise ShardingTypeError(f"unreduced rule for reduce_{name} is not implemented")
        result = rules.reduce_dims(t, dims, keepdim)
        final = placements_of(view, result.dims, result.unreduced)
        reduced = {axis for d in (dims or range(len(t.shape))) for axis in t.dims[d]}
        natural = tuple(Partial(_REDUCE_OPS[name]) if axis in reduced else placement
                        for axis, placement in zip(view.mesh_dim_names or (), final))
        return _Plan((), natural, shape=result.shape, final=final)
    return _planned(make)


def _reduction(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A reduction, reduced at once over the split dims it reduces: on the local block and
    then all-reduced where nothing is recorded for autograd, else DTensor's op (whose
    gradients a partial max or mean of blocks would not give)."""
    x = args[0]
    given = {**dict(zip(("dim", "keepdim"), args[1:])), **kwargs}
    dim = given.get("dim")
    dims = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    name = _jax_name(func).removeprefix("a")
    plan = _reduction_plan(name, x.device_mesh, _layout(x), dims, bool(given.get("keepdim", False)))
    _refuse_if(plan.error)
    if (x.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return _laid_out(func(_leaf_typed(x), *args[1:], **kwargs), plan.final)
    local = func(_compat.local_tensor(x), *args[1:], **kwargs)
    spec = _compat.even_spec(x.device_mesh, plan.result, local)
    found = None if kwargs else fast_key(func, args)
    if found is not None:
        _keep_fast(found[0], _FastOp(func, x.device_mesh, spec, plan.final))
    return _laid_out(_compat.dtensor_of(local, spec), plan.final)


@_compat.constant_when_traced
def _reshape_plan(view: DeviceMesh, layout: Layout, shape: tuple[int, ...]) -> _Plan:
    def make() -> _Plan:
        assert layout is not None
        axes = axes_of(view)
        t = _type_of(view, *layout)
        before, result = rules.reshape(t, shape, axes)
        sizes = dict(axes)
        local = []
        for size, entry in zip(result.shape, result.dims):
            parts = math.prod(sizes[axis] for axis in entry)
            if size % parts:
                raise ShardingTypeError(
                    f"reshaping {rules.str_type(t, axes)} to {shape}: dim of size {size} does "
                    f"not divide by its axes' {parts}; reshard first (meshstate.reshard)"
                )
            local.append(size // parts)
        return _Plan((placements_of(view, before, t.unreduced),),
                     placements_of(view, result.dims, result.unreduced), tuple(local))
    return _planned(make)


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
    plan = _reshape_plan(x.device_mesh, _layout(x), shape)
    _refuse_if(plan.error)
    moved = _typed(x.device_mesh, x, plan.operands[0])
    local = moved.to_local().reshape(plan.local_shape)
    return DTensor.from_local(local, x.device_mesh, plan.result, run_check=False,
                              shape=torch.Size(shape), stride=contiguous_strides(shape))


@_compat.constant_when_traced
def _shape_plan(kind: str, view: DeviceMesh, layouts: tuple[Layout, ...], arguments: tuple[Any, ...]) -> _Plan:
    def make() -> _Plan:
        axes = axes_of(view)
        types = [_type_of(view, *layout) for layout in layouts if layout is not None]
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
            return _with_grads(_Plan((operand,), placements_of(view, result.dims, result.unreduced),
                                     shape=result.shape))
        operands: list[tuple[Placement, ...] | None] = []
        for t in types:
            cut = arguments[0] % len(t.shape) if kind == "cat" else None
            unsplit = tuple(() if d == cut or (kind == "take" and _sliced(arguments, d, size))
                            else e for d, (size, e) in enumerate(zip(t.shape, t.dims)))
            operands.append(placements_of(view, unsplit, t.unreduced))
        return _Plan(tuple(operands), placements_of(view, result.dims, result.unreduced))
    return _planned(make)


def _sliced(keys: tuple[Any, ...], dim: int, size: int) -> bool:
    return dim < len(keys) and keys[dim] is not None and tuple(keys[dim]) != (0, size)


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
    plan = _shape_plan("permute", x.device_mesh, (_layout(x),), tuple(order))
    if not _through_dtensor(args):
        _remember_fast(func, args, plan, result, plan.result)
    return result


def _unsqueeze(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _shaped(func, args, kwargs, "unsqueeze", (args[1] if len(args) > 1 else kwargs["dim"],))


def _cat(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    view = _view_of(tensors)
    plan = _shape_plan("cat", view, tuple(_layout(t) for t in tensors), (dim,))
    _refuse_if(plan.error)
    moved = [_typed(view, t, p) for t, p in zip(tensors, plan.operands)]
    return _laid_out(func(moved, dim), plan.result)


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
    plan = _shape_plan(kind, x.device_mesh, (_layout(x),), arguments)
    _refuse_if(plan.error)
    if kind in ("permute", "unsqueeze") and _through_dtensor(args):
        return _as_dtensor(func, args, kwargs, x.device_mesh, plan, plan.result)
    if kind in ("permute", "unsqueeze"):  # a view of each block
        result = _on_blocks(x.device_mesh, plan, [x], lambda block: func(block, *args[1:], **kwargs))
        if not kwargs:
            _remember_fast(func, args, plan, result, plan.result)
        return result
    moved = _typed(x.device_mesh, x, plan.operands[0])
    return _laid_out(func(moved, *args[1:], **kwargs), plan.result)


# --- the table --------------------------------------------------------------------------

_T = torch.Tensor
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
_REDUCTIONS: list[Callable[..., Any]] = [torch.sum, torch.mean, torch.amax, torch.amin, _T.sum, _T.mean, _T.amax, _T.amin]
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
    torch._C.TensorBase.__getitem__: "getitem",
    _T.requires_grad_: "requires_grad",
    **dict.fromkeys([
        _T.size, _T.dim, _T.numel, _T.stride, _T.__len__, _T.backward,
        _T.retain_grad, _T.register_hook, _T.__repr__, _T.__format__, _T.detach,
        _T.is_contiguous, _T.element_size, _T.data_ptr, _T.__hash__, _T.storage_offset,
        _T.untyped_storage, _T._is_view, _T.is_complex, _T.is_floating_point, _T.is_conj,
        _T.is_neg, _T.as_strided,  # as_strided: how a compiled function rebuilds a view it returns
        torch.autograd.grad,
        torch.autograd.backward], "passes"),
}
"""Each torch function JAX's Explicit axes type here, by its kind (torch's own functions:
indexing is the class's slot, whatever a simulated world has put on ``torch.Tensor``);
``passes``: those that read a value without computing on it (and autograd)."""
_BY_NAME = {resolve_name(func): kind for func, kind in _KINDS.items() if resolve_name(func)}


@_compat.constant_when_traced
def kind_of(func: Callable[..., Any]) -> str:
    """The kind of torch function ``func`` (by itself, its name, or what it wraps: a
    simulated world's replacement), ``passes`` for a property read, else ``untyped``."""
    wrapped = getattr(func, "__wrapped__", None)
    found = _KINDS.get(func) or _BY_NAME.get(resolve_name(func)) or _KINDS.get(wrapped)  # type: ignore[arg-type]
    if found:
        return found
    name = resolve_name(func) or ""
    return "passes" if name.endswith((".__get__", ".__set__")) else "untyped"


HANDLERS: dict[str, Callable[..., Any]] = {
    "elementwise": elementwise, "matmul": _matmul, "einsum": _einsum, "reduction": _reduction,
    "reshape": _reshape, "permute": _permute, "unsqueeze": _unsqueeze, "cat": _cat,
    "getitem": _getitem, "requires_grad": _requires_grad,
}
"""Each kind's handler."""
