"""The seam through which the runtime asks its per-rank questions.

A process is one rank: it asks ``torch.distributed`` and its own tables. A
*simulated* world runs every rank of a world in one process (torch's
``LocalTensorMode`` over the fake backend), and there each of these questions has
one answer per rank. :mod:`meshstate.simulation` gives those answers: it plugs a
:class:`Simulation` in here when it is imported (``meshstate.testing.simulated_world``
imports it; so does the first question asked while torch's ``LocalTensorMode`` is
on, by name). Nothing in ``core``, ``layout``, ``jax`` or the façades imports it;
in a process every question here is answered as plain torch would, for a global read.

Example, inside ``simulated_world(4).run``::

    simulated_ranks()                        # frozenset({0, 1, 2, 3})
    each_rank(lambda index: index * 2)(mesh.rank("tp"))   # 0 on tp rank 0, 2 on tp rank 1
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from meshstate.errors import SimulationError

if TYPE_CHECKING:
    from meshstate.core.ordered import OrderedGroup
    from meshstate.layout.layout import Key, MeshLayout

_TORCH_SIMULATION = "torch.distributed._local_tensor"
"""The module of torch's ``LocalTensorMode``; no simulation is on before it is imported."""
_SIMULATION = "meshstate.simulation"
"""The package that plugs a :class:`Simulation` in, imported by name the first time a
question finds torch's simulation imported and none plugged in."""


class Simulation(Protocol):
    """What a world simulated in one process answers for every rank it runs."""

    def ranks(self) -> frozenset[int] | None:
        """The ranks this thread simulates now, else ``None``."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """A block whose tensor ops run once, not once per rank."""

    def on_any_rank(self, value: bool) -> bool:
        """Whether a per-rank bool is true on some rank."""

    def each_rank(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function`` run once per rank on each rank's arguments, results per rank."""

    def tables(
        self, layout: MeshLayout, keys: Sequence[Key], declared: Mapping[Key, Key],
        own_group_of: Mapping[Key, dist.ProcessGroup], ranks: frozenset[int],
    ) -> tuple[int, dict[Key, int], dict[Key, int], dict[Key, dist.ProcessGroup],
               dict[Key, Sequence[int]]]:
        """A mesh's global rank and its rank, size, group and ranks tables, per rank."""

    def coordinate(self, layout: MeshLayout, ranks: frozenset[int]) -> dict[str, int]:
        """Every rank's position on every axis of ``layout``."""

    def ordered(self, name: str, own: OrderedGroup, groups: list[list[int]]) -> OrderedGroup:
        """``own`` (the process's group of the axes ``name``) with each rank's index and
        ranks among ``groups``; refused where torch would run its collectives elsewhere."""

    def group_rank(self, group: dist.ProcessGroup) -> int:
        """Each rank's rank in its group of the family ``group`` belongs to."""

    def view_rank(self, view: DeviceMesh, dim: int) -> int:
        """Each rank's position on dim ``dim`` of ``view``."""

    def tiling_mismatch(
        self, name: str, group: dist.ProcessGroup | None, groups: Sequence[Sequence[int] | None]
    ) -> str | None:
        """Why collectives over ``group`` would not run on ``groups`` here, or ``None``."""


_plugged: Simulation | None = None


def plug(simulation: Simulation) -> None:
    """Answer the per-rank questions with ``simulation`` wherever it simulates a world."""
    global _plugged
    _plugged = simulation


def _on() -> Simulation | None:
    """The plugged simulation where it simulates this thread's world now, else ``None``."""
    if _plugged is None:
        if _TORCH_SIMULATION not in sys.modules:
            return None
        importlib.import_module(_SIMULATION)  # plugs itself in
        assert _plugged is not None
    return _plugged if _plugged.ranks() is not None else None


_simulating = threading.local()


def simulating() -> bool:
    """Whether this thread runs a simulated world's body now: a thread-local, which
    ``torch.compile`` reads while it traces (and guards on) without tracing the simulation."""
    return bool(getattr(_simulating, "on", False))


