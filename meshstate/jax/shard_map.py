"""``shard_map``: JAX's per-shard programming model on a ParallelMesh, with JAX's types.

``shard_map(f, in_specs=..., out_specs=...)`` returns a function that cuts each
argument to this rank's block of its :class:`~meshstate.jax.sharding.P`, runs
``f`` on the blocks with the mesh current (so ``psum(x, "tp")`` inside needs
no ``mesh=``), and returns DTensors laid out by the out-specs. The specs pick
the view: dense axes (tp, cp, dp, pp) or expert axes (etp, ep, edp, pp).

``check_vma=True`` (the default, JAX's) types every value inside ``f`` with
the mesh axes it may vary over (:mod:`meshstate.jax.vma`): arguments vary over
their in-spec's axes, ops join their operands' axes (casting the less varying
up with ``pvary``, or refusing the mix with ``auto_pvary=False``), and each
collective follows JAX's rule. An out-spec that leaves out an axis its result
varies over is refused while tracing, on every rank, before anything is sent.
Gradients follow the types: ``psum``'s backward is the identity and ``pvary``'s
a ``psum``, so a gradient taken inside ``f`` (``torch.autograd.grad``) is
JAX's, and the boundary passes cotangents through unchanged.

``check_vma=False`` is JAX's legacy mode: nothing is typed or checked,
``psum``'s backward is a ``psum``, and the boundary divides each result's
cotangent among the replicas of the axes its out-spec leaves out and sums each
argument's gradient over the axes its in-spec leaves out. The gradient of the
whole function is the same in both modes wherever both accept the program.

Differences from JAX, and why:

- Dims need not divide: blocks are DTensor's uneven shards (last ones smaller).
- torch's ``local_map`` does the placement bookkeeping too, but gives every
  rank the whole cotangent of a replicated result under the legacy transposes,
  and knows no types.

Example (8 ranks, ``init_mesh(tp=2, cp=2)``; a row-parallel matmul)::

    matmul = shard_map(
        lambda x, w: psum(x @ w, "tp"),
        in_specs=(P(None, "tp"), P("tp", None)),
        out_specs=P(),
    )
    matmul(x, w).full_tensor()   # x @ w on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, overload

import torch
from torch.distributed.tensor import DTensor

from meshstate.core import compat as _compat
from meshstate.errors import ConfigError
from meshstate.core.mesh import ParallelMesh, current_mesh, require_parallel_mesh
from meshstate.jax.collectives import pvary_over
from meshstate.jax.plan import Plan, SpecTree, plan_on, spec_branches, spec_key, spec_leaves
from meshstate.jax.reshard import reshard
from meshstate.jax.sharding import P
from meshstate.jax.vma import NO_AXES, VaryingAxesError, VaryingTypes, axes_text, body, typed, vma

__all__ = ["reshard", "shard_map"]


@overload
def shard_map(
    f: Callable[..., Any],
    /,
    *,
    in_specs: SpecTree,
    out_specs: SpecTree,
    mesh: ParallelMesh | None = None,
    check_vma: bool = True,
    auto_pvary: bool = True,
) -> Callable[..., Any]: ...


@overload
def shard_map(
    f: None = None,
    /,
    *,
    in_specs: SpecTree,
    out_specs: SpecTree,
    mesh: ParallelMesh | None = None,
    check_vma: bool = True,
    auto_pvary: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def shard_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    in_specs: SpecTree,
    out_specs: SpecTree,
    mesh: ParallelMesh | None = None,
    check_vma: bool = True,
    auto_pvary: bool = True,
) -> Callable[..., Any]:
    """``f`` applied to each rank's blocks of the arguments; results as DTensors.

    Without ``f``, a decorator (JAX's ``@shard_map(in_specs=..., out_specs=...)``).

    Each argument is a ``DTensor`` (redistributed to its in-spec if needed; one
    on a slice of the view, such as ``mesh["tp"]``, keeps its block) or a plain
    tensor holding the full global value on every rank. Specs are pytrees like
    JAX's: one ``P`` stands for every argument (or result), a tuple, list or
    dict matches the arguments (results) it describes. While ``f`` runs,
    ``mesh`` (default: the current mesh when called) is current. What the specs
    need of a mesh is worked out on the first call and kept with the mesh;
    under ``torch.compile`` the call traces as part of the caller's graph,
    built inside the compiled function or outside.

    ``check_vma`` (JAX's default ``True``) types the values inside ``f`` and
    checks the out-specs against the types; ``False`` is JAX's legacy mode
    (see the module). ``auto_pvary=False`` refuses an op whose operands vary
    over different axes instead of casting them up.

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``, so dp=2)::

        gather = shard_map(lambda x: all_gather_invariant(x, ("cp", "dp"), tiled=True),
                           in_specs=P(("cp", "dp")), out_specs=P())
        gather(torch.arange(8)).full_tensor()   # tensor([0, 1, ..., 7]) on every rank

    Raises:
        AxisError: a spec names an axis the mesh lacks, or mixes dense and
            expert axes (on every rank, before anything is sent).
        VaryingAxesError: with ``check_vma``, a result varies over an axis its
            out-spec leaves out (JAX's ``ValueError``), or ``f`` mixes types
            the rules refuse (see :mod:`meshstate.jax.vma`).
    """
    if f is None:
        return partial(shard_map, in_specs=in_specs, out_specs=out_specs, mesh=mesh,
                       check_vma=check_vma, auto_pvary=auto_pvary)
    leaves = [*spec_leaves(in_specs, "in_specs"), *spec_leaves(out_specs, "out_specs")]
    keys = tuple(spec_key(spec) for spec in leaves)
    name = getattr(f, "__name__", type(f).__name__)

    def mapped(*args: Any) -> Any:
        parallel_mesh = (
            current_mesh() if mesh is None else require_parallel_mesh(mesh, "shard_map(mesh=...)")
        )
        plan = plan_on(parallel_mesh, keys)
        even = [True]
        types = (
            VaryingTypes(auto_pvary, partial(pvary_over, parallel_mesh=parallel_mesh))
            if check_vma
            else None
        )
        local_args = _map(in_specs, args, "in_specs", partial(_block, plan, even, check_vma))
        results = _run(f, local_args, parallel_mesh, types)
        outputs: list[tuple[P, torch.Tensor]] = []
        _map(out_specs, results, "out_specs", partial(_result, name, plan, outputs, check_vma))
        shapes = iter(plan.global_shapes(outputs, even[0]))
        if not check_vma:
            return _map(out_specs, results, "out_specs",
                        lambda spec, y, path: plan.to_dtensor(y, spec, next(shapes)))
        return _map(
            out_specs, results, "out_specs",
            lambda spec, y, path: plan.to_dtensor(
                _untyped(y, plan.named[spec_key(spec)], parallel_mesh), spec, next(shapes),
                share=False,
            ),
        )

    return mapped


def _run(
    f: Callable[..., Any], local_args: Any, parallel_mesh: ParallelMesh, types: VaryingTypes | None
) -> Any:
    """``f(*local_args)`` with the mesh current and the body's semantics set for this thread."""
    outer = body.types, body.legacy
    body.types, body.legacy = types, types is None
    # Not `with`: torch.compile traces enter and exit calls only.
    parallel_mesh.__enter__()
    if types is not None:
        types.__enter__()  # type: ignore[no-untyped-call]
    try:
        return f(*local_args)
    finally:
        if types is not None:
            types.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        parallel_mesh.__exit__(None, None, None)
        body.types, body.legacy = outer


def _rematerialized(run_function: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """``run_function`` as reentrant activation checkpointing runs it inside a typed body:
    in the forward as it is; recomputed in the backward, after the body is gone, on
    arguments typed as in the forward and with the body's mesh and types again (JAX's
    ``remat`` keeps the types; without them the recompute would cast nothing up)."""
    types = body.types
    if types is None:
        return run_function
    parallel_mesh = current_mesh()
    arg_types = [vma(arg) if isinstance(arg, torch.Tensor) else NO_AXES for arg in args]

    def recomputed(*inputs: Any) -> Any:
        if body.types is not None:
            return run_function(*inputs)
        typed_inputs = [
            typed(value, axes) if axes else value for value, axes in zip(inputs, arg_types)
        ]
        return _run(run_function, typed_inputs, parallel_mesh, types)

    return recomputed


_compat.follow_reentrant_checkpoint(_rematerialized)


def _block(
    plan: Plan, even: list[bool], check_vma: bool, spec: P, x: torch.Tensor, path: str
) -> torch.Tensor:
    """This rank's block of ``x``. Typed (``check_vma``): varying over the axes ``spec``
    names, its gradient the block's own (the types, not the boundary, sum where JAX sums)."""
    if not check_vma:
        return plan.to_local(spec, x, even=even)
    local = plan.to_local(spec, x, even=even, jax_grads=False)
    if local is x or isinstance(x, DTensor):  # not the caller's tensor: type a view of it
        local = local.view_as(local)
    return typed(local, plan.named[spec_key(spec)])


def _result(
    name: str, plan: Plan, outputs: list[tuple[P, torch.Tensor]], check_vma: bool,
    spec: P, y: torch.Tensor, path: str,
) -> None:
    """Collect ``y``; typed, refuse it if it varies over an axis its out-spec leaves out
    (JAX's message)."""
    outputs.append((spec, y))
    if not check_vma:
        return
    extra = vma(y) - plan.named[spec_key(spec)]
    if extra:
        shape = tuple(plan.sizes[axis] for axis in plan.mesh_axes)
        raise VaryingAxesError(
            f"shard_map applied to the function {name!r} was given out_specs which require "
            f"replication which can't be statically inferred given the mesh of shape {shape} "
            f"with axis names {plan.mesh_axes}: {path} is {spec!r} which implies that the "
            f"corresponding output value is only varying across mesh axes "
            f"{axes_text(spec.axes)} and not {axes_text(extra)}, but it was inferred to be "
            f"possibly varying over {axes_text(vma(y))}; name {axes_text(extra)} in that "
            "out_spec, reduce over it (psum, all_gather_invariant), or pass check_vma=False"
        )


def _untyped(y: torch.Tensor, named: frozenset[str], parallel_mesh: ParallelMesh) -> torch.Tensor:
    """A result leaving a typed body: pvary'd over the out-spec's axes ``named`` it does
    not vary over (their copies' cotangents are summed back), and without its type."""
    axes = vma(y)
    missing = named - axes
    if missing:
        y = pvary_over(y, missing, parallel_mesh)
    elif not axes:
        return y  # never typed: nothing to take off
    return y.view_as(y)


def _map(tree: SpecTree, values: Any, path: str, apply: Callable[[P, Any, str], Any]) -> Any:
    """``values`` with ``apply(spec, tensor, path)`` on each tensor leaf under a spec of
    ``tree``; ``path`` names the spec in the tree as JAX does (``out_specs['a'][1]``)."""
    if tree is None:
        return values
    if isinstance(tree, P):
        if isinstance(values, torch.Tensor):
            return apply(tree, values, path)
        if isinstance(values, dict):
            return {key: _map(tree, value, path, apply) for key, value in values.items()}
        if isinstance(values, (tuple, list)):
            return type(values)(_map(tree, value, path, apply) for value in values)
        return values
    branches = spec_branches(tree, path)
    if isinstance(tree, dict):
        if not isinstance(values, dict) or set(values) != set(tree):
            raise ConfigError(
                f"{path} is a dict with keys {sorted(map(str, tree))}, "
                f"the value is {_describe(values)}"
            )
        return {key: _map(branches[key][0], value, branches[key][1], apply)
                for key, value in values.items()}
    if not isinstance(values, (tuple, list)) or len(values) != len(branches):
        raise ConfigError(f"{path} has {len(branches)} entries, the value is {_describe(values)}")
    return type(values)(
        _map(branches[number][0], value, branches[number][1], apply)
        for number, value in enumerate(values)
    )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"
