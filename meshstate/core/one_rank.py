"""Compile a step once, on one rank, and run it on every rank.

Each rank's ``torch.compile`` traces and compiles the same code again; at scale that is
minutes per job start, times every rank. ``compile_on_one_rank`` has one rank trace and
compile, and every rank load what it made. That is right only for a graph that carries no
rank, and meshstate's parts of a graph carry none:

- a collective calls its group by a name that each rank's group of those axes has
  (``meshstate-{build}-{backend}-{axes}``), so the graph reaches the caller's group;
- ``axis_index`` is a 0-dim int64 tensor read from that group when the graph runs, and
  ``shard_map`` takes each rank's block at that index when the graph runs.

What the graph cannot carry is refused while tracing: ``ppermute``, whose split sizes are
each rank's own. An int read during the trace (``mesh.rank("tp")``,
``dist.get_rank()``) is the tracing rank's, in every rank's graph: read the index with
``axis_index`` instead.

Example (every rank calls it; rank 0 compiles, ranks 1-7 load)::

    step = meshstate.compile_on_one_rank(train_step, (x, w))
    loss = step(x, w)     # this rank's values
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.agreement import leave_barrier
from meshstate.core.ordered import OrderedGroup
from meshstate.core.world import group_rank, ranks_share_the_process, refuse_simulation, simulating
from meshstate.errors import ArgumentTypeError, MeshStateError

__all__ = [
    "compile_on_one_rank", "index_when_run", "refuse_for_every_rank",
    "tracing_for_a_simulated_world", "tracing_for_every_rank",
]

_per_thread = threading.local()
_calls = itertools.count()
"""This process's ``compile_on_one_rank`` calls, which every rank makes in the same order."""

_FAILED = b"meshstate: failed: "


def tracing_for_every_rank() -> bool:
    """Whether this thread traces a graph that every rank will run (a rank's values are
    then read when the graph runs, or refused): in :func:`compile_on_one_rank`, under
    ``torch.compile`` with torch's ``compile_on_one_rank`` flag on, or under
    ``torch.compile`` in a simulated world (one graph, run by torch's simulation for
    every rank)."""
    if getattr(_per_thread, "every_rank", False):
        return True
    return _compat.tracing() and (_compat.torch_compiles_on_one_rank() or simulating())


def tracing_for_a_simulated_world() -> bool:
    """Whether this thread traces, under ``torch.compile``, a graph that torch's simulation
    will run for every rank of a simulated world (whose ranks share this process)."""
    return _compat.tracing() and simulating()


def refuse_for_every_rank(why: str) -> NoReturn:
    """Raise a :class:`MeshStateError` saying why the graph traced now cannot serve every
    rank; :func:`compile_on_one_rank` raises it on every rank (torch's tracer wraps it)."""
    _record_refusal(why)
    raise MeshStateError(f"compile_on_one_rank: {why}")


@_compat.constant_when_traced  # run, not traced: the tracer wraps what the trace raises
def _record_refusal(why: str) -> bool:
    _per_thread.refused = MeshStateError(f"compile_on_one_rank: {why}")
    return True


@contextlib.contextmanager
def _every_rank() -> Iterator[None]:
    _per_thread.every_rank, _per_thread.refused = True, None
    try:
        yield
    except Exception as error:
        refused: MeshStateError | None = _per_thread.refused
        if refused is None:
            raise
        raise refused from error
    finally:
        _per_thread.every_rank, _per_thread.refused = False, None


def compile_on_one_rank(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "inductor",
    rank: int = 0,
) -> Callable[..., Any]:
    """``function`` compiled whole (``fullgraph=True``) by ``rank`` alone for arguments like
    ``args`` and ``kwargs``; every rank of the world calls this and gets the same compiled
    function, which computes each rank's own values.

    The artifact goes from ``rank`` to the others through the default group's store. Where
    ranks share a process (a threaded world) their groups cannot share names, so each rank
    compiles its own; a simulated world refuses.

    Args:
        function: the step; meshstate's collectives, ``axis_index`` and ``shard_map``
            inside it are read per rank when it runs.
        args, kwargs: example arguments (shapes, dtypes, devices as in every call).
        backend: ``torch.compile``'s backend (``"aot_eager"``: no code generation).
        rank: the rank that compiles.

    Returns:
        The compiled function. On ranks 0-7 of ``init_mesh(tp=2)``, ``step(x, w)`` with
        ``psum(x @ w, "tp")`` inside returns each tp pair's own sum.
    """
    if not callable(function):
        raise ArgumentTypeError(f"compile_on_one_rank: function must be callable, got {function!r}")
    if not isinstance(args, tuple):
        raise ArgumentTypeError(
            f"compile_on_one_rank: args must be a tuple of example arguments, got {type(args).__name__}"
        )
    refuse_simulation("compile_on_one_rank()")
    kwargs = {} if kwargs is None else kwargs
    world_size = dist.get_world_size()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ArgumentTypeError(
            f"compile_on_one_rank: rank must be a rank of the world (0 to {world_size - 1}), "
            f"got {rank!r}"
        )
    if ranks_share_the_process():
        return _compiled(function, args, kwargs, backend)
    key = f"meshstate/compile_on_one_rank/{next(_calls)}"
    store = _compat.thread_store()
    if dist.get_rank() == rank:
        try:
            artifact = _compiled_bytes(function, args, kwargs, backend)
        except BaseException as error:
            why = str(error) if isinstance(error, MeshStateError) else f"{type(error).__name__}: {error}"
            store.set(key, _FAILED + why.encode())  # type: ignore[arg-type, unused-ignore]
            leave_barrier(store, key, world_size)
            raise
        store.set(key, artifact)  # type: ignore[arg-type, unused-ignore]
    else:
        artifact = store.get(key)
    leave_barrier(store, key, world_size)
    if artifact.startswith(_FAILED):
        why = artifact[len(_FAILED):].decode(errors="replace").splitlines()[0]
        raise MeshStateError(
            f"compile_on_one_rank: rank {rank} could not compile "
            f"{getattr(function, '__qualname__', function)!s}: {why.removeprefix('compile_on_one_rank: ')}"
        )
    return _compat.load_compiled(artifact)


def _compiled_bytes(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: str
) -> bytes:
    with _every_rank():
        return _compat.compile_to_bytes(function, args, kwargs, backend)


def _compiled(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: str
) -> Callable[..., Any]:
    with _one_compile_at_a_time:  # torch's whole-graph capture keeps process-wide mode stacks
        return _compat.load_compiled(_compiled_bytes(function, args, kwargs, backend))


_one_compile_at_a_time = threading.Lock()


def index_when_run(group: OrderedGroup) -> torch.Tensor:
    """``group.index`` as a 0-dim int64 tensor that a traced graph reads from the group it
    runs on, not from the rank that traced it (see :func:`~meshstate.compile_on_one_rank`).
    """
    by_group_rank = group.by_group_rank
    axis_of_group_rank = list(range(len(group.ranks)) if by_group_rank is None else by_group_rank)
    index: torch.Tensor = _index_in_group(group.group_name, axis_of_group_rank)
    return index


@torch.library.custom_op("meshstate::index_in_group", mutates_args=())
def _index_in_group(group_name: str, axis_of_group_rank: list[int]) -> torch.Tensor:
    """The axis index of this process's rank in the group called ``group_name`` (of each
    rank, simulated: ``group_rank`` answers per rank there)."""
    group_rank_now = group_rank(_compat.group_named(group_name))
    return torch.tensor(axis_of_group_rank).select(0, group_rank_now).clone()


@_index_in_group.register_fake
def _(group_name: str, axis_of_group_rank: list[int]) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)
