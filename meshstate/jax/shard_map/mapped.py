"""``shard_map``: JAX's per-shard programming model on a ParallelMesh, with JAX's types.

``shard_map(f, in_specs=..., out_specs=...)`` returns a function that cuts each
argument to this rank's block of its :class:`~meshstate.jax.sharding.P`, runs
``f`` on the blocks with the mesh current (so ``psum(x, "tp")`` inside needs
no ``mesh=``), and returns DTensors laid out by the out-specs. The specs pick
the view: dense axes (tp, cp, dp, pp) or expert axes (etp, ep, edp, pp).

``check_vma=True`` (the default, JAX's) types every value inside ``f`` with
the mesh axes it may vary over (:mod:`meshstate.jax.types.vma`): arguments vary over
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

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from functools import partial
from typing import Any, overload

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshstate.core import compat as _compat
from meshstate.errors import ConfigError
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh, require_parallel_mesh
from meshstate.jax.shard_map.partial_manual import PartialPlan, check_manual, partial_plan_on, run_partial
from meshstate.jax.plan import Leaves, Plan, plan_on, share_grad
from meshstate.jax.shard_map.infer import Infer, InferFromArgs, inferred_specs, refuse_disagreeing
from meshstate.jax.sharding import P
from meshstate.jax.types.explicit import state as explicit_state
from meshstate.jax.typing import (
    NO_AXES, VaryingAxesError, VaryingTypes, axes_text, body, checker_on, checker_paused,
    checker_types_block, every_op_typed, pvary_over, refuse_legacy_under_checker, typed, vma,
)
from meshstate.jax.torch_calls import summed_gradient

__all__ = ["shard_map"]

SpecTree = P | None | tuple[Any, ...] | list[Any] | dict[Any, Any]
"""A ``P``, or a tuple, list or dict of spec trees (``None``: pass the value through)."""


@overload
def shard_map(
    f: Callable[..., Any],
    /,
    *,
    out_specs: SpecTree,
    in_specs: SpecTree | InferFromArgs = Infer,
    mesh: ParallelMesh | None = None,
    check_vma: bool = True,
    auto_pvary: bool = True,
    axis_names: AbstractSet[str] = frozenset(),
) -> Callable[..., Any]: ...


@overload
def shard_map(
    f: None = None,
    /,
    *,
    out_specs: SpecTree,
    in_specs: SpecTree | InferFromArgs = Infer,
    mesh: ParallelMesh | None = None,
    check_vma: bool = True,
    auto_pvary: bool = True,
    axis_names: AbstractSet[str] = frozenset(),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def shard_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    out_specs: SpecTree,
    in_specs: SpecTree | InferFromArgs = Infer,
    mesh: ParallelMesh | None = None,
    check_vma: bool = True,
    auto_pvary: bool = True,
    axis_names: AbstractSet[str] = frozenset(),
) -> Callable[..., Any]:
    """``f`` applied to each rank's blocks of the arguments; results as DTensors.

    Without ``f``, a decorator (JAX's ``@shard_map(in_specs=..., out_specs=...)``).

    Each argument is a ``DTensor`` (redistributed to its in-spec if needed; one on a
    slice of the view, such as ``mesh["tp"]``, keeps its block) or a plain tensor holding
    the full global value on every rank. Specs are pytrees like JAX's: one ``P`` stands
    for every argument (or result), a tuple, list or dict matches the arguments (results)
    it describes. While ``f`` runs, ``mesh`` (default: the current mesh when called) is
    current. What the specs need of a mesh is worked out on the first call and kept with
    the mesh; under ``torch.compile`` the call traces into the caller's graph, built
    inside the compiled function or outside. ``check_vma`` (JAX's default ``True``)
    types the values inside ``f`` and checks the out-specs against the types; ``False``
    is JAX's legacy mode (see the module). ``auto_pvary=False`` refuses an op whose
    operands vary over different axes instead of casting them up. ``axis_names`` (JAX's;
    default: every axis) makes ``f`` manual over those axes only: the specs name only
    them, and inside ``f`` each block stays global over the view's other axes, a DTensor
    on their mesh (see :mod:`~meshstate.jax.shard_map.partial_manual`).

    Example (8 ranks, ``init_mesh(tp=2, cp=2)``, so dp=2)::

        gather = shard_map(lambda x: all_gather_invariant(x, ("cp", "dp"), tiled=True),
                           in_specs=P(("cp", "dp")), out_specs=P())
        gather(torch.arange(8)).full_tensor()   # tensor([0, 1, ..., 7]) on every rank

    Raises:
        AxisError: a spec names an axis the mesh lacks, or mixes dense and
            expert axes (on every rank, before anything is sent).
        VaryingAxesError: with ``check_vma``, a result varies over an axis its
            out-spec leaves out (JAX's ``ValueError``), or ``f`` mixes types
            the rules refuse (see :mod:`meshstate.jax.types.vma`).
        ConfigError: with ``axis_names``, a spec names another axis (JAX's words).
        UnboundAxisError: with ``axis_names``, a collective inside ``f`` names another
            axis (JAX's ``NameError``, its words).
    """
    if f is None:
        return partial(shard_map, in_specs=in_specs, out_specs=out_specs, mesh=mesh,
                       check_vma=check_vma, auto_pvary=auto_pvary, axis_names=axis_names)
    manual = tuple(sorted(axis_names))

    def prepared(in_tree: SpecTree) -> _Prepared:
        return _Prepared(f, in_tree, out_specs, manual, check_vma, auto_pvary)

    inferred = isinstance(in_specs, InferFromArgs)
    fixed = prepared(() if isinstance(in_specs, InferFromArgs) else in_specs)

    def mapped(*args: Any) -> Any:
        # Inferred: the specs read from the arguments, at each call.
        ready = prepared(inferred_specs(args, frozenset(manual) or None)) if inferred else fixed
        flat_in, flat_out, specs, mode = ready.flat_in, ready.flat_out, ready.specs, ready.mode
        parallel_mesh = (
            current_mesh() if mesh is None else require_parallel_mesh(mesh, "shard_map(mesh=...)")
        )
        if explicit_state.active:
            for number, x in flat_in.tree.leaves(args):
                refuse_disagreeing(specs[number], x, frozenset(manual) or None)
        if manual:
            partial_plan = partial_plan_on(parallel_mesh, specs, manual)
            if partial_plan.auto_axes:
                return _run_partial(ready, partial_plan, args, parallel_mesh)
        plan = plan_on(parallel_mesh, specs)
        arguments = flat_in.tree.leaves(args)
        blocks = _blocks(mode, plan, parallel_mesh, arguments)
        local_args = flat_in.tree.rebuilt(args, iter(blocks))
        results = _run(f, local_args, parallel_mesh, mode.types(parallel_mesh))
        outputs = mode.leave(plan, parallel_mesh, flat_out.tree.leaves(results))
        return flat_out.tree.rebuilt(results, iter(_as_dtensors(plan, outputs, arguments)))

    def _run_partial(ready: _Prepared, plan: PartialPlan, args: tuple[Any, ...],
                     parallel_mesh: ParallelMesh) -> Any:
        """The call manual over ``manual`` only: blocks global over the plan's other axes."""
        types = ready.mode.types(parallel_mesh)
        results: Any = None

        def run_body(blocks: list[torch.Tensor]) -> Leaves:
            nonlocal results
            results = _run(f, ready.flat_in.tree.rebuilt(args, iter(blocks)), parallel_mesh,
                           types, frozenset(manual), plan.auto_mesh)
            return ready.flat_out.tree.leaves(results)

        outputs = run_partial(plan, ready.mode, check_vma, ready.flat_in.tree.leaves(args),
                              run_body, parallel_mesh)
        return ready.flat_out.tree.rebuilt(results, iter(outputs))

    return mapped


def _blocks(mode: _Typed | _Legacy, plan: Plan, parallel_mesh: ParallelMesh,
            arguments: Leaves) -> list[torch.Tensor]:
    """This rank's block of each argument, typed by ``mode`` (and for torchtitan's checker,
    while it runs)."""
    blocks = [mode.enter(plan, number, x) for number, x in arguments]
    if checker_on():
        mode.checked_blocks(plan, parallel_mesh, arguments, blocks)
    return blocks


def _as_dtensors(plan: Plan, outputs: Leaves, arguments: Leaves) -> list[DTensor]:
    """``plan.to_dtensors(outputs, arguments)``, torchtitan's checker paused while it runs:
    DTensor's bookkeeping is not the body's."""
    with checker_paused():
        return plan.to_dtensors(outputs, arguments)


def _run(
    f: Callable[..., Any], local_args: Any, parallel_mesh: ParallelMesh, types: VaryingTypes | None,
    manual: frozenset[str] | None = None, auto_mesh: DeviceMesh | None = None,
) -> Any:
    """``f(*local_args)`` with the mesh current and the body's semantics set for this thread
    (``manual``: the axes a partial-manual body is manual over, ``auto_mesh`` the others')."""
    outer = body.types, body.legacy, body.manual, body.auto_mesh
    body.types, body.legacy, body.manual, body.auto_mesh = types, types is None, manual, auto_mesh
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
        body.types, body.legacy, body.manual, body.auto_mesh = outer


def _rematerialized(run_function: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """``run_function`` as reentrant activation checkpointing runs it inside a typed body:
    in the forward as it is; recomputed in the backward, after the body is gone, on
    arguments typed as in the forward and with the body's mesh and types again (JAX's
    ``remat`` keeps the types; without them the recompute would cast nothing up)."""
    types = body.types
    if types is None:
        return run_function
    parallel_mesh, manual, auto_mesh = current_mesh(), body.manual, body.auto_mesh
    arg_types = [vma(arg) if isinstance(arg, torch.Tensor) else NO_AXES for arg in args]

    def recomputed(*inputs: Any) -> Any:
        if body.types is not None:
            return run_function(*inputs)
        typed_inputs = [
            typed(value, axes) if axes else value for value, axes in zip(inputs, arg_types)
        ]
        return _run(run_function, typed_inputs, parallel_mesh, types, manual, auto_mesh)

    return recomputed


_compat.follow_reentrant_checkpoint(_rematerialized)


class _Prepared:
    """A shard_map's specs flattened and checked, and its mode: made once, or at each call
    where the in-specs are read from the arguments."""

    def __init__(self, f: Callable[..., Any], in_tree: SpecTree, out_tree: SpecTree,
                 manual: tuple[str, ...], check_vma: bool, auto_pvary: bool) -> None:
        self.flat_in = _FlatSpecs(in_tree, "in_specs", first=0)
        self.flat_out = _FlatSpecs(out_tree, "out_specs", first=len(self.flat_in.specs))
        self.specs = self.flat_in.specs + self.flat_out.specs
        paths = self.flat_in.paths + self.flat_out.paths
        if manual:
            check_manual(self.specs, paths, frozenset(manual))
        self.mode: _Typed | _Legacy = _Typed(f, paths, auto_pvary) if check_vma else _Legacy()


class _Typed:
    """``check_vma=True``, JAX's typed mode. A block enters varying over the axes its
    in-spec names, its gradient its own (the types, not the boundary, sum where JAX sums);
    a result that varies over an axis its out-spec leaves out is refused (JAX's message),
    and one that does not vary over an axis its out-spec names leaves pvary'd over it."""

    def __init__(self, f: Callable[..., Any], paths: tuple[str, ...], auto_pvary: bool) -> None:
        self.name = getattr(f, "__name__", type(f).__name__)
        self.paths = paths
        """Each spec's path, by its number in the plan (``out_specs['a'][1]``)."""
        self.auto_pvary = auto_pvary

    def types(self, parallel_mesh: ParallelMesh) -> VaryingTypes:
        """What types the body's values (its casts pvary over ``parallel_mesh``)."""
        every_op_typed()
        return VaryingTypes(self.auto_pvary, partial(pvary_over, parallel_mesh=parallel_mesh))

    def enter(self, plan: Plan, number: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``x``, typed by its in-spec ``number``."""
        local = plan.block_of(number, x)
        if local is x or isinstance(x, DTensor):  # not the caller's tensor: type a view of it
            local = local.view_as(local)
        return typed(local, plan.named[number])

    def checked_blocks(self, plan: Plan, parallel_mesh: ParallelMesh, arguments: Leaves,
                       blocks: list[torch.Tensor]) -> None:
        """Type the blocks for torchtitan's checker: ``V`` on the axes each in-spec names,
        the argument's own type on the others."""
        for (number, x), block in zip(arguments, blocks):
            checker_types_block(block, x, plan.named[number], plan.mesh_axes, parallel_mesh)

    def leave(self, plan: Plan, parallel_mesh: ParallelMesh, outputs: Leaves) -> Leaves:
        """The results untyped, once every one is checked (before anything is sent)."""
        for number, y in outputs:
            extra = vma(y) - plan.named[number]
            if extra:
                raise self._refusal(plan, number, y, extra)
        return [(number, _untyped(y, plan.named[number], parallel_mesh)) for number, y in outputs]

    def _refusal(
        self, plan: Plan, number: int, y: torch.Tensor, extra: frozenset[str]
    ) -> VaryingAxesError:
        spec = plan.specs[number]
        shape = tuple(plan.sizes[axis] for axis in plan.mesh_axes)
        return VaryingAxesError(
            f"shard_map applied to the function {self.name!r} was given out_specs which require "
            f"replication which can't be statically inferred given the mesh of shape {shape} "
            f"with axis names {plan.mesh_axes}: {self.paths[number]} is {spec!r} which implies "
            f"that the corresponding output value is only varying across mesh axes "
            f"{axes_text(spec.axes)} and not {axes_text(extra)}, but it was inferred to be "
            f"possibly varying over {axes_text(vma(y))}; name {axes_text(extra)} in that "
            "out_spec, reduce over it (psum, all_gather_invariant), or pass check_vma=False"
        )


class _Legacy:
    """``check_vma=False``, JAX's legacy mode: nothing is typed. A block's gradient is
    summed over the axes its in-spec leaves out; a result replicated over the axes its
    out-spec leaves out hands each replica its share of the cotangent."""

    def types(self, parallel_mesh: ParallelMesh) -> None:
        """Nothing types the body's values."""
        return None

    def enter(self, plan: Plan, number: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``x`` under its in-spec ``number``."""
        local = plan.block_of(number, x)
        left_out = plan.left_out[number]
        if left_out is None or not local.requires_grad:
            return local
        return summed_gradient(local, left_out.group_name)

    def checked_blocks(self, plan: Plan, parallel_mesh: ParallelMesh, arguments: Leaves,
                       blocks: list[torch.Tensor]) -> None:
        """Refused: the checker types values, and this mode has no types."""
        refuse_legacy_under_checker()

    def leave(self, plan: Plan, parallel_mesh: ParallelMesh, outputs: Leaves) -> Leaves:
        """The results, each replicated one sharing its cotangent among its replicas."""
        return [
            (number, share_grad(y, plan.replicas[number]))
            if plan.replicas[number] > 1 and y.requires_grad
            else (number, y)
            for number, y in outputs
        ]


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


class _Spec:
    """A spec of a flattened tree, by its number: it stands for every tensor of its value."""

    def __init__(self, number: int) -> None:
        self.number = number

    def leaves(self, values: Any) -> Leaves:
        """The tensors of ``values``, in order, each with the spec's number."""
        if isinstance(values, torch.Tensor):
            return [(self.number, values)]
        if isinstance(values, dict):
            values = values.values()
        elif not isinstance(values, (tuple, list)):
            return []
        return [leaf for value in values for leaf in self.leaves(value)]

    def rebuilt(self, values: Any, tensors: Iterator[torch.Tensor]) -> Any:
        """``values`` with its tensors, in order, replaced by ``tensors``."""
        if isinstance(values, torch.Tensor):
            return next(tensors)
        if isinstance(values, dict):
            return {key: self.rebuilt(value, tensors) for key, value in values.items()}
        if isinstance(values, (tuple, list)):
            return type(values)([self.rebuilt(value, tensors) for value in values])
        return values


class _Pass:
    """``None`` in a spec tree: its value passes through, tensors and all."""

    def leaves(self, values: Any) -> Leaves:
        return []

    def rebuilt(self, values: Any, tensors: Iterator[torch.Tensor]) -> Any:
        return values


class _Branches:
    """An inner node of a flattened spec tree: its path, as JAX words it, and its
    branches, by key (a dict's) or in order (a tuple's or list's)."""

    def __init__(self, path: str, branches: dict[Any, _Node] | tuple[_Node, ...]) -> None:
        self.path = path
        self.branches = branches

    def leaves(self, values: Any) -> Leaves:
        """The tensors of ``values``, in order, each with its spec's number; a value of
        another shape than the tree's is a :class:`ConfigError`."""
        if isinstance(self.branches, dict):
            if not isinstance(values, dict) or set(values) != set(self.branches):
                raise ConfigError(
                    f"{self.path} is a dict with keys {sorted(map(str, self.branches))}, "
                    f"the value is {_describe(values)}"
                )
            return [
                leaf for key, value in values.items() for leaf in self.branches[key].leaves(value)
            ]
        if not isinstance(values, (tuple, list)) or len(values) != len(self.branches):
            raise ConfigError(
                f"{self.path} has {len(self.branches)} entries, the value is {_describe(values)}"
            )
        return [
            leaf for branch, value in zip(self.branches, values) for leaf in branch.leaves(value)
        ]

    def rebuilt(self, values: Any, tensors: Iterator[torch.Tensor]) -> Any:
        """``values``, flattened by :meth:`leaves`, with its tensors taken from ``tensors``."""
        if isinstance(self.branches, dict):
            return {
                key: self.branches[key].rebuilt(value, tensors) for key, value in values.items()
            }
        return type(values)(
            [branch.rebuilt(value, tensors) for branch, value in zip(self.branches, values)]
        )


_Node = _Spec | _Pass | _Branches


class _FlatSpecs:
    """A spec tree flattened once: its specs in order, numbered from ``first``, each with
    its path (``out_specs['a'][1]``), and ``tree``, against which each call's values are
    flattened into tensors with their specs' numbers and rebuilt with other tensors.

    Example: ``_FlatSpecs((P("tp"), None), "in_specs", first=0).tree.leaves((x, 3))`` is
    ``[(0, x)]``.
    """

    def __init__(self, tree: SpecTree, path: str, first: int) -> None:
        self.tree, numbered = _numbered(tree, path, first)
        self.specs = tuple(spec for spec, _ in numbered)
        self.paths = tuple(spec_path for _, spec_path in numbered)


def _numbered(tree: SpecTree, path: str, first: int) -> tuple[_Node, list[tuple[P, str]]]:
    """``tree`` with each P replaced by its number, counting from ``first``, and its specs
    in order with their paths. The one rule of what a tree holds (P, None, tuples, lists
    and dicts); anything else is a :class:`ConfigError`."""
    if tree is None:
        return _Pass(), []
    if isinstance(tree, P):
        return _Spec(first), [(tree, path)]
    if isinstance(tree, dict):
        keyed = [(key, branch, f"{path}[{key!r}]") for key, branch in tree.items()]
    elif isinstance(tree, (tuple, list)):
        keyed = [(number, branch, f"{path}[{number}]") for number, branch in enumerate(tree)]
    else:
        raise ConfigError(
            f"{path}: a spec tree holds P, None, tuples, lists and dicts, not {type(tree).__name__}"
        )
    branches: dict[Any, _Node] = {}
    numbered: list[tuple[P, str]] = []
    for key, branch, branch_path in keyed:
        branches[key], branch_specs = _numbered(branch, branch_path, first + len(numbered))
        numbered += branch_specs
    node = _Branches(path, branches if isinstance(tree, dict) else tuple(branches.values()))
    return node, numbered


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"
