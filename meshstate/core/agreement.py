"""Before any group exists, every rank agrees on the config, or all fail alike.

At thousands of ranks the common failures are one rank launched with a
different flag and one node that never came up. :func:`agree` runs first in
every mesh build: each rank posts its config to the default group's store under
its own rank and its own build number (how many builds it has started in this
scope), and waits, within the timeout, until every rank has posted to that
build. Then either every rank holds the same config and the build goes on, or
every rank raises the same :class:`~meshstate.errors.ConfigMismatchError`
naming the ranks and fields that differ. A rank that times out writes the
verdict for everyone, so ranks that never arrive (by rank, not by count: a rank
that retries posts to its next build) end it on every rank that did with one
:class:`~meshstate.errors.MeshTimeoutError` naming them. On either error,
each rank raises only once every rank that arrived has read the verdict, so a
rank that hosts the store and exits at once leaves no one without it.

A rank that knows the others will not come (a threaded world's run, when one
rank fails) says so with :func:`abandon`: every rank waiting in a barrier raises
:class:`~meshstate.errors.AbandonedError` instead of waiting out its timeout.

The store traffic per rank is constant, and a build that passes leaves no key
behind but each rank's build count; only the error paths read every rank's entry.

On torch's fake backend there is no one to agree with, so nothing is checked.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.errors import AbandonedError, ConfigMismatchError, MeshStateError, MeshTimeoutError

_PREFIX = "meshstate/agree"
_LISTED = 16  # ranks named in a message before "and N more"
_ARRIVED = "arrived"  # the verdict of a build every rank reached; a timeout's is its message
_ABANDONED = "meshstate/abandoned"  # why the world will not complete, in its root store


def agree(
    fields: Mapping[str, Any],
    *,
    timeout: timedelta | None,
    ranks: range | tuple[int, ...] | None = None,
) -> int | None:
    """Wait until every rank (of ``ranks``, default the world) has posted ``fields``;
    check they are all the same. ``ranks`` is a range or an increasing tuple of ranks;
    ``timeout`` ``None`` is torch's default for the default group's backend.

    Returns the build's number, the same on every rank (``None`` on the fake
    backend; negative for a sub-world). Every rank must call it once per mesh build.

    Raises:
        MeshTimeoutError: some ranks did not call it within ``timeout``.
        ConfigMismatchError: some ranks posted different ``fields``.
    """
    backend = str(dist.get_backend())
    if backend == "fake":
        return None
    timeout = timeout or _compat.default_timeout(backend)
    store = _compat.thread_store()
    ranks = ranks or range(dist.get_world_size())
    rank = ranks.index(dist.get_rank())
    listed = "" if isinstance(ranks, range) else _digest(json.dumps(ranks))
    if len(ranks) == dist.get_world_size():
        scope = _PREFIX
    elif isinstance(ranks, range):
        scope = f"{_PREFIX}/{ranks.start}-{ranks.stop}"
    else:
        scope = f"{_PREFIX}/listed-{listed}"
    build = store.add(f"{scope}/builds/{rank}", 1) - 1
    _post_and_compare(store, f"{scope}/{build}", fields, ranks, rank, timeout)
    if scope == _PREFIX:
        return build
    if not isinstance(ranks, range):
        # A hash of the build and the listed ranks, far below any range's number.
        return -(1 << 62) - int(_digest(f"{build}/{listed}")[:15], 16)
    # A sub-world's build, told apart from the world's and other sub-worlds' (negative,
    # one integer per (build, start, stop)): group names built from it never collide.
    span = dist.get_world_size() + 1
    return -1 - (build * span + ranks.start) * span - ranks.stop


def _post_and_compare(
    store: Any,
    prefix: str,
    fields: Mapping[str, Any],
    ranks: range | tuple[int, ...],
    rank: int,
    timeout: timedelta,
) -> None:
    """Post ``fields`` as ``rank`` of ``ranks`` under ``prefix``, wait for the others, and
    raise the verdict's error on every rank that arrived (once all of them have read it)."""
    world_size = len(ranks)
    text = json.dumps(dict(fields), sort_keys=True, default=repr)
    digest = _digest(text)
    store.set(f"{prefix}/rank/{rank}", text)
    store.add(f"{prefix}/digest/{digest}", 1)

    def missing_ranks() -> str:  # the first rank to time out gives the verdict
        missing = [ranks[r] for r in range(world_size) if not store.check([f"{prefix}/rank/{r}"])]
        return (
            f"{_ranks(missing)} did not reach the mesh build within "
            f"{timeout.total_seconds():g} s ({world_size - len(missing)} of {world_size} "
            "ranks arrived)"
        )

    arrivals = f"{prefix}/count"
    verdict = store_barrier(
        store, arrivals, world_size, timeout, verdict=_ARRIVED, timed_out=missing_ranks
    )
    error: MeshStateError | None = None
    if verdict != _ARRIVED:
        error = MeshTimeoutError(verdict)
    elif store.add(f"{prefix}/digest/{digest}", 0) != world_size:
        keys = [f"{prefix}/rank/{r}" for r in range(world_size)]
        error = ConfigMismatchError(describe_mismatch([json.loads(v) for v in store.multi_get(keys)]))
    if error is None:
        store.delete_key(f"{prefix}/rank/{rank}")
        leave_barrier(store, arrivals, world_size, [f"{prefix}/digest/{digest}"])
        return
    # The store may live in this process: every rank that arrived reads the verdict before
    # any raises (a rank that died between arriving and reading never says so: time out).
    store_barrier(store, f"{prefix}/read", store.add(arrivals, 0), timeout, timed_out=str)
    raise error


