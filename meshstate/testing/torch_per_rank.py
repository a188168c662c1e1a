"""torch and torch.distributed as each simulated rank sees them, while a simulated body runs.

:func:`per_rank_torch` patches what a test body calls and torch's simulation alone would
answer for rank 0 or refuse from its internals: ranks and groups per rank, shards cut
by a per-rank integer, tensors made of per-rank integers, explicit generators, object
collectives, comparisons, text and logging; and it refuses by name what one program for
all ranks cannot follow (point-to-point, a group of some ranks, DDP, FSDP). torch's and
meshstate's own modules keep c10d's answers (the process's, rank 0's), which torch's
simulation runs every collective from. :mod:`meshstate.testing.simulated` turns it on.

Example, inside ``simulated_world(4).run``::

    t = meshstate.init_mesh(tp=2).rank("tp")
    W[:, t * 3:(t + 1) * 3]          # each rank's shard
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import resolve_name

from meshstate.core.compat import mesh_copies
from meshstate.errors import OTHER_WORLDS, SimulationError
from meshstate.layout.ranks import ranks_text
from meshstate.simulation import local_compat
from meshstate.simulation.per_rank import (
    GroupMembers,
    PerRankIntNode,
    PerRankParts,
    group_rank,
    holds_per_rank,
    members,
    per_rank_bool,
    per_rank_int,
    per_rank_value,
    tiling_mismatch,
    value_on,
)
from meshstate.simulation.the_body import from_a_library, the_bodys_line


_NOT_SIMULATED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
"""Point-to-point calls: torch simulates them only with a thread per rank (LocalRunnerMode)."""
_GATHERS = ("all_gather_into_tensor", "all_gather_single")
_IN_PLACE_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all_single",
)
"""c10d collectives that write a tensor they are given: torch's simulation computes them for
tensors that hold every rank's value, and leaves a plain tensor as it was (so do ``_GATHERS``)."""


@contextlib.contextmanager
def per_rank_torch() -> Iterator[None]:
    """``torch`` and ``torch.distributed`` as each simulated rank sees them, while a body runs.

    ``get_rank()`` answers per rank; list-form ``all_gather`` gathers each
    group's values (torch 2.13's simulation gives every rank the last group's);
    ``torch.equal``, ``torch.allclose``, ``torch.testing.assert_close`` (a failure names
    the ranks) and every integer an op gives (``.item()``) answer per rank, comparisons
    included; a per-rank integer indexes a tensor (``W[t]``) and the parts ``chunk``,
    ``split``, ``tensor_split`` and ``unbind`` give; ``torch.tensor`` of per-rank
    integers, ``torch.Generator().manual_seed`` of a per-rank seed, a group's members
    and rank (``get_process_group_ranks``, ``get_global_rank``, ``get_group_rank``,
    ``group.rank()``, ``DeviceMesh.mesh``), ``all_gather_object`` and
    ``broadcast_object_list`` are per rank; logging's ``%s`` arguments give a line per
    rank. ``str()`` or a format of a per-rank value, point-to-point calls (real between
    the stages of a world simulated stage by stage: :mod:`meshstate.testing.stages`),
    a ``new_group`` of some ranks, subgroups the simulation would read otherwise,
    DistributedDataParallel and FSDP1 raise :class:`SimulationError`; FSDP2
    (``fully_shard``) shards, frees and regrows each rank's parameters. torch's and
    meshstate's own modules keep c10d's answers (the process's, rank 0's).
    """
    # torch names the functions a torch function mode sees from a table it builds once,
    # on its first question: asked now, it holds torch's own functions, not these.
    resolve_name(torch.add)
    local_compat.tables_of_torch_for_dynamo()  # so does dynamo
    with contextlib.ExitStack() as patches:
        for owner, name, replacement in _replaced():
            patches.enter_context(mock.patch.object(owner, name, replacement))
        patches.enter_context(local_compat.ints_made_as(per_rank_int, PerRankIntNode))
        yield


