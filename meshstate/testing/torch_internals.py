"""The private torch APIs the harness and the benchmark touch, kept in one place.

The tools-and-testing layer's counterpart of :mod:`meshstate.core.compat`: what
only ``meshstate.testing`` and ``meshstate.tools`` use (torch's store types,
the fake backend's store, counting group creation, torch's own flatten and
unflatten, torch's threaded process group and the switches of c10d it needs).
A torch upgrade that moves any of these is this file's work alone; each
function says which private name it relies on.
"""

from __future__ import annotations

import time
from datetime import timedelta
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
# Store, TCPStore, HashStore and PrefixStore are public as torch.distributed.TCPStore & co., but
# torch does not declare them exported there, so a strict type check sees only these
# torch._C names; switch when torch lists them in torch.distributed.__all__.
from torch._C._distributed_c10d import HashStore as HashStore
from torch._C._distributed_c10d import PrefixStore as PrefixStore
from torch._C._distributed_c10d import Store as Store
from torch._C._distributed_c10d import TCPStore as TCPStore
import torch._C._distributed_c10d as _c10d_extension
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed import multi_threaded_pg as _multi_threaded_pg
# torch's in-process group of a thread per rank, the base of meshstate's threaded group:
# it lives in torch.testing._internal, without a public name.
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup as ProcessLocalGroup,
)

from meshstate.core import compat as _core_compat



@contextmanager
def recompiles_per_rank(world_size: int) -> Iterator[None]:
    """Let the calling rank, one of ``world_size`` in this process, compile a function as
    often as one process may: ``torch._dynamo.config.recompile_limit`` and its accumulated
    twin times ``world_size`` in this thread (torch keeps a setting per thread) until the
    block ends. The ranks share dynamo's caches, and a graph that guards on a rank's own
    values is one cache entry per rank."""
    import torch._dynamo.config as dynamo_config

    limits = dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit
    dynamo_config.recompile_limit = limits[0] * world_size
    dynamo_config.accumulated_recompile_limit = limits[1] * world_size
    try:
        yield
    finally:
        dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit = limits

