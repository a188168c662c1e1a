"""The worker process: one rank of a local world, running the tasks it is sent.

A worker leads its own process group (its own session), so a terminal's Ctrl-C
reaches only the calling process; it kills its group itself once its parent is
gone, even by SIGKILL. Each task gets a fresh default process group, its
function's result or failure goes back pickled, and every mesh is destroyed
after it. Output goes to pipes the caller relays with the rank in front.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import inspect
import io
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, TextIO

import torch
import torch.distributed as dist

from meshstate.errors import MeshStateError
from meshstate.core.groups import release_side_by_side
from meshstate.core.current import destroy_every_mesh
from meshstate.testing import torch_internals
from meshstate.testing.fork_server import _WORKER_MARK, STOP_SIGNALS

IMPORTED_MAIN_EXIT = 86
"""A worker's exit code when the caller's script, imported in it, starts a local world."""


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
        if not _importable(fn.__module__):
            raise MeshStateError(
                f"{qualname} is defined in {fn.__module__}, which has no file the worker "
                "processes can import (a notebook, python -, python -c); threaded_world or "
                "simulated_world run every rank in this process"
            )
        return cls(fn.__module__, qualname)

    def resolve(self) -> Callable[..., Any]:
        target: Any = sys.modules.get(self.module) or importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return inspect.unwrap(target)  # type: ignore[no-any-return]


def _importable(module_name: str) -> bool:
    """Whether a worker process can import the module ``module_name``: one with a spec, or
    a script's ``__main__`` (from its file); not a notebook's, ``python -``'s (its file is
    ``<stdin>``) or ``python -c``'s."""
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__spec__", None) is not None:
        return True
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and os.path.isfile(file)


@contextlib.contextmanager
def unimportable_main_hidden() -> Iterator[None]:
    """Start workers inside: where ``__main__`` has a file that cannot be imported
    (``python -`` names it ``<stdin>``), it is hidden meanwhile, or multiprocessing would
    have every worker run it, and fail."""
    main = sys.modules["__main__"]
    file = getattr(main, "__file__", None)
    if file is None or _importable("__main__"):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = file


def exit_if_importing_main() -> None:
    """End this process quietly if it is a worker still importing the caller's script.

    A worker imports the script that started it (as multiprocessing does, so the
    script's functions can be found); a script that starts a world outside
    ``if __name__ == "__main__":`` would start one in every worker. The caller
    reads the exit code :data:`IMPORTED_MAIN_EXIT` and says what to add.
    """
    # multiprocessing's own flag for "this child is being set up" (private; no public name).
    if _WORKER_MARK in os.environ and getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(IMPORTED_MAIN_EXIT)


def _dumps(value: object) -> bytes:
    """Pickle as a multiprocessing queue would, but here, so a failure is seen at once."""
    return bytes(ForkingPickler.dumps(value))


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
    tasks: Connection,
    results: Connection,
) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked while its parent started it
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
    results.send((0, rank, ("ok", _dumps(None))))  # task 0: started
    while (task := _next_task(tasks)) is not None:
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
            # Every group is destroyed before the outcome goes back; kept here, the groups are
            # torn down after it, side by side (gloo takes 20 ms a group).
            groups = torch_internals.every_group() if dist.is_initialized() else []
            destroy_every_mesh()
            if dist.is_initialized():
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        results.send((task_id, rank, outcome))
        release_side_by_side(groups)


def _next_task(tasks: Connection) -> Any:
    """The next task, or ``None`` when the world ends: told so, or its pipe closed (the
    parent stopped, by Ctrl-C say, between two tasks: nothing to report)."""
    try:
        return tasks.recv()
    except EOFError:
        return None


def _wait_for_every_rank(store: torch_internals.PrefixStore, key: str, world_size: int) -> None:
    """Return once every rank of the world has called this with ``key``."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "")
    store.wait([f"{key}/all"])