def _replaced() -> list[tuple[object, str, Any]]:
    """What :func:`per_rank_torch` replaces: (owner, name, replacement)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    comparison = local_compat.comparison()
    fsdp_param, fsdp_param_group = local_compat.fsdp_param_modules()
    replaced: list[tuple[object, str, Any]] = [
        (dist, "get_rank", _get_rank), (dist, "new_group", _new_group),
        (dist, "new_subgroups_by_enumeration", _new_subgroups_by_enumeration),
        (dist, "all_gather_object", _all_gather_object),
        (dist, "broadcast_object_list", _broadcast_object_list),
        (dist, "get_process_group_ranks",
         _in_the_body(_process_group_ranks, dist.get_process_group_ranks)),
        (dist, "get_global_rank", _in_the_body(_global_rank, dist.get_global_rank)),
        (dist, "get_group_rank", _in_the_body(_group_rank, dist.get_group_rank)),
        (dist.ProcessGroup, "rank", _in_the_body(_group_rank_of, dist.ProcessGroup.rank)),
        (DeviceMesh, "mesh", property(_in_the_body(_mesh_of, vars(DeviceMesh)["mesh"].fget))),
        (torch, "Generator", _Generator),
        *[(module, "get_rng_state", _in_the_body(_get_rng_state, torch.random.get_rng_state))
          for module in (torch, torch.random)],
        *[(module, "set_rng_state", _in_the_body(_set_rng_state, torch.random.set_rng_state))
          for module in (torch, torch.random)],
        (torch.random, "fork_rng", _fork_rng),
        (torch.Tensor, "__getitem__", _getitem), (torch.Tensor, "__setitem__", _setitem),
        (torch.Tensor, "split", _cut(torch.Tensor.split)),  # torch.split calls it
        (logging.Logger, "handle", _log_each_rank),
        (comparison, "not_close_error_metas", _not_close_on_some_rank(comparison.not_close_error_metas)),
        (DistributedDataParallel, "__init__", _refuse_data_parallel(
            "DistributedDataParallel", "its C++ reducer all-reduces gradients over rank 0's "
            "fake group, past torch's simulation, so no rank would get the others' gradients")),
        # FSDP2: each rank's shard, rank in its group and storage
        (fsdp_param, "_chunk_with_empty", _even_shards),
        *[(module, name, _on_each_rank_value(getattr(module, name)))
          for module in (fsdp_param, fsdp_param_group)
          for name in ("free_storage", "alloc_storage") if hasattr(module, name)],
        *[(info, "__post_init__", _rank_per_rank(info.__post_init__, group, rank))
          for info, group, rank in local_compat.fsdp_mesh_infos()],
        (FullyShardedDataParallel, "__init__", _refuse_data_parallel(
            "FullyShardedDataParallel", "it flattens parameters into storage it frees and "
            "regrows, which torch's simulated tensors have none of")),
    ]
    replaced += [(dist, name, _refuse_point_to_point(name)) for name in _NOT_SIMULATED]
    replaced += [(module, "all_gather", _all_gather) for module in (dist, c10d)]  # c10d's own all_gather_object calls it
    replaced += [(torch, name, _for_every_rank(getattr(torch, name))) for name in ("tensor", "as_tensor")]
    replaced += [(dist, name, _simulated_only(name)) for name in _IN_PLACE_COLLECTIVES if hasattr(dist, name)]
    replaced += [(dist, name, _gathered_whatever_the_shape(name)) for name in _GATHERS if hasattr(dist, name)]
    for owner in (torch, torch.Tensor):
        replaced += [(owner, "equal", _per_rank_predicate(torch.equal)),
                     (owner, "allclose", _per_rank_predicate(torch.allclose)),
                     (owner, "chunk", _cut(owner.chunk)), (owner, "tensor_split", _cut(owner.tensor_split)),
                     (owner, "unbind", _cut(owner.unbind, dim_at=0, unbound=True))]
    for symbolic in (torch.SymInt, torch.SymBool):
        replaced += [(symbolic, "__str__", _refuse_text("str()", object.__str__)),
                     (symbolic, "__format__", _refuse_text("a format (an f-string)", object.__format__))]
    return replaced


def _get_rng_state() -> torch.Tensor:
    """``torch.get_rng_state`` in a simulated body: each rank's once their streams differ."""
    states = local_compat.rng_states()
    return torch.random.get_rng_state() if states is None else states


