"""``meshstate bench``: meshstate beside megatron-core and plain DeviceMesh, in one run.

For each world size, one rank is simulated on torch's fake backend and every
approach builds the same layout: meshstate's ``init_mesh``, meshstate's
``parallel_state.initialize_model_parallel``, megatron-core's
``initialize_model_parallel`` (when installed) and a plain ``init_device_mesh``
with the ``_flatten``/``_unflatten`` calls that give the same joint and expert
groups. Each row reports the median init time, the group-creation calls the
rank made, the process groups it ends up in and how many distinct rank sets
they hold, the Python memory the built state keeps (tracemalloc: tensors and
C++ objects are not counted), the cost of the hot getters, and for meshstate
and megatron-core the time to compute the groups of every kind. Ratios are
against megatron-core at the same world size. Where torchtitan is installed,
its ``ParallelDims`` and meshstate's drop-in (:mod:`meshstate.titan`) build the
same layout with ``dp_replicate=1``, ``dp_shard=dp``.

Then the same approaches run on real local processes (gloo, NCCL with a GPU
per rank): the wall time of init, the maximum over ranks.

Last, how long a test suite takes to start N ranks: pytest running one test (and
each count of tests asked for) in a single process, the same with
``@distributed(world_size=N)``, and torch's ``MultiProcessTestCase`` with N
ranks, each in a fresh ``pytest`` process; the harnesses' rows show their cost
over the single process.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import statistics
import time
import timeit
import tracemalloc
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshstate.core import compat as _compat
from meshstate.megatron import parallel_state as mpu
from meshstate.core.config import MeshConfig, check_positive_int
from meshstate.core.errors import ConfigError
from meshstate.testing.launch import LocalWorld, default_backend, fake_world
from meshstate.tools.bench_settings import MAX_SIMULATED_WORLD, PROCESS_SIZES
from meshstate.core.layout import GROUP_KINDS, ParallelLayout
from meshstate.core.mesh import init_mesh

INIT_MESH = "meshstate init_mesh"
PARALLEL_STATE = "meshstate parallel_state"
MEGATRON = "megatron-core"
DEVICE_MESH = "init_device_mesh"
APPROACHES = (INIT_MESH, PARALLEL_STATE, MEGATRON, DEVICE_MESH)
TITAN = "torchtitan ParallelDims"
MESHSTATE_TITAN = "meshstate.titan"
TITAN_APPROACHES = (MESHSTATE_TITAN, TITAN)
"""Simulated worlds only, when torchtitan is installed: dp_replicate=1, dp_shard=dp."""
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


@dataclass(frozen=True)
class ProcessRow:
    """One approach on real local processes: init wall time, the slowest rank."""

    world_size: int
    backend: str
    approach: str
    init_seconds: float


@dataclass(frozen=True)
class AxisSetRow:
    """A psum over an axis tuple the mesh was not built with, beside one over a declared key.

    The first call makes the group (only its members take part); later calls
    look it up. Seconds, the slowest rank.
    """

    world_size: int
    backend: str
    axes: tuple[str, ...]
    first_call_seconds: float
    later_call_seconds: float
    declared: str
    declared_call_seconds: float


UNDECLARED_AXES = ("pp", "cp")
DECLARED_KEY = "tp-cp"
"""The axis tuple timed without declaring it, and a declared key of the same size."""


@dataclass(frozen=True)
class HarnessRow:
    """A fresh ``pytest`` process running ``tests`` tests the way ``runner`` says: wall seconds."""

    runner: str
    world_size: int
    tests: int
    seconds: float


@dataclass
class Report:
    """Everything ``meshstate bench`` prints."""

    machine: dict[str, Any]
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    process_config: dict[str, Any] = field(default_factory=dict)
    process_rows: list[ProcessRow] = field(default_factory=list)
    axis_set_rows: list[AxisSetRow] = field(default_factory=list)
    harness_rows: list[HarnessRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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


def _sizes(config: MeshConfig) -> dict[str, Any]:
    return dict(order=config.order, tp=config.tp, cp=config.cp, ep=config.ep, etp=config.etp, pp=config.pp)


def _build_init_mesh(config: MeshConfig) -> _Built:
    mesh = init_mesh(**_sizes(config))
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
        "cpu", layout.dense.mesh_shape, mesh_dim_names=layout.dense.mesh_axes
    )
    flattened = {}
    for key in GROUP_KINDS:
        _, grid, axes = layout.resolve(key)
        if "-" in key and grid is layout.dense:
            flattened[key] = _compat.flatten(dense[axes], key)
    expert = _compat.unflatten(
        _compat.flatten(dense, "world"), layout.expert.mesh_shape, layout.expert.mesh_axes
    )
    for key in ("etp-ep", "etp-ep-pp"):
        flattened[key] = _compat.flatten(expert[layout.resolve(key)[2]], key)
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


def _ns_per_call(statement: str, function: Callable[..., object]) -> float:
    """Nanoseconds per call, the timing loop's own cost taken off."""
    calls = 50000
    best = min(timeit.repeat(statement, globals={"f": function}, number=calls, repeat=5))
    loop = min(timeit.repeat("pass", number=calls, repeat=5))
    return (best - loop) / calls * 1e9


