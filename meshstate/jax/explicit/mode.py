"""The explicit mode: :class:`ExplicitAxes` hands each torch op on DTensors to its handler
(:mod:`~meshstate.jax.explicit.ops`), and the public calls made under it (:func:`explicit`,
:func:`device_put`, :func:`auto_axes`, :func:`explicit_axes`); what a value's type is, and
whether this thread is in the mode, stand in :mod:`~meshstate.jax.types.explicit`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from meshstate.core import compat as _compat
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh, require_parallel_mesh
from meshstate.errors import ArgumentTypeError
from meshstate.jax.explicit.ops import HANDLERS, kind_of
from meshstate.jax.explicit.plans import name_of
from meshstate.jax.explicit.runs import NOT_FAST, run_fast
from meshstate.jax.reshard import reshard
from meshstate.jax.sharding import P
from meshstate.jax.types.explicit import ShardingTypeError, state, suspended
from meshstate.jax.typing import every_op_typed


@contextlib.contextmanager
def explicit(mesh: ParallelMesh | None = None) -> Iterator[ParallelMesh]:
    """Type DTensors on ``mesh``'s views (default: the current mesh) as JAX's Explicit
    axes do, for the block, with ``mesh`` the current mesh there (JAX's ``set_mesh``);
    yields the mesh. Nests; :func:`auto_axes` leaves it."""
    parallel_mesh = current_mesh() if mesh is None else require_parallel_mesh(mesh, "explicit(mesh=...)")
    outer, state.suspended = state.suspended, False
    outer_active, state.active = state.active, True
    try:
        every_op_typed()
        with ExplicitAxes(), parallel_mesh:
            yield parallel_mesh
    finally:
        state.suspended, state.active = outer, outer_active


def device_put(x: torch.Tensor, spec: P, mesh: ParallelMesh | None = None) -> DTensor:
    """``x`` laid out as ``spec`` says: a plain tensor (the global value, alike on every
    rank) cut on the view holding the spec's axes, a DTensor resharded; unreduced axes
    zero-filled as JAX does. Example: ``device_put(torch.ones(8, 16), P("dp", "tp"))``."""
    if not isinstance(spec, P):
        raise ArgumentTypeError(f"device_put(spec=...) takes a P, got {type(spec).__name__}")
    return reshard(x, spec, mesh)


def auto_axes(f: Callable[..., Any], out_sharding: P) -> Callable[..., DTensor]:
    """``f`` run with DTensor's own propagation (JAX's Auto axes), its result resharded to
    ``out_sharding``. Example: ``auto_axes(lambda a, b: a @ b, out_sharding=P("dp"))(x, w)``."""

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> DTensor:
        with suspended():
            result = f(*args, **kwargs)
        return reshard(result, out_sharding)
    return run


def explicit_axes(f: Callable[..., Any], in_sharding: P | Sequence[P]) -> Callable[..., Any]:
    """``f`` run typed (JAX's Explicit axes) on its arguments resharded to ``in_sharding``
    (one spec for every argument, or one each). Example: ``explicit_axes(g, P("dp"))(x)``."""

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        specs = [in_sharding] * len(args) if isinstance(in_sharding, P) else list(in_sharding)
        moved = [reshard(arg, spec) for arg, spec in zip(args, specs, strict=True)]
        with explicit():
            return f(*moved, **kwargs)
    return run


class ExplicitAxes(TorchFunctionMode):
    """Types each torch op on DTensors by JAX's rules (see :func:`explicit`)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if (not kwargs and args and isinstance(args[0], DTensor) and not state.suspended
                and not _compat.tracing()):
            result = run_fast(func, args, args[0].device_mesh)
            if result is not NOT_FAST:
                return result
        kwargs = kwargs or {}
        if state.suspended or not _any_dtensor(args) and not _any_dtensor(tuple(kwargs.values())):
            return func(*args, **kwargs)
        kind = kind_of(func)
        if kind == "passes":
            return func(*args, **kwargs)
        if kind == "untyped":
            raise ShardingTypeError(
                f"{name_of(func)} on an explicitly sharded value: JAX's Explicit "
                "axes type no such op here; reshard its operands as it needs "
                "(meshstate.reshard) or run it in meshstate.auto_axes"
            )
        return HANDLERS[kind](func, args, kwargs)


def _any_dtensor(values: tuple[Any, ...]) -> bool:
    for value in values:
        if isinstance(value, DTensor):
            return True
        if isinstance(value, (list, tuple)) and value and _any_dtensor(tuple(value)):
            return True
    return False
