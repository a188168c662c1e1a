"""Run a function as every rank of a local ``torch.distributed`` world.

A :class:`LocalWorld` starts N worker processes once and reuses them: each
``run`` gives every worker a fresh default process group (gloo on CPU, NCCL
when there is a GPU per rank), calls the function, destroys the groups and
returns the results by rank.

When a run goes wrong the error explains it: a failure raised the same way on
several ranks is shown once with those ranks (``ranks 0-3: AssertionError:
…``), a rank that does not finish is shown with its Python stack, an argument
that cannot be sent to the workers is named before anything starts. Every line
a worker prints carries its rank (``[rank 3] …``).

Each worker leads its own process group (its own session), so a terminal's
Ctrl-C reaches only the calling process, which kills the groups on every way
out: ``close``, an interrupted ``run``, SIGTERM (the handler then chains to the
one it replaced) and interpreter exit. A worker whose parent dies, even by
SIGKILL, kills its group itself.

Workers are forked from a fork server (multiprocessing's ``forkserver``) that
has already imported torch, so a world starts in a fraction of a second instead
of N interpreters importing torch. On Linux without a GPU the server is itself
a fork of the calling process, ready at once with every module the caller had
imported; elsewhere it is a new interpreter that imports torch and meshstate.
:func:`warm_up` starts that server ahead of the first world.

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

import atexit
import contextlib
import faulthandler
import importlib
import inspect
import io
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import queue
import selectors
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from types import FrameType, ModuleType
from typing import Any, TextIO

import torch
import torch.distributed as dist

from meshstate.core.errors import MeshStateError
from meshstate.core.mesh import destroy_every_mesh
from meshstate.testing import torch_internals

DEFAULT_TIMEOUT = timedelta(seconds=120)
"""How long a run may take unless told otherwise; halfway, a line on stderr says who is still running."""
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
# After one rank fails, how long the others get to report before the world is torn down.
_FAILURE_GRACE_SECONDS = 5.0
# How long unfinished ranks get to write their stacks; how often the output relay looks up.
_STACK_WAIT_SECONDS = 2.0
_RELAY_POLL_SECONDS = 0.5


class RankFailure(MeshStateError, RuntimeError):
    """One or more ranks raised or died; the message holds each distinct traceback."""


class RankTimeout(MeshStateError, TimeoutError):
    """Some ranks did not finish in time; the message names them and shows their stacks."""


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


def _dumps(value: object) -> bytes:
    """Pickle as a multiprocessing queue would, but here, so a failure is seen at once."""
    return bytes(ForkingPickler.dumps(value))


def _describe_ranks(ranks: Collection[int]) -> str:
    """``"rank 3"``, ``"ranks 0-3"``, ``"ranks 0, 2, 5-7"``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    listed = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {listed}" if len(ranks) == 1 else f"ranks {listed}"


# Modules the fork server imports once, so that forked workers start with them loaded.
_PRELOADED = ["torch", "torch.distributed", "meshstate", "meshstate.testing.launch"]
_CONTEXT = multiprocessing.get_context("forkserver")
# Set in the fork server's environment and every worker's: such a process never starts a server.
_WORKER_MARK = "MESHSTATE_WORKER"
# How multiprocessing starts its fork server: a new interpreter (see _fork_server_from_here).
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def warm_up() -> None:
    """Start the fork server the workers come from, if it is not running; returns at once.

    Where :func:`_server_can_fork_from_here`, the server is a fork of this
    process and serves at once; otherwise it is a new interpreter that imports
    torch (and pytest, when the caller has) in the background, so a world
    started later forks its workers from a warm process. Example:
    ``warm_up()`` while a test module is collected.
    """
    if _WORKER_MARK in os.environ:
        return  # a worker importing a test module: its caller's server is the one to use
    loaded_extras = [name for name in ("pytest",) if name in sys.modules]
    _CONTEXT.set_forkserver_preload(_PRELOADED + loaded_extras)
    os.environ[_WORKER_MARK] = "1"  # the server inherits it, and so every worker from birth
    if _server_can_fork_from_here():
        multiprocessing.util.spawnv_passfds = _fork_server_from_here
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = _spawnv_passfds
        del os.environ[_WORKER_MARK]


def _server_can_fork_from_here() -> bool:
    """Whether the fork server may be a fork of this process.

    On Linux, with no world running here (its pipes and threads would be
    copied) and no GPU (CUDA does not survive a fork; NCCL workers need it).
    """
    return sys.platform == "linux" and not _running and torch.cuda.device_count() == 0


_SERVER_COMMAND = "from multiprocessing.forkserver import main"


