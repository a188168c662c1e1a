"""meshstate's collectives as spmd_types' checker types them (torchtitan's type system).

spmd_types types each local tensor per mesh axis: ``V`` varying, ``I`` invariant,
``R`` replicated with its gradient pending a sum (JAX's pvary'd value), ``P`` a
pending sum (JAX's unreduced). While its checker runs
(``spmd_types.checker.typecheck``), each meshstate collective is one autograd
Function whose ``spmd_typecheck`` hook types it as spmd_types' table of
megatron-core mappings does, axis by axis of the axes it names, leaving the
others as they were; the c10d call underneath runs with the checker paused, so it
is not what the checker types. Values and gradients are the unchecked call's.

=========================  =============================================
meshstate                  spmd_types (each named axis)
=========================  =============================================
``pvary``                  ``convert(I -> R)``
``psum``, ``pmean``        ``all_reduce(V or P -> I)``
``pmax``, ``pmin``         ``all_reduce(V -> I)``
``all_gather``             ``all_gather(V -> R)`` (tiled: ``S(axis)``)
``all_gather_invariant``   ``all_gather(V -> I)`` (tiled: ``S(axis)``)
``psum_scatter``           ``reduce_scatter(V or P -> V)`` (tiled: ``S(dim)``; untiled
                           over one axis only)
``all_to_all``             ``all_to_all(V -> V)`` (tiled: ``S(concat) -> S(split)``)
``ppermute``               ``V -> V`` (typed as ``all_to_all``)
=========================  =============================================

A wrong input type is refused by the checker, in its own words. spmd_types is
never imported here: without it, or with its checker off, nothing changes (one
``sys.modules`` lookup a call).

Example (4 ranks, ``init_mesh(tp=2)``, ``x`` typed ``{tp: V, dp: I}``)::

    with spmd.set_current_mesh(mesh.dense), typecheck(strict_mode="strict", local=True):
        spmd.get_local_type(psum(x, "tp"))     # {tp: I, dp: I}
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import current_mesh, live_meshes
from meshstate.core.ordered import OrderedGroup
from meshstate.errors import ConfigError, MeshStateError
from meshstate.jax.torch_calls import Axes
from meshstate.jax.types.system import CollectiveRule, Move
from meshstate.jax.types.vma import NO_AXES, own_type, typed

MODULE = "spmd_types"
"""The checker's module, read from ``sys.modules`` (never imported here)."""
_loaded = sys.modules
_dynamo_traces = torch.compiler.is_dynamo_compiling
"""True only in dynamo's trace, where it sets no guard: asked before ``sys.modules``,
whose size dynamo guards on when a trace reads it (every import after would trace again)."""


def paused() -> Any:
    """A context in which spmd_types' checker types nothing (its ``no_typecheck``)."""
    return _loaded[MODULE].no_typecheck()


@dataclass
class CheckedCall:
    """One collective call as the checker types it: its kind (a row of the table), its
    work, its group and the groups of the axes it names (size 1 left out, as
    spmd_types leaves them out), and, with ``tiled``, the dims its axes split: a gather's
    or a scatter's dim, an all_to_all's split and concat dims. Without ``ordered`` it runs
    on the group :class:`TypedCollective` is given, in that group's rank order
    (``spmd_types.rulecheck`` makes its own).
    ``result_axes`` carries the meshstate type its result had inside a typed
    ``shard_map`` body out of the autograd Function."""

    kind: str
    run: Move
    ordered: OrderedGroup | None = None
    axis_groups: tuple[dist.ProcessGroup, ...] = ()
    dims: tuple[int, ...] = (0,)
    tiled: bool = False
    result_axes: frozenset[str] | None = field(default=None, compare=False)

    def __repr__(self) -> str:  # how the checker names the call in its messages
        tiled = f", tiled over dims {self.dims}" if self.tiled else ""
        return f"meshstate collective ({self.kind}{tiled})"

    def given(self, group: dist.ProcessGroup) -> bool:
        """Whether ``group`` is this call's own (not one rulecheck made)."""
        return self.ordered is not None and group is self.ordered.group