def store_barrier(
    store: Any,
    key: str,
    size: int,
    timeout: timedelta,
    *,
    verdict: str = "",
    timed_out: Callable[[], str] | None = None,
) -> str:
    """Count the caller in at ``key`` and wait until ``size`` callers have; return the verdict.

    The caller that brings the count to ``size`` writes ``verdict`` under
    ``f"{key}/all"`` unless one is there, and every caller waits for it within
    ``timeout``. Where the timeout passes first, ``timed_out()`` gives the verdict
    (the first caller to time out writes it, the others read it) or, without
    ``timed_out``, ``DistStoreError`` is raised. :func:`leave_barrier` removes the keys.

    Example: ``store_barrier(store, "tp-0/formed", 2, timedelta(seconds=30))``
    returns on both members of a 2-rank group once both have called it.
    """
    done = f"{key}/all"
    if store.add(key, 1) >= size:
        store.compare_set(done, "", verdict)
    try:
        _wait(store, done, size, timeout)
    except dist.DistStoreError:
        if timed_out is None:
            raise
        return str(store.compare_set(done, "", timed_out()).decode())
    return str(store.get(done).decode())


def abandon(store: Any, why: str) -> None:
    """Wake every rank waiting in a :func:`store_barrier` on ``store`` (or on a prefix of
    it), now and from now on: each raises :class:`~meshstate.errors.AbandonedError` with
    ``why`` within about a second (plus a second per thousand waiters)."""
    _compat.root_store(store).set(_ABANDONED, why)


def _wait(store: Any, key: str, size: int, timeout: timedelta) -> None:
    """``store.wait([key], timeout)``, in slices between which the world's root store is
    asked whether it was abandoned (the slice grows with ``size``, as torch's store-based
    barrier's does, so a large world's waiters do not crowd the store)."""
    deadline = time.monotonic() + timeout.total_seconds()
    window = timedelta(seconds=1 + size / 1000)
    root = _compat.root_store(store)
    while True:
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            store.wait([key], min(window, left))
            return
        except dist.DistStoreError:
            if root.check([_ABANDONED]):
                raise AbandonedError(root.get(_ABANDONED).decode()) from None
            if time.monotonic() >= deadline:
                raise


def leave_barrier(store: Any, key: str, size: int, keys: Sequence[str] = ()) -> None:
    """Count the caller out of the barrier at ``key``: the last of ``size`` callers
    deletes the barrier's keys and ``keys``."""
    if store.add(f"{key}/left", 1) == size:
        for done in (key, f"{key}/all", f"{key}/left", *keys):
            store.delete_key(done)


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
