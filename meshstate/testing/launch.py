"""The controller of a local ``torch.distributed`` world: start it, run a function on every rank.

A :class:`LocalWorld` starts N worker processes once and reuses them: each
``run`` gives every worker a fresh default process group (gloo on CPU, NCCL
when there is a GPU per rank), calls the function, destroys the groups and
returns the results by rank.

This module is the controller; the jobs around it have their own modules:
the workers (:mod:`~meshstate.testing.worker`), the fork server they come from
(:mod:`~meshstate.testing.fork_server`), the errors of a run that went wrong
(:mod:`~meshstate.testing.report`), the relay of their output with ``[rank 3]``
in front (:mod:`~meshstate.testing.relay`) and :func:`fake_world`
(:mod:`~meshstate.testing.fake`), which stands in for one rank of a large world in
the calling process instead.

Each worker leads its own process group (its own session), so a terminal's
Ctrl-C reaches only the calling process, which kills the groups on every way
out: ``close``, an interrupted ``run``, SIGTERM (the handler then chains to the
one it replaced) and interpreter exit.

Example::

    def world_sum() -> float:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    with LocalWorld(4) as world:
        world.run(world_sum)          # [6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from types import FrameType
from typing import Any, cast

import torch

from meshstate.errors import MeshStateError
from meshstate.testing import torch_internals
from meshstate.testing.fork_server import _CONTEXT, STOP_SIGNALS, running_worlds
from meshstate.testing.fork_server import warm_up
from meshstate.testing.relay import _OutputRelay, _read_available
from meshstate.testing.report import (
    _describe_ranks,
    _main_thread_stack,
    _report,
    _unguarded_main,
    _unsendable,
)
from meshstate.testing.worker import (
    IMPORTED_MAIN_EXIT,
    _dumps,
    _FunctionRef,
    _worker_main,
    exit_if_importing_main,
    unimportable_main_hidden,
)

DEFAULT_TIMEOUT = timedelta(seconds=120)
"""How long a run may take unless told otherwise; halfway, a line on stderr says who is still running."""
# After one rank fails, how long the others get to report before the world is torn down.
_FAILURE_GRACE_SECONDS = 5.0
# How long unfinished ranks get to write their stacks.
_STACK_WAIT_SECONDS = 2.0


def default_backend(world_size: int) -> str:
    """``"nccl"`` when every rank can have its own GPU, else ``"gloo"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class LocalWorld:
    """``world_size`` worker processes that run functions as one distributed world.

    ``backend`` defaults to NCCL when there is a GPU per rank, else gloo.
    ``timeout`` bounds the start-up, each ``run`` and every collective inside it.
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
        _refuse_inside_threads()
        exit_if_importing_main()
        self.world_size = world_size
        self.backend = backend or default_backend(world_size)
        self.timeout = timeout
        self._context = _CONTEXT
        warm_up()
        self._alive_reader, self._alive_writer = self._context.Pipe(duplex=False)
        self._port = _free_port()
        self._store = torch_internals.TCPStore(
            "127.0.0.1", self._port, is_master=True, wait_for_workers=False
        )
        # A pipe each way per worker: no semaphore (a Queue's) for a signalled caller to leak.
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        self._workers: list[BaseProcess] = []
        self._task_counter = 0
        self._stack_readers: list[Connection] = []
        self._relay = _OutputRelay()
        _install_sigterm_handler()
        running_worlds.add(self)
        pipes = [[self._context.Pipe(duplex=False) for _ in range(3)] for _ in range(world_size)]
        for rank, ((out_reader, _), (err_reader, _), (stack_reader, _)) in enumerate(pipes):
            self._relay.add(rank, out_reader, 1)
            self._relay.add(rank, err_reader, 2)
            os.set_blocking(stack_reader.fileno(), False)
            self._stack_readers.append(stack_reader)
        self._relay.start()
        try:
            try:
                with unimportable_main_hidden():
                    for rank, ((_, stdout), (_, stderr), (_, stacks)) in enumerate(pipes):
                        self._start_worker(rank, stdout, stderr, stacks)
            finally:
                for _, writer in itertools.chain(*pipes):
                    writer.close()
                self._alive_reader.close()  # the workers hold it now
        except BaseException:
            self._kill()
            raise
        self._execute(f"starting {world_size} workers", 0, timeout, [])

    def _start_worker(
        self, rank: int, stdout: Connection, stderr: Connection, stacks: Connection
    ) -> None:
        task_reader, tasks = self._context.Pipe(duplex=False)
        results, result_writer = self._context.Pipe(duplex=False)
        worker = self._context.Process(
            target=_worker_main,
            args=(rank, self.world_size, self.backend, self._port, dict(os.environ),
                  self._alive_reader, stdout, stderr, stacks, task_reader, result_writer),
            daemon=True,
            name=f"meshstate-rank{rank}",
        )
        # A Ctrl-C or SIGTERM waits until the worker is started and recorded, so the cleanup
        # it triggers kills it rather than leaving it half-started.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            worker.start()
            self._tasks.append(tasks)
            self._results.append(results)
            self._workers.append(worker)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            task_reader.close()  # the worker's ends
            result_writer.close()

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

        ``fn`` must be a module-level function of a module the workers can
        import (a function of a notebook or of ``python -`` runs in
        :func:`~meshstate.testing.threaded_world`), its arguments and result
        picklable. Raises :class:`RankFailure` if a rank raises or dies and
        :class:`RankTimeout` if ranks do not finish within ``timeout``. If the
        run is interrupted (Ctrl-C, a signal), the workers are killed.
        """
        if not self.alive:
            raise MeshStateError("this LocalWorld is closed; start a new one")
        _refuse_inside_threads()
        timeout = timeout or self.timeout
        task = (_FunctionRef.of(fn), args, kwargs, timeout)
        try:
            payloads = [_dumps(task) for _ in self._workers]
        except Exception as error:
            raise MeshStateError(
                f"{fn.__qualname__}: {_unsendable(args, kwargs)} cannot be sent to the "
                f"worker processes: {error}"
            ) from None
        self._task_counter += 1
        return self._execute(fn.__qualname__, self._task_counter, timeout, payloads)

    def _execute(
        self, name: str, task_id: int, timeout: timedelta, payloads: list[bytes]
    ) -> list[Any]:
        """Send each rank its payload as task ``task_id``; return the results by rank.

        If the outcome is not a result on every rank, raise the report on ``name``.
        """
        try:
            for tasks, payload in zip(self._tasks, payloads):
                with contextlib.suppress(OSError):  # a worker that died: collecting finds it
                    tasks.send((task_id, payload))
            outcomes = self._collect(name, task_id, timeout)
            self._relay.drain()
            missing = [rank for rank in range(self.world_size) if rank not in outcomes]
            stacks = self._stacks([rank for rank in missing if self._workers[rank].is_alive()])
            # Read after the stacks: a worker whose pipe closed may exit while they are asked.
            exits = {rank: self._workers[rank].exitcode for rank in missing
                     if not self._workers[rank].is_alive()}
            stacks = {rank: stack for rank, stack in stacks.items() if rank not in exits}
        except BaseException:  # interrupted: the workers are mid-task
            self._kill()
            raise
        if missing:
            self._kill()
        if IMPORTED_MAIN_EXIT in exits.values():
            raise _unguarded_main()
        failures = {rank: value for rank, (kind, value) in outcomes.items() if kind == "error"}
        if failures or missing:
            raise _report(name, self.world_size, timeout, failures, exits, stacks)
        return [ForkingPickler.loads(outcomes[rank][1]) for rank in range(self.world_size)]

    def _collect(
        self, name: str, task_id: int, timeout: timedelta
    ) -> dict[int, tuple[str, Any]]:
        """Each rank's outcome of ``task_id``: until all are in, time is up or a worker dies.

        Halfway to the timeout, one line on stderr names the ranks still running."""
        outcomes: dict[int, tuple[str, Any]] = {}
        open_results = list(self._results)
        deadline = time.monotonic() + timeout.total_seconds()
        halfway: float | None = time.monotonic() + timeout.total_seconds() / 2
        while len(outcomes) < self.world_size:
            if halfway is not None and time.monotonic() >= halfway:
                halfway = None
                running = [rank for rank in range(self.world_size) if rank not in outcomes]
                print(
                    f"meshstate.testing: {name} has run half its {timeout.total_seconds():g} s "
                    f"timeout; {_describe_ranks(running)} not finished",
                    file=sys.stderr, flush=True,
                )
            if any(kind == "error" for kind, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_SECONDS)
            ready = wait(open_results, timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            if not ready and (time.monotonic() >= deadline or not self.alive):
                break
            for results in cast(list[Connection], ready):
                try:
                    done_id, rank, outcome = results.recv()
                except EOFError:  # the worker died
                    open_results.remove(results)
                    continue
                if done_id == task_id:
                    outcomes[rank] = outcome
            if not open_results:
                break
        return outcomes

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the workers of ``ranks`` for their Python stacks (faulthandler, on SIGUSR1)."""
        for rank in ranks:
            pid = self._workers[rank].pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):  # it may have exited since
                    os.kill(pid, signal.SIGUSR1)
        dumps = dict.fromkeys(ranks, b"")
        deadline = time.monotonic() + _STACK_WAIT_SECONDS
        while ranks and time.monotonic() < deadline:
            time.sleep(0.05)
            news = {rank: _read_available(self._stack_readers[rank].fileno())[0] for rank in ranks}
            if all(dumps.values()) and not any(news.values()):
                break
            for rank, new in news.items():
                dumps[rank] += new
        return {rank: _main_thread_stack(dump.decode(errors="replace"))
                for rank, dump in dumps.items()}

    def close(self) -> None:
        """Stop the workers, giving them a few seconds to exit; safe to call twice."""
        for tasks, worker in zip(self._tasks, self._workers):
            if worker.is_alive():
                with contextlib.suppress(OSError):
                    tasks.send(None)
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _signal_kill(self) -> None:
        """SIGKILL every worker and its process group; safe inside a signal handler."""
        for worker in self._workers:
            if worker.pid is None or worker.exitcode is not None:
                continue  # not started, or exited and reaped: its pid may be another's now
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError):
                    kill(worker.pid, signal.SIGKILL)

    def _kill(self) -> None:
        self._signal_kill()
        for worker in self._workers:
            worker.join()
        self._workers.clear()
        for connection in (*self._tasks, *self._results):
            connection.close()
        self._tasks.clear()
        self._results.clear()
        self._relay.close()
        for reader in self._stack_readers:
            reader.close()
        self._alive_writer.close()
        running_worlds.discard(self)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# The previous SIGTERM handler, for the exit paths that no ``with`` block covers.
_previous_sigterm_handler: Callable[[int, FrameType | None], Any] | int | None = None


def _kill_running_worlds() -> None:
    for world in list(running_worlds):
        world._kill()


atexit.register(_kill_running_worlds)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Kill every world's workers, then do what SIGTERM did before (by default: die of it)."""
    for world in list(running_worlds):
        world._signal_kill()
    if callable(_previous_sigterm_handler):
        _previous_sigterm_handler(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_sigterm_handler() -> None:
    """Put :func:`_on_sigterm` in front of the SIGTERM handler, once, from the main thread.

    An ignored SIGTERM, or one handled outside Python, stays as it is.
    """
    global _previous_sigterm_handler
    if _previous_sigterm_handler is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current in (signal.SIG_IGN, None):
        return
    _previous_sigterm_handler = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _refuse_inside_threads() -> None:
    """Refuse a local world while a threaded world runs in this process (nested in a rank)."""
    if torch_internals.thread_per_rank_world_installed():
        raise MeshStateError(
            "a local world cannot start or run inside a threaded world's rank: c10d's world is "
            "one per thread there, and its workers would fork from a rank; start it before or "
            "after the threaded world"
        )


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
