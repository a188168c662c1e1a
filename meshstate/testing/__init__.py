"""Helpers for multi-rank tests of code that uses meshstate (or any torch.distributed code).

``@distributed(world_size=8)`` runs a pytest test body on 8 local ranks: gloo on
CPU, NCCL when there is a GPU per rank. The worker processes are started once
per world size and reused by later tests, so a suite stays fast. A failure is
shown once with the ranks that raised it (``ranks 0-3: AssertionError: …``;
alike means the same type, message and failing line, pytest's per-rank assertion
detail listed below it), a hung run ends in a timeout (120 s unless
``timeout=`` says otherwise; halfway, a line on stderr names the ranks still
running) that shows each unfinished rank's stack, a fixture
that cannot be sent to the workers fails at once, and worker output lines start
with ``[rank N]``. Workers fork from a server started when the first test is
decorated: on Linux without a GPU a fork of pytest itself, which has imported
torch already, so the first world starts in well under a second. Ctrl-C,
SIGTERM or the death of pytest takes the workers down.
``fake_world`` stands the calling process in for one rank of a large world on
torch's fake backend (a *fake world*: the layout, no values; collectives do
nothing). ``simulated_world`` and
``@distributed(world_size=8, simulate=True)`` run every rank of a world in the
calling process instead, collectives included (torch's ``LocalTensorMode``):
no processes to start, for tests that stick to collectives over regular groups;
``stages=P`` runs a pipeline's world in P blocks, a process each, with real
send/recv between them.
``threaded_world`` and ``@distributed(world_size=8, threads=True)`` run every
rank as a thread of the calling process, with real values: FSDP2, DDP, DCP,
pipelining and megatron-core's layers run there, and so do functions worker
processes cannot import (a notebook's, ``python -``'s).

Example::

    from meshstate.testing import distributed

    @distributed(world_size=4)
    def test_tp_groups():
        mesh = meshstate.init_mesh(tp=2)
        assert mesh.size("tp") == 2
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from meshstate.errors import MeshStateError
from meshstate.testing.fake import fake_world
from meshstate.testing.fork_server import warm_up
from meshstate.testing.launch import DEFAULT_TIMEOUT, LocalWorld, default_backend
from meshstate.testing.simulated import SimulatedWorld, simulated_world
from meshstate.testing.threaded import ThreadedWorld, threaded_world

__all__ = [
    "SimulatedWorld", "ThreadedWorld", "close_pooled_worlds", "distributed", "fake_world",
    "local_world", "simulated_world", "threaded_world",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_pooled: dict[tuple[int, str], LocalWorld] = {}


def local_world(world_size: int, backend: str | None = None) -> LocalWorld:
    """A running :class:`LocalWorld` of ``world_size`` ranks, reused between calls.

    One world is kept per size and backend until :func:`close_pooled_worlds`
    (or exit); a world whose workers died is replaced.
    """
    key = (world_size, backend or default_backend(world_size))
    world = _pooled.get(key)
    if world is None or not world.alive:
        world = _pooled[key] = LocalWorld(world_size, backend=key[1])
    return world


def close_pooled_worlds() -> None:
    """Stop every pooled world (also done at interpreter exit)."""
    while _pooled:
        _, world = _pooled.popitem()
        world.close()


atexit.register(close_pooled_worlds)


def distributed(
    world_size: int,
    *,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    simulate: bool = False,
    stages: int = 1,
    threads: bool = False,
) -> Callable[[_F], _F]:
    """Decorate a module-level test so its body runs on every rank of a local world.

    The body sees an initialised default process group (``dist.get_rank()``)
    and no current mesh; pytest parameters reach it as keyword arguments.
    Meshes it leaves alive (Megatron's ``initialize_model_parallel`` without
    ``destroy_model_parallel`` too) are destroyed after it. ``timeout``
    (default 120 s) bounds the body; halfway, a line on stderr names the ranks
    still running. With ``backend="nccl"`` the test is skipped unless there is
    a GPU per rank. ``simulate=True`` runs the body once for every rank in
    the test's own process (:func:`simulated_world`): no processes, no
    ``backend``, the same ``timeout`` (in one process no rank waits for another);
    its assertions hold for every rank or fail;
    with ``stages=P`` too, in P blocks of ranks (pipeline stages), a process each, with
    real send/recv between them (``simulated_world(world_size, stages=P)``).
    ``threads=True`` runs each rank as a thread of the test's process
    (:func:`threaded_world`): real values, no ``backend``, the same ``timeout``.
    """
    if simulate and threads:
        raise MeshStateError(
            "a world is simulated or threaded, not both; got simulate=True, threads=True"
        )
    if stages != 1 and not simulate:
        raise MeshStateError(f"stages={stages!r} splits a simulated world; add simulate=True")
    if (simulate or threads) and backend is not None:
        kind = "simulated" if simulate else "threaded"
        raise MeshStateError(f"a {kind} world has no backend; got backend={backend!r}")

    def decorate(body: _F) -> _F:
        if not simulate and not threads:
            warm_up()  # the fork server, ready (or importing torch) before the first test runs

        @functools.wraps(body)
        def run_on_ranks(*args: Any, **kwargs: Any) -> None:
            import pytest

            if simulate:
                simulated_world(world_size, stages).run(body, *args, timeout=timeout, **kwargs)
                return
            if backend == "nccl" and torch.cuda.device_count() < world_size:
                pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
            world = threaded_world(world_size) if threads else local_world(world_size, backend)
            try:
                world.run(body, *args, timeout=timeout, **kwargs)
            except MeshStateError as error:  # the report says it all; the harness's frames do not
                raise pytest.fail.Exception(str(error), pytrace=False) from None

        return cast(_F, run_on_ranks)

    return decorate
