"""The checkpoint's error, and the refusal every rank raises when some rank found gaps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshstate.errors import MeshStateError


class CheckpointError(MeshStateError, ValueError):
    """A checkpoint that does not cover the state asked for, or a layout that cannot
    say where a shard lies. Raised on every rank before anything is loaded; the
    message names the key and the range."""


class Gaps(CheckpointError):
    """What one rank found missing or different (``problems``, one line each): raised where
    a backend's own collective gathers failures (DCP's planning) and turned into
    :func:`refusal` there."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


def refusal(found: Mapping[int, Sequence[str]]) -> CheckpointError:
    """The error every rank raises when the ranks in ``found`` found gaps: the first
    rank's first three named.

    Example: ``refusal({3: ["a.0.w (this rank's w) is not in the checkpoint"]})`` says
    ``the checkpoint does not cover this layout (rank 3 of 1 ranks that found gaps):
    a.0.w (this rank's w) is not in the checkpoint; nothing was loaded``.
    """
    rank = min(found)
    problems = list(found[rank])
    listed = problems[:3] + ([f"and {len(problems) - 3} more"] if len(problems) > 3 else [])
    return CheckpointError(
        f"the checkpoint does not cover this layout (rank {rank} of {len(found)} ranks "
        f"that found gaps): " + "; ".join(listed) + "; nothing was loaded"
    )