@contextlib.contextmanager
def simulating_here() -> Iterator[None]:
    """A block in which this thread runs a simulated world's body (:func:`simulating`)."""
    _simulating.on = True
    try:
        yield
    finally:
        _simulating.on = False


def simulation() -> Simulation:
    """The simulation that answers for this thread's simulated world (only ask inside one)."""
    found = _on()
    if found is None:
        raise SimulationError("no simulated world is running in this thread")
    return found


def simulated_ranks() -> frozenset[int] | None:
    """The ranks this thread simulates under torch's ``LocalTensorMode``, else ``None``.

    Example: inside ``simulated_world(8).run(body)``, ``frozenset(range(8))``.
    """
    found = _on()
    return None if found is None else found.ranks()


def outside_simulation() -> contextlib.AbstractContextManager[None]:
    """A block whose tensor ops run once, as in a plain process, even in a simulated world.

    For what every simulated rank shares, such as a DeviceMesh's rank grid:
    simulated, each op would run once per rank.
    """
    found = _on()
    return contextlib.nullcontext() if found is None else found.paused()


def differs_anywhere(first: int, second: int) -> bool:
    """Whether ``first != second`` on any simulated rank (on this one outside a simulation).

    Example: with ranks 0-3 simulated, ``differs_anywhere(tp_rank, 0)`` is True.
    """
    differs = first != second
    if isinstance(differs, bool):
        return differs
    return simulation().on_any_rank(differs)


_F = TypeVar("_F", bound=Callable[..., Any])


def each_rank(function: _F) -> _F:
    """``function``, a pure function of rank-dependent integers (no collectives, no side
    effects), run once per simulated rank where a simulation is on, its results per-rank
    integers; elsewhere called as it is.

    Example: ``each_rank(lambda index: [0, index])(mesh.rank("tp"))`` is ``[0, 0]`` on
    tp rank 0 and ``[0, 1]`` on tp rank 1, also when both are simulated in one process.
    """

    @functools.wraps(function)
    def run(*args: Any) -> Any:
        found = _on()
        return function(*args) if found is None else found.each_rank(function, *args)

    return cast(_F, run)


def group_rank(group: dist.ProcessGroup) -> int:
    """The calling rank's rank in ``group`` (``torch.distributed.get_rank(group)``), per
    rank in a simulated world."""
    found = _on()
    return dist.get_rank(group) if found is None else found.group_rank(group)


def view_rank(view: DeviceMesh, dim: int) -> int:
    """The calling rank's position on dim ``dim`` of ``view``, per rank when simulated."""
    found = _on()
    return view.get_local_rank(dim) if found is None else found.view_rank(view, dim)


def tiling_mismatch(
    name: str, group: dist.ProcessGroup | None, groups: Sequence[Sequence[int] | None]
) -> str | None:
    """In a simulated world, why collectives over ``group`` (rank 0's) would not run on the
    family ``groups``; ``None`` there when they would, and always in a process."""
    found = _on()
    return None if found is None else found.tiling_mismatch(name, group, groups)


_state_hooks: list[Callable[[], contextlib.AbstractContextManager[None]]] = []
_threads: contextlib.ExitStack | None = None


def keep_state_per_thread(hook: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Have a façade's per-process state kept per thread inside ``hook()`` whenever a
    world runs a rank per thread (its ranks share one process); at once if one runs now.

    Example: the Megatron façade registers the context in which each thread serves a
    state of its own: ``keep_state_per_thread(state_per_thread)``.
    """
    _state_hooks.append(hook)
    if _threads is not None:
        _threads.enter_context(hook())


@contextlib.contextmanager
def state_per_thread() -> Iterator[None]:
    """A block in which every façade keeps its per-process state per thread (a threaded
    world's ranks); the process's state comes back after."""
    global _threads
    with contextlib.ExitStack() as threads:
        for hook in _state_hooks:
            threads.enter_context(hook())
        _threads = threads
        try:
            yield
        finally:
            _threads = None


def ranks_share_the_process() -> bool:
    """Whether several ranks live in this process: a threaded world runs, or a simulation
    is on. Then a name this process gives a group is every rank's, not one rank's."""
    return _threads is not None or simulated_ranks() is not None


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