def _set_rng_state(state: torch.Tensor) -> None:
    if not local_compat.ranks_draw_apart() and not local_compat.is_simulated(state):
        torch.random.set_rng_state(state)
    else:
        local_compat.set_rng_states(state)


@contextlib.contextmanager
def _fork_rng(*args: Any, **kwargs: Any) -> Iterator[None]:
    """``torch.random.fork_rng`` in a simulated body: each rank's state comes back too."""
    states = local_compat.rng_states()
    with _fork_rng_of_torch(*args, **kwargs):
        yield
    if states is not None and kwargs.get("enabled", True):
        local_compat.set_rng_states(states)


_fork_rng_of_torch = torch.random.fork_rng


def _get_rank(group: dist.ProcessGroup | None = None) -> int:
    """``torch.distributed.get_rank`` for every simulated rank at once."""
    if group is None or group is c10d.GroupMember.WORLD:
        return per_rank_int({rank: rank for rank in _simulated()})
    return group_rank(group)


def _simulated() -> list[int]:
    """The ranks this process simulates, in order: the world's, or one stage's of a world
    simulated stage by stage (ask it before pausing the simulation)."""
    return sorted(local_compat.mode_ranks() or range(dist.get_world_size()))


_create_group = c10d.new_group


def _new_group(ranks: Sequence[int] | None = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.new_group``, refusing a group of some ranks only."""
    world_size = dist.get_world_size()
    if ranks is not None and sorted(ranks) != list(range(world_size)):
        raise SimulationError(
            f"new_group(ranks={ranks_text(ranks)}) in a simulated world of {world_size} ranks: "
            "every simulated rank takes part in each collective over it, not only its "
            f"members; make groups with meshstate.init_mesh, or {OTHER_WORLDS}"
        )
    return _create_group(ranks, *args, **kwargs)


_enumerate_subgroups = c10d.new_subgroups_by_enumeration


def _new_subgroups_by_enumeration(
    ranks_per_subgroup_list: list[list[int]], *args: Any, **kwargs: Any
) -> Any:
    """``torch.distributed.new_subgroups_by_enumeration``, refusing groups whose collectives
    torch's simulation would run over other ranks."""
    mine, subgroups = _enumerate_subgroups(ranks_per_subgroup_list, *args, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]
    mismatch = tiling_mismatch("subgroups", cast(Any, mine), ranks_per_subgroup_list)
    if mismatch is not None:
        raise SimulationError(mismatch)
    return mine, subgroups


def _for_every_rank(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.tensor`` (or ``as_tensor``) making a tensor every simulated rank holds: torch's
    simulation leaves what these make a plain tensor, which its collectives skip; of data
    holding per-rank integers (``torch.tensor([rank, 1])``), each rank's own."""
    def made_for_every_rank(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        ranks = local_compat.ranks_of_eager_ops()  # None paused, and while tracing
        if ranks is None:
            return make(data, *args, **kwargs)
        if not holds_per_rank(data):
            return local_compat.replicated(make(data, *args, **kwargs), ranks)
        with local_compat.simulation_paused():
            made = {rank: make(value_on(data, rank), *args, **kwargs) for rank in ranks}
        return cast(torch.Tensor, per_rank_value(made, make.__name__))

    return made_for_every_rank


def _simulated_only(name: str) -> Callable[..., Any]:
    """``torch.distributed.<name>``, refusing a plain tensor, which torch's simulation would
    leave as it was (a wrong value on every rank)."""
    collective = getattr(dist, name)

    def checked(*args: Any, **kwargs: Any) -> Any:
        _refuse_plain(name, (*args, *kwargs.values()))
        return collective(*args, **kwargs)

    return checked


def _refuse_plain(name: str, arguments: tuple[Any, ...]) -> None:
    plain = [value for value in arguments
             if isinstance(value, torch.Tensor) and not local_compat.is_simulated(value)]
    if plain:
        raise SimulationError(
            f"torch.distributed.{name} of a tensor made outside the simulated world "
            f"(shape {tuple(plain[0].shape)}): torch's simulation computes collectives only "
            "for tensors that hold a value per rank; make it inside the body (an op, "
            f"torch.tensor, torch.full) or {OTHER_WORLDS}"
        )


def _gathered_whatever_the_shape(name: str) -> Callable[..., Any]:
    """``torch.distributed.<name>`` (an all-gather into one tensor) as c10d runs it: the
    members' inputs fill the output's elements in group rank order, whatever its shape
    (``(world * n,)`` or stacked ``(world, n)``; torch's simulation concatenates along the
    first dimension and takes only the first)."""
    collective = getattr(dist, name)

    def gather(
        output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None, async_op: bool = False,
    ) -> Any:
        _refuse_plain(name, (output_tensor, input_tensor))
        if output_tensor.shape[1:] == input_tensor.shape[1:]:  # concatenated: torch's own form
            return collective(output_tensor, input_tensor, group=group, async_op=async_op)
        flat = output_tensor.new_empty(output_tensor.numel())
        work = collective(flat, input_tensor.reshape(-1), group=group, async_op=async_op)
        outputs, gathered = local_compat.tensor_by_rank(output_tensor), local_compat.tensor_by_rank(flat)
        with local_compat.simulation_paused():  # each rank's own output, a view of a shared one too
            for rank, output in cast(dict[int, torch.Tensor], outputs).items():
                output.copy_(cast(dict[int, torch.Tensor], gathered)[rank].view(output.shape))
        return work

    return gather


def _refuse_point_to_point(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise SimulationError(
            f"torch.distributed.{name} in a simulated world: torch simulates send and recv "
            f"only with a thread per rank (LocalRunnerMode); between pipeline stages, simulate "
            f"the world stage by stage (simulated_world(world_size, stages=pp)), or {OTHER_WORLDS}"
        )

    return refuse


_gather_single = c10d.all_gather_single


def _all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``torch.distributed.all_gather``, each group's tensors into its members' lists."""
    flat = tensor.contiguous().view(-1)
    gathered = torch.empty(len(tensor_list) * flat.numel(), dtype=flat.dtype, device=flat.device)
    work = _gather_single(gathered, flat, group=group, async_op=async_op)
    for output, part in zip(tensor_list, gathered.view(len(tensor_list), *tensor.shape).unbind(0)):
        output.copy_(part)
    return work


def _per_rank_predicate(compare: Callable[..., bool]) -> Callable[..., bool]:
    """``torch.equal`` (or ``allclose``) on every simulated rank: a per-rank bool (torch's
    simulation answers ``True`` for all ranks when only some are equal)."""
    def compare_on_every_rank(first: torch.Tensor, second: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        ranks = _simulated()
        with local_compat.simulation_paused():
            firsts, seconds = local_compat.tensor_by_rank(first), local_compat.tensor_by_rank(second)
            return per_rank_bool({
                rank: compare(first if firsts is None else firsts[rank],
                              second if seconds is None else seconds[rank], *args, **kwargs)
                for rank in ranks
            })

    return compare_on_every_rank


def _not_close_on_some_rank(not_close: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """torch.testing's check behind ``assert_close``, on every simulated rank: a failure
    names the ranks it fails on."""
    def not_close_on_every_rank(actual: Any, expected: Any, **options: Any) -> list[Any]:
        ranks = _simulated()
        with local_compat.simulation_paused():
            by_rank = {rank: not_close(value_on(actual, rank), value_on(expected, rank), **options)
                       for rank in ranks}
        failed = sorted(rank for rank, failures in by_rank.items() if failures)
        if not failed:
            return []
        first = by_rank[failed[0]][0]
        first.msg = f"On simulated rank{'s' if len(failed) > 1 else ''} {ranks_text(failed)}: {first.msg}"
        return [first]

    return not_close_on_every_rank


def _in_the_body(per_rank: Callable[..., Any], process: Callable[..., Any]) -> Callable[..., Any]:
    """``per_rank`` called from the body (a test, megatron-core), ``process`` from torch's and
    meshstate's own modules (torch's simulation reads a group's members to run its collectives)."""

    def answer(*args: Any, **kwargs: Any) -> Any:
        return (process if from_a_library(sys._getframe(1)) else per_rank)(*args, **kwargs)

    return answer


def _members(group: dist.ProcessGroup | None) -> GroupMembers:
    return members(group or cast(dist.ProcessGroup, c10d.GroupMember.WORLD))


def _process_group_ranks(group: dist.ProcessGroup | None) -> Sequence[int]:
    """``torch.distributed.get_process_group_ranks`` for every simulated rank: its group's
    members (a list where every rank has the same)."""
    ranks = _members(group)
    groups = ranks.groups()
    return groups[0] if len(groups) == 1 else ranks


def _global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """``torch.distributed.get_global_rank`` for every simulated rank."""
    return _members(group)[group_rank]


def _group_rank(group: dist.ProcessGroup, global_rank: int) -> int:
    """``torch.distributed.get_group_rank`` for every simulated rank."""
    return _members(group).index(global_rank)


def _group_rank_of(group: dist.ProcessGroup) -> int:
    """``ProcessGroup.rank()`` for every simulated rank."""
    return group_rank(group)


def _mesh_of(view: DeviceMesh) -> torch.Tensor:
    """``DeviceMesh.mesh`` for every simulated rank: the copy of ``view`` it is in."""
    with local_compat.simulation_paused():
        copies = mesh_copies(view)
        copy_of = {rank: copy for copy in copies.unbind(0) for rank in copy.flatten().tolist()}
        return cast(torch.Tensor, per_rank_value(copy_of, "DeviceMesh.mesh"))


def _all_gather_object(object_list: list[Any], obj: Any, group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.all_gather_object`` for every simulated rank: each rank's list
    holds its group's objects."""
    ranks, simulated = _members(group), _simulated()
    _refuse_other_stages("all_gather_object", group, simulated, [ranks.on(rank) for rank in simulated])
    for at in range(len(ranks)):
        object_list[at] = per_rank_value(
            {rank: value_on(obj, ranks.on(rank)[at]) for rank in simulated},
            "all_gather_object",
        )


def _broadcast_object_list(
    object_list: list[Any], src: int | None = None, group: dist.ProcessGroup | None = None,
    device: torch.device | None = None, group_src: int | None = None,
) -> None:
    """``torch.distributed.broadcast_object_list`` for every simulated rank: each rank's
    list becomes its source's (``src`` a global rank, or ``group_src`` one of its group)."""
    ranks, simulated = _members(group), _simulated()
    source = {
        rank: ranks.on(rank)[value_on(group_src, rank)] if group_src is not None
        else value_on(0 if src is None else src, rank)
        for rank in simulated
    }
    _refuse_other_stages("broadcast_object_list", group, simulated, [list(source.values())])
    for at, item in enumerate(list(object_list)):
        object_list[at] = per_rank_value(
            {rank: value_on(item, source[rank]) for rank in source}, "broadcast_object_list"
        )


def _refuse_other_stages(
    what: str, group: dist.ProcessGroup | None, simulated: list[int], needed: list[Sequence[int]]
) -> None:
    """Refuse ``what`` where it needs ranks this process does not simulate (another stage's,
    in a world simulated stage by stage)."""
    outside = sorted({rank for ranks in needed for rank in ranks} - set(simulated))
    if outside:
        raise SimulationError(
            f"{what} over the group of ranks {ranks_text(_members(group).on(simulated[0]))}: "
            f"ranks {ranks_text(outside[:8])} are simulated in another stage's process, which "
            f"exchanges objects only by send_object_list and recv_object_list; {OTHER_WORLDS}"
        )


_PlainGenerator = torch.Generator


class _GeneratorType(type(_PlainGenerator)):  # type: ignore[misc]
    """The type of :class:`_Generator`, which every ``torch.Generator`` is an instance of."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, _PlainGenerator)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _PlainGenerator)


class _Generator(torch.Generator, metaclass=_GeneratorType):
    """``torch.Generator`` in a simulated body: ``manual_seed`` of a per-rank seed seeds each
    rank's stream with its own (``torch.Generator().manual_seed(rank)``)."""

    def manual_seed(self, seed: Any) -> torch.Generator:
        if not holds_per_rank(seed):
            return super().manual_seed(seed)
        local_compat.seed_each_rank(self, local_compat.local_ints(seed.node))
        return self


_index = torch.Tensor.__getitem__
_assign = torch.Tensor.__setitem__


def _getitem(tensor: torch.Tensor, index: Any) -> Any:
    """``tensor[index]``, where an integer of ``index`` may differ per rank (``W[t]``):
    torch's own indexing takes a per-rank integer inside a slice only. Each such integer
    is a ``select`` of the view the rest of ``index`` gives."""
    items = index if isinstance(index, tuple) else (index,)
    if not any(_per_rank_integer(item) for item in items):
        return _index(tensor, index)
    consumed = sum(isinstance(item, (int, torch.SymInt, slice)) for item in items)
    plain: list[Any] = []
    picks: list[tuple[int, torch.SymInt]] = []
    dim = 0  # of the view, where the next item's dim lands
    for item in items:
        if _per_rank_integer(item):
            picks.append((dim, item))
            item = slice(None)
        elif isinstance(item, bool) or not isinstance(item, _BASIC_INDEX):
            kind = "tensor" if isinstance(item, torch.Tensor) else type(item).__name__
            raise SimulationError(
                f"tensor[...] with an integer that differs between the simulated ranks beside a "
                f"{kind} index: index with the integer alone first (tensor.select(dim, index)), "
                f"or {OTHER_WORLDS}"
            )
        plain.append(item)
        if item is ...:
            dim += tensor.dim() - consumed
        elif not isinstance(item, (int, torch.SymInt)):  # a slice keeps its dim, None adds one
            dim += 1
    picked = _index(tensor, tuple(plain))
    for at, position in reversed(picks):
        picked = picked.select(at, position)
    return picked


_getitem.__wrapped__ = _index  # type: ignore[attr-defined]  # a torch function mode finds torch's own


_BASIC_INDEX = (int, torch.SymInt, slice, type(None), type(...))


def _setitem(tensor: torch.Tensor, index: Any, value: Any) -> None:
    """``tensor[index] = value``, where an integer of ``index`` may differ per rank."""
    items = index if isinstance(index, tuple) else (index,)
    if not any(_per_rank_integer(item) for item in items):
        _assign(tensor, index, value)
    elif isinstance(value, torch.Tensor):
        _getitem(tensor, index).copy_(value)
    else:
        _getitem(tensor, index).fill_(value)


def _per_rank_integer(item: object) -> bool:
    return isinstance(item, torch.SymInt) and holds_per_rank(item)


def _cut(
    cut: Callable[..., Sequence[torch.Tensor]], dim_at: int = 1, unbound: bool = False
) -> Callable[..., Sequence[torch.Tensor]]:
    """``chunk`` (``split``, ``tensor_split``, ``unbind``) whose parts a per-rank integer
    indexes (``W.chunk(2, 1)[t]`` is each rank's part); ``dim_at``: where ``dim`` is among
    the arguments after the tensor."""
    def cut_for_every_rank(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Sequence[torch.Tensor]:
        parts = cut(tensor, *args, **kwargs)
        if local_compat.ranks_of_eager_ops() is None:
            return parts
        dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else 0)
        return PerRankParts(parts, tensor, dim % tensor.dim(), unbound)

    return cut_for_every_rank


def _refuse_text(what: str, plainly: Callable[..., str]) -> Callable[..., str]:
    """``SymInt.__str__`` (or ``__format__``), refusing a per-rank value in the body: one
    string cannot hold every rank's text, and the same text on every rank would be wrong.
    torch's and meshstate's own modules (torch's log prefix ``[rank{get_rank()}]``) get its
    description."""

    def text(value: Any, *spec: str) -> str:
        if not holds_per_rank(value) or from_a_library(sys._getframe(1)):
            return plainly(value, *spec)
        raise SimulationError(
            f"{what} of a value that differs between the simulated ranks ({value!r})"
            f"{the_bodys_line()}: one string "
            "cannot hold every rank's text; keep it a number (value_on reads each rank's), "
            "log it as an argument (logger.info('%s', value) logs a line per rank), or run it "
            "with a thread per rank (meshstate.testing.threaded_world)"
        )

    return text


_handle = logging.Logger.handle


def _log_each_rank(logger: logging.Logger, record: logging.LogRecord) -> None:
    """``Logger.handle`` in a simulated body: a record whose arguments differ per rank is
    logged once per text, naming its ranks, as each rank's process logs its own."""
    if not holds_per_rank((record.msg, record.args)):
        _handle(logger, record)
        return
    ranks_of_text: dict[str, list[int]] = {}
    for rank in _simulated():
        ranks_record = copy.copy(record)
        ranks_record.msg, ranks_record.args = value_on(record.msg, rank), value_on(record.args, rank)
        ranks_of_text.setdefault(ranks_record.getMessage(), []).append(rank)
    for text, ranks in ranks_of_text.items():
        ranks_record = copy.copy(record)
        named = f"simulated rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        ranks_record.msg, ranks_record.args = f"[{named}] {text}", ()
        _handle(logger, ranks_record)


def _on_each_rank_value(storage_call: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``storage_call`` (FSDP2's ``free_storage`` or ``alloc_storage``) on each simulated
    rank's value of the tensor: a simulated tensor's own storage is none."""
    def on_each_rank(tensor: torch.Tensor) -> None:
        values = local_compat.tensor_by_rank(tensor)
        if values is None:
            return storage_call(tensor)
        with local_compat.simulation_paused():
            for value in values.values():
                storage_call(value)
        return None

    return on_each_rank


def _rank_per_rank(post_init: Callable[[Any], None], group: str, rank: str) -> Callable[[Any], None]:
    """FSDP2's ``post_init`` of its mesh facts, then the caller's rank in the group it holds
    as ``group`` read for every simulated rank, where torch reads the process's once."""
    def per_rank(facts: Any) -> None:
        post_init(facts)
        setattr(facts, rank, group_rank(getattr(facts, group)))

    return per_rank


def _even_shards(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
    """FSDP2's ``_chunk_with_empty`` in a simulated body: the shards, which each rank's
    own (per-rank) shard index picks; a tensor cut into fewer parts than ranks is refused
    (torch pads the missing shards with empty ones, a shape per rank)."""
    parts = torch.chunk(tensor, num_chunks, dim=dim)
    if len(parts) != num_chunks:
        raise SimulationError(
            f"fully_shard (FSDP2) of a {tuple(tensor.shape)} parameter over {num_chunks} ranks "
            f"in a simulated world: dim {dim} cuts into {len(parts)} shards, and the ranks "
            "without one would hold empty shards of another shape; run it with a thread per "
            "rank (meshstate.testing.threaded_world) or in processes (meshstate.testing.local_world)"
        )
    return parts


def _refuse_data_parallel(what: str, why: str) -> Callable[..., None]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise SimulationError(
            f"{what} in a simulated world: {why}; run it with a thread per rank "
            f"(meshstate.testing.threaded_world) or in processes (meshstate.testing.local_world)"
        )

    return refuse