@contextmanager
def counting_group_creation() -> Iterator[list[float]]:
    """Count the calls that create process groups while the block runs, and time them.

    Every group creation, by ``new_group``, ``init_device_mesh`` or meshstate,
    goes through ``c10d._new_process_group_helper`` (members and non-members
    alike), or through ``split_group``; the count is ``calls[0]``. ``calls[1]``
    is the seconds spent in torch's constructors, with the member lists that
    meshstate makes only for them (``meshstate.core.compat._torch_group``).
    """
    calls = [0, 0.0]
    helper, split = c10d._new_process_group_helper, dist.split_group
    listed_helper = _core_compat._torch_group
    depth = [0]

    def timed(create: Any, counts: bool) -> Any:
        def create_timed(*args: Any, **kwargs: Any) -> Any:
            calls[0] += counts
            depth[0] += 1
            started = time.perf_counter()
            try:
                return create(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:  # the outermost constructor only
                    calls[1] += time.perf_counter() - started

        return create_timed

    c10d._new_process_group_helper = timed(helper, counts=True)
    dist.split_group = timed(split, counts=True)
    _core_compat._torch_group = timed(listed_helper, counts=False)
    try:
        yield calls
    finally:
        c10d._new_process_group_helper = helper
        dist.split_group = split
        _core_compat._torch_group = listed_helper


def every_group() -> list[dist.ProcessGroup]:
    """Every process group this rank is a member of, the default group included.

    Reads ``c10d._world.pg_map``.
    """
    return list(c10d._world.pg_map)


def live_groups() -> list[dist.ProcessGroup]:
    """:func:`every_group`, the default group aside."""
    world_group = _core_compat.default_group()
    return [group for group in every_group() if group is not world_group]


def fake_store() -> Store:
    """A store for torch's ``fake`` backend, on which one process stands in for a rank of a
    large world.

    Uses ``torch.testing._internal.distributed.fake_pg.FakeStore``; torch has no public
    name for it yet.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store: Store = FakeStore()
    return store


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims flattened into one named ``name``, as torch itself does it.

    Creates the flattened dim's groups for every rank of the world (the
    benchmark's peer measures exactly that). Uses ``DeviceMesh._flatten``,
    which torch has not made public yet.
    """
    return mesh._flatten(name)


def unflatten(mesh: DeviceMesh, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A 1-D ``mesh`` split into dims of ``shape`` named ``names``.

    Uses ``DeviceMesh._unflatten``, which torch has not made public yet.
    """
    return mesh._unflatten(0, shape, names)


_TorchCollective = _multi_threaded_pg.Collective


class _FinishedCollective(_TorchCollective):
    """torch's threaded collective, but a rank whose collective has completed returns from it
    though the run was released meanwhile (torch's ``join`` exits every rank that finds the
    release set on waking, also one whose data rank 0 had already moved): the rank goes on to
    what it does next, as a process would, and its failure is reported as its own."""

    def join(self, rank: int, data: Any) -> Any:
        try:
            return super().join(rank, data)  # type: ignore[no-untyped-call]
        except SystemExit:
            if not self._done:
                raise
            return _multi_threaded_pg.ret_work(data)  # type: ignore[no-untyped-call]


def install_thread_per_rank_world() -> None:
    """Make c10d's world one per thread, so each thread can be a rank with a default group.

    Uses ``multi_threaded_pg._install_threaded_pg`` (swaps ``c10d._world`` for a
    thread-local one and turns autograd's multithreading off) and
    ``_set_thread_isolation_mode`` (a registry of group names per thread); torch
    has neither in public. Its collectives are :class:`_FinishedCollective`
    (``multi_threaded_pg.Collective``, which ``ProcessLocalGroup._start_coll`` makes).
    :func:`uninstall_thread_per_rank_world` undoes all three.
    """
    _c10d_extension._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    _multi_threaded_pg._install_threaded_pg()  # type: ignore[no-untyped-call]
    setattr(_multi_threaded_pg, "Collective", _FinishedCollective)


def uninstall_thread_per_rank_world() -> None:
    """Give c10d back the world it had before :func:`install_thread_per_rank_world`.

    Uses ``multi_threaded_pg._uninstall_threaded_pg``, ``_set_thread_isolation_mode`` and
    ``multi_threaded_pg.Collective``.
    """
    setattr(_multi_threaded_pg, "Collective", _TorchCollective)
    _multi_threaded_pg._uninstall_threaded_pg()  # type: ignore[no-untyped-call]
    _c10d_extension._set_thread_isolation_mode(False)  # type: ignore[attr-defined]


def thread_per_rank_world_installed() -> bool:
    """Whether c10d's world is torch's thread-local one (ours or torch's own test harness's).

    Reads ``c10d._world``.
    """
    return isinstance(c10d._world, _multi_threaded_pg.ThreadLocalWorld)


def release_threaded_collectives() -> None:
    """Wake every rank waiting in a collective of torch's threaded group, and every rank
    that enters one from now on: each raises ``SystemExit``.

    Uses ``ProcessLocalGroup.exception_handle``, under the class's ``_coll_lock`` so no
    collective starts while it wakes the waiting ones.
    """
    with ProcessLocalGroup._coll_lock:
        ProcessLocalGroup.exception_handle(None)  # type: ignore[no-untyped-call]


def reset_threaded_collectives() -> None:
    """Forget the collectives of torch's threaded group and its wake-up (``ProcessLocalGroup.reset``)."""
    ProcessLocalGroup.reset()  # type: ignore[no-untyped-call]


def import_dynamo() -> None:
    """Import torch.compile's tracer (private ``torch._dynamo``) now, not at the first op
    that needs it."""
    import torch._dynamo  # noqa: F401


def compiler_backend(name: str) -> Any:
    """torch.compile's backend ``name`` as a callable (private ``torch._dynamo.lookup_backend``),
    for a backend that counts graphs and hands them on."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def graphs_and_breaks(function: Any, *args: Any) -> tuple[int, int]:
    """The graphs and graph breaks dynamo makes of ``function(*args)`` (private
    ``torch._dynamo.explain``)."""
    import torch._dynamo

    explained = torch._dynamo.explain(function)(*args)
    return explained.graph_count, explained.graph_break_count


def graphs_traced() -> int:
    """The graphs dynamo has traced in this process so far (private ``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