def measure(config: MeshConfig, approach: str, rank: int, repeats: int) -> Row:
    """One row: ``approach`` building ``config`` on ``rank`` of a fake world."""
    build = _BUILDERS[approach]
    with fake_world(rank, config.world_size):
        gc.collect()
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        with _compat.counting_group_creation() as calls:
            built = build(config)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        groups = _compat.live_groups()
        rank_sets = {tuple(dist.get_process_group_ranks(group)) for group in groups}
        getter_ns = {name: _ns_per_call(*getter) for name, getter in built.getters.items()}
        built.teardown()
    times, torch_times, rss_growth = [], [], []
    for _ in range(repeats):
        with fake_world(rank, config.world_size):
            gc.collect()
            rss_before = _rss_mib()
            with _compat.counting_group_creation() as timed:
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


def time_init_on_rank(approach: str, sizes: dict[str, Any]) -> float:
    """Build ``approach`` on this rank of an initialised world; return the seconds it took."""
    config = MeshConfig(dist.get_world_size(), **sizes)
    dist.barrier()
    started = time.perf_counter()
    built = _BUILDERS[approach](config)
    seconds = time.perf_counter() - started
    dist.barrier()
    built.teardown()
    return seconds


def time_axis_set_psum(sizes: dict[str, Any], repeats: int = 20) -> tuple[float, float, float]:
    """On this rank: the first psum over ``UNDECLARED_AXES``, the median of later ones,
    and the median psum over ``DECLARED_KEY``, in seconds."""
    from meshstate.jax.collectives import psum

    mesh = init_mesh(**sizes)
    value = torch.ones(1024)
    try:
        dist.barrier()
        started = time.perf_counter()
        psum(value, UNDECLARED_AXES, mesh=mesh)
        first = time.perf_counter() - started
        later = _median_seconds(lambda: psum(value, UNDECLARED_AXES, mesh=mesh), repeats)
        declared = _median_seconds(lambda: psum(value, DECLARED_KEY, mesh=mesh), repeats)
        return first, later, declared
    finally:
        dist.barrier()
        mesh.destroy()


