"""Run a function as every rank of a local ``torch.distributed`` world.

A :class:`LocalWorld` starts N worker processes once and reuses them: each
``run`` gives every worker a fresh default process group (gloo on CPU, NCCL
when there is a GPU per rank), calls the function, destroys the groups and
returns the results by rank. A rank that raises is reported with its
traceback; ranks that do not finish in time end the run with an error naming
them, and the workers are stopped (``meshstate.testing`` starts new ones).

:func:`fake_world` instead simulates one rank of a large world in the calling
process on torch's fake backend (collectives move no data).

Example::

    def world_sum() -> float:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    with LocalWorld(4) as world:
        world.run(world_sum)          # [6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from meshstate.errors import MeshStateError

DEFAULT_TIMEOUT = timedelta(seconds=120)
# After one rank fails, how long the others get to report before the world is torn down.
_FAILURE_GRACE_SECONDS = 5.0


class RankFailure(MeshStateError, RuntimeError):
    """One or more ranks raised; the message holds each one's traceback."""


class RankTimeout(MeshStateError, TimeoutError):
    """Some ranks did not finish in time; the message names them."""


def default_backend(world_size: int) -> str:
    """``"nccl"`` when every rank can have its own GPU, else ``"gloo"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


@dataclass(frozen=True)
class _FunctionRef:
    """A module-level function by name, so it travels to spawned workers.

    A decorated test is found by name and unwrapped (``functools.wraps``).
    """

    module: str
    qualname: str

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _FunctionRef:
        qualname = getattr(fn, "__qualname__", "")
        if "<" in qualname or not getattr(fn, "__module__", None):
            raise MeshStateError(
                f"{fn!r} cannot be sent to worker processes; pass a module-level function"
            )
        return cls(fn.__module__, qualname)

    def resolve(self) -> Callable[..., Any]:
        target: Any = sys.modules.get(self.module) or importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return inspect.unwrap(target)  # type: ignore[no-any-return]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    tasks: multiprocessing.Queue[Any],
    results: multiprocessing.Queue[Any],
) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    while (task := tasks.get()) is not None:
        task_id, function, args, kwargs, timeout = task
        try:
            dist.init_process_group(
                backend,
                store=PrefixStore(f"task{task_id}", store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
            outcome: tuple[str, Any] = ("ok", function.resolve()(*args, **kwargs))
        except BaseException:
            outcome = ("error", traceback.format_exc())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            results.put((task_id, rank, outcome))
        except Exception:
            results.put((task_id, rank, ("error", traceback.format_exc())))


class LocalWorld:
    """``world_size`` worker processes that run functions as one distributed world.

    ``backend`` defaults to NCCL when there is a GPU per rank, else gloo.
    ``timeout`` bounds each ``run`` and every collective inside it.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise MeshStateError(f"world size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self.backend = backend or default_backend(world_size)
        self.timeout = timeout
        self._context = multiprocessing.get_context("spawn")
        self._port = _free_port()
        self._store = TCPStore(
            "127.0.0.1", self._port, is_master=True, wait_for_workers=False
        )
        self._results: multiprocessing.Queue[Any] = self._context.Queue()
        self._tasks: list[multiprocessing.Queue[Any]] = []
        self._workers: list[BaseProcess] = []
        self._task_counter = 0
        for rank in range(world_size):
            tasks: multiprocessing.Queue[Any] = self._context.Queue()
            worker = self._context.Process(
                target=_worker_main,
                args=(rank, world_size, self.backend, self._port, tasks, self._results),
                daemon=True,
                name=f"meshstate-rank{rank}",
            )
            worker.start()
            self._tasks.append(tasks)
            self._workers.append(worker)

    @property
    def alive(self) -> bool:
        """Whether every worker process is still running."""
        return bool(self._workers) and all(w.is_alive() for w in self._workers)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results by rank.

        ``fn`` must be a module-level function and its arguments and result
        picklable. Raises :class:`RankFailure` if a rank raises and
        :class:`RankTimeout` if ranks do not finish within ``timeout``.
        """
        if not self.alive:
            raise MeshStateError("this LocalWorld is closed; start a new one")
        timeout = timeout or self.timeout
        reference = _FunctionRef.of(fn)
        self._task_counter += 1
        task_id = self._task_counter
        for tasks in self._tasks:
            tasks.put((task_id, reference, args, kwargs, timeout))
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout.total_seconds()
        while len(outcomes) < self.world_size:
            if any(kind == "error" for kind, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_SECONDS)
            try:
                done_id, rank, outcome = self._results.get(
                    timeout=max(0.0, min(1.0, deadline - time.monotonic()))
                )
            except queue.Empty:
                if time.monotonic() >= deadline or not self.alive:
                    break
                continue
            if done_id == task_id:
                outcomes[rank] = outcome
        missing = [rank for rank in range(self.world_size) if rank not in outcomes]
        failures = {r: text for r, (kind, text) in sorted(outcomes.items()) if kind == "error"}
        exits = {
            rank: worker.exitcode
            for rank, worker in enumerate(self._workers)
            if rank in missing and not worker.is_alive()
        }
        if missing:
            self._kill()
        if exits:
            raise RankFailure(
                f"{fn.__qualname__}: the worker processes of ranks {sorted(exits)} exited "
                f"(exit codes {sorted(set(exits.values()), key=str)}); see their output above"
            )
        if failures:
            details = "\n".join(f"--- rank {r} ---\n{text}" for r, text in failures.items())
            unfinished = f"; ranks {missing} did not finish" if missing else ""
            raise RankFailure(
                f"{fn.__qualname__} failed on ranks {sorted(failures)}{unfinished}\n{details}"
            )
        if missing:
            raise RankTimeout(
                f"{fn.__qualname__}: ranks {missing} of {self.world_size} did not finish "
                f"within {timeout.total_seconds():g} s"
            )
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers, giving them a few seconds to exit; safe to call twice."""
        for tasks, worker in zip(self._tasks, self._workers):
            if worker.is_alive():
                tasks.put(None)
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
            worker.join()
        self._workers.clear()
        self._tasks.clear()

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """Start a :class:`LocalWorld`, run ``fn`` once on every rank, stop it."""
    with LocalWorld(world_size, backend=backend, timeout=timeout) as world:
        return world.run(fn, *args, **kwargs)


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of a ``world_size``-rank world on torch's fake backend.

    For layout, group-count and timing work in one process; collectives do not
    move data. The default group (and every group made inside) is destroyed on exit.

    Example: ``with fake_world(5, 131072): meshstate.init_mesh(tp=8)``.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
