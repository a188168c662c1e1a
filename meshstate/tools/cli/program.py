"""The ``meshstate`` command: ``plan`` a layout without processes, ``check`` it on real ones.

``meshstate plan --world-size 16 --tp 2 --pp 2`` prints every group kind;
``--json`` prints them as one object; ``--rank R`` adds that rank's view;
``--gpus-per-node N`` adds how many nodes each group spans and order advice;
``--svg FILE`` draws the ranks by node. ``meshstate check`` builds the mesh on
local processes (or the ranks torchrun launched) and verifies every group with
real collectives; it refuses to start more local ranks than the machine holds
unless told ``--force``. ``meshstate bench`` measures meshstate beside
megatron-core and plain DeviceMesh.

``--help``, argument errors and layout mistakes come from
:mod:`meshstate.tools.cli.parser` without importing torch; a command that runs loads
:mod:`meshstate.tools.cli.plan` (``plan``) or :mod:`meshstate.tools.cli.commands`; all
take the exit codes and :class:`Progress` from :mod:`meshstate.tools.cli.shared`. A
mistake in the input exits with status 2 and one line on stderr; Ctrl-C exits 130, SIGTERM 143, a
closed stdout pipe 141, each without a traceback. Progress goes to stderr when it is a terminal,
or always with ``--verbose``; a step that takes more than 2 s says what it is.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType, ModuleType

from meshstate.errors import MeshStateError
from meshstate.tools.cli.parser import layout_config, parse_args
from meshstate.tools.cli.shared import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_TERMINATED,
    Progress,
)


def _load_commands(command: str, progress: Progress) -> ModuleType:
    """The module that runs ``command``: :mod:`meshstate.tools.cli.plan` for ``plan``,
    else :mod:`meshstate.tools.cli.commands`; both import torch.

    torch warns "Failed to initialize NumPy" on import where numpy is absent;
    meshstate needs no numpy, so that warning is silenced here.
    """
    module = "plan" if command == "plan" else "commands"
    with progress.if_slow("importing torch"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        return importlib.import_module(f"meshstate.tools.cli.{module}")


class _Terminated(BaseException):
    """SIGTERM arrived during :func:`main`: unwind, stopping local ranks on the way."""


_main_running = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """During :func:`main` raise :class:`_Terminated`; otherwise die of SIGTERM as by default."""
    if _main_running:
        raise _Terminated
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Make SIGTERM unwind the stack (``finally`` blocks and ``__exit__`` run) while inside."""
    global _main_running
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    installed = previous not in (signal.SIG_IGN, None)
    if installed:
        signal.signal(signal.SIGTERM, _on_sigterm)
    _main_running = True
    try:
        yield
    finally:
        _main_running = False
        if installed and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, previous)


def _print_output(text: str) -> bool:
    """Print ``text`` to stdout; False if the reader has gone (stdout then goes nowhere)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # As Python's docs advise: point stdout at devnull so the flush at exit stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return False
    return True


def _is_rank_failure(error: MeshStateError) -> bool:
    """Whether ``error`` says local ranks failed or timed out (their module is loaded if so)."""
    report = sys.modules.get("meshstate.testing.report")
    return report is not None and isinstance(error, (report.RankFailure, report.RankTimeout))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``meshstate`` command; return its exit status."""
    with _sigterm_unwinds():
        args = parse_args(argv)
        progress = Progress(args.command, args.verbose or sys.stderr.isatty())
        try:
            if args.command != "bench":  # checked before torch loads (seconds): args.layout
                args.layout = layout_config(args)
            commands = _load_commands(args.command, progress)
            status, output = getattr(commands, f"run_{args.command}")(args, progress)
            if output and not _print_output(output):
                return EXIT_BROKEN_PIPE
            return int(status)
        except KeyboardInterrupt:
            print(f"meshstate {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except _Terminated:
            print(f"meshstate {args.command}: terminated", file=sys.stderr)
            return EXIT_TERMINATED
        except MeshStateError as error:
            if _is_rank_failure(error):
                print(f"meshstate {args.command}: {error}", file=sys.stderr)
                return EXIT_MISMATCH
            print(f"meshstate {args.command}: error: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