def run(
    world_sizes: Sequence[int],
    sizes: dict[str, Any],
    *,
    rank: int | None = None,
    repeats: int = 3,
    process_world_sizes: Sequence[int] = (8, 16),
    process_sizes: dict[str, Any] | None = None,
    with_megatron: bool = True,
    with_titan: bool = True,
    harness_tests: Sequence[int] = (),
    harness_world_size: int = 8,
    progress: Callable[[str], object] = lambda message: None,
) -> Report:
    """Measure every approach; see the module docstring.

    Every argument is checked before anything is measured; ``progress`` is told
    each world size and approach as it starts.
    """
    process_sizes = process_sizes or dict(PROCESS_SIZES)
    _check_worlds(world_sizes, sizes, rank, process_world_sizes, process_sizes)
    check_positive_int("repeats", repeats)
    report = Report(machine=machine(), config={"world_sizes": list(world_sizes), **sizes})
    approaches = [a for a in APPROACHES if a != MEGATRON or (with_megatron and megatron_available())]
    if MEGATRON in approaches:
        with warnings.catch_warnings():  # megatron-core warns about optional CUDA packages
            warnings.simplefilter("ignore")
            importlib.import_module("megatron.core.parallel_state")  # outside any measurement
    else:
        report.notes.append("megatron-core is left out (not installed, or --without-megatron)")
    simulated = list(approaches)
    if with_titan and titan_available():
        importlib.import_module("torchtitan.distributed.parallel_dims")  # outside any measurement
        simulated += TITAN_APPROACHES
    else:
        report.notes.append("torchtitan is left out (not installed, or --without-torchtitan)")
    last: dict[str, Row] = {}
    for world_size in world_sizes:
        config = MeshConfig(world_size, **sizes)
        measured_rank = _default_rank(world_size) if rank is None else rank
        for approach in simulated:
            before = last.get(approach)
            if before is not None:
                predicted = before.init_seconds * world_size / before.world_size
                if predicted > PEER_BUDGET_SECONDS:
                    report.notes.append(
                        f"{approach} left out at world {world_size}: about {predicted:.0f} s "
                        f"per init, predicted from world {before.world_size}"
                    )
                    continue
            progress(f"world {world_size}, rank {measured_rank}: {approach}")
            last[approach] = measure(config, approach, measured_rank, repeats)
            report.rows.append(last[approach])
    report.process_config = dict(process_sizes)
    for world_size in process_world_sizes:
        backend = default_backend(world_size)
        progress(f"starting {world_size} local ranks ({backend})")
        with LocalWorld(world_size, backend=backend) as world:
            for approach in approaches:
                progress(f"{world_size} local ranks: {approach}")
                seconds = world.run(time_init_on_rank, approach, process_sizes)
                report.process_rows.append(ProcessRow(world_size, backend, approach, max(seconds)))
            progress(f"{world_size} local ranks: psum over {UNDECLARED_AXES}, not declared")
            timings = world.run(time_axis_set_psum, process_sizes)
            first, later, declared = (max(column) for column in zip(*timings))
            report.axis_set_rows.append(AxisSetRow(
                world_size, backend, UNDECLARED_AXES, first, later, DECLARED_KEY, declared
            ))
    if process_world_sizes and not torch.cuda.is_available():
        report.notes.append("no GPU here: the NCCL path (and split_group) was not measured")
    runners = list(HARNESS_RUNNERS)
    if harness_tests and importlib.util.find_spec("expecttest") is None:
        runners.remove(MULTI_PROCESS_TEST_CASE)
        report.notes.append("torch's MultiProcessTestCase is left out: it needs expecttest")
    for tests in sorted({1, *harness_tests}) if harness_tests else []:  # one: the start-up cost
        for runner in runners:
            progress(f"harness start-up: {runner}, {tests} test(s)")
            wall = time_test_run(runner, tests, harness_world_size)
            report.harness_rows.append(HarnessRow(runner, harness_world_size, tests, wall))
    return report


