"""Before any group exists, every rank agrees on the config, or all fail alike.

At thousands of ranks the common failures are one rank launched with a
different flag and one node that never came up. :func:`agree` runs first in
every mesh build: each rank posts its config to the default group's store under
its own rank and its own build number (how many builds it has started in this
scope), and waits, within the timeout, until every rank has posted to that
build. Then either every rank holds the same config and the build goes on, or
every rank raises the same :class:`~meshstate.core.errors.ConfigMismatchError`
naming the ranks and fields that differ. A rank that times out writes the
verdict for everyone, so ranks that never arrive (by rank, not by count: a rank
that retries posts to its next build) end it on every rank that did with one
:class:`~meshstate.core.errors.MeshTimeoutError` naming them. On either error,
each rank raises only once every rank that arrived has read the verdict, so a
rank that hosts the store and exits at once leaves no one without it.

The store traffic per rank is constant, and a build that passes leaves no key
behind but each rank's build count; only the error paths read every rank's entry.

On torch's fake backend there is no one to agree with, so nothing is checked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.core.errors import ConfigMismatchError, MeshStateError, MeshTimeoutError

_PREFIX = "meshstate/agree"
_LISTED = 16  # ranks named in a message before "and N more"
_ARRIVED = "arrived"  # the verdict of a build every rank reached; a timeout's is its message


def agree(
    fields: Mapping[str, Any], *, timeout: timedelta, ranks: range | tuple[int, ...] | None = None
) -> int | None:
    """Wait until every rank (of ``ranks``, default the world) has posted ``fields``;
    check they are all the same. ``ranks`` is a range or an increasing tuple of ranks.

    Returns the build's number, the same on every rank (``None`` on the fake
    backend; negative for a sub-world). Every rank must call it once per mesh build.

    Raises:
        MeshTimeoutError: some ranks did not call it within ``timeout``.
        ConfigMismatchError: some ranks posted different ``fields``.
    """
    if dist.get_backend() == "fake":
        return None
    store = _compat.thread_store()
    ranks = ranks or range(dist.get_world_size())
    rank, world_size = ranks.index(dist.get_rank()), len(ranks)
    listed = "" if isinstance(ranks, range) else _digest(json.dumps(ranks))
    if len(ranks) == dist.get_world_size():
        scope = _PREFIX
    elif isinstance(ranks, range):
        scope = f"{_PREFIX}/{ranks.start}-{ranks.stop}"
    else:
        scope = f"{_PREFIX}/listed-{listed}"
    build = store.add(f"{scope}/builds/{rank}", 1) - 1
    prefix = f"{scope}/{build}"
    text = json.dumps(dict(fields), sort_keys=True, default=repr)
    digest = _digest(text)
    store.set(f"{prefix}/rank/{rank}", text)
    store.add(f"{prefix}/digest/{digest}", 1)
    if store.add(f"{prefix}/count", 1) == world_size:
        store.compare_set(f"{prefix}/verdict", "", _ARRIVED)
    try:
        store.wait([f"{prefix}/verdict"], timeout)
        verdict = store.get(f"{prefix}/verdict").decode()
    except dist.DistStoreError:  # timed out: the first rank to say so gives the verdict
        missing = [ranks[r] for r in range(world_size) if not store.check([f"{prefix}/rank/{r}"])]
        message = (
            f"{_ranks(missing)} did not reach the mesh build within "
            f"{timeout.total_seconds():g} s ({world_size - len(missing)} of {world_size} "
            "ranks arrived)"
        )
        verdict = store.compare_set(f"{prefix}/verdict", "", message).decode()
    error: MeshStateError | None = None
    if verdict != _ARRIVED:
        error = MeshTimeoutError(verdict)
    elif store.add(f"{prefix}/digest/{digest}", 0) != world_size:
        keys = [f"{prefix}/rank/{r}" for r in range(world_size)]
        error = ConfigMismatchError(describe_mismatch([json.loads(v) for v in store.multi_get(keys)]))
    if error is None:
        store.delete_key(f"{prefix}/rank/{rank}")
        if store.add(f"{prefix}/left", 1) == world_size:
            for key in ("verdict", "count", f"digest/{digest}", "left"):
                store.delete_key(f"{prefix}/{key}")
    else:
        _wait_until_read(store, prefix, world_size, timeout)
        raise error
    if scope == _PREFIX:
        return build
    if not isinstance(ranks, range):
        # A hash of the build and the listed ranks, far below any range's number.
        return -(1 << 62) - int(_digest(f"{build}/{listed}")[:15], 16)
    # A sub-world's build, told apart from the world's and other sub-worlds' (negative,
    # one integer per (build, start, stop)): group names built from it never collide.
    span = dist.get_world_size() + 1
    return -1 - (build * span + ranks.start) * span - ranks.stop


def _wait_until_read(store: Any, prefix: str, world_size: int, timeout: timedelta) -> None:
    """Return once every rank that arrived has read the verdict (or ``timeout`` passed):
    the store may live in this process, and the others must not lose it before then."""
    read = store.add(f"{prefix}/read", 1)
    if read >= store.add(f"{prefix}/count", 0):
        store.set(f"{prefix}/all read", "")
    try:
        store.wait([f"{prefix}/all read"], timeout)
    except dist.DistStoreError:
        pass  # a rank died between arriving and reading: it will never say so


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def describe_mismatch(posted: list[dict[str, Any]]) -> str:
    """Which ranks posted configs that differ from rank 0's, and in which fields.

    Example: ``"ranks disagree on the mesh config: rank 3 has tp=4 (rank 0: tp=2)"``.
    """
    reference = posted[0]
    by_difference: dict[str, list[int]] = {}
    for rank, fields in enumerate(posted):
        names = sorted(set(fields) | set(reference))
        different = [n for n in names if fields.get(n) != reference.get(n)]
        if different:
            mine = ", ".join(f"{n}={fields.get(n)!r}" for n in different)
            theirs = ", ".join(f"{n}={reference.get(n)!r}" for n in different)
            by_difference.setdefault(f"{mine} (rank 0: {theirs})", []).append(rank)
    parts = [f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {text}"
             for text, ranks in by_difference.items()]
    return "ranks disagree on the mesh config: " + "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:_LISTED]))
    more = f" and {len(ranks) - _LISTED} more" if len(ranks) > _LISTED else ""
    return f"ranks {shown}{more}"
