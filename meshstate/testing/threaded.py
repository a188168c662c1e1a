"""A threaded world: every rank a thread of the calling process, with real values.

``threaded_world(4).run(fn)`` calls ``fn`` in 4 threads, each a rank with a
default process group of its own, and returns the results by rank, as
:class:`~meshstate.testing.launch.LocalWorld` does with processes. The groups
are torch's threaded group (collectives move tensors between the threads) with
the send and receive it lacks, so whatever runs on processes runs here:
FSDP2, DDP, DCP, torch's pipelining, megatron-core's layers, printing (each
line with ``[rank N]`` in front). It also runs functions that worker processes
could not import: a notebook's, ``python -``'s. What meshstate keeps per
process is per rank here: the current mesh, the meshes, the Megatron façade's
state. A failure or a timeout is reported as a local world reports it; ranks
waiting in a receive, a collective or a group's creation are woken, and a thread that cannot be
woken is left running as a daemon and named.

Each rank draws random numbers from a default generator of its own, as a process
does (:mod:`meshstate.testing.threaded_random`), starting from the caller's state.
The threads share the rest of the process: ``os.environ`` and other libraries'
globals. One threaded world runs at a time.

Example::

    def world_sum() -> float:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    threaded_world(4).run(world_sum)          # [6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from meshstate.core.agreement import abandon, leave_barrier, store_barrier
from meshstate.core.current import destroy_every_mesh
from meshstate.errors import AbandonedError, MeshStateError
from meshstate.core.world import state_per_thread
from meshstate.testing import torch_internals
from meshstate.testing.launch import _FAILURE_GRACE_SECONDS, _STACK_WAIT_SECONDS, DEFAULT_TIMEOUT
from meshstate.testing.report import _describe_ranks, _report
from meshstate.testing.threaded_random import RankRandomness, seeding_per_rank
from meshstate.testing.worker import _failure

__all__ = ["BACKEND", "ThreadedWorld", "threaded_world"]

BACKEND = "meshstate_threads"
"""The backend of a threaded world's groups, as ``dist.get_backend()`` names it in a rank."""

# A message's address: (group name, source and destination group ranks, tag).
_Address = tuple[str, int, int, int]