SINGLE_PROCESS = "pytest, one process"
MESHSTATE_HARNESS = "meshstate @distributed"
MULTI_PROCESS_TEST_CASE = "torch MultiProcessTestCase"
HARNESS_RUNNERS = (SINGLE_PROCESS, MESHSTATE_HARNESS, MULTI_PROCESS_TEST_CASE)
_TEST_FILES = {
    SINGLE_PROCESS: """
import torch

def test_{index}():
    assert torch.ones(1).item() == 1
""",
    MESHSTATE_HARNESS: """
import torch
import torch.distributed as dist
from meshstate.testing import distributed

@distributed(world_size={world_size})
def test_{index}():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {world_size}
""",
    MULTI_PROCESS_TEST_CASE: """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

class Test{index}(MultiProcessTestCase):
    world_size = {world_size}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_{index}(self):
        dist.init_process_group("gloo", init_method=f"file://{{self.file_name}}",
                                rank=self.rank, world_size={world_size})
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == {world_size}
        dist.destroy_process_group()
""",
}


def time_test_run(runner: str, tests: int, world_size: int) -> float:
    """Wall seconds of a fresh ``pytest`` running ``tests`` all-reduce tests the ``runner`` way."""
    with tempfile.TemporaryDirectory() as folder:
        for index in range(tests):
            body = _TEST_FILES[runner].format(index=index, world_size=world_size)
            with open(os.path.join(folder, f"test_{index}.py"), "w") as file:
                file.write(body)
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", folder],
            check=True, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        return time.perf_counter() - started


