"""The fork server the harness's workers come from, and starting it.

Workers are forked from a fork server (multiprocessing's ``forkserver``) that
has already imported torch, so a world starts in a fraction of a second instead
of N interpreters importing torch. On Linux without a GPU the server is itself
a fork of the calling process, ready at once with every module the caller had
imported; elsewhere it is a new interpreter that imports torch and meshstate.
:func:`warm_up` starts that server ahead of the first world.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import stat
import sys
import threading
import traceback
import warnings
from collections.abc import Collection, Iterator, Sequence
from types import ModuleType, TracebackType
from typing import Any, TextIO

import torch

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
"""Blocked while a process is started, so a Ctrl-C or SIGTERM waits until it is recorded."""
running_worlds: set[Any] = set()
"""The worlds with workers in this process (a fork of it would copy their pipes and threads)."""

# Modules the fork server imports once, so that forked workers start with them loaded.
_PRELOADED = ["torch", "torch.distributed", "meshstate", "meshstate.testing.launch"]
_CONTEXT = multiprocessing.get_context("forkserver")
# Set in the fork server's environment and every worker's: such a process never starts a server.
_WORKER_MARK = "MESHSTATE_WORKER"
# How multiprocessing starts its fork server: a new interpreter (see _fork_server_from_here).
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def warm_up(fork_from_here: bool = True) -> None:
    """Start the fork server the workers come from, if it is not running; returns at once.

    Where :func:`_server_can_fork_from_here`, the server is a fork of this
    process and serves at once; otherwise it is a new interpreter that imports
    torch (and pytest, when the caller has) in the background, so a world
    started later forks its workers from a warm process. Example:
    ``warm_up()`` while a test module is collected. ``fork_from_here=False`` starts a new
    interpreter whatever this process is.
    """
    if _WORKER_MARK in os.environ:
        return  # a worker importing a test module: its caller's server is the one to use
    loaded_extras = [name for name in ("pytest",) if name in sys.modules]
    _CONTEXT.set_forkserver_preload(_PRELOADED + loaded_extras)
    os.environ[_WORKER_MARK] = "1"  # the server inherits it, and so every worker from birth
    if fork_from_here and _server_can_fork_from_here():
        multiprocessing.util.spawnv_passfds = _fork_server_from_here
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = _spawnv_passfds
        del os.environ[_WORKER_MARK]


def autograd_survives_a_fork() -> bool:
    """Whether a process forked from this one can run autograd: since torch 2.14 one forked
    after a DTensor backward cannot ("Unable to handle autograd's threading in combination
    with fork-based multiprocessing"). Asked of a fork that runs a backward (milliseconds)."""
    with uncollected():
        pid = os.fork()
        if pid == 0:
            try:
                probe = torch.ones(1, requires_grad=True)
                torch.autograd.backward((probe * 2).sum())
                os._exit(0)
            except BaseException:
                os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def clean_context() -> Any:
    """The fork server's start method with its server running: the one :func:`warm_up`
    started (before the caller ran anything), else a new interpreter started now, never a
    fork of this process."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        warm_up(fork_from_here=False)
    return _CONTEXT


def _server_can_fork_from_here() -> bool:
    """Whether the fork server may be a fork of this process.

    On Linux, with no world running here (its pipes and threads would be
    copied) and no GPU (CUDA does not survive a fork; NCCL workers need it).
    """
    return sys.platform == "linux" and not running_worlds and torch.cuda.device_count() == 0


_SERVER_COMMAND = "from multiprocessing.forkserver import main"


@contextlib.contextmanager
def uncollected() -> Iterator[None]:
    """No garbage collection while this process forks (the fork server, a simulated world's
    stages): garbage here (a threaded world's gloo groups, say) must not be destroyed in a
    fork, where its locks may be copied held and destroying it hangs or aborts. A fork
    freezes what it inherited (``gc.freeze()``) before it turns collection back on; nothing
    is collected here first (in a long test session that takes a good part of a second)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _collect_again(collecting)


def _collect_again(collecting: bool) -> None:
    if collecting:
        gc.enable()


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
    # A Ctrl-C or SIGTERM waits until the fork is done: the caller handles it afterwards,
    # the server (which gets the default handlers back first) never sees it.
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    collecting = gc.isenabled()
    gc.disable()  # as uncollected() does, until the child has frozen what it inherited
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns of forking a process with threads (torch starts some): the
            # child takes no lock of theirs; its workers run torch with one thread, as
            # DataLoader's do.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        _collect_again(collecting)
        raise
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        _collect_again(collecting)
        return pid
    status = 1
    gc.freeze()  # nothing of the caller's is collected (destroyed) in the server or its workers
    _collect_again(collecting)
    try:
        for fd in other_ends:  # the "alive" pipe must read as closed once the caller is gone
            os.close(fd)
        # ensure_running() held the server's lock when it forked; this copy must be free
        server = multiprocessing.forkserver._forkserver
        server._lock = threading.Lock()  # type: ignore[attr-defined]
        _forget_caller_state()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
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
    reach their stderr again (an uncaught exception through
    :func:`quiet_when_caller_gone`). Signal handlers are the defaults again (a
    caller's SIGTERM handler must not run in the server). The main script and
    any module still being imported are dropped, so a worker runs or imports
    them whole.
    """
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    sys.excepthook, sys.unraisablehook = quiet_when_caller_gone, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    warnings.showwarning = _print_warning
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    faulthandler.disable()
    for name, module in list(sys.modules.items()):
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]
    sys.modules["__main__"] = ModuleType("__main__")


def quiet_when_caller_gone(
    kind: type[BaseException], value: BaseException, trace: TracebackType | None
) -> None:
    """The server's and its workers' hook for an uncaught exception: Python's, except that
    a worker forked while its caller was being stopped (Ctrl-C, SIGTERM), which finds its
    start data cut short (``EOFError: Ran out of input``) or its pipe closed, ends
    without a traceback on the caller's terminal, as the caller itself does."""
    if not issubclass(kind, (EOFError, ConnectionError)):
        sys.__excepthook__(kind, value, trace)


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
