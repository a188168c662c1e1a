"""``shard_map``: JAX's per-shard programming model on a ParallelMesh.

``shard_map(f, in_specs=..., out_specs=...)`` returns a function that cuts each
argument to this rank's block of its :class:`~meshstate.jax.sharding.P`, runs
``f`` on the blocks with the mesh current (so ``psum(x, "tp")`` inside needs
no ``mesh=``), and returns DTensors laid out by the out-specs. The specs pick
the view: dense axes (tp, cp, dp, pp) or expert axes (etp, ep, edp, pp).

Gradients are JAX's. A result that an out-spec leaves replicated over an axis
counts once, not once per rank, and an argument's gradient is summed over the
axes its in-spec does not name. Inside ``f`` each rank holds its share of the
cotangent of a value replicated over an axis (shares sum to the whole), which
is what makes ``psum``'s backward (an all-reduce) right; a plain DTensor round
trip (``to_local`` / ``from_local``) hands every rank the whole cotangent, and
a row-parallel matmul's weight gradient comes out ``tp`` times too large.

Differences from JAX, and why:

- ``check_vma=True`` checks at run time, by comparing the results along each
  axis an out-spec leaves out (JAX proves it while tracing); torch has no
  tracer that knows which values vary over which axes. Off by default.
- Dims need not divide: blocks are DTensor's uneven shards (last ones smaller).
- torch's ``local_map`` does the placement bookkeeping too, but it gives every
  rank the whole cotangent of a replicated result and never sums an input's
  gradient over the axes its spec leaves out, so it does not fit here.

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
from typing import Any

import torch
import torch.distributed as dist

from meshstate.core.errors import MeshStateError, ConfigError
from meshstate.core.mesh import ParallelMesh, current_mesh, require_parallel_mesh
from meshstate.jax.plan import Plan, Specs, SpecTree, device_of
from meshstate.jax.reshard import reshard
from meshstate.jax.sharding import P

__all__ = ["reshard", "shard_map"]


def shard_map(
    f: Callable[..., Any],
    *,
    in_specs: SpecTree,
    out_specs: SpecTree,
    mesh: ParallelMesh | None = None,
    check_vma: bool = False,
) -> Callable[..., Any]:
    """``f`` applied to each rank's blocks of the arguments; results as DTensors.

    Each argument is a ``DTensor`` (redistributed to its in-spec if needed) or
    a plain tensor holding the full global value on every rank. Specs are
    pytrees like JAX's: one ``P`` stands for every argument (or result), a
    tuple, list or dict matches the arguments (results) it describes. While
    ``f`` runs, ``mesh`` (default: the current mesh when called) is current.
    What the specs need of a mesh (its view, placements, groups) is worked out
    on the first call and kept; under ``torch.compile`` the call traces as part
    of the caller's graph (with ``check_vma=False``).

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``, so dp=2)::

        gather = shard_map(lambda x: all_gather(x, ("cp", "dp"), tiled=True),
                           in_specs=P(("cp", "dp")), out_specs=P())
        gather(torch.arange(8)).full_tensor()   # tensor([0, 1, ..., 7]) on every rank

    Raises:
        AxisError: a spec names an axis the mesh lacks, or mixes dense and
            expert axes (on every rank, before anything is sent).
        MeshStateError: with ``check_vma``, a result differs along an axis its
            out-spec leaves out; the message names the axis and two ranks.
    """
    specs = Specs(in_specs, out_specs)

    def mapped(*args: Any) -> Any:
        parallel_mesh = (
            current_mesh() if mesh is None else require_parallel_mesh(mesh, "shard_map(mesh=...)")
        )
        plan = specs.plan_for(parallel_mesh)
        even = [True]
        local_args = _map(in_specs, args, "in_specs", partial(plan.to_local, even=even))
        parallel_mesh.__enter__()  # not `with`: torch.compile traces enter and exit calls only
        try:
            results = f(*local_args)
        finally:
            parallel_mesh.__exit__(None, None, None)
        outputs: list[tuple[P, torch.Tensor]] = []
        _map(out_specs, results, "out_specs", lambda spec, y: outputs.append((spec, y)))
        if check_vma:
            _check_replicated(outputs, plan)
        shapes = iter(plan.global_shapes(outputs, even[0]))
        return _map(out_specs, results, "out_specs", lambda spec, y: plan.to_dtensor(y, spec, next(shapes)))

    return mapped


def _map(tree: SpecTree, values: Any, where: str, apply: Callable[[P, Any], Any]) -> Any:
    """``values`` with ``apply(spec, tensor)`` on each tensor leaf under a spec of ``tree``."""
    if tree is None:
        return values
    if isinstance(tree, P):
        if isinstance(values, torch.Tensor):
            return apply(tree, values)
        if isinstance(values, dict):
            return {key: _map(tree, value, where, apply) for key, value in values.items()}
        if isinstance(values, (tuple, list)):
            return type(values)(_map(tree, value, where, apply) for value in values)
        return values
    if isinstance(tree, dict):
        if not isinstance(values, dict) or set(values) != set(tree):
            raise ConfigError(
                f"{where} is a dict with keys {sorted(map(str, tree))}, "
                f"the value is {_describe(values)}"
            )
        return {key: _map(tree[key], value, where, apply) for key, value in values.items()}
    if not isinstance(values, (tuple, list)) or len(values) != len(tree):
        raise ConfigError(f"{where} has {len(tree)} entries, the value is {_describe(values)}")
    return type(values)(_map(spec, value, where, apply) for spec, value in zip(tree, values))


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"


def _check_replicated(outputs: list[tuple[P, torch.Tensor]], plan: Plan) -> None:
    """Raise on every rank if a result differs along an axis its out-spec leaves out."""
    view, parallel_mesh, mesh_axes = plan.view, plan.parallel_mesh, plan.mesh_axes
    checks = [
        (number, spec, axis)
        for number, (spec, _) in enumerate(outputs)
        for axis in plan.left_out_axes(spec)
    ]
    if not checks:
        return
    differing, nobody = [], parallel_mesh.config.world_size
    with torch.no_grad():
        for number, _, axis in checks:
            group = parallel_mesh.ordered((axis,))
            local = outputs[number][1].detach()
            pieces = [torch.empty_like(local) for _ in group.ranks]
            dist.all_gather(pieces, local.contiguous(), group=group.group)
            by_index = [pieces[group_rank] for group_rank in group.group_ranks]
            odd = [i for i, piece in enumerate(by_index) if not torch.equal(piece, by_index[0])]
            differing.append(group.ranks[odd[0]] if odd else nobody)
        found = torch.tensor(differing, dtype=torch.int64, device=device_of(view))
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=parallel_mesh.ordered(mesh_axes).group)
    for (number, spec, axis), rank in zip(checks, found.tolist()):
        if rank != nobody:
            layout = parallel_mesh.layout
            grid = layout.dense if view is parallel_mesh.dense else layout.expert
            ranks = grid.group_ranks(rank, (axis,))
            raise MeshStateError(
                f"shard_map: result {number} has out-spec {spec!r}, which leaves out axis {axis!r} "
                f"(replicated), but ranks {ranks[0]} and {rank} of {axis!r} group {list(ranks)} "
                f"hold different values; name {axis!r} in the out-spec or psum/all_gather over it"
            )