def _default_rank(world_size: int) -> int:
    """The rank measured unless told otherwise: past the middle, so neither first nor last
    of most groups; the last rank of a world too small for that.

    Example: ``_default_rank(1024) == 513``, ``_default_rank(2) == 1``.
    """
    return min(world_size // 2 + 1, world_size - 1)


def _check_worlds(
    world_sizes: Sequence[int],
    sizes: dict[str, Any],
    rank: int | None,
    process_world_sizes: Sequence[int],
    process_sizes: dict[str, Any],
) -> None:
    """Raise ConfigError for any world that cannot be measured, before measuring any."""
    if not world_sizes:
        raise ConfigError("bench needs at least one simulated world size")
    for world_size in world_sizes:
        MeshConfig(world_size, **sizes)
        if world_size > MAX_SIMULATED_WORLD:
            raise ConfigError(
                f"simulated world size {world_size} is above {MAX_SIMULATED_WORLD}, the most "
                "one process can simulate (DeviceMesh and megatron-core hold world-sized maps)"
            )
        if rank is not None and not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
    for world_size in process_world_sizes:
        try:
            MeshConfig(world_size, **process_sizes)
        except ConfigError as error:
            layout = " ".join(f"{name}={size}" for name, size in process_sizes.items())
            raise ConfigError(f"local processes ({layout}): {error}") from None


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def _ratio(mine: float | None, reference: float | None) -> str:
    if mine is None or reference is None or mine <= 0:
        return "-"
    return f"{reference / mine:.0f}x" if reference / mine >= 10 else f"{reference / mine:.1f}x"


def format_report(report: Report) -> str:
    """The tables ``meshstate bench`` prints."""
    config = report.config
    lines = [
        "meshstate bench: one simulated rank per world size (fake backend); "
        + " ".join(f"{k}={v}" for k, v in config.items() if k != "world_sizes"),
        f"machine: {report.machine['processor']}, {report.machine['cpus']} CPUs, "
        f"Python {report.machine['python']}, torch {report.machine['torch']}",
        "",
        f"{'world':>7} {'approach':<25} {'init s':>8} {'calls':>7} {'groups':>7} {'sets':>5} "
        f"{'state KiB':>10} {'tp rank ns':>10} {'layout s':>9} {'init':>6} {'getter':>6} {'layout':>6}",
    ]
    for row in report.rows:
        reference = next(
            (r for r in report.rows if r.world_size == row.world_size and r.approach == MEGATRON),
            None,
        )
        layout = "-" if row.layout_seconds is None else f"{row.layout_seconds:.4f}"
        ratios = ["-", "-", "-"]
        if reference is not None:
            ratios = [
                _ratio(row.init_seconds, reference.init_seconds),
                _ratio(row.getter_ns["tp rank"], reference.getter_ns["tp rank"]),
                _ratio(row.layout_seconds, reference.layout_seconds),
            ]
        lines.append(
            f"{row.world_size:>7} {row.approach:<25} {row.init_seconds:>8.4f} "
            f"{row.creation_calls:>7} {row.member_groups:>7} {row.distinct_rank_sets:>5} "
            f"{row.state_kib:>10.0f} {row.getter_ns['tp rank']:>10.0f} {layout:>9} "
            + " ".join(f"{ratio:>6}" for ratio in ratios)
        )
    lines += ["", "init growth and memory: init s at each world (x the smallest world's); "
              "own: without torch's group constructors, which copy each group's member "
              "list (O(members)), and that list; RSS MiB the process gained over init"]
    for approach in APPROACHES:
        rows = [row for row in report.rows if row.approach == approach]
        if rows:
            own = [row.init_seconds - (row.torch_seconds or 0.0) for row in rows]
            growth = "  ".join(
                f"{row.world_size}: {row.init_seconds:.4f} s "
                f"({row.init_seconds / rows[0].init_seconds:.1f}x; "
                f"own {mine:.4f} s, {mine / own[0]:.1f}x; {row.rss_mib or 0:.0f} MiB)"
                for row, mine in zip(rows, own)
            )
            lines.append(f"  {approach:<25} {growth}")
    getter_world = min(report.rows[-1].world_size, max(
        (row.world_size for row in report.rows if row.approach == MEGATRON),
        default=report.rows[-1].world_size))
    lines += ["", f"hot getters at world {getter_world}, ns per call:",
              f"{'':>33}" + "".join(f"{name:>12}" for name in GETTERS)]
    for row in report.rows:
        if row.world_size == getter_world:
            figures = "".join(
                f"{row.getter_ns[name]:>12.0f}" if name in row.getter_ns else f"{'-':>12}"
                for name in GETTERS
            )
            lines.append(f"{row.world_size:>7} {row.approach:<25} {figures}")
    if report.process_rows:
        lines += ["", "real processes, init wall time of the slowest rank: "
                  + " ".join(f"{k}={v}" for k, v in report.process_config.items())]
        for process_row in report.process_rows:
            lines.append(
                f"{process_row.world_size:>7} {process_row.backend:<6} "
                f"{process_row.approach:<25} {process_row.init_seconds:>8.4f} s"
            )
    if report.axis_set_rows:
        lines += ["", "psum of 1024 floats over an axis tuple not declared at init "
                  "(first call makes its group), beside a declared key, slowest rank:"]
        for axis_row in report.axis_set_rows:
            lines.append(
                f"{axis_row.world_size:>7} {axis_row.backend:<6} {axis_row.axes!s:<12} "
                f"first {axis_row.first_call_seconds * 1e3:8.2f} ms  "
                f"later {axis_row.later_call_seconds * 1e6:8.0f} us  "
                f"{axis_row.declared!r}: {axis_row.declared_call_seconds * 1e6:8.0f} us"
            )
    if report.harness_rows:
        lines += ["", "test harness start-up: wall seconds of a fresh pytest, all-reduce tests"]
        single = {row.tests: row.seconds for row in report.harness_rows
                  if row.runner == SINGLE_PROCESS}
        for harness_row in report.harness_rows:
            is_single = harness_row.runner == SINGLE_PROCESS
            ranks = "1 rank" if is_single else f"{harness_row.world_size} ranks"
            over = single.get(harness_row.tests)
            extra = "" if is_single or over is None else (
                f"  {harness_row.seconds - over:+.1f} s over one process")
            lines.append(
                f"  {harness_row.runner:<28} {ranks:<9} {harness_row.tests:>3} test(s) "
                f"{harness_row.seconds:>8.1f} s{extra}"
            )
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def report_json(report: Report) -> str:
    """The report as one JSON object."""
    return json.dumps(asdict(report))
