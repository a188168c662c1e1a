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
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from meshstate.core import compat as _compat
from meshstate.core.errors import MeshStateError

__all__ = ["VaryingAxesError", "VaryingTypes", "vma"]

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


def vma(x: torch.Tensor) -> frozenset[str]:
    """The mesh axes ``x`` may vary over: its JAX type inside ``shard_map``.

    Inside a ``shard_map`` body (``check_vma=True``, the default) every tensor
    has one: an argument varies over the axes its in-spec names, a constant
    or closed-over value over none. Outside any body, and with
    ``check_vma=False``, nothing is typed and every tensor answers ``frozenset()``.

    Example: ``vma(x)`` is ``frozenset({'tp'})`` inside ``shard_map(f,
    in_specs=P(None, "tp"), ...)``; ``vma(psum(x, "tp"))`` is ``frozenset()``.
    """
    found: frozenset[str] = getattr(x, _ATTRIBUTE, NO_AXES)
    return found


def typed(x: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
    """``x`` with the type ``axes`` (set in place; returns ``x``)."""
    setattr(x, _ATTRIBUTE, axes)
    return x


def type_text(x: torch.Tensor) -> str:
    """``x``'s type as JAX prints it: ``float64[4,2]{V:cp,tp}``, ``float32[]``."""
    dtype = str(x.dtype).removeprefix("torch.")
    shape = ",".join(str(size) for size in x.shape)
    axes = vma(x)
    return f"{dtype}[{shape}]" + ("{V:" + ",".join(sorted(axes)) + "}" if axes else "")


def axes_text(axes: Iterable[str]) -> str:
    """A set of axes as JAX writes it: ``{cp,tp}``, ``{}``."""
    return "{" + ",".join(sorted(axes)) + "}"


class _Body(threading.local):
    """What the shard_map body running in this thread types (a thread-local, which
    ``torch.compile`` guards on): ``types`` while a ``check_vma=True`` body runs,
    ``legacy`` while a ``check_vma=False`` one does; neither outside any body."""

    def __init__(self) -> None:
        self.types: VaryingTypes | None = None
        self.legacy = False


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
        if mixed:
            if not self.auto_pvary:
                _refuse_mix(func, args, kwargs)
            args, kwargs = self._cast_up(func, args, kwargs, union)
        result = func(*args, **kwargs)
        if union:
            if isinstance(result, torch.Tensor):  # an in-place op's result is the tensor it wrote
                setattr(result, _ATTRIBUTE, union)
            elif result is None and func is _SETITEM:
                setattr(args[0], _ATTRIBUTE, union)
            else:
                _type_results(result, union)
        return result

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


def _union(values: tuple[Any, ...]) -> tuple[frozenset[str], bool]:
    """The union of the types of the tensors in ``values`` (one level of lists and tuples
    too), and whether they differ."""
    union: frozenset[str] | None = None
    mixed = False
    for value in values:
        if isinstance(value, torch.Tensor):
            axes = getattr(value, _ATTRIBUTE, NO_AXES)
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


def _type_results(result: Any, axes: frozenset[str]) -> None:
    """Type each tensor of a list or tuple result (``split``, ``max(dim)``; not ``shape``)."""
    if isinstance(result, (list, tuple)) and result and isinstance(result[0], torch.Tensor):
        for item in result:
            if isinstance(item, torch.Tensor):
                setattr(item, _ATTRIBUTE, axes)


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
    for gradient, source in zip(gradients, inputs):
        if gradient is not None and vma(source):
            typed(gradient, vma(source))
    return gradients


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
