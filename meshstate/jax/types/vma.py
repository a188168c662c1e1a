"""Varying manual axes: which mesh axes a value inside ``shard_map`` may vary over.

JAX gives every value inside ``shard_map`` a type: the set of mesh axes it may
vary over (its *vma*). Arguments vary over the axes their in-spec names;
constants and closed-over values vary over none (they are *invariant*). An op
on operands of different sets gives their union, after casting the less
varying ones up with :func:`pvary` (identity forward, a ``psum`` of the
gradient backward), and each collective has a rule of its own (``psum``
removes its axes, ``all_gather`` keeps them). The types decide two things:
which out-specs are accepted (a result may not vary over an axis its out-spec
leaves out), and each collective's backward.

Here the types live on the tensors themselves, as an attribute that
:class:`VaryingTypes`, a ``TorchFunctionMode`` active while a typed
``shard_map`` body runs, sets on every result; ``torch.compile`` traces the
mode like any Python code, so the checks happen while tracing.

Example (inside ``shard_map(f, in_specs=P("tp"), out_specs=P("tp"))``)::

    vma(x)                       # frozenset({'tp'}): x is this tp rank's block
    vma(x * 2), vma(torch.ones(3))   # {'tp'}, frozenset(): a constant is invariant
    vma(x + torch.ones(3))       # {'tp'}: ones(3) was pvary'd to {'tp'} first
    vma(psum(x, "tp"))           # frozenset(): psum removes tp
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from meshstate.core import compat as _compat
from meshstate.errors import MeshStateError
from meshstate.core.which_mesh import current_mesh

__all__ = ["VaryingAxesError", "VaryingTypes", "own_type", "plug_outside_types", "vma"]

NO_AXES: frozenset[str] = frozenset()
_ATTRIBUTE = "_meshstate_vma"
"""The tensor attribute that holds a value's vma inside a typed body (absent: invariant)."""


class VaryingAxesError(MeshStateError, ValueError):
    """A value's varying axes do not allow what was asked of it (JAX raises ``ValueError``).

    Raised while tracing, on every rank, before anything is sent: an out-spec
    that leaves out an axis the result varies over, a ``psum`` over axes of
    which the value varies over some and not others, a ``pvary`` over an axis
    the value already varies over, and, under ``shard_map(auto_pvary=False)``,
    an op whose operands vary over different axes.
    """


def own_type(x: torch.Tensor) -> frozenset[str] | None:
    """The type a typed ``shard_map`` body gave ``x``; ``None`` where it gave none."""
    return getattr(x, _ATTRIBUTE, None)


def vma(x: torch.Tensor) -> frozenset[str]:
    """The mesh axes ``x`` may vary over: its JAX type inside ``shard_map``.

    Inside a ``shard_map`` body (``check_vma=True``, the default) every tensor
    has one: an argument varies over the axes its in-spec names, a constant
    or closed-over value over none. Outside any body, and with
    ``check_vma=False``, nothing is typed and every tensor answers ``frozenset()``,
    but for a value another type system typed: the answer :func:`plug_outside_types`
    was given (:mod:`meshstate.jax.typing` plugs torchtitan's checker's in).

    Example: ``vma(x)`` is ``frozenset({'tp'})`` inside ``shard_map(f,
    in_specs=P(None, "tp"), ...)``; ``vma(psum(x, "tp"))`` is ``frozenset()``.
    """
    found: frozenset[str] | None = getattr(x, _ATTRIBUTE, None)
    return _outside_type(x) if found is None else found


def _no_type(x: torch.Tensor) -> frozenset[str]:
    return NO_AXES


_outside_type: Callable[[torch.Tensor], frozenset[str]] = _no_type


def plug_outside_types(answer: Callable[[torch.Tensor], frozenset[str]]) -> None:
    """Have :func:`vma` answer ``answer(x)`` for a value no typed body typed."""
    global _outside_type
    _outside_type = answer


