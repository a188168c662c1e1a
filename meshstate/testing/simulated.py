"""Every rank of a world in this process: torch's ``LocalTensorMode`` on the fake backend.

``simulated_world(8).run(fn)`` keeps :class:`~meshstate.testing.launch.LocalWorld`'s
contract (one result per rank, in rank order) without a process per rank: the
process is rank 0 of torch's ``fake`` backend, ``LocalTensorMode`` runs every
tensor op once per simulated rank and computes every collective's result, and
meshstate answers each rank's rank-dependent questions per rank
(:mod:`meshstate.simulation.per_rank`). So ``fn`` runs once, for all ranks at
once; inside it ``torch.distributed.get_rank()`` is a per-rank integer, and a
Python branch the ranks would take apart raises
:class:`~meshstate.errors.SimulationError`, as does what torch's
simulation cannot do (send and recv, a group only some ranks make with
``new_group``, a collective over ranks that are no regular grid). Each rank's
result is ``fn``'s return value with every per-rank tensor, integer, bool and
group replaced by that rank's.

Example::

    def world_sum() -> float:
        t = torch.full((1,), dist.get_rank(), dtype=torch.float)
        dist.all_reduce(t)
        return t

    simulated_world(4).run(world_sum)   # [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from meshstate.errors import MeshStateError, SimulationError
from meshstate.core.mesh import destroy_every_mesh
from meshstate.layout.ranks import ranks_text
from meshstate.testing import torch_internals

_LOCAL_WORLD = "run it in processes with meshstate.testing.local_world"
_NOT_SIMULATED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
"""Point-to-point calls: torch simulates them only with a thread per rank (LocalRunnerMode)."""
_IN_PLACE_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single",
)
"""c10d collectives that write a tensor they are given: torch's simulation computes them for
tensors that hold every rank's value, and leaves a plain tensor as it was."""


