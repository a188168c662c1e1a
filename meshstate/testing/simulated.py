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

A test body runs as it does in processes: a per-rank integer takes each rank's
shard (``W[:, t*3:(t+1)*3]``, ``W[t]``, ``W.narrow(1, t*3, 3)``, ``W.chunk(2, 1)[t]``
and the parts of ``split``, ``tensor_split`` and ``unbind``) and makes tensors
(``torch.tensor([rank, 1])``); an explicit ``torch.Generator`` draws each rank's
stream, seeded with a per-rank seed too; a group's members and rank
(``get_process_group_ranks``, ``group.rank()``, ``DeviceMesh.mesh``),
``all_gather_object``, ``broadcast_object_list``, ``allclose`` and ``assert_close``
(its failure names the ranks) answer per rank. Text is the exception: ``repr`` of a
per-rank integer describes every rank's (``per rank (0 on ranks 0, 2; 1 on ranks 1,
3)``), but ``str()`` and formats (f-strings, ``print``, a per-rank shape's repr)
raise, since one string cannot hold each rank's text and one text for all would be
wrong; logging formats its ``%s`` arguments per rank, a line per text naming its
ranks. A write into a tensor every rank shares (one made outside the body), a float
``.item()`` that differs, DistributedDataParallel and FSDP, and what
``torch.compile`` cannot trace (dynamo alone traces a TP step; AOTAutograd does not)
raise :class:`~meshstate.errors.SimulationError` naming the call.

Example::

    def world_sum() -> float:
        t = torch.full((1,), dist.get_rank(), dtype=torch.float)
        dist.all_reduce(t)
        return t

    simulated_world(4).run(world_sum)   # [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from meshstate.errors import MeshStateError, SimulationError
from meshstate.core.mesh import destroy_every_mesh
from meshstate.testing import torch_internals

_LOCAL_WORLD = "run it in processes with meshstate.testing.local_world"


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
        from meshstate.simulation.torch_per_rank import per_rank_torch

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
            with local_compat.local_tensor_mode(ranks), per_rank_torch():
                result = fn(*args, **kwargs)
        except (AssertionError, AttributeError, NotImplementedError, RuntimeError) as error:
            if isinstance(error, MeshStateError):
                raise
            if local_compat.failed_compiling(error):
                cause = _root_cause(error)
                raise SimulationError(
                    f"torch.compile cannot trace this with every rank's values in one process "
                    f"({type(error).__name__}: {type(cause).__name__}: {_first_line(cause)}); "
                    f"{_LOCAL_WORLD}"
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


def _root_cause(error: BaseException) -> BaseException:
    """The exception ``error`` was raised for, through the exceptions it wraps."""
    while (cause := error.__cause__ or error.__context__) is not None:
        error = cause
    return error


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def simulated_world(world_size: int) -> SimulatedWorld:
    """A :class:`SimulatedWorld` of ``world_size`` ranks in this process.

    Example: ``simulated_world(8).run(body) == local_world(8).run(body)`` for a
    body that sticks to collectives over regular groups.
    """
    return SimulatedWorld(world_size)