def checked(x: torch.Tensor, group: OrderedGroup, call: CheckedCall) -> torch.Tensor:
    """``call.run(x, group)``, typed by the checker through :class:`TypedCollective`."""
    # Looked up each call: the checker replaces Function.apply while it runs.
    apply = cast(Callable[..., torch.Tensor], getattr(TypedCollective, "apply"))
    result = apply(x, group.group, call)
    if call.result_axes is not None:
        typed(result, call.result_axes)
    return result


class CheckerTypes:
    """spmd_types' checker, while it runs in this thread: each collective one
    :class:`TypedCollective`, typed axis by axis of the axes it names."""

    def refuse(self, rule: CollectiveRule, x: torch.Tensor, axes: Axes, names: frozenset[str]) -> None:
        """Nothing: the checker refuses a wrong input type in its own words, as the call runs."""

    def around(
        self, rule: CollectiveRule, axes: Axes, names: frozenset[str], mesh: ParallelMesh | None,
        move: Move, dims: tuple[int, ...], tiled: bool,
    ) -> Move:
        groups = axis_groups(current_mesh() if mesh is None else mesh, names)
        return lambda x, group: checked(x, group, CheckedCall(rule.checker_kind, move, group, groups, dims, tiled))


CHECKER_TYPES = CheckerTypes()


def axis_groups(parallel_mesh: ParallelMesh, names: frozenset[str]) -> tuple[dist.ProcessGroup, ...]:
    """The process group of each mesh axis of ``names``, size 1 left out (the checker's axes)."""
    return tuple(parallel_mesh.group(axis) for axis in sorted(names)
                 if parallel_mesh.size(axis) > 1)


class TypedCollective(torch.autograd.Function):
    """A meshstate collective as one autograd Function with an ``spmd_typecheck`` hook.

    ``forward`` runs the collective with the checker paused, recording its autograd
    graph; ``backward`` runs that graph (the collective's own transpose).
    ``group`` is the process group the hook types on; where it is not the call's
    own (``spmd_types.rulecheck`` passes a group of its own making), the collective
    runs on it in its rank order.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, call: CheckedCall) -> torch.Tensor:
        own = call.ordered
        ordered = own if own is not None and call.given(group) else OrderedGroup.in_group_order(group)
        with paused(), torch.enable_grad():
            inner = x.detach().requires_grad_(x.requires_grad)
            result = call.run(inner, ordered)
        call.result_axes = own_type(result)
        ctx.graph = (inner, result) if result.requires_grad else None
        return result.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if ctx.graph is None:
            return None, None, None
        inner, result = ctx.graph
        with paused():
            (grad_x,) = torch.autograd.grad(result, inner, grad)
        return grad_x, None, None

    @staticmethod
    def spmd_typecheck(*, x: torch.Tensor, group: dist.ProcessGroup, call: CheckedCall) -> Any:
        groups = call.axis_groups if call.given(group) else (group,)
        if not groups:  # every axis it names has size 1: spmd_types types nothing there
            _rules().ignore(x)
            return x
        typed_value: Any = x
        for number, axis_group in enumerate(groups):
            first, last = number == 0, number == len(groups) - 1
            typed_value = _STEPS[call.kind](typed_value, axis_group, first, last, call)
        return typed_value


def _rules() -> Any:
    return _loaded[MODULE].rules


def _type(name: str) -> Any:
    """spmd_types' ``V``, ``I``, ``R`` or ``P``."""
    return getattr(_loaded[MODULE], name)


def _source(x: Any, group: dist.ProcessGroup, *accepted: str) -> Any:
    """The type ``x`` has on ``group``'s axis where the rule accepts it (a reduction takes
    ``V`` as spmd_types' own collectives do, reinterpreted as ``P``), else the last type
    it accepts, which the checker then refuses in its own words."""
    spmd_types: Any = _loaded[MODULE]
    kind = spmd_types.get_local_type(x).get(spmd_types.MeshAxis.of(group))
    return kind if any(kind is _type(name) for name in accepted) else _type(accepted[-1])