def _fork_server_from_here(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds`` that starts the fork server as a fork of the caller.

    The child runs the server's ``-c`` command itself instead of a new
    interpreter, so it starts with torch and everything else imported here.
    Any other command is spawned as before. Returns the child's pid.
    """
    command = args[-1]
    if not command.startswith(_SERVER_COMMAND):
        return _spawnv_passfds(path, args, passfds)
    other_ends = _other_pipe_ends(passfds)
    with warnings.catch_warnings():
        # Python 3.12+ warns of forking a process with threads (torch starts some): the child
        # takes no lock of theirs; its workers run torch with one thread, as DataLoader's do.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        for fd in other_ends:  # the "alive" pipe must read as closed once the caller is gone
            os.close(fd)
        # ensure_running() held the server's lock when it forked; this copy must be free
        server = multiprocessing.forkserver._forkserver
        server._lock = threading.Lock()  # type: ignore[attr-defined]
        _forget_caller_state()
        exec(command, {})
    except (SystemExit, EOFError, ConnectionError):
        # The server's way out once the caller is gone; a caller killed while it was
        # sending a request (a signal to the whole process group) ends it with EOF.
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _other_pipe_ends(fds: Collection[int]) -> list[int]:
    """The open descriptors, not in ``fds``, that are the other end of a pipe in ``fds``."""
    pipes = {_pipe_id(fd) for fd in fds} - {None}
    ends = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if fd not in fds and _pipe_id(fd) in pipes:
                ends.append(fd)
    return ends


def _pipe_id(fd: int) -> tuple[int, int] | None:
    """What both ends of the pipe ``fd`` share (its device and inode); None if not a pipe."""
    info = os.fstat(fd)
    return (info.st_dev, info.st_ino) if stat.S_ISFIFO(info.st_mode) else None


def _forget_caller_state() -> None:
    """In a fork of the caller, undo what a new interpreter would not have.

    pytest's capture of ``sys.stdout``/``sys.stderr``, record of warnings,
    logging handlers and hooks for uncaught exceptions: in the workers these
    reach their stderr again. Signal handlers are the defaults again (a
    caller's SIGTERM handler must not run in the server). The main script and
    any module still being imported are dropped, so a worker runs or imports
    them whole.
    """
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    warnings.showwarning = _print_warning
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    faulthandler.disable()
    for name, module in list(sys.modules.items()):
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]
    sys.modules["__main__"] = ModuleType("__main__")


def _print_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Show a warning on stderr, as Python does by default."""
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def _exit_with_parent(parent_alive: Connection) -> None:
    """Kill this worker's process group as soon as the calling process is gone (even by SIGKILL).

    The caller holds the only write end of ``parent_alive``; it reads as closed once it dies.
    """
    with contextlib.suppress(EOFError, OSError):
        parent_alive.recv_bytes()
    os.killpg(0, signal.SIGKILL)


def _redirect(pipe: Connection, fd: int, stream: TextIO) -> None:
    """Send ``fd`` (and C++ code writing to it) into ``pipe``, line by line."""
    os.dup2(pipe.fileno(), fd)
    pipe.close()
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(line_buffering=True)


@dataclass(frozen=True)
class _Failure:
    """What a rank raised: ``summary`` (type and message, pytest's assertion detail left
    out), the ``line`` that raised it, the ``detail`` and the traceback ``text``."""

    summary: str
    line: str
    detail: str
    text: str


def _failure(error: BaseException) -> _Failure:
    """``error`` as a rank reports it: ``assert 0 < 0`` and ``assert 1 < 0`` (pytest's
    rewritten detail, which differs by rank) are one failure with two details."""
    lines = str(error).splitlines()
    detail_at = next(
        (i for i, line in enumerate(lines) if isinstance(error, AssertionError) and line.startswith("assert ")),
        len(lines),
    )
    message = lines[0] if lines and detail_at > 0 else ""
    summary = f"{type(error).__name__}: {message}" if message else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    line = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    detail = lines[detail_at] if detail_at < len(lines) else ""
    return _Failure(summary, line, detail, traceback.format_exc())


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    environment: dict[str, str],
    parent_alive: Connection,
    stdout: Connection,
    stderr: Connection,
    stacks: Connection,
    tasks: multiprocessing.Queue[Any],
    results: multiprocessing.Queue[Any],
) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked while its parent started it
    os.setsid()  # one killable group, out of reach of the terminal's Ctrl-C
    threading.Thread(target=_exit_with_parent, args=(parent_alive,), daemon=True).start()
    _redirect(stdout, 1, sys.stdout)
    _redirect(stderr, 2, sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=stacks.fileno(), all_threads=True)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(
        environment,
        MESHSTATE_WORKER="1",
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    store = torch_internals.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    results.put((0, rank, ("ok", _dumps(None))))  # task 0: started
    while (task := tasks.get()) is not None:
        task_id, payload = task
        try:
            function, args, kwargs, timeout = ForkingPickler.loads(payload)
            task_store = torch_internals.PrefixStore(f"task{task_id}", store)
            dist.init_process_group(
                backend, store=task_store, rank=rank, world_size=world_size, timeout=timeout
            )
            # A rank that finishes first and destroys its group must not cut a gloo connection
            # another rank is still completing.
            _wait_for_every_rank(task_store, "initialised", world_size)
            value = function.resolve()(*args, **kwargs)
            outcome: tuple[str, Any] = ("ok", _dumps(value))
        except BaseException as error:
            outcome = ("error", _failure(error))
        finally:
            # Every mesh, the current one and so Megatron's façade: the next task starts afresh.
            destroy_every_mesh()
            if dist.is_initialized():
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        results.put((task_id, rank, outcome))


def _wait_for_every_rank(store: torch_internals.PrefixStore, key: str, world_size: int) -> None:
    """Return once every rank of the world has called this with ``key``."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "")
    store.wait([f"{key}/all"])


class _OutputRelay:
    """Copies the workers' stdout and stderr to this process's, each line prefixed ``[rank N] ``.

    A thread copies output as it arrives; :meth:`drain` copies what is already
    written, so a run's output is out before the run returns.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, daemon=True, name="meshstate-output")

    def add(self, rank: int, pipe: Connection, fd: int) -> None:
        """Relay ``pipe`` (one of a worker's streams) to this process's ``fd``."""
        os.set_blocking(pipe.fileno(), False)
        self._selector.register(pipe.fileno(), selectors.EVENT_READ,
                                _Stream(f"[rank {rank}] ".encode(), pipe, fd))

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Copy every complete line the workers have written so far."""
        with self._lock:
            for key in list(self._selector.get_map().values()):
                key.data.copy()

    def close(self) -> None:
        """Wait briefly for the last lines of workers that have exited."""
        if self._thread.is_alive():
            self._thread.join(timeout=_STACK_WAIT_SECONDS)

    def _pump(self) -> None:
        while self._selector.get_map():
            for key, _ in self._selector.select(timeout=_RELAY_POLL_SECONDS):
                with self._lock:
                    if not key.data.copy():
                        self._selector.unregister(key.fd)
                        key.data.pipe.close()


@dataclass
class _Stream:
    """One worker stream being relayed: its prefix, pipe, destination and unfinished line."""

    prefix: bytes
    pipe: Connection
    fd: int
    pending: bytes = b""

    def copy(self) -> bool:
        """Copy the complete lines the pipe holds; False at its end (the last line goes too)."""
        new, is_open = _read_available(self.pipe.fileno())
        data = self.pending + new
        if data and not is_open:
            data += b"\n"
        *lines, self.pending = data.split(b"\n")
        out = b"".join(self.prefix + line + b"\n" for line in lines)
        with contextlib.suppress(OSError):  # a closed stdout: keep draining, drop the output
            while out:
                out = out[os.write(self.fd, out):]
        return is_open


def _read_available(fd: int) -> tuple[bytes, bool]:
    """What the non-blocking pipe ``fd`` holds now; False once every writer has closed it."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data, True
        if not chunk:
            return data, False
        data += chunk


def _main_thread_stack(dump: str) -> str:
    """The frames of a worker's own code in its faulthandler dump, innermost first."""
    for block in dump.split("\n\n"):
        frames = block.strip("\n").splitlines()[1:]
        if any(frame.endswith(" in _worker_main") for frame in frames):
            own = itertools.takewhile(lambda frame: not frame.endswith(" in _worker_main"), frames)
            return "\n".join(own)
    return dump.strip() or "(no stack: the worker did not answer)"


def _unsendable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Which argument fails to pickle, e.g. ``"argument 'lock' (a _thread.lock)"``."""
    named = [(f"positional argument {i}", value) for i, value in enumerate(args)]
    named += [(f"argument {name!r}", value) for name, value in kwargs.items()]
    for name, value in named:
        try:
            _dumps(value)
        except Exception:
            return f"{name} (a {type(value).__module__}.{type(value).__qualname__})"
    return "its arguments"


def _report(
    name: str,
    world_size: int,
    timeout: timedelta,
    failures: dict[int, _Failure],
    exits: dict[int, int | None],
    stacks: dict[int, str],
) -> RankFailure | RankTimeout:
    """One error for a run that went wrong; identical tracebacks and stacks are shown once."""
    problems, sections = [], []
    if failures:
        problems.append(f"{_describe_ranks(failures)} raised")
        by_failure: dict[tuple[str, str], dict[int, _Failure]] = {}
        for rank, failure in sorted(failures.items()):
            by_failure.setdefault((failure.summary, failure.line), {})[rank] = failure
        for (summary, _), alike in by_failure.items():
            first = next(iter(alike.values()))
            sections.append(f"--- {_describe_ranks(alike)}: {summary} ---\n{first.text.rstrip()}")
            by_detail: dict[str, list[int]] = {}
            for rank, failure in alike.items():
                by_detail.setdefault(failure.detail, []).append(rank)
            if len(by_detail) > 1:
                sections += [f"{_describe_ranks(ranks)}: {detail}" for detail, ranks in by_detail.items()]
    if exits:
        codes = ", ".join(str(code) for code in sorted(set(exits.values()), key=str))
        plural = "es" if len(exits) > 1 else ""
        problems.append(
            f"the worker process{plural} of {_describe_ranks(exits)} exited "
            f"(exit code {codes}); see the output above"
        )
    if stacks:
        within = "" if failures or exits else f" within {timeout.total_seconds():g} s"
        problems.append(f"{_describe_ranks(stacks)} of {world_size} did not finish{within}")
        by_stack: dict[str, list[int]] = {}
        for rank, stack in sorted(stacks.items()):
            by_stack.setdefault(stack, []).append(rank)
        sections += [
            f"--- {_describe_ranks(ranks)} stack (most recent call first) ---\n{stack}"
            for stack, ranks in by_stack.items()
        ]
    message = "\n".join([f"{name}: {'; '.join(problems)}", *sections])
    return RankFailure(message) if failures or exits else RankTimeout(message)


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
        self._results: multiprocessing.Queue[Any] = self._context.Queue()
        self._tasks: list[multiprocessing.Queue[Any]] = []
        self._workers: list[BaseProcess] = []
        self._task_counter = 0
        self._stack_readers: list[Connection] = []
        self._relay = _OutputRelay()
        _install_sigterm_handler()
        _running.add(self)
        pipes = [[self._context.Pipe(duplex=False) for _ in range(3)] for _ in range(world_size)]
        for rank, ((out_reader, _), (err_reader, _), (stack_reader, _)) in enumerate(pipes):
            self._relay.add(rank, out_reader, 1)
            self._relay.add(rank, err_reader, 2)
            os.set_blocking(stack_reader.fileno(), False)
            self._stack_readers.append(stack_reader)
        self._relay.start()
        try:
            try:
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
        tasks: multiprocessing.Queue[Any] = self._context.Queue()
        worker = self._context.Process(
            target=_worker_main,
            args=(rank, self.world_size, self.backend, self._port, dict(os.environ),
                  self._alive_reader, stdout, stderr, stacks, tasks, self._results),
            daemon=True,
            name=f"meshstate-rank{rank}",
        )
        # A Ctrl-C or SIGTERM waits until the worker is started and recorded, so the cleanup
        # it triggers kills it rather than leaving it half-started.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            worker.start()
            self._tasks.append(tasks)
            self._workers.append(worker)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)

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
        picklable. Raises :class:`RankFailure` if a rank raises or dies and
        :class:`RankTimeout` if ranks do not finish within ``timeout``. If the
        run is interrupted (Ctrl-C, a signal), the workers are killed.
        """
        if not self.alive:
            raise MeshStateError("this LocalWorld is closed; start a new one")
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
                tasks.put((task_id, payload))
            outcomes = self._collect(name, task_id, timeout)
            self._relay.drain()
            missing = [rank for rank in range(self.world_size) if rank not in outcomes]
            exits = {rank: self._workers[rank].exitcode for rank in missing
                     if not self._workers[rank].is_alive()}
            stacks = self._stacks([rank for rank in missing if rank not in exits])
        except BaseException:  # interrupted: the workers are mid-task
            self._kill()
            raise
        if missing:
            self._kill()
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
        return outcomes

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the workers of ``ranks`` for their Python stacks (faulthandler, on SIGUSR1)."""
        for rank in ranks:
            pid = self._workers[rank].pid
            if pid is not None:
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
                tasks.put(None)
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
        self._tasks.clear()
        self._relay.close()
        for reader in self._stack_readers:
            reader.close()
        self._alive_writer.close()
        _running.discard(self)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# Worlds with workers, for the exit paths that no ``with`` block covers.
_running: set[LocalWorld] = set()
_previous_sigterm_handler: Callable[[int, FrameType | None], Any] | int | None = None


def _kill_running_worlds() -> None:
    for world in list(_running):
        world._kill()


atexit.register(_kill_running_worlds)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Kill every world's workers, then do what SIGTERM did before (by default: die of it)."""
    for world in list(_running):
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
    dist.init_process_group("fake", store=torch_internals.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
