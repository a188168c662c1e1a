"""``meshstate bench``'s fake worlds: every approach builds one layout on one rank.

For each world size, one rank stands in on torch's fake backend (a fake world) and every
approach builds the same layout: meshstate's ``init_mesh``, meshstate's
``parallel_state.initialize_model_parallel``, megatron-core's
``initialize_model_parallel`` (when installed) and a plain ``init_device_mesh``
with the ``_flatten``/``_unflatten`` calls that give the same joint and expert
groups; where torchtitan is installed, its ``ParallelDims`` and meshstate's
drop-in (:mod:`meshstate.titan`) with ``dp_replicate=1``, ``dp_shard=dp``. A
:class:`Row` holds the median init time, the group-creation calls, the groups
kept and their distinct rank sets, the Python memory kept, the hot getters'
cost and the time to compute every kind's groups.

Example: ``measure(MeshConfig(1024, tp=8), INIT_MESH, rank=513, repeats=3)``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import statistics
import time
import timeit
import tracemalloc
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshstate.layout.config import MeshConfig
from meshstate.layout.layout import GROUP_KINDS, ParallelLayout
from meshstate.core.build import init_mesh
from meshstate.megatron import parallel_state as mpu
from meshstate.testing import torch_internals
from meshstate.testing.fake import fake_world

INIT_MESH = "meshstate init_mesh"
PARALLEL_STATE = "meshstate parallel_state"
MEGATRON = "megatron-core"
DEVICE_MESH = "init_device_mesh"
APPROACHES = (INIT_MESH, PARALLEL_STATE, MEGATRON, DEVICE_MESH)
TITAN = "torchtitan ParallelDims"
MESHSTATE_TITAN = "meshstate.titan"
TITAN_APPROACHES = (MESHSTATE_TITAN, TITAN)
"""Fake worlds only, when torchtitan is installed: dp_replicate=1, dp_shard=dp."""
GETTERS = ("tp rank", "tp size", "first stage", "dp-cp size", "dp group", "cp group", "ep group")
"""The getters timed; torchtitan's rows have the first four."""
PEER_BUDGET_SECONDS = 60.0
"""An approach whose init is predicted (linearly from the last world) to take longer is left out."""


@dataclass(frozen=True)
class Row:
    """One approach at one world size."""

    world_size: int
    approach: str
    init_seconds: float
    creation_calls: int
    member_groups: int
    distinct_rank_sets: int
    state_kib: float
    getter_ns: dict[str, float]
    layout_seconds: float | None = None
    rss_mib: float | None = None
    torch_seconds: float | None = None
    """Of ``init_seconds``, the time inside torch's process-group constructors."""


@dataclass
class _Built:
    """A built state: each hot getter as a call statement on ``f``, and how to tear down."""

    getters: dict[str, tuple[str, Callable[..., object]]]
    teardown: Callable[[], None] = lambda: None