Step = Callable[[Any, dist.ProcessGroup, bool, bool, CheckedCall], Any]
"""A rule on one axis: the value so far, the axis's group, whether it is the first and the
last axis the call names, and the call."""


def _gathered(dst: str) -> Step:
    def step(x: Any, group: dist.ProcessGroup, first: bool, last: bool, call: CheckedCall) -> Any:
        stacks = first and not call.tiled  # the stack form adds one dim, once
        src = _type("V") if stacks else _type("S")(call.dims[0])
        return _rules().all_gather(x, group, src=src, dst=_type(dst))
    return step


def _scattered(x: Any, group: dist.ProcessGroup, first: bool, last: bool, call: CheckedCall) -> Any:
    if not call.tiled and not (first and last):
        raise ConfigError(
            "psum_scatter over several axes with tiled=False under spmd_types' checker: "
            "spmd_types types the dim it removes on one axis only (its unbinding "
            "reduce_scatter); pass tiled=True, or scatter over one axis at a time"
        )
    dst = _type("S")(call.dims[0]) if call.tiled else _type("V")  # untiled: the dim goes
    return _rules().reduce_scatter(x, group, src=_source(x, group, "V", "P"), dst=dst)


def _exchanged(x: Any, group: dist.ProcessGroup, first: bool, last: bool, call: CheckedCall) -> Any:
    """all_to_all: tiled, a value split along its concat dim leaves split along its split dim."""
    if not call.tiled:
        return _rules().all_to_all(x, group, src=_type("V"), dst=_type("V"))
    split, concat = call.dims
    return _rules().all_to_all(x, group, src=_type("S")(concat), dst=_type("S")(split))


_STEPS: dict[str, Step] = {
    "convert": lambda x, group, first, last, call: _rules().convert(
        x, group, src=_type("I"), dst=_type("R")),
    "sum": lambda x, group, first, last, call: _rules().all_reduce(
        x, group, src=_source(x, group, "V", "P"), dst=_type("I")),
    "extreme": lambda x, group, first, last, call: _rules().all_reduce(
        x, group, src=_source(x, group, "V"), dst=_type("I")),
    "gather": _gathered("R"),
    "gather_invariant": _gathered("I"),
    "scatter": _scattered,
    "exchange": _exchanged,
    "permute": lambda x, group, first, last, call: _rules().all_to_all(
        x, group, src=_type("V"), dst=_type("V")),
}
"""Each kind's rule on one axis (the table in the module's docstring)."""


def spmd_typed(value: torch.Tensor, like: torch.Tensor, varying: frozenset[str],
               view_axes: tuple[str, ...], parallel_mesh: ParallelMesh) -> torch.Tensor:
    """``value`` typed for the checker: ``V`` on the axes ``varying`` names, ``like``'s type
    on the other axes of the view (``I`` where ``like`` has none). A ``shard_map`` block
    is typed so (``varying``: its in-spec's axes, ``like``: its argument, a plain tensor
    holding the whole value on every rank), and ``axis_index``'s typed value."""
    spmd_types: Any = _loaded[MODULE]
    own = spmd_types.get_local_type(like) if spmd_types.has_local_type(like) else {}
    before = spmd_types.get_local_type(value) if spmd_types.has_local_type(value) else {}
    added, changed = {}, {}
    for axis, mesh_axis in _spmd_axes(parallel_mesh, view_axes):
        wanted = spmd_types.V if axis in varying else own.get(mesh_axis, spmd_types.I)
        if mesh_axis not in before:
            added[mesh_axis] = wanted
        elif before[mesh_axis] is not wanted:
            changed[mesh_axis] = wanted
    if added:
        spmd_types.assert_type(value, added)
    if changed:
        spmd_types.mutate_type(value, src={axis: before[axis] for axis in changed}, dst=changed)
    return value


