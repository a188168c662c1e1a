"""Whether this thread simulates a whole world, asked without importing the simulation.

torch's ``LocalTensorMode`` runs every rank of a world in one process (rank 0
of torch's ``fake`` backend); :mod:`meshstate.testing.simulated` turns it on.
A mesh build asks once: a dict lookup where torch's simulation was never
imported, else a look at torch's mode stack; no getter ever asks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

from torch.distributed import distributed_c10d as c10d

from meshstate.core.errors import SimulationError

_TORCH_SIMULATION = "torch.distributed._local_tensor"
"""The module of torch's ``LocalTensorMode``; no mode is on before it is imported."""


def simulated_ranks() -> frozenset[int] | None:
    """The ranks this thread simulates under torch's ``LocalTensorMode``, else ``None``.

    Example: inside ``simulated_world(8).run(body)``, ``frozenset(range(8))``.
    """
    if _TORCH_SIMULATION not in sys.modules:
        return None
    from meshstate.core.local_compat import enabled_ranks

    return enabled_ranks()


def outside_simulation() -> contextlib.AbstractContextManager[None]:
    """A block whose tensor ops run once, as in a plain process, even in a simulated world.

    For what every simulated rank shares, such as a DeviceMesh's rank grid:
    simulated, each op would run once per rank.
    """
    if _TORCH_SIMULATION not in sys.modules:
        return contextlib.nullcontext()
    from meshstate.core.local_compat import simulation_paused

    return simulation_paused()


def differs_anywhere(first: int, second: int) -> bool:
    """Whether ``first != second`` on any simulated rank (on this one outside a simulation).

    Example: with ranks 0-3 simulated, ``differs_anywhere(tp_rank, 0)`` is True.
    """
    differs = first != second
    if isinstance(differs, bool):
        return differs
    from meshstate.core.per_rank import on_any_rank

    return on_any_rank(differs)


_F = TypeVar("_F", bound=Callable[..., Any])


def each_rank(function: _F) -> _F:
    """``function``, a pure function of rank-dependent integers (no collectives, no side
    effects), run once per simulated rank where a simulation is on, its results per-rank
    integers; elsewhere called as it is, for one dict lookup.

    Example: ``each_rank(lambda index: [0, index])(mesh.rank("tp"))`` is ``[0, 0]`` on
    tp rank 0 and ``[0, 1]`` on tp rank 1, also when both are simulated in one process.
    """

    @functools.wraps(function)
    def run(*args: Any) -> Any:
        if simulated_ranks() is None:
            return function(*args)
        from meshstate.core.local_compat import run_for_each_rank

        return run_for_each_rank(function, *args)

    return cast(_F, run)


def process_rank() -> int:
    """This process's rank in the default group.

    The same as ``torch.distributed.get_rank()``, except in a simulated world:
    there the process is rank 0 of the fake backend, whose groups it holds,
    while ``torch.distributed.get_rank()`` answers for every simulated rank.
    """
    return c10d.get_rank()


def refuse_simulation(what: str) -> None:
    """Raise :class:`SimulationError` if a simulation is on: ``what`` cannot be simulated.

    Example: ``refuse_simulation("adopt()")`` inside ``simulated_world(8).run``
    raises ``adopt() cannot run in a simulated world; ...``.
    """
    if simulated_ranks() is not None:
        raise SimulationError(
            f"{what} cannot run in a simulated world (it needs groups every rank made "
            "itself); run it in processes with meshstate.testing.local_world"
        )
