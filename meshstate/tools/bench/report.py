"""``meshstate bench``: meshstate beside megatron-core, plain DeviceMesh and torchtitan, in one run.

Five measurements, each in its own module, in this order:

- :mod:`~meshstate.tools.bench.init`: every approach builds the same layout on
  one rank of a fake world per world size (torch's fake backend): init time, groups, memory,
  getter cost, ratios against megatron-core at the same world size;
- :mod:`~meshstate.tools.bench.processes`: the same on real local processes,
  and a psum over an undeclared axis tuple;
- :mod:`~meshstate.tools.bench.runtime`: what each JAX-layer call costs, eager
  and compiled, beside torch's own;
- :mod:`~meshstate.tools.bench.explicit`: a typed op of JAX's Explicit axes beside the
  same DTensor op;
- :mod:`~meshstate.tools.bench.harness`: how long a test suite takes to start N ranks;
- :mod:`~meshstate.tools.bench.simulated`: ``check --simulate`` of whole worlds in one
  process, its time and peak memory, and one 1F1B step of a pipeline simulated stage by
  stage (a process per stage), against one process's computation;
- :mod:`~meshstate.tools.bench.checkpoints`: meshstate.checkpoint's save and load beside
  DCP's own on the same DTensors, on local gloo ranks.

Example: ``print(format_report(run([1024], dict(tp=8), process_world_sizes=())))``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from meshstate.layout.config import MeshConfig, check_positive_int
from meshstate.errors import ConfigError
from meshstate.tools.bench.harness import SINGLE_PROCESS, HarnessRow, measure_harness
from meshstate.tools.bench.init import (
    APPROACHES,
    GETTERS,
    MEGATRON,
    TITAN_APPROACHES,
    Row,
    measure_worlds,
    megatron_available,
    titan_available,
)
from meshstate.tools.bench.processes import (
    AxisSetRow,
    ProcessRow,
    measure_processes,
)
from meshstate.tools.bench.runtime import (
    QueryRow, RuntimeRow, format_queries, format_runtime, measure_queries, measure_runtime,
)
from meshstate.tools.bench.settings import (
    CHECKPOINT_RUNS,
    CHECKPOINT_SIZES,
    COMPILE_SIZES,
    MAX_SIMULATED_CHECK,
    MAX_FAKE_WORLD,
    PROCESS_SIZES,
    SIMULATED_CHECK_SIZES,
    SIMULATED_PIPELINE_SIZES,
)
from meshstate.tools.bench.checkpoints import CheckpointRow, format_checkpoints, measure_checkpoints
from meshstate.tools.bench.compiled import CompileRow, format_compile, measure_compile
from meshstate.tools.bench.explicit import ExplicitRow, format_explicit, measure_explicit
from meshstate.tools.bench.simulated import (
    SimulatedCheckRow,
    format_simulated_checks,
    measure_simulated_checks,
    time_simulated_pipeline,
)
from meshstate.layout.config import sizes_text


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
    runtime_rows: list[RuntimeRow] = field(default_factory=list)
    query_rows: list[QueryRow] = field(default_factory=list)
    explicit_rows: list[ExplicitRow] = field(default_factory=list)
    simulated_check_rows: list[SimulatedCheckRow] = field(default_factory=list)
    compile_rows: list[CompileRow] = field(default_factory=list)
    checkpoint_rows: list[CheckpointRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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
    with_runtime: bool = True,
    harness_tests: Sequence[int] = (),
    harness_world_size: int = 8,
    simulated_checks: Sequence[int] = (),
    simulated_pipeline: int = 0,
    compile_world_sizes: Sequence[int] = (),
    checkpoint_world_sizes: Sequence[int] = (),
    progress: Callable[[str], object] = lambda message: None,
) -> Report:
    """Measure every approach; see the module docstring.

    ``simulated_pipeline``, unless 0, is the world a 1F1B step is timed at, simulated
    stage by stage with :data:`SIMULATED_PIPELINE_SIZES`; its row joins the simulated
    checks'. ``compile_world_sizes`` are the local worlds a step is compiled on, every rank
    compiling and one for all; ``checkpoint_world_sizes`` those a checkpoint is saved and
    loaded on, by meshstate.checkpoint and by DCP. Every argument is checked before anything is measured; ``progress`` is told
    each world size and approach as it starts.
    """
    process_sizes = process_sizes or dict(PROCESS_SIZES)
    _check_worlds(world_sizes, sizes, rank, process_world_sizes, process_sizes)
    _check_simulated_checks(simulated_checks)
    if simulated_pipeline:
        _check_layout("simulated 1F1B step", simulated_pipeline, SIMULATED_PIPELINE_SIZES)
    for world_size in compile_world_sizes:
        _check_layout("compiled step", world_size, COMPILE_SIZES)
    for world_size in checkpoint_world_sizes:
        _check_layout("checkpoint", world_size, CHECKPOINT_SIZES)
    check_positive_int("repeats", repeats)
    report = Report(machine=machine(), config={"world_sizes": list(world_sizes), **sizes})
    approaches = _peers(with_megatron, with_titan, report.notes)
    measured = approaches + (list(TITAN_APPROACHES) if with_titan and titan_available() else [])
    report.rows = measure_worlds(world_sizes, sizes, measured, rank, repeats, report.notes, progress)
    report.process_config = dict(process_sizes)
    report.process_rows, report.axis_set_rows = measure_processes(
        process_world_sizes, process_sizes, approaches, progress
    )
    if process_world_sizes and not torch.cuda.is_available():
        report.notes.append("no GPU here: the NCCL path (and split_group) was not measured")
    if with_runtime:
        report.runtime_rows = measure_runtime(progress)
        report.query_rows = measure_queries(progress)
        report.explicit_rows = measure_explicit(progress)
    report.harness_rows = measure_harness(harness_tests, harness_world_size, report.notes, progress)
    report.simulated_check_rows = measure_simulated_checks(
        simulated_checks, SIMULATED_CHECK_SIZES, progress
    )
    report.compile_rows = measure_compile(compile_world_sizes, progress)
    report.checkpoint_rows = measure_checkpoints(checkpoint_world_sizes, progress,
                                                 repeats=max(repeats, CHECKPOINT_RUNS))
    if simulated_pipeline:
        progress(f"a 1F1B step of {simulated_pipeline} ranks, simulated stage by stage")
        report.simulated_check_rows.append(
            time_simulated_pipeline(simulated_pipeline, SIMULATED_PIPELINE_SIZES))
    return report


def _check_simulated_checks(world_sizes: Sequence[int]) -> None:
    """Raise ConfigError for a simulated check that cannot run, before measuring anything."""
    for world_size in world_sizes:
        _check_layout("simulated check", world_size, SIMULATED_CHECK_SIZES)
        if world_size > MAX_SIMULATED_CHECK:
            raise ConfigError(
                f"simulated check of {world_size} ranks: check --simulate builds at most "
                f"{MAX_SIMULATED_CHECK}"
            )


def _peers(with_megatron: bool, with_titan: bool, notes: list[str]) -> list[str]:
    """The approaches measured on every world (torchtitan's only in fake worlds); each optional
    peer imported here, outside any measurement, or noted as left out."""
    approaches = [a for a in APPROACHES if a != MEGATRON or (with_megatron and megatron_available())]
    if MEGATRON in approaches:
        with warnings.catch_warnings():  # megatron-core warns about optional CUDA packages
            warnings.simplefilter("ignore")
            importlib.import_module("megatron.core.parallel_state")
    else:
        notes.append("megatron-core is left out (not installed, or --without-megatron)")
    if with_titan and titan_available():
        importlib.import_module("torchtitan.distributed.parallel_dims")
    else:
        notes.append("torchtitan is left out (not installed, or --without-torchtitan)")
    return approaches


def _check_worlds(
    world_sizes: Sequence[int],
    sizes: dict[str, Any],
    rank: int | None,
    process_world_sizes: Sequence[int],
    process_sizes: dict[str, Any],
) -> None:
    """Raise ConfigError for any world that cannot be measured, before measuring any."""
    if not world_sizes:
        raise ConfigError("bench needs at least one fake world size")
    for world_size in world_sizes:
        MeshConfig(world_size, **sizes)
        if world_size > MAX_FAKE_WORLD:
            raise ConfigError(
                f"fake world size {world_size} is above {MAX_FAKE_WORLD}, the most one "
                "process can stand a rank in for (DeviceMesh and megatron-core hold world-sized maps)"
            )
        if rank is not None and not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
    for world_size in process_world_sizes:
        _check_layout("local processes", world_size, process_sizes)


def _check_layout(measurement: str, world_size: int, sizes: dict[str, Any]) -> None:
    """Raise ConfigError, naming ``measurement`` and its sizes, if ``sizes`` do not fit the world."""
    try:
        MeshConfig(world_size, **sizes)
    except ConfigError as error:
        raise ConfigError(f"{measurement} ({sizes_text(sizes)}): {error}") from None


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
    sections = [
        _fake_world_table(report), _growth_table(report), _getter_table(report),
        _process_table(report), _axis_set_table(report),
        format_runtime(report.runtime_rows) if report.runtime_rows else "",
        format_queries(report.query_rows) if report.query_rows else "",
        format_explicit(report.explicit_rows) if report.explicit_rows else "",
        format_compile(report.compile_rows) if report.compile_rows else "",
        format_checkpoints(report.checkpoint_rows) if report.checkpoint_rows else "",
        _harness_table(report),
        format_simulated_checks(report.simulated_check_rows, SIMULATED_CHECK_SIZES)
        if report.simulated_check_rows else "",
    ]
    notes = [f"note: {note}" for note in report.notes]
    return "\n\n".join(section for section in sections if section) + (
        "\n" + "\n".join(notes) if notes else "")


def _fake_world_table(report: Report) -> str:
    config = report.config
    lines = [
        "meshstate bench: one rank of a fake world per world size (torch's fake backend); "
        + sizes_text({k: v for k, v in config.items() if k != "world_sizes"}),
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
    return "\n".join(lines)


def _growth_table(report: Report) -> str:
    lines = ["init growth and memory: init s at each world (x the smallest world's); "
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
    return "\n".join(lines)


def _getter_table(report: Report) -> str:
    getter_world = min(report.rows[-1].world_size, max(
        (row.world_size for row in report.rows if row.approach == MEGATRON),
        default=report.rows[-1].world_size))
    lines = [f"hot getters at world {getter_world}, ns per call:",
             f"{'':>33}" + "".join(f"{name:>12}" for name in GETTERS)]
    for row in report.rows:
        if row.world_size == getter_world:
            figures = "".join(
                f"{row.getter_ns[name]:>12.0f}" if name in row.getter_ns else f"{'-':>12}"
                for name in GETTERS
            )
            lines.append(f"{row.world_size:>7} {row.approach:<25} {figures}")
    return "\n".join(lines)


def _process_table(report: Report) -> str:
    if not report.process_rows:
        return ""
    lines = ["real processes, init wall time of the slowest rank: "
             + sizes_text(report.process_config)]
    for row in report.process_rows:
        lines.append(
            f"{row.world_size:>7} {row.backend:<6} {row.approach:<25} {row.init_seconds:>8.4f} s"
        )
    return "\n".join(lines)


def _axis_set_table(report: Report) -> str:
    if not report.axis_set_rows:
        return ""
    lines = ["psum of 1024 floats over an axis tuple not declared at init "
             "(first call makes its group), beside a declared key, slowest rank:"]
    for row in report.axis_set_rows:
        lines.append(
            f"{row.world_size:>7} {row.backend:<6} {row.axes!s:<12} "
            f"first {row.first_call_seconds * 1e3:8.2f} ms  "
            f"later {row.later_call_seconds * 1e6:8.0f} us  "
            f"{row.declared!r}: {row.declared_call_seconds * 1e6:8.0f} us"
        )
    return "\n".join(lines)


def _harness_table(report: Report) -> str:
    if not report.harness_rows:
        return ""
    lines = ["test harness start-up: wall seconds of a fresh pytest, all-reduce tests"]
    single = {row.tests: row.seconds for row in report.harness_rows if row.runner == SINGLE_PROCESS}
    for row in report.harness_rows:
        is_single = row.runner == SINGLE_PROCESS
        ranks = "1 rank" if is_single else f"{row.world_size} ranks"
        over = single.get(row.tests)
        extra = "" if is_single or over is None else f"  {row.seconds - over:+.1f} s over one process"
        lines.append(
            f"  {row.runner:<28} {ranks:<9} {row.tests:>3} test(s) {row.seconds:>8.1f} s{extra}"
        )
    return "\n".join(lines)


def report_json(report: Report) -> str:
    """The report as one JSON object."""
    return json.dumps(asdict(report))