def _spmd_axes(parallel_mesh: ParallelMesh, view_axes: tuple[str, ...]) -> list[tuple[str, Any]]:
    """Each of ``view_axes`` but those of size 1, and its spmd_types ``MeshAxis``."""
    spmd_types: Any = _loaded[MODULE]
    return [(axis, spmd_types.MeshAxis.of(parallel_mesh.group(axis)))
            for axis in view_axes if parallel_mesh.size(axis) > 1]


def checking() -> bool:
    """Whether spmd_types' checker types this thread's torch calls now (never while
    ``torch.compile`` traces; spmd_types is read from ``sys.modules``, never imported).
    The checker is a torch function mode: where none is on (one C call to ask), it is off,
    and asking spmd_types (400 ns in a thread that never checked) is skipped."""
    if not _compat.torch_function_mode_on() or _dynamo_traces():
        return False
    spmd_types = _loaded.get(MODULE)
    return spmd_types is not None and not _compat.tracing() and spmd_types.is_type_checking()


def may_have_typed() -> bool:
    """Whether spmd_types may have typed a tensor (it is imported; never while tracing)."""
    return not _dynamo_traces() and MODULE in _loaded and not _compat.tracing()


def varying_axes(x: torch.Tensor) -> frozenset[str]:
    """The axes of the current mesh that spmd_types types ``x`` ``V``, ``R`` or ``P`` on
    (none where it has no spmd type, or there is no current mesh)."""
    spmd_types: Any = _loaded[MODULE]
    if not spmd_types.has_local_type(x):
        return NO_AXES
    try:
        names = _spmd_axis_names(current_mesh(), spmd_types)
    except MeshStateError:
        names = _names_where_spmd_types_types(spmd_types)
    varying = (spmd_types.V, spmd_types.R, spmd_types.P)
    return frozenset(
        names[axis] for axis, kind in spmd_types.get_local_type(x).items()
        if kind in varying and axis in names
    )


def _spmd_axis_names(parallel_mesh: ParallelMesh, spmd_types: Any) -> dict[Any, str]:
    """The axes of ``parallel_mesh`` by spmd_types' ``MeshAxis`` (size-1 axes left out, as
    spmd_types leaves them), kept in the mesh's store."""
    names: dict[Any, str] | None = parallel_mesh.store.get(_SPMD_AXES)
    if names is None:
        layout, names = parallel_mesh.layout, {}
        # dense axes first: an expert axis over the same ranks (etp, tp) is the same MeshAxis
        for axis in (*layout.dense.axes_fastest_first, *layout.expert.axes_fastest_first):
            if parallel_mesh.size(axis) > 1:
                names.setdefault(spmd_types.MeshAxis.of(parallel_mesh.group(axis)), axis)
        parallel_mesh.store[_SPMD_AXES] = names
    return names


def _names_where_spmd_types_types(spmd_types: Any) -> dict[Any, str]:
    """Outside ``with mesh:``, the axes of the one live mesh that spmd_types' current mesh
    is made of; none where spmd_types has no current mesh. Several such meshes, or none,
    are refused: an answer from another grid would be silently wrong."""
    typed_over = spmd_types.current_mesh()
    if not typed_over:
        return {}
    found = [names for names in (_spmd_axis_names(mesh, spmd_types) for mesh in live_meshes())
             if set(typed_over) <= set(names)]
    if len(found) != 1:
        raise MeshStateError(
            f"vma: spmd_types types values over {sorted(map(str, typed_over))}, which "
            f"{'no live mesh' if not found else f'{len(found)} live meshes'} of this rank "
            "name; ask inside `with mesh:` for the mesh whose axes you mean"
        )
    return found[0]


_SPMD_AXES = ("spmd_checker", "spmd_types axes")
"""The key in a mesh's store of its axes by spmd_types' ``MeshAxis``."""


def refuse_legacy_shard_map() -> NoReturn:
    """Refuse ``shard_map(check_vma=False)`` while the checker runs: that mode has no types."""
    raise ConfigError(
        "shard_map(check_vma=False) under spmd_types' checker: JAX's legacy mode has no "
        "types (its psum's backward is a psum, which no spmd_types type says); use "
        "check_vma=True, JAX's default, whose types the checker follows"
    )