class SimulatedWorld:
    """A world of ``world_size`` ranks simulated in this process; see the module docstring.

    Like a :class:`~meshstate.testing.launch.LocalWorld` it is also a context
    manager (with nothing to close): every ``run`` initialises the fake
    default group, and destroys it and every mesh left alive on the way out.
    """

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise MeshStateError(f"world size must be a positive integer, got {world_size!r}")
        self.world_size = world_size

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` once for every simulated rank; the results by rank."""
        from meshstate.simulation.per_rank import value_on

        result = self.call(fn, *args, **kwargs)
        return [value_on(result, rank) for rank in range(self.world_size)]

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` once for every simulated rank; its result as it is,
        per-rank values and all (for a caller that reads every rank's itself)."""
        from meshstate.simulation import local_compat

        if dist.is_initialized():
            raise SimulationError(
                "this process already has a default process group; a simulated world needs "
                "one of its own (destroy it first, or run this where none is initialised)"
            )
        ranks = frozenset(range(self.world_size))
        dist.init_process_group(
            "fake", store=torch_internals.fake_store(), rank=0, world_size=self.world_size
        )
        try:
            with local_compat.local_tensor_mode(ranks), _per_rank_torch():
                result = fn(*args, **kwargs)
        except (AssertionError, AttributeError, NotImplementedError, RuntimeError) as error:
            if isinstance(error, MeshStateError):
                raise
            if local_compat.failed_compiling(error):
                raise SimulationError(
                    f"torch.compile cannot trace this with every rank's values in one process "
                    f"({type(error).__name__}: {str(error).splitlines()[0]}); {_LOCAL_WORLD}"
                ) from error
            if not local_compat.raised_inside(error):
                raise
            raise SimulationError(
                f"torch's simulation of every rank in one process cannot run this "
                f"({type(error).__name__}: {error}); {_LOCAL_WORLD}"
            ) from error
        finally:
            destroy_every_mesh()
            dist.destroy_process_group()
            local_compat.forget_random_state()
        return result

    def __enter__(self) -> SimulatedWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def simulated_world(world_size: int) -> SimulatedWorld:
    """A :class:`SimulatedWorld` of ``world_size`` ranks in this process.

    Example: ``simulated_world(8).run(body) == local_world(8).run(body)`` for a
    body that sticks to collectives over regular groups.
    """
    return SimulatedWorld(world_size)


@contextlib.contextmanager
def _per_rank_torch() -> Iterator[None]:
    """``torch.distributed`` as each simulated rank sees it, while a body runs.

    ``get_rank()`` answers per rank; list-form ``all_gather`` gathers each
    group's values (torch 2.13's simulation gives every rank the last group's);
    ``torch.equal`` and every integer an op gives (``.item()``) answer per rank,
    comparisons included (torch's answer ``==`` for all ranks at once);
    point-to-point calls, a ``new_group`` of some ranks and subgroups the
    simulation would read otherwise raise :class:`SimulationError`. torch's
    own modules keep c10d's functions.
    """
    from meshstate.simulation import local_compat
    from meshstate.simulation.per_rank import per_rank_int

    replaced: dict[str, Callable[..., Any]] = {
        "get_rank": _get_rank, "new_group": _new_group,
        "new_subgroups_by_enumeration": _new_subgroups_by_enumeration,
    }
    replaced.update({name: _refuse_point_to_point(name) for name in _NOT_SIMULATED})
    with contextlib.ExitStack() as patches:
        for name, function in replaced.items():
            patches.enter_context(mock.patch.object(dist, name, function))
        for module in (dist, c10d):  # c10d's own all_gather_object calls it
            patches.enter_context(mock.patch.object(module, "all_gather", _all_gather))
        patches.enter_context(mock.patch.object(torch, "equal", _equal))
        patches.enter_context(mock.patch.object(torch.Tensor, "equal", _equal))
        for name in ("tensor", "as_tensor"):
            patches.enter_context(mock.patch.object(torch, name, _for_every_rank(getattr(torch, name))))
        for name in _IN_PLACE_COLLECTIVES:
            if hasattr(dist, name):
                patches.enter_context(mock.patch.object(dist, name, _simulated_only(name)))
        patches.enter_context(local_compat.ints_made_as(per_rank_int))
        yield


def _get_rank(group: dist.ProcessGroup | None = None) -> int:
    """``torch.distributed.get_rank`` for every simulated rank at once."""
    from meshstate.simulation.per_rank import group_rank, per_rank_int

    if group is None or group is c10d.GroupMember.WORLD:
        return per_rank_int({rank: rank for rank in range(dist.get_world_size())})
    return group_rank(group)


_create_group = c10d.new_group


def _new_group(ranks: Sequence[int] | None = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.new_group``, refusing a group of some ranks only."""
    world_size = dist.get_world_size()
    if ranks is not None and sorted(ranks) != list(range(world_size)):
        raise SimulationError(
            f"new_group(ranks={ranks_text(ranks)}) in a simulated world of {world_size} ranks: "
            "every simulated rank takes part in each collective over it, not only its "
            f"members; make groups with meshstate.init_mesh, or {_LOCAL_WORLD}"
        )
    return _create_group(ranks, *args, **kwargs)


_enumerate_subgroups = c10d.new_subgroups_by_enumeration


def _new_subgroups_by_enumeration(
    ranks_per_subgroup_list: list[list[int]], *args: Any, **kwargs: Any
) -> Any:
    """``torch.distributed.new_subgroups_by_enumeration``, refusing groups whose collectives
    torch's simulation would run over other ranks."""
    from meshstate.simulation.per_rank import tiling_mismatch

    mine, subgroups = _enumerate_subgroups(ranks_per_subgroup_list, *args, **kwargs)  # type: ignore[no-untyped-call]
    mismatch = tiling_mismatch("subgroups", mine, ranks_per_subgroup_list)
    if mismatch is not None:
        raise SimulationError(mismatch)
    return mine, subgroups


def _for_every_rank(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.tensor`` (or ``as_tensor``) making a tensor every simulated rank holds: torch's
    simulation leaves what these make a plain tensor, which its collectives skip."""
    from meshstate.simulation import local_compat

    def made_for_every_rank(*args: Any, **kwargs: Any) -> torch.Tensor:
        made = make(*args, **kwargs)
        ranks = local_compat.enabled_ranks()  # None where the simulation is paused
        return made if ranks is None else local_compat.replicated(made, ranks)

    return made_for_every_rank


def _simulated_only(name: str) -> Callable[..., Any]:
    """``torch.distributed.<name>``, refusing a plain tensor, which torch's simulation would
    leave as it was (a wrong value on every rank)."""
    from meshstate.simulation import local_compat

    collective = getattr(dist, name)

    def checked(*args: Any, **kwargs: Any) -> Any:
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        plain = [value for value in tensors if not local_compat.is_simulated(value)]
        if plain:
            raise SimulationError(
                f"torch.distributed.{name} of a tensor made outside the simulated world "
                f"(shape {tuple(plain[0].shape)}): torch's simulation computes collectives only "
                "for tensors that hold a value per rank; make it inside the body (an op, "
                f"torch.tensor, torch.full) or {_LOCAL_WORLD}"
            )
        return collective(*args, **kwargs)

    return checked


def _refuse_point_to_point(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise SimulationError(
            f"torch.distributed.{name} in a simulated world: torch simulates send and recv "
            f"only with a thread per rank (LocalRunnerMode); {_LOCAL_WORLD}"
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


_equal_on_one_rank = torch.equal


def _equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """``torch.equal`` on every simulated rank: a per-rank bool (torch's simulation answers
    ``True`` for all ranks when only some are equal)."""
    from meshstate.simulation import local_compat
    from meshstate.simulation.per_rank import per_rank_bool

    with local_compat.simulation_paused():
        firsts, seconds = local_compat.tensor_by_rank(first), local_compat.tensor_by_rank(second)
        return per_rank_bool({
            rank: _equal_on_one_rank(
                first if firsts is None else firsts[rank], second if seconds is None else seconds[rank]
            )
            for rank in range(dist.get_world_size())
        })