def megatron_available() -> bool:
    """Whether megatron-core can be imported (it is an optional peer)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` package at all
        return False


def _build_init_mesh(config: MeshConfig) -> _Built:
    mesh = init_mesh(**config.arguments())
    return _Built(
        {
            "tp rank": ("f('tp')", mesh.rank),
            "tp size": ("f('tp')", mesh.size),
            "first stage": ("f('pp')", mesh.is_first),
            "dp-cp size": ("f('dp-cp')", mesh.size),
            "dp group": ("f('dp')", mesh.group),
            "cp group": ("f('cp')", mesh.group),
            "ep group": ("f('ep')", mesh.group),
        },
        mesh.destroy,
    )


def _megatron_arguments(config: MeshConfig) -> dict[str, Any]:
    return dict(
        tensor_model_parallel_size=config.tp,
        context_parallel_size=config.cp,
        expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.etp,
        pipeline_model_parallel_size=config.pp,
        order=config.order,
        create_gloo_process_groups=dist.get_backend() != "fake",
    )


def _build_with_getters(module: Any, config: MeshConfig) -> _Built:
    """``initialize_model_parallel`` of a parallel_state module (ours or megatron-core's)."""
    module.initialize_model_parallel(**_megatron_arguments(config))
    return _Built(
        {
            "tp rank": ("f()", module.get_tensor_model_parallel_rank),
            "tp size": ("f()", module.get_tensor_model_parallel_world_size),
            "first stage": ("f()", module.is_pipeline_first_stage),
            "dp-cp size": ("f(with_context_parallel=True)", module.get_data_parallel_world_size),
            "dp group": ("f()", module.get_data_parallel_group),
            "cp group": ("f()", module.get_context_parallel_group),
            "ep group": ("f()", module.get_expert_model_parallel_group),
        },
        module.destroy_model_parallel,
    )


def _build_parallel_state(config: MeshConfig) -> _Built:
    return _build_with_getters(mpu, config)


def _build_megatron(config: MeshConfig) -> _Built:
    with warnings.catch_warnings():  # megatron-core warns about optional CUDA packages
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as megatron

    return _build_with_getters(megatron, config)


def _build_device_mesh(config: MeshConfig) -> _Built:
    """Plain torch: every axis by ``init_device_mesh``, joint and expert groups by flattening."""
    layout = ParallelLayout(config)
    dense = init_device_mesh(
        "cpu", layout.dense.mesh_shape, mesh_dim_names=layout.dense.axes_mesh_order
    )
    flattened = {}
    for key in GROUP_KINDS:
        _, grid, axes = layout.resolve(key)
        if "-" in key and grid is layout.dense:
            flattened[key] = torch_internals.flatten(dense[axes], key)
    expert = torch_internals.unflatten(
        torch_internals.flatten(dense, "world"), layout.expert.mesh_shape, layout.expert.axes_mesh_order
    )
    for key in ("etp-ep", "etp-ep-pp"):
        flattened[key] = torch_internals.flatten(expert[layout.resolve(key)[2]], key)
    tp, pp, dp_cp = dense["tp"], dense["pp"], flattened["dp-cp"]
    return _Built(
        {
            "tp rank": ("f()", tp.get_local_rank),
            "tp size": ("f()", tp.size),
            "first stage": ("f() == 0", pp.get_local_rank),
            "dp-cp size": ("f()", dp_cp.size),
            "dp group": ("f()", dense["dp"].get_group),
            "cp group": ("f()", dense["cp"].get_group),
            "ep group": ("f()", expert["ep"].get_group),
        }
    )


def titan_available() -> bool:
    """Whether torchtitan can be imported (an optional peer, installed without its deps)."""
    try:
        return importlib.util.find_spec("torchtitan.distributed.parallel_dims") is not None
    except ModuleNotFoundError:  # no ``torchtitan`` package at all
        return False


def _parallel_dims_arguments(config: MeshConfig) -> dict[str, Any]:
    return dict(
        dp_replicate=1, dp_shard=config.dp, cp=config.cp, tp=config.tp, pp=config.pp,
        ep=config.ep, world_size=config.world_size,
    )


def _titan_getters(dims: Any, teardown: Callable[[], None] = lambda: None) -> _Built:
    """The hot getters of a built ``ParallelDims`` (torchtitan's or meshstate's)."""
    return _Built(
        {
            "tp rank": ("f('tp', include_singleton_axes=True).get_local_rank()", dims.get_optional_mesh),
            "tp size": ("f('tp', include_singleton_axes=True).size()", dims.get_optional_mesh),
            "first stage": ("f('pp', include_singleton_axes=True).get_local_rank() == 0", dims.get_optional_mesh),
            "dp-cp size": ("f('loss', include_singleton_axes=True).size()", dims.get_optional_mesh),
        },
        teardown,
    )


def _build_titan(config: MeshConfig) -> _Built:
    parallel_dims = importlib.import_module("torchtitan.distributed.parallel_dims")
    dims = parallel_dims.ParallelDims(**_parallel_dims_arguments(config))
    dims.build_mesh()
    return _titan_getters(dims)


def _build_meshstate_titan(config: MeshConfig) -> _Built:
    from meshstate.titan import ParallelDims

    dims = ParallelDims(**_parallel_dims_arguments(config))
    dims.build_mesh()
    return _titan_getters(dims, dims.mesh.destroy)


_BUILDERS: dict[str, Callable[[MeshConfig], _Built]] = {
    INIT_MESH: _build_init_mesh,
    PARALLEL_STATE: _build_parallel_state,
    MEGATRON: _build_megatron,
    DEVICE_MESH: _build_device_mesh,
    TITAN: _build_titan,
    MESHSTATE_TITAN: _build_meshstate_titan,
}


# megatron-core's RankGenerator token for each expert kind; dense kinds keep their names.
_EXPERT_TOKENS = {"ep": "ep", "etp": "tp", "etp-ep": "tp-ep", "etp-ep-pp": "tp-ep-pp", "edp": "dp"}


def _megatron_layout(config: MeshConfig) -> None:
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(config.tp, 1, config.dp, config.pp, config.cp, config.order)
    expert = RankGenerator(config.etp, config.ep, config.edp, config.pp, 1, config.order)
    for kind in GROUP_KINDS:
        if kind in _EXPERT_TOKENS:
            expert.get_ranks(_EXPERT_TOKENS[kind])
        else:
            dense.get_ranks(kind)


def _meshstate_layout(config: MeshConfig) -> None:
    layout = ParallelLayout(config)
    for kind in GROUP_KINDS:
        layout.groups(kind)


def _median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _ns_per_call(statement: str, function: Callable[..., object], repeats: int) -> float:
    """Nanoseconds per call once warm (a first call may build what later ones read), the
    timing loop's own cost taken off: the best of ``repeats`` (at most 5) rounds of as many
    calls as take 20 ms (at least 1,000)."""
    timer, calls, rounds = timeit.Timer(statement, globals={"f": function}), 1000, max(1, min(repeats, 5))
    timer.timeit(1)
    while (took := timer.timeit(calls)) < 0.02:
        calls = int(calls * min(10.0, 0.025 / max(took, 1e-9)))
    best = min([took, *timer.repeat(number=calls, repeat=rounds - 1)])
    loop = min(timeit.repeat("pass", number=calls, repeat=rounds))
    return (best - loop) / calls * 1e9


def measure(config: MeshConfig, approach: str, rank: int, repeats: int) -> Row:
    """One row: ``approach`` building ``config`` on ``rank`` of a fake world."""
    build = _BUILDERS[approach]
    with fake_world(rank, config.world_size):
        gc.collect()
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        with torch_internals.counting_group_creation() as calls:
            built = build(config)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        groups = torch_internals.live_groups()
        rank_sets = {tuple(dist.get_process_group_ranks(group)) for group in groups}
        getter_ns = {
            name: _ns_per_call(*getter, repeats) for name, getter in built.getters.items()
        }
        built.teardown()
    times, torch_times, rss_growth = [], [], []
    for _ in range(repeats):
        with fake_world(rank, config.world_size):
            gc.collect()
            rss_before = _rss_mib()
            with torch_internals.counting_group_creation() as timed:
                started = time.perf_counter()
                built = build(config)
                times.append(time.perf_counter() - started)
            torch_times.append(timed[1])
            rss_growth.append(_rss_mib() - rss_before)
            built.teardown()
    layout_seconds = None
    if approach in (INIT_MESH, MEGATRON):
        compute = _meshstate_layout if approach == INIT_MESH else _megatron_layout
        layout_seconds = _median_seconds(lambda: compute(config), repeats)
    return Row(
        world_size=config.world_size,
        approach=approach,
        init_seconds=statistics.median(times),
        creation_calls=int(calls[0]),
        member_groups=len(groups),
        distinct_rank_sets=len(rank_sets),
        state_kib=(kept - before) / 1024,
        getter_ns=getter_ns,
        layout_seconds=layout_seconds,
        rss_mib=statistics.median(rss_growth),
        torch_seconds=statistics.median(torch_times),
    )


def _rss_mib() -> float:
    """This process's resident memory (Linux ``/proc``), MiB; 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


def measure_worlds(
    world_sizes: Sequence[int],
    sizes: dict[str, Any],
    approaches: Sequence[str],
    rank: int | None,
    repeats: int,
    notes: list[str],
    progress: Callable[[str], object],
) -> list[Row]:
    """A row per world size and approach; an approach predicted (linearly from its
    last world) to take over ``PEER_BUDGET_SECONDS`` per init is left out, with a note."""
    rows: list[Row] = []
    last: dict[str, Row] = {}
    with _old_objects_frozen():
        for world_size in world_sizes:
            config = MeshConfig(world_size, **sizes)
            measured_rank = default_rank(world_size) if rank is None else rank
            for approach in approaches:
                before = last.get(approach)
                if before is not None:
                    predicted = before.init_seconds * world_size / before.world_size
                    if predicted > PEER_BUDGET_SECONDS:
                        notes.append(
                            f"{approach} left out at world {world_size}: about {predicted:.0f} s "
                            f"per init, predicted from world {before.world_size}"
                        )
                        continue
                progress(f"world {world_size}, rank {measured_rank}: {approach}")
                last[approach] = measure(config, approach, measured_rank, repeats)
                rows.append(last[approach])
    return rows


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """Collect once, then keep what is alive out of every ``gc.collect()`` inside, which looks
    at new objects only (with torch imported, a full collection takes a quarter of a second)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def default_rank(world_size: int) -> int:
    """The rank measured unless told otherwise: past the middle, so neither first nor last
    of most groups; the last rank of a world too small for that.

    Example: ``default_rank(1024) == 513``, ``default_rank(2) == 1``.
    """
    return min(world_size // 2 + 1, world_size - 1)