def typed(x: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
    """``x`` with the type ``axes``: set on ``x`` and ``x`` returned; under
    ``torch.compile``, which lets a traced program set attributes only on tensors it
    made in the same scope (not on an op's several results, nor on an autograd
    Function's result inside activation checkpointing), set on a view of ``x``."""
    if _compat.tracing():
        x = x.view_as(x)
    setattr(x, _ATTRIBUTE, axes)
    return x


def type_text(x: torch.Tensor) -> str:
    """``x``'s type as JAX prints it: ``float64[4,2]{V:tp}``, ``float32[]``; several axes
    in mesh order, ``{V:(cp,tp)}`` (sorted where no current mesh knows them)."""
    dtype = str(x.dtype).removeprefix("torch.")
    shape = ",".join(str(size) for size in x.shape)
    axes = _in_mesh_order(vma(x))
    if not axes:
        return f"{dtype}[{shape}]"
    return f"{dtype}[{shape}]{{V:{axes[0] if len(axes) == 1 else '(' + ','.join(axes) + ')'}}}"


def _in_mesh_order(axes: frozenset[str]) -> tuple[str, ...]:
    """``axes`` outer to inner in the current mesh, else sorted."""
    if len(axes) < 2:
        return tuple(axes)
    try:
        return current_mesh().layout.view_of(axes).mesh_order(axes)
    except MeshStateError:
        return tuple(sorted(axes))


def axes_text(axes: Iterable[str]) -> str:
    """A set of axes as JAX writes it: ``{cp,tp}``, ``{}``."""
    return "{" + ",".join(sorted(axes)) + "}"


every_op_typed = _compat.constant_when_traced(_compat.modes_see_every_op)
"""Have torch.compile hand every op to a typing mode (:func:`meshstate.core.compat.modes_see_every_op`),
also when first asked inside a trace."""


class _Body(threading.local):
    """What the shard_map body running in this thread types (a thread-local, which
    ``torch.compile`` guards on): ``types`` while a ``check_vma=True`` body runs,
    ``legacy`` while a ``check_vma=False`` one does; neither outside any body. ``manual``:
    the axes a partial-manual body (``shard_map(axis_names=...)``) is manual over."""

    def __init__(self) -> None:
        self.types: VaryingTypes | None = None
        self.legacy = False
        self.manual: frozenset[str] | None = None
        self.auto_mesh: Any = None
        """With ``manual``: the DeviceMesh of the view's other axes, over which values are global."""


body = _Body()


class VaryingTypes(TorchFunctionMode):
    """Types every result of a torch op run inside a typed ``shard_map`` body.

    A result varies over the union of its operands' axes (tensors, and tensors
    in a list or tuple argument); an operand that varies over fewer is cast up
    first with ``pvary(operand, missing)`` (``pvary_to``), as JAX's
    ``auto_pcast`` does. With ``auto_pvary=False`` the mix is refused instead.
    An in-place op types the tensor it writes; ``torch.autograd.grad`` gives each
    gradient its input's type.
    """

    def __init__(
        self, auto_pvary: bool, pvary_to: Callable[[torch.Tensor, frozenset[str]], torch.Tensor]
    ) -> None:
        super().__init__()
        self.auto_pvary = auto_pvary
        self.pvary_to = pvary_to

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs:
            union, mixed = _union((*args, *kwargs.values()))
        else:
            kwargs = {}
            union, mixed = _union(args)
        if func is torch.autograd.grad:
            return _typed_gradients(func, args, kwargs)
        if isinstance(func, _compat.HigherOrderOperator) and _name_of(func) in _WITH_BODIES:
            return self._higher_order(func, args, kwargs)
        if mixed:
            if not self.auto_pvary:
                _refuse_mix(func, args, kwargs)
            args, kwargs = self._cast_up(func, args, kwargs, union)
        if func in _NARROW and _compat.tracing():
            func, args, kwargs = _narrow_traceably(func, args, kwargs)
        if getattr(func, "__name__", None) == "apply":
            func = _applied_again(func)
        result = func(*args, **kwargs)
        if union:
            if isinstance(result, torch.Tensor):  # an in-place op's result is the tensor it wrote
                setattr(result, _ATTRIBUTE, union)
            elif result is None and func is _SETITEM:
                setattr(args[0], _ATTRIBUTE, union)
            else:
                return _typed_results(result, union)
        return result

    def _higher_order(
        self, func: _compat.HigherOrderOperator, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A higher-order op with a body, which ``torch.compile`` hands to the mode whole
        (eagerly the body's ops come one by one). Activation checkpointing runs its body
        typed, so each result leaves with the type the body gave it; control flow
        (``cond``, ``while_loop``, ``scan``, ``map``), whose branches ``torch.compile``
        traces without the mode, is refused. An op of tensors alone (flex attention) is
        typed like any op."""
        name = _name_of(func)
        if name == "tag_activation_checkpoint":
            body_function, *operands = args
            return func(partial(self._run_typed, body_function), *operands, **kwargs)
        raise VaryingAxesError(
            f"torch.{name} inside a typed shard_map body under torch.compile: its "
            "branches are traced without JAX's types, which would drop them; compute both "
            "sides and pick with torch.where, or pass shard_map(check_vma=False)"
        )

    def _run_typed(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` with this mode on again (a higher-order op's body)."""
        with self:
            return function(*args, **kwargs)

    def _cast_up(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
        union: frozenset[str],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with each tensor that varies over fewer axes and whose
        gradient autograd records pvary'd up (the cast changes only the gradient; the
        result's type is the union either way). Not the tensor an in-place op writes,
        whose type is raised after it."""

        def up(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not (value.requires_grad and torch.is_grad_enabled()):
                    return value
                axes = vma(value)
                return value if axes == union else self.pvary_to(value, union - axes)
            if isinstance(value, (list, tuple)):
                return type(value)(up(item) for item in value)
            return value

        if not (torch.is_grad_enabled() and _any_recorded(args, kwargs)):
            return args, kwargs
        first = 1 if _writes_first(func) else 0
        cast = (*args[:first], *(up(value) for value in args[first:]))
        return cast, {name: up(value) for name, value in kwargs.items()} if kwargs else kwargs


def _applied_again(func: Callable[..., Any]) -> Callable[..., Any]:
    """An autograd Function's ``apply`` as a mode beneath this one must see it: torchtitan's
    type checker dispatches ``apply`` as a torch function (to run a Function's typing
    hook), but the ``func`` a mode is handed is the original, which no mode beneath
    sees; the class's ``apply`` goes through the checker again."""
    function = getattr(func, "__self__", None)
    if isinstance(function, type) and issubclass(function, torch.autograd.Function):
        return cast(Callable[..., Any], getattr(function, "apply"))
    return func


_NARROW = frozenset({torch.Tensor.narrow, torch.narrow})


def _narrow_traceably(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``narrow(x, dim, start, length)`` with a tensor ``start`` (JAX's ``dynamic_slice``
    at ``axis_index(...) * n``) as ``index_select`` of ``start + arange(length)``: the same
    values and gradient, and no graph break (``torch.compile`` cannot narrow at a start
    it reads from a tensor)."""
    given = {**dict(zip(("input", "dim", "start", "length"), args)), **kwargs}
    start = given.get("start")
    if not isinstance(start, torch.Tensor):
        return func, args, kwargs
    indices = start + torch.arange(given["length"], device=start.device)
    return torch.index_select, (given.get("input", given.get("self")), given["dim"], indices), {}


def _union(values: tuple[Any, ...]) -> tuple[frozenset[str], bool]:
    """The union of the types of the tensors in ``values`` (one level of lists and tuples
    too), and whether they differ."""
    union: frozenset[str] | None = None
    mixed = False
    for value in values:
        if isinstance(value, torch.Tensor):
            axes = getattr(value, _ATTRIBUTE, None)
            if axes is None:  # a value made outside the body: another type system's, if any
                axes = vma(value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            axes, inner_mixed = _union(tuple(value))
            mixed = mixed or inner_mixed
        else:
            continue
        if union is None:
            union = axes
        elif axes is not union and axes != union:
            mixed = True
            union = union | axes
    return (NO_AXES if union is None else union), mixed


def _any_recorded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether any tensor among ``args`` and ``kwargs`` (or in a list or tuple among them)
    requires grad."""
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)) and _any_recorded(tuple(value), {}):
            return True
    return False


_SETITEM = torch.Tensor.__setitem__


def _typed_results(result: Any, axes: frozenset[str]) -> Any:
    """``result`` with each tensor of a list or tuple result typed (``split``, ``max(dim)``;
    not ``shape``): the same list or tuple, or under ``torch.compile`` one of the same
    kind holding the typed views (see :func:`typed`)."""
    if not (isinstance(result, (list, tuple)) and result and isinstance(result[0], torch.Tensor)):
        return result
    items = [typed(item, axes) if isinstance(item, torch.Tensor) else item for item in result]
    return type(result)(items) if _compat.tracing() else result


@_compat.constant_when_traced
def _writes_first(func: Callable[..., Any]) -> bool:
    """Whether ``func`` is an in-place method (``add_``, ``__iadd__``, ``__setitem__``),
    which writes its first argument."""
    found = _writing.get(func)
    if found is None:
        name: str = getattr(func, "__name__", "")
        found = _writing[func] = (
            (name.endswith("_") and not name.endswith("__"))
            or name.startswith("__i")
            or name == "__setitem__"
        )
    return found


_writing: dict[Callable[..., Any], bool] = {}


def _typed_gradients(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``torch.autograd.grad(outputs, inputs, ...)``, each gradient typed as its input."""
    gradients = func(*args, **kwargs)
    inputs = args[1] if len(args) > 1 else kwargs["inputs"]
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple(
        typed(gradient, vma(source)) if gradient is not None and vma(source) else gradient
        for gradient, source in zip(gradients, inputs)
    )


_WITH_BODIES = frozenset(
    {"tag_activation_checkpoint", "cond", "while_loop", "scan", "map_impl", "associative_scan"}
)
"""The higher-order ops that run functions of their own: activation checkpointing and
control flow (flex attention's score function runs on no typed value)."""


@_compat.constant_when_traced
def _name_of(operator: _compat.HigherOrderOperator) -> str:
    """A higher-order op's name (``torch.compile`` reads it while tracing)."""
    name: str = operator.name()  # type: ignore[no-untyped-call]
    return name


class _TypesThroughTransforms(_compat.TransformHooks):
    """Inside a typed body, torch.func's vmap, grad and vjp (so jacrev) carry each value's
    type in and out, as JAX's transforms do: a transform's batch or tangent dim is no
    mesh axis. Forward mode (jvp, jacfwd, hessian, linearize) is refused there."""

    def entered(self, sources: Sequence[Any], wrapped: Sequence[Any]) -> None:
        if body.types is None:
            return
        for source, value in zip(sources, wrapped):
            if value is not source and isinstance(value, torch.Tensor):
                axes = getattr(source, _ATTRIBUTE, None)
                if axes:
                    setattr(value, _ATTRIBUTE, axes)

    def left(self, wrapped: Sequence[Any], results: Sequence[Any]) -> None:
        self.entered(wrapped, results)

    def forward_mode(self, name: str) -> None:
        if body.types is not None:
            raise VaryingAxesError(
                f"{name} (and jacfwd, hessian and linearize, which use it) inside a typed "
                "shard_map body: forward-mode tangents do not carry JAX's types here, which "
                "would drop them; use torch.func.vjp or jacrev, or shard_map(check_vma=False)"
            )


_compat.follow_functorch_transforms(_TypesThroughTransforms())


def _refuse_mix(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    operands = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    operands += [
        item
        for value in (*args, *kwargs.values())
        if isinstance(value, (list, tuple))
        for item in value
        if isinstance(item, torch.Tensor)
    ]
    union = frozenset().union(*(vma(operand) for operand in operands))
    types = ", ".join(type_text(operand) for operand in operands)
    fewer = next(operand for operand in operands if vma(operand) != union)
    missing = tuple(sorted(union - vma(fewer)))
    raise VaryingAxesError(
        f"{resolve_name(func) or func} mixes operands of types {types} and "
        f"shard_map(auto_pvary=False) casts none; write meshstate.pvary(operand, {missing!r}) "
        f"for the {type_text(fewer)} operand (or leave auto_pvary on, as JAX does)"
    )
