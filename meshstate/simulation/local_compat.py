"""The simulation layer's private torch names (those behind simulated worlds), kept in one place.

``torch.distributed._local_tensor`` (torch 2.13) runs every rank of a world in
one process: under ``LocalTensorMode`` a tensor holds one value per rank and a
collective computes every group's result. Nothing of it is public yet; each
function here says which private name it relies on. Importing this module
imports torch's; :mod:`meshstate.core.world` tells, without importing
either, whether a simulation is on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed._local_tensor as _simulation
# Public as torch.distributed.FileStore, which torch does not declare exported: strict typing
# sees this name (the stages of a staged world meet through one file).
from torch._C._distributed_c10d import FileStore as FileStore
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
# The per-rank integer node torch's simulation maps to each rank's value in every op;
# meshstate's per-rank integers subclass it so they reach aten ops as torch's do.
from torch.distributed._local_tensor import LocalIntNode as LocalIntNode
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    _int_on_rank,
    enabled_local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed._local_tensor._c10d import _prepare_collective_groups
# A functional collective's result, waited for on first use.
from torch.distributed._functional_collectives import AsyncCollectiveTensor
# What torch.compile makes of a tensor while it traces: it holds no storage to share.
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from meshstate.core.compat import torch_compiling_on_one_rank, tracing
from meshstate.errors import OTHER_WORLDS, SimulationError


def enabled_ranks() -> frozenset[int] | None:
    """The ranks the enabled ``LocalTensorMode`` of this thread simulates, or ``None``.

    Uses ``enabled_local_tensor_mode`` and the mode's ``ranks``.
    """
    mode = enabled_local_tensor_mode()
    return None if mode is None else frozenset(mode.ranks)


def ranks_of_eager_ops() -> frozenset[int] | None:
    """:func:`enabled_ranks`, but ``None`` while this thread traces for ``torch.compile``
    (dynamo's trace and its run on fake tensors): a graph traced in a simulated world
    carries no rank, and torch's simulation runs it for every rank."""
    return None if tracing() else enabled_ranks()


def mode_ranks() -> frozenset[int] | None:
    """The ranks this thread's ``LocalTensorMode`` simulates, paused or not, or ``None``.

    Uses ``local_tensor_mode`` and the mode's ``ranks``.
    """
    mode = _simulation.local_tensor_mode()
    return None if mode is None else frozenset(mode.ranks)


class _SimulatedMode(LocalTensorMode):
    """torch's ``LocalTensorMode``, which also runs per rank an op on tensors every rank
    shares whose integers differ per rank (``W.narrow(1, 3 * t, 3)`` of a ``W`` made outside
    the body), draws each rank's numbers from its own stream of an explicit
    ``torch.Generator``, and refuses a write into a tensor every rank shares. Overrides
    ``LocalTensorMode.__torch_dispatch__`` and runs ``_local_tensor._for_each_rank_run_func``."""

    def __init__(self, ranks: frozenset[int]) -> None:
        super().__init__(ranks)  # type: ignore[no-untyped-call, unused-ignore]
        self._mesh_at: dict[int, weakref.ref[DeviceMesh]] = {}

    def __torch_dispatch__(
        self, func: Any, types: tuple[Any, ...], args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self._disable:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func.namespace == "meshstate" or tracing():
            # Passed on to the modes below, as if this one were not on the stack: a meshstate
            # op's kernel reads each rank's answers itself (under a fake mode, its fake
            # kernel); a compile's fake run carries no rank. Dynamo takes this mode off while
            # it compiles; where it was back on (CI saw it after other tests), torch's
            # simulation read each rank's mesh coordinate from fake tensors ("Could not
            # guard on data-dependent expression Eq(u0, 0)").
            return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], LocalTensor):
            return _scalar(args[0])
        flat = pytree.tree_leaves((args, kwargs))
        per_rank = any(isinstance(value, LocalTensor) for value in flat)
        if not per_rank and any(_is_per_rank_int(value) for value in flat):
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._shared, (args, kwargs))
            per_rank = True
        if per_rank and func.namespace == "aten":
            _refuse_shared_writes(func, args, kwargs or {})
        generator = next((value for value in flat if isinstance(value, torch.Generator)), None)
        if generator is not None:
            return self._draw_per_rank(func, args, kwargs or {}, generator)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _patch_device_mesh(self) -> None:
        """torch's (private ``LocalTensorMode._patch_device_mesh``), each DeviceMesh method it
        patches answering without a rank while this thread traces (:func:`_rank_free`):
        the graph reads the mesh coordinates when it runs, where torch's simulation reads
        them per rank, for the mesh it is asked about (:meth:`_for_this_mesh`)."""
        super()._patch_device_mesh()  # type: ignore[no-untyped-call, unused-ignore]
        rank_free = _rank_free(self._old_device_mesh_methods or {})
        for name, answer in rank_free.items():
            simulated = self._for_this_mesh(getattr(DeviceMesh, name))
            setattr(DeviceMesh, name, _while_tracing(answer, simulated))

    def _for_this_mesh(self, simulated: Callable[..., Any]) -> Callable[..., Any]:
        """``simulated``, having first forgotten the coordinates torch 2.13 keeps under the
        asked mesh's ``id`` (private ``_coordinate_cache``) when they were another mesh's: a
        mesh made after one is gone may take its address, and was given its coordinates.
        (torch 2.14 keeps them under the mesh's layout: a mesh of the same layout has the same
        coordinates.)"""
        @functools.wraps(simulated)
        def answer(mesh: DeviceMesh, *args: Any, **kwargs: Any) -> Any:
            known = self._mesh_at.get(id(mesh))
            if known is None or known() is not mesh:
                self._coordinate_cache.pop(id(mesh), None)  # type: ignore[call-overload, unused-ignore]
                self._mesh_at[id(mesh)] = weakref.ref(mesh)
            return simulated(mesh, *args, **kwargs)

        return answer

    def _patch_dist(self) -> None:
        """Leave ``dist.get_rank`` to the simulated world's own answer: torch 2.14's
        ``LocalTensorMode`` replaces it on enter (private ``_patch_dist``) with one that answers
        for every member of a group, other stages' ranks too, and whichever replacement is
        entered last wins. (torch 2.13 has no such method and calls none.)"""

    def _unpatch_dist(self) -> None:
        """Nothing to restore (see ``_patch_dist``)."""

    def _shared(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` held by every simulated rank, one storage for all (views stay views)."""
        shared: torch.Tensor = LocalTensor({rank: tensor.detach() for rank in self.ranks})  # type: ignore[no-untyped-call, unused-ignore]
        return shared

    def _draw_per_rank(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], generator: torch.Generator
    ) -> Any:
        """``func`` once per rank, each drawing from its own stream of ``generator``."""
        streams = _streams_of(generator, self.ranks)
        by_rank = {}
        for rank in sorted(self.ranks):
            generator.set_state(streams[rank])
            by_rank[rank] = _simulation._for_each_rank_run_func(
                func, frozenset({rank}), args, kwargs, alias=False
            )
            streams[rank] = generator.get_state()
        _left_at(generator, streams)
        first = by_rank[min(self.ranks)]
        if _simulation._is_inplace_op(func):
            return first
        firsts, spec = pytree.tree_flatten(first)
        flat_by_rank = {rank: pytree.tree_leaves(result) for rank, result in by_rank.items()}
        merged = [
            LocalTensor({rank: flat[index]._local_tensors[rank] for rank, flat in flat_by_rank.items()})  # type: ignore[no-untyped-call, unused-ignore]
            if isinstance(value, LocalTensor) else value
            for index, value in enumerate(firsts)
        ]
        return pytree.tree_unflatten(merged, spec)

def describe(values: Mapping[int, object], most: int = 4) -> str:
    """Per-rank values grouped by value: ``"0 on ranks 0, 2; 1 on ranks 1, 3"``.

    Shows at most ``most`` values and ``most`` ranks of each.
    """
    by_value: dict[object, list[int]] = {}
    for rank, value in sorted(values.items()):
        by_value.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in list(by_value.items())[:most]:
        shown = ", ".join(map(str, ranks[:most])) + (", …" if len(ranks) > most else "")
        parts.append(f"{value} on rank{'s' if len(ranks) > 1 else ''} {shown}")
    return "; ".join(parts) + ("; …" if len(by_value) > most else "")


def _scalar(tensor: LocalTensor) -> Any:
    """``tensor.item()`` on every rank: a per-rank int or bool, or the float every rank has."""
    values = {rank: local.item() for rank, local in tensor._local_tensors.items()}
    first = next(iter(values.values()))
    if isinstance(first, int):  # bools too
        return _simulation._combine_int_rank_results(cast(dict[int, int], values))
    if all(value == first for value in values.values()):
        return first
    raise SimulationError(
        f"Tensor.item() (or float()) of a {tensor.dtype} tensor whose value differs between the "
        f"simulated ranks ({describe(values)}): torch's simulation has no per-rank floats; keep "
        "it a tensor, or " + OTHER_WORLDS
    )


def _is_per_rank_int(value: object) -> bool:
    return isinstance(value, torch.SymInt) and isinstance(value.node, LocalIntNode)


def _cloning_a_storage() -> bool:
    """Whether the write is torch filling a storage it just made (``UntypedStorage.clone``, as
    ``copy.deepcopy`` of a tensor does: dynamo's guard on a DTensor's spec copies its mesh)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name == "clone" and frame.f_code.co_filename == _STORAGE_FILE:
            return True
        frame = frame.f_back
    return False


_STORAGE_FILE = torch.storage.__file__


def _refuse_shared_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse an op run per rank that writes into a tensor every simulated rank shares (a
    plain tensor, or views of one): each rank's write would land in the others' too."""
    arguments = func._schema.arguments
    for index, argument in enumerate(arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or index >= len(args) else args[index]
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tensor, torch.Tensor) and shared_between_ranks(tensor) and not _cloning_a_storage():
                raise SimulationError(
                    f"{func.overloadpacket.__name__}() writes per rank into a tensor of shape "
                    f"{tuple(tensor.shape)} that every simulated rank shares (one made outside "
                    "the body, or a view of one): each rank's write would reach the others; "
                    "copy it into one the body makes first (torch.empty(shape).copy_(tensor) is "
                    "each rank's own), or " + OTHER_WORLDS
                )


def shared_between_ranks(tensor: torch.Tensor) -> bool:
    """Whether the simulated ranks' values of ``tensor`` share storage (a plain tensor, or
    views of one), so that a write for one rank reaches the others'."""
    if not isinstance(tensor, LocalTensor):
        return True
    storages = [local.untyped_storage().data_ptr() for local in tensor._local_tensors.values()
                if _holds_storage(local)]
    return len(set(storages)) < len(storages)


def _holds_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has data of its own: not a meta or empty tensor, nor one
    ``torch.compile`` makes while it traces."""
    return not isinstance(tensor, FakeTensor) and tensor.untyped_storage().data_ptr() != 0


def ranks_draw_apart() -> bool:
    """Whether the simulated ranks' CPU generators have states of their own (a per-rank seed
    set them apart), rather than all drawing from the process's."""
    mode = enabled_local_tensor_mode()
    return mode is not None and bool(mode._per_rank_rng_states)


def rng_states() -> torch.Tensor | None:
    """Each simulated rank's CPU generator state (a ``LocalTensor``), or ``None`` while the
    ranks draw from the process's (torch keeps them in ``LocalTensorMode._per_rank_rng_states``
    once a per-rank seed set them apart)."""
    mode = enabled_local_tensor_mode()
    if not ranks_draw_apart() or mode is None:
        return None
    with mode.disable():
        states: torch.Tensor = LocalTensor(  # type: ignore[no-untyped-call, unused-ignore]
            {rank: mode._per_rank_rng_states[rank][0].clone() for rank in mode.ranks})
    return states


def set_rng_states(state: torch.Tensor) -> None:
    """Set each simulated rank's CPU generator state: its own from a ``LocalTensor``, else the
    same for all; their accelerator states stay."""
    mode = enabled_local_tensor_mode()
    assert mode is not None
    for rank in mode.ranks:
        own = state._local_tensors[rank] if isinstance(state, LocalTensor) else state
        accelerators = mode._per_rank_rng_states[rank][1] if rank in mode._per_rank_rng_states else {}
        mode._per_rank_rng_states[rank] = (own.clone(), accelerators)


_streams: dict[bytes, dict[int, torch.Tensor]] = {}
"""Each simulated rank's state of a generator whose ranks' streams differ, by the marker
state the generator was left in (torch hands ``__torch_dispatch__`` a new Python object for
the same generator at every op, so the state is what tells it)."""
_MARKER_SEED = 0xFFFF_FFFF_0000_0000
_plain_equal = torch.equal
_seed = torch.Generator.manual_seed


def _streams_of(generator: torch.Generator, ranks: frozenset[int]) -> dict[int, torch.Tensor]:
    state = generator.get_state()
    streams = _streams.get(bytes(state.tolist())) if _streams else None
    return dict.fromkeys(ranks, state) if streams is None else dict(streams)


def _left_at(generator: torch.Generator, streams: dict[int, torch.Tensor]) -> None:
    """Leave ``generator`` in the state every rank's stream has, else in a new marker state
    that stands for each rank's."""
    first = streams[min(streams)]
    if all(_plain_equal(first, state) for state in streams.values()):
        generator.set_state(first)
        return
    _seed(generator, _MARKER_SEED + len(_streams))
    _streams[bytes(generator.get_state().tolist())] = streams


def seed_each_rank(generator: torch.Generator, seeds: dict[int, int]) -> None:
    """Seed simulated rank ``r``'s stream of ``generator`` with ``seeds[r]``."""
    streams = {}
    for rank, seed in seeds.items():
        _seed(generator, seed)
        streams[rank] = generator.get_state()
    _left_at(generator, streams)


def comparison() -> Any:
    """The module behind ``torch.testing.assert_close`` (``torch.testing._comparison``), whose
    ``not_close_error_metas`` every comparison of it calls by name."""
    import torch.testing._comparison as comparison

    return comparison


def fsdp_param_modules() -> tuple[Any, Any]:
    """FSDP2's parameter modules (``fsdp._fully_shard._fsdp_param`` and
    ``_fsdp_param_group``): the first cuts a parameter into its shards by the name
    ``_chunk_with_empty`` and frees and regrows its storage by ``free_storage`` and
    ``alloc_storage``, the second regrows it by ``alloc_storage`` too."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    return _fsdp_param, _fsdp_param_group


def fsdp_mesh_infos() -> tuple[tuple[Any, str, str], ...]:
    """FSDP2's mesh facts (``fsdp._fully_shard._fsdp_common``'s ``FSDPMeshInfo`` and
    ``DDPMeshInfo``), each with the attribute holding its group and the one holding the
    caller's rank in it, which its ``__post_init__`` reads once from the group."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    return ((FSDPMeshInfo, "shard_process_group", "shard_mesh_rank"),
            (DDPMeshInfo, "replicate_process_group", "replicate_mesh_rank"))


def tree_node_like_tuple(kind: type[tuple[Any, ...]]) -> None:
    """Have torch's pytrees (``vmap``'s outputs, ``tree_map``) walk ``kind``, a tuple
    subclass, as the tuple it stands for, which they would take whole. Uses
    ``torch.utils._pytree.register_pytree_node``."""
    pytree.register_pytree_node(
        kind, lambda parts: (list(parts), None), lambda children, _: tuple(children)
    )


def _rank_free(own: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The DeviceMesh methods torch's simulation patches, as a graph that carries no rank
    asks them (``own``: torch's own): a coordinate is an integer read when the graph runs
    (``_sym_get_coordinate`` under torch's ``compile_on_one_rank`` flag), and the global
    rank, which no op reads then, is refused."""
    def coordinate_on(mesh: DeviceMesh, index: int) -> Any:
        with torch_compiling_on_one_rank():
            return own["_sym_get_coordinate"](mesh, index)

    def coordinate(mesh: DeviceMesh) -> list[Any] | None:
        if not own["_is_current_rank_part_of_mesh"](mesh):
            return None
        return [coordinate_on(mesh, index) for index in range(mesh.ndim)]

    def local_rank(mesh: DeviceMesh, mesh_dim: int | str | None = None) -> Any:
        index = (mesh.mesh_dim_names or ()).index(mesh_dim) if isinstance(mesh_dim, str) else mesh_dim or 0
        return coordinate_on(mesh, index)

    def rank(mesh: DeviceMesh) -> int:
        raise SimulationError(
            "DeviceMesh.get_rank() inside torch.compile in a simulated world: the graph is "
            "traced once for every rank, and no op reads the global rank when it runs"
        )

    return {"_sym_get_coordinate": coordinate_on, "get_coordinate": coordinate,
            "get_local_rank": local_rank, "get_rank": rank,
            "_is_current_rank_part_of_mesh": own["_is_current_rank_part_of_mesh"]}


def _while_tracing(rank_free: Callable[..., Any], simulated: Callable[..., Any]) -> Callable[..., Any]:
    """``simulated`` (a DeviceMesh method as torch's simulation patches it), except while
    this thread traces: then ``rank_free``."""
    @functools.wraps(simulated)
    def answer(*args: Any, **kwargs: Any) -> Any:
        return (rank_free if tracing() else simulated)(*args, **kwargs)

    return answer


def local_tensor_mode(ranks: frozenset[int]) -> LocalTensorMode:
    """torch's mode that runs every op and collective once per rank of ``ranks``
    (``LocalTensorMode``, extended by the dispatch above)."""
    return _SimulatedMode(ranks)


def tables_of_torch_for_dynamo() -> None:
    """Have dynamo build its tables of torch's functions and Tensor methods now (private
    ``torch._dynamo.trace_rules``, each built once, on first use): built while the
    simulation's replacements are in, they would hold those, and dynamo would refuse to
    call torch's own (``Tensor.chunk``) inside a replacement it traces."""
    from torch._dynamo import trace_rules

    trace_rules.get_torch_obj_rule_map()
    trace_rules.get_tensor_method()


def simulation_paused() -> contextlib.AbstractContextManager[None]:
    """A block in which tensor ops run once, as in a plain process, not once per rank
    (to read each rank's values). Uses ``maybe_disable_local_tensor_mode``."""
    paused: contextlib.AbstractContextManager[None] = maybe_disable_local_tensor_mode()
    return paused


def per_rank_rows(rows: torch.Tensor, first: int = 0) -> torch.Tensor:
    """A tensor whose value on simulated rank ``first + i`` is ``rows[i]`` (a view of it):
    made for every rank at once, where ``LocalTensorMode.rank_map`` would run an op per
    rank. Builds a ``LocalTensor`` from its per-rank dict.
    """
    with maybe_disable_local_tensor_mode():
        local: torch.Tensor = LocalTensor(dict(enumerate(rows.unbind(0), first)))  # type: ignore[no-untyped-call, unused-ignore]
    return local


def per_rank_tensor(values: dict[int, torch.Tensor]) -> torch.Tensor:
    """A tensor whose value on simulated rank ``r`` is ``values[r]`` (detached). Builds a
    ``LocalTensor``."""
    with maybe_disable_local_tensor_mode():
        local: torch.Tensor = LocalTensor({rank: value.detach() for rank, value in values.items()})  # type: ignore[no-untyped-call, unused-ignore]
    return local


def replicated(tensor: torch.Tensor, ranks: frozenset[int]) -> torch.Tensor:
    """``tensor`` held by every simulated rank of ``ranks`` (a copy each): what
    ``torch.tensor`` makes for every rank in a simulated body. Builds a ``LocalTensor``."""
    if isinstance(tensor, LocalTensor):
        return tensor
    with maybe_disable_local_tensor_mode():
        local: torch.Tensor = LocalTensor({rank: tensor.clone() for rank in ranks})  # type: ignore[no-untyped-call, unused-ignore]
    return local


def is_simulated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds a value per simulated rank (a ``LocalTensor``)."""
    return isinstance(tensor, LocalTensor)


def tensor_by_rank(tensor: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Each simulated rank's value of ``tensor``, or ``None`` for a plain tensor.

    Reads ``LocalTensor._local_tensors``, after waiting for a functional collective's
    result (``_functional_collectives.AsyncCollectiveTensor``, what a TP layer returns).
    """
    if isinstance(tensor, AsyncCollectiveTensor):
        tensor = tensor.trigger_wait()  # type: ignore[no-untyped-call]
    if isinstance(tensor, LocalTensor):
        values: dict[int, torch.Tensor] = tensor._local_tensors
        return values
    return None


def int_on_rank(node: Any, rank: int) -> int:
    """Simulated rank ``rank``'s value of an integer ``SymInt`` node (a per-rank
    ``LocalIntNode``, a constant) or of a plain int. Uses ``_local_tensor._int_on_rank``.
    """
    value: int = _int_on_rank(node, rank)
    return value


def local_ints(node: LocalIntNode) -> dict[int, int]:
    """Each simulated rank's value of a per-rank integer node: ``LocalIntNode._local_ints``."""
    values: dict[int, int] = node._local_ints
    return values


def constant_bool_node(value: bool) -> Any:
    """torch's constant ``SymBool`` node: what a per-rank comparison that every rank
    answers alike returns. Uses ``torch._C._get_constant_bool_symnode``, as
    ``LocalIntNode``'s own comparisons do."""
    return torch._C._get_constant_bool_symnode(value)


_QUERIES = frozenset({"get_rank"})
"""What torch's simulation asks the groups of without moving data: torch 2.14's
``LocalTensorMode`` answers ``dist.get_rank(group)`` so, and torch's collective logger asks
it before every collective."""


@contextlib.contextmanager
def collectives_checked(
    check: Callable[[str, ProcessGroup, list[tuple[int, ...]]], None]
) -> Iterator[None]:
    """A block in which every collective torch's simulation runs is first shown to ``check``:
    its name (``"broadcast"``), the group, and the rank sets it would run over (which
    ``check`` may refuse). Wraps ``_local_tensor._c10d._prepare_collective_groups``, which
    every one of them (``_local_broadcast_``, ``_local_functional_all_gather_into_tensor``,
    …) calls first."""
    prepare = _simulation._c10d._prepare_collective_groups

    def checked(group: Any) -> tuple[list[int], list[int], int]:
        relative, offsets, offset = prepare(group)
        unboxed = ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group
        caller = sys._getframe(1).f_code.co_name
        name = caller.removeprefix("_local_").removeprefix("functional_").strip("_")
        if name not in _QUERIES:
            check(name, unboxed, [tuple(start + rank for rank in relative) for start in offsets])
        return relative, offsets, offset

    with mock.patch.object(_simulation._c10d, "_prepare_collective_groups", checked):
        yield


def collective_groups(group: ProcessGroup) -> list[tuple[int, ...]]:
    """The rank sets the simulation runs each collective over ``group`` on.

    torch infers them from the group the process holds (rank 0's): its ranks
    read as a strided grid, repeated over the rest of the world. Raises
    ``AssertionError`` where they are no such grid. Uses
    ``_local_tensor._c10d._prepare_collective_groups``.
    """
    relative, offsets, _ = _prepare_collective_groups(group)
    return [tuple(offset + rank for rank in relative) for offset in offsets]


def raised_inside(error: BaseException) -> bool:
    """Whether ``error`` was raised inside torch's simulation (its innermost frame is in
    ``torch/distributed/_local_tensor``), as an op it cannot simulate is."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(os.path.dirname(_simulation.__file__))


def failed_compiling(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.compile`` failing (``torch._dynamo.exc.TorchDynamoException``:
    dynamo's tracing, its fake run, or the backend's), as it does on a simulated world's
    per-rank sizes (dynamo reads ``has_hint`` of every symbolic integer's node) and on
    ``LocalTensor``s it makes fake (AOTAutograd meets a tensor of one as a constant)."""
    dynamo_errors = sys.modules.get("torch._dynamo.exc")
    return dynamo_errors is not None and isinstance(error, dynamo_errors.TorchDynamoException)


def failed_in_the_backend(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.compile``'s backend failing on the graph dynamo traced
    (``torch._dynamo.exc.BackendCompilerFailed``)."""
    dynamo_errors = sys.modules.get("torch._dynamo.exc")
    return dynamo_errors is not None and isinstance(error, dynamo_errors.BackendCompilerFailed)


@contextlib.contextmanager
def ints_made_as(combine: Callable[[dict[int, int]], Any], node: type[LocalIntNode]) -> Iterator[None]:
    """A block in which every per-rank integer torch's simulation makes (``.item()``, a
    size, a tensor's per-rank shape) is ``combine(values by rank)``, or a ``node``, instead
    of its own. Replaces ``_local_tensor._combine_int_rank_results`` and
    ``_local_tensor.LocalIntNode``, whose ``==`` answers for all ranks at once."""
    with mock.patch.object(_simulation, "_combine_int_rank_results", combine), \
            mock.patch.object(_simulation, "LocalIntNode", node):
        yield


def run_for_each_rank(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` once per simulated rank, each with that rank's values of the
    per-rank integers in ``args``; results combined into per-rank values. Uses
    ``_local_tensor.maybe_run_for_local_tensor``."""
    return _simulation.maybe_run_for_local_tensor(function)(*args)


def forget_random_state() -> None:
    """Drop the RNG tracker DTensor keeps once a simulated world used it (a per-rank
    one), as torch's own simulated tests do, and each generator's per-rank streams.
    Resets ``tensor._random._rng_tracker``."""
    random = sys.modules.get("torch.distributed.tensor._random")
    if random is not None:
        setattr(random, "_rng_tracker", None)
    _streams.clear()
