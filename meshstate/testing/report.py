"""What a run that went wrong says: the errors and how their message is put together.

A failure raised the same way on several ranks is shown once with those ranks
(``ranks 0-3: AssertionError: …``), a rank that does not finish is shown with
its Python stack, an argument that cannot be sent to the workers is named.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Collection
from datetime import timedelta
from typing import Any

from meshstate.errors import MeshStateError
from meshstate.testing.worker import _dumps, _Failure


class RankFailure(MeshStateError, RuntimeError):
    """One or more ranks raised or died; the message holds each distinct traceback."""


class RankTimeout(MeshStateError, TimeoutError):
    """Some ranks did not finish in time; the message names them and shows their stacks."""


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


def _unguarded_main() -> MeshStateError:
    """The error of a script that starts a world when imported (its workers import it)."""
    script = getattr(sys.modules["__main__"], "__file__", None) or "the main module"
    return MeshStateError(
        f"meshstate.testing: the script {script} starts a local world when imported; "
        f'put the call under if __name__ == "__main__":'
    )


def _report(
    name: str,
    world_size: int,
    timeout: timedelta,
    failures: dict[int, _Failure],
    exits: dict[int, int | None],
    stacks: dict[int, str],
    running: Collection[int] = (),
) -> RankFailure | RankTimeout:
    """One error for a run that went wrong; identical tracebacks and stacks are shown once.

    ``running`` are the ranks of a threaded world whose threads could not be woken.
    """
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
    if running:
        problems.append(
            f"the threads of {_describe_ranks(running)} could not be woken and still run "
            "(daemon threads: a thread cannot be killed)"
        )
    message = "\n".join([f"{name}: {'; '.join(problems)}", *sections])
    return RankFailure(message) if failures or exits else RankTimeout(message)