class ThreadedWorld:
    """``world_size`` ranks as threads of this process; ``timeout`` bounds each ``run``."""

    def __init__(self, world_size: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise MeshStateError(f"world size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self._closed = False

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results by rank.

        Each rank gets a fresh default process group; its meshes are destroyed
        after it. Raises :class:`~meshstate.testing.report.RankFailure` if a rank
        raises and :class:`~meshstate.testing.report.RankTimeout` if ranks do not
        finish within ``timeout`` (halfway, a line on stderr names them).
        """
        if self._closed:
            raise MeshStateError("this ThreadedWorld is closed; start a new one")
        timeout = timeout or self.timeout
        with _claim(self.world_size) as run, _ranked_output(sys.stdout, sys.stderr):
            run.start(fn, args, kwargs, timeout)
            return run.finish(getattr(fn, "__qualname__", repr(fn)), timeout)

    def close(self) -> None:
        """Refuse further runs (a threaded world holds nothing between them)."""
        self._closed = True

    def __enter__(self) -> ThreadedWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def threaded_world(world_size: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> ThreadedWorld:
    """A :class:`ThreadedWorld` of ``world_size`` ranks: ``threaded_world(4).run(fn)``."""
    return ThreadedWorld(world_size, timeout=timeout)


def _is_skip(error: BaseException) -> bool:
    """Whether ``error`` is pytest's ``pytest.skip()`` (named, not imported: pytest is a
    development dependency)."""
    pytest = sys.modules.get("pytest")
    return pytest is not None and isinstance(error, pytest.skip.Exception)


class _Released(SystemExit):
    """Raised in a rank woken from a receive because the run ended (as torch's threaded
    collectives raise ``SystemExit``): not an error of its own."""


class _Receive(dist.Work):
    """A posted receive: ``wait()`` blocks until its message arrives, then copies it in,
    or raises :class:`_Released` when the run ends first."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors
        self.arrived = threading.Event()
        self.message: list[torch.Tensor] = []
        self.released: str | None = None

    def deliver(self, message: list[torch.Tensor]) -> None:
        self.message = message
        self.arrived.set()

    def release(self, why: str) -> None:
        self.released = why
        self.arrived.set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.arrived.wait()
        if self.released is not None:
            raise _Released(f"released from a receive: {self.released}")
        with torch.no_grad():  # hidden from autograd, as torch's threaded collectives do
            for tensor, sent in zip(self.tensors, self.message, strict=True):
                tensor.detach().copy_(sent)
        return True

    def is_completed(self) -> bool:
        return self.arrived.is_set()


class _Sent(dist.Work):
    """A send: done once posted, since the message is a copy."""

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Mail:
    """The messages sent and not yet received, and the receives posted and not yet
    delivered, by address; an address's messages arrive in the order sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unclaimed: dict[_Address, deque[list[torch.Tensor]]] = {}
        self.waiting: dict[_Address, deque[_Receive]] = {}
        self.closed: str | None = None

    def post(self, address: _Address, message: list[torch.Tensor]) -> None:
        with self.lock:
            waiting = self.waiting.get(address)
            if waiting:
                waiting.popleft().deliver(message)
            else:
                self.unclaimed.setdefault(address, deque()).append(message)

    def receive(self, address: _Address, tensors: list[torch.Tensor]) -> _Receive:
        receive = _Receive(tensors)
        with self.lock:
            unclaimed = self.unclaimed.get(address)
            if unclaimed:
                receive.deliver(unclaimed.popleft())
            elif self.closed is not None:
                receive.release(self.closed)
            else:
                self.waiting.setdefault(address, deque()).append(receive)
        return receive

    def close(self, why: str) -> None:
        """Release every receive waiting now or posted from now on."""
        with self.lock:
            self.closed = why
            for receives in self.waiting.values():
                for receive in receives:
                    receive.release(why)
            self.waiting.clear()


class _ThreadedGroup(torch_internals.ProcessLocalGroup):
    """torch's threaded group with send and receive, through the running world's mail.

    A send posts a copy and is done at once; a receive is done when its message
    is there, so a batch that posts its receives before its sends cannot deadlock.
    """

    def _set_group_name(self, name: str) -> None:
        # torch names a group after creating it; the base class keeps a name on its backends,
        # and this one has none, and torch's threaded group reads the world's map of names,
        # from which destroy_process_group removes the group before asking for its name.
        self._name = name

    @property
    def pg_name(self) -> str:
        return self._name

    @property
    def group_name(self) -> c10d.GroupName:
        return c10d.GroupName(self._name)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work:
        message = [tensor.detach().clone() for tensor in tensors]
        _running_world().mail.post((self.pg_name, self._rank, dstRank, tag), message)
        return _Sent()

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work:
        return _running_world().mail.receive((self.pg_name, srcRank, self._rank, tag), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        raise MeshStateError("a threaded world receives from a given rank only: pass src= to recv")

    def _get_backend(self, device: torch.device) -> Any:  # a Backend to torch; here the group
        """This group, which is its own backend on every device (torch 2.14's
        ``batch_isend_irecv`` asks a group's backend whether it coalesces; this one does not)."""
        return self


def _create_threaded_group(
    store: torch_internals.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroup:
    """A rank's group, returned once every member has created it (threads create different
    groups at once, the tp and dp groups of a 2x2 mesh, and a collective must not start
    before its group exists on every member); a failed run wakes the members waiting."""
    group = _ThreadedGroup(rank, world_size)  # type: ignore[no-untyped-call]
    store_barrier(store, "meshstate/members", world_size, timeout)
    leave_barrier(store, "meshstate/members", world_size)
    return group


dist.Backend.register_backend(BACKEND, _create_threaded_group, devices=["cpu", "cuda"])


class _Run:
    """One ``run``: the rank threads, their outcomes and mail, and waking them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.store = torch_internals.HashStore()
        self.mail = _Mail()
        self.threads: list[threading.Thread] = []
        # rank -> ("ok", result) | ("error", _Failure) | ("released", stack)
        self.outcomes: dict[int, tuple[str, Any]] = {}
        self.ended = threading.Condition()
        self.woken: str | None = None

    def start(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: timedelta,
    ) -> None:
        random_state = torch.default_generator.get_state()
        for rank in range(self.world_size):
            thread = threading.Thread(
                target=self._rank_main, args=(rank, fn, args, kwargs, timeout, random_state.clone()),
                name=f"meshstate-rank{rank}", daemon=True,
            )
            thread.start()
            self.threads.append(thread)

    def _rank_main(
        self, rank: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
        timeout: timedelta, random_state: torch.Tensor,
    ) -> None:
        _thread_rank.rank = rank
        outcome: tuple[str, Any]
        try:
            dist.init_process_group(
                BACKEND, store=self.store, rank=rank, world_size=self.world_size, timeout=timeout
            )
            with RankRandomness(random_state), torch_internals.recompiles_per_rank(self.world_size):
                outcome = ("ok", fn(*args, **kwargs))
        except BaseException as error:
            outcome = self._outcome_of(rank, error)
        try:
            if _running is self:  # not a thread left running once its world ended
                destroy_every_mesh()  # this rank's meshes, the Megatron façade's too
                if dist.is_initialized():
                    dist.destroy_process_group()
        except BaseException as error:
            if outcome[0] == "ok":
                outcome = self._outcome_of(rank, error)
        with self.ended:
            self.outcomes[rank] = outcome
            self.ended.notify_all()

    def _outcome_of(self, rank: int, error: BaseException) -> tuple[str, Any]:
        """A rank's error, or where it was when woken (torch's collectives and our
        receives raise ``SystemExit`` then, a mesh build or group creation ``AbandonedError``)."""
        if self.woken is not None and isinstance(error, (SystemExit, AbandonedError)):
            return "released", _stack(traceback.extract_tb(error.__traceback__))
        if _is_skip(error):  # pytest.skip() in a body: the test is skipped, as in a process
            self.wake(f"rank {rank} skipped the test")
            return "skipped", error
        failure = _failure(error)
        self.wake(f"rank {rank} raised {failure.summary}")
        return "error", failure

    def wake(self, why: str) -> None:
        """Release every rank waiting in a collective, a receive, a mesh build or a group's
        creation, now and from now on."""
        if self.woken is None:
            self.woken = why
            torch_internals.release_threaded_collectives()
            self.mail.close(why)
            abandon(self.store, why)

    def finish(self, name: str, timeout: timedelta) -> list[Any]:
        """Wait for every rank's outcome, until ``timeout`` or a failure's grace is over;
        return the results by rank or raise the report."""
        started = time.monotonic()
        deadline = started + timeout.total_seconds()
        halfway: float | None = started + timeout.total_seconds() / 2
        with self.ended, self._woken_if_interrupted():
            while len(self.outcomes) < self.world_size:
                now = time.monotonic()
                if halfway is not None and now >= halfway:
                    halfway = None
                    print(
                        f"meshstate.testing: {name} has run half its {timeout.total_seconds():g} s "
                        f"timeout; {_describe_ranks(self._unfinished())} not finished",
                        file=sys.stderr, flush=True,
                    )
                if self.woken is not None:
                    deadline = min(deadline, now + _FAILURE_GRACE_SECONDS)
                if now >= deadline:
                    break
                self.ended.wait(min(deadline, halfway or deadline) - now)
            outcomes = dict(self.outcomes)
        unfinished = self._unfinished(outcomes)
        frames = sys._current_frames()  # the stacks of the ranks still running, before waking them
        stacks = {rank: _stack(traceback.extract_stack(frames[ident]))
                  for rank, ident in self._idents(unfinished).items() if ident in frames}
        stacks.update({rank: where for rank, (kind, where) in outcomes.items() if kind == "released"})
        if unfinished:
            self.wake(f"{name} timed out after {timeout.total_seconds():g} s")
        wake_deadline = time.monotonic() + _STACK_WAIT_SECONDS
        for thread in self.threads:  # a finished rank's thread is ending; a woken one soon
            thread.join(max(0.0, wake_deadline - time.monotonic()))
        running = [rank for rank in unfinished if self.threads[rank].is_alive()]
        failures = {rank: failure for rank, (kind, failure) in outcomes.items() if kind == "error"}
        skips = [skip for kind, skip in outcomes.values() if kind == "skipped"]
        if skips and not failures:
            raise skips[0]
        if failures or stacks:
            raise _report(name, self.world_size, timeout, failures, {}, stacks, running)
        return [outcomes[rank][1] for rank in range(self.world_size)]

    @contextlib.contextmanager
    def _woken_if_interrupted(self) -> Iterator[None]:
        try:
            yield
        except BaseException:  # Ctrl-C: the ranks must not outlive the world's c10d
            self.wake("the run was interrupted")
            raise

    def _unfinished(self, outcomes: dict[int, Any] | None = None) -> list[int]:
        done = self.outcomes if outcomes is None else outcomes
        return [rank for rank in range(self.world_size) if rank not in done]

    def _idents(self, ranks: list[int]) -> dict[int, int]:
        return {rank: ident for rank in ranks if (ident := self.threads[rank].ident) is not None}


def _stack(frames: traceback.StackSummary) -> str:
    """The frames of a rank's own code (below ``_Run._rank_main``), innermost first, as
    a faulthandler dump of a worker shows them."""
    names = [frame.name for frame in frames]
    own = frames[names.index("_rank_main") + 1:] if "_rank_main" in names else frames
    return "\n".join(f'  File "{frame.filename}", line {frame.lineno} in {frame.name}'
                     for frame in reversed(own))


# The running world's run: the one threaded world this process may run at a time.
_claim_lock = threading.Lock()
_running: _Run | None = None


def _running_world() -> _Run:
    if _running is None:
        raise MeshStateError("no threaded world is running: its groups are gone")
    return _running


@contextlib.contextmanager
def _claim(world_size: int) -> Iterator[_Run]:
    """Run a threaded world of ``world_size`` ranks in this process: c10d's world one per
    thread, and the Megatron façade's state, until the block ends; then the process's
    come back (its default group, if it has one, untouched), and its ``sys.excepthook``."""
    global _running
    with _claim_lock:
        if _running is not None:
            raise MeshStateError(
                f"a threaded world of {_running.world_size} ranks is running in this process; "
                f"a second ({world_size} ranks) must wait: torch's threaded group swaps c10d's "
                "process-wide world"
            )
        if torch_internals.thread_per_rank_world_installed():
            raise MeshStateError(
                "torch's threaded process group is installed in this process (torch's own "
                "threaded tests?); a threaded world needs c10d's world to itself"
            )
        run = _running = _Run(world_size)
    excepthook = sys.excepthook  # each rank's init_process_group wraps it in a "[rankN]: " one
    try:
        torch_internals.install_thread_per_rank_world()
        try:
            with state_per_thread(), seeding_per_rank():
                yield run
        finally:
            torch_internals.reset_threaded_collectives()
            torch_internals.uninstall_thread_per_rank_world()
    finally:
        sys.excepthook = excepthook
        with _claim_lock:
            _running = None


_thread_rank = threading.local()


class _RankLines:
    """``sys.stdout`` or ``sys.stderr`` while a threaded world runs: a rank's lines get
    ``[rank N] `` in front, as a local world's do; other threads' text passes through."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.unfinished: dict[int, str] = {}

    def write(self, text: str) -> int:
        rank: int | None = getattr(_thread_rank, "rank", None)
        if rank is None:
            return self.stream.write(text)
        with self.lock:
            *lines, rest = (self.unfinished.pop(rank, "") + text).split("\n")
            self.stream.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            if rest:
                self.unfinished[rank] = rest
        return len(text)

    def finish(self) -> None:
        """Write the lines a rank left unfinished."""
        with self.lock:
            for rank, line in sorted(self.unfinished.items()):
                self.stream.write(f"[rank {rank}] {line}\n")
            self.unfinished.clear()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def _ranked_output(stdout: TextIO, stderr: TextIO) -> Iterator[None]:
    ranked_stdout, ranked_stderr = _RankLines(stdout), _RankLines(stderr)
    sys.stdout, sys.stderr = ranked_stdout, ranked_stderr
    try:
        yield
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        ranked_stdout.finish()
        ranked_stderr.finish()
