"""``meshstate bench``'s simulated worlds: ``check --simulate`` at each world size, and one
1F1B training step of a pipeline simulated stage by stage, timed.

Each is measured in a fresh process, so its peak memory is its own: for a check, the
seconds from building every rank's mesh to the table's last row, the peak resident
memory of the process and what it held before the check (Python, torch and
meshstate imported); for the pipeline step (:func:`pipeline_step` in
``simulated_world(world_size, stages=pp)``), the seconds of the step and the peak
resident memory of the largest stage's process, and whether every rank's loss and
gradients equal one process's computation of the whole model (:func:`pipeline_expected`).

Example: ``measure_simulated_checks([8, 1024], dict(tp=2, cp=2, pp=2), print)``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional

from meshstate.core.build import init_mesh
from meshstate.layout.config import sizes_text

CHECK_STEP = "check --simulate"
PIPELINE_STEP = "1F1B step"
_FEATURES, _HIDDEN, _ROWS = 8, 32, 8
"""The pipeline's model: each stage maps 8 features through 32 hidden ones (split over tp)
and back; each dp rank trains on 8 rows, in pp microbatches."""


@dataclass(frozen=True)
class SimulatedCheckRow:
    """``check --simulate`` of one world (or a pipeline step, ``step`` says which) in a fresh
    process: seconds and memory, and whether it verified."""

    world_size: int
    seconds: float
    peak_rss_mib: float
    before_rss_mib: float
    verified: bool
    step: str = CHECK_STEP



def check_in_this_process(world_size: int, sizes: dict[str, Any]) -> SimulatedCheckRow:
    """Run ``check --simulate``'s work here, timed; this process's peak memory with it."""
    from meshstate.layout.config import MeshConfig
    from meshstate.testing.simulated import simulated_world
    from meshstate.tools.verify import check_every_rank

    before = _peak_rss_mib()
    started = time.perf_counter()
    rows = simulated_world(world_size).call(check_every_rank, MeshConfig(world_size, **sizes))
    seconds = time.perf_counter() - started
    return SimulatedCheckRow(
        world_size, seconds, _peak_rss_mib(), before, all(row.ok for row in rows)
    )


def _peak_rss_mib() -> float:
    """This process's peak resident memory so far: Linux's ``VmHWM``, which starts again
    at ``exec`` (``ru_maxrss`` keeps the peak of the process that forked it, a bench
    already holding gigabytes), else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def time_simulated_check(world_size: int, sizes: dict[str, Any]) -> SimulatedCheckRow:
    """:func:`check_in_this_process` in a fresh Python process."""
    return _in_a_fresh_process("check_in_this_process", world_size, sizes)


def _in_a_fresh_process(measure: str, world_size: int, sizes: dict[str, Any]) -> SimulatedCheckRow:
    """This module's ``measure(world_size, sizes)`` run in a fresh Python process."""
    code = (
        "import json, sys; from dataclasses import asdict; "
        f"from meshstate.tools.bench.simulated import {measure}; "
        f"print(json.dumps(asdict({measure}(*json.loads(sys.argv[1])))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps([world_size, sizes])],
        check=True, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return SimulatedCheckRow(**json.loads(done.stdout.splitlines()[-1]))


def measure_simulated_checks(
    world_sizes: Sequence[int], sizes: dict[str, Any], progress: Callable[[str], object]
) -> list[SimulatedCheckRow]:
    """A row per world size, each from its own process."""
    rows = []
    for world_size in world_sizes:
        progress(f"check --simulate of {world_size} ranks")
        rows.append(time_simulated_check(world_size, sizes))
    return rows


def pipeline_step(tp: int, pp: int) -> dict[str, Any]:
    """One training step of a pipeline, as every rank runs it: ``init_mesh(tp=tp, pp=pp)``;
    each stage an MLP split over ``mesh["tp"]`` (``parallelize_module``, Colwise then
    Rowwise); ``Schedule1F1B`` over ``mesh.group("pp")`` with ``pp`` microbatches of each dp
    rank's batch and ``mse_loss`` (the schedule divides gradients by the microbatches); then
    the gradients averaged over ``mesh.group("dp")`` with ``all_reduce``.

    Returns the rank's loss (on the last stage, the mean of its microbatches'; ``None``
    elsewhere) and its gradients' local shards by parameter name. The same in processes
    (``local_world``) and simulated stage by stage (``simulated_world(n, stages=pp)``).
    """
    mesh = init_mesh(tp=tp, pp=pp)
    dp, stage = mesh.size("dp"), mesh.rank("pp")
    model = _pipeline_stages(pp)[stage]
    inputs, targets = _pipeline_batches(dp)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    pipe = PipelineStage(model, stage, pp, torch.device("cpu"), group=mesh.group("pp"))
    schedule = Schedule1F1B(pipe, n_microbatches=pp, loss_fn=functional.mse_loss)
    losses: list[torch.Tensor] = []
    if stage == 0:
        schedule.step(inputs[mesh.rank("dp")])
    elif stage == pp - 1:
        schedule.step(target=targets[mesh.rank("dp")], losses=losses)
    else:
        schedule.step()
    grads = {}
    for name, parameter in model.named_parameters():
        grad = cast(DTensor, parameter.grad).to_local()
        dist.all_reduce(grad, group=mesh.group("dp"))  # gloo has no AVG: sum, then divide
        grads[name] = grad / dp
    return {"loss": torch.stack(losses).mean().detach() if losses else None, "grads": grads}


def pipeline_expected(world_size: int, tp: int, pp: int) -> list[dict[str, Any]]:
    """What every rank of :func:`pipeline_step` gets, computed in one process: the whole
    model on the whole batch, each rank's loss its dp rank's rows' and its gradients its
    tp shards of its stage's (Megatron's default order: tp fastest, pp outermost)."""
    dp, stage_size = world_size // (tp * pp), world_size // pp
    stages = _pipeline_stages(pp)
    inputs, targets = _pipeline_batches(dp)
    output = inputs.flatten(0, 1)
    for module in stages:
        output = module(output)
    torch.autograd.backward(functional.mse_loss(output, targets.flatten(0, 1)))
    losses = [functional.mse_loss(mine, target).detach()
              for mine, target in zip(output.view(dp, _ROWS, _FEATURES), targets)]
    expected = []
    for rank in range(world_size):
        stage, shard = rank // stage_size, rank % tp
        grads = {name: cast(torch.Tensor, parameter.grad)
                 for name, parameter in stages[stage].named_parameters()}
        width = _HIDDEN // tp
        columns = slice(shard * width, (shard + 1) * width)
        expected.append({
            "loss": losses[rank // tp % dp] if stage == pp - 1 else None,
            "grads": {"0.weight": grads["0.weight"][columns], "0.bias": grads["0.bias"][columns],
                      "2.weight": grads["2.weight"][:, columns], "2.bias": grads["2.bias"]},
        })
    return expected


def _pipeline_stages(pp: int) -> list[torch.nn.Sequential]:
    """The model's ``pp`` stages, the same on every rank (seeded)."""
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(_FEATURES, _HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(_HIDDEN, _FEATURES)) for _ in range(pp)]


def _pipeline_batches(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every dp rank's inputs and targets, ``(dp, rows, features)`` each."""
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randn(dp, _ROWS, _FEATURES, generator=generator) for _ in range(2))  # type: ignore[return-value]


def pipeline_in_this_process(world_size: int, sizes: dict[str, Any]) -> SimulatedCheckRow:
    """Time :func:`pipeline_step` simulated in ``sizes["pp"]`` stages here, compare it with
    :func:`pipeline_expected`; the peak memory of the largest stage's process."""
    from meshstate.testing.simulated import simulated_world

    tp, pp = sizes["tp"], sizes["pp"]
    before = _peak_rss_mib()
    started = time.perf_counter()
    got = simulated_world(world_size, stages=pp).run(pipeline_step, tp, pp)
    seconds = time.perf_counter() - started
    stage_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10  # KiB on Linux
    verified = all(_close(mine, theirs) for mine, theirs in zip(got, pipeline_expected(world_size, tp, pp)))
    layout = sizes_text({**sizes, "dp": world_size // (tp * pp)})
    return SimulatedCheckRow(world_size, seconds, stage_peak, before, verified,
                             f"{PIPELINE_STEP} in {pp} stages, {layout}")


def _close(got: Any, expected: Any) -> bool:
    try:
        torch.testing.assert_close(got, expected)
    except AssertionError:
        return False
    return True


def time_simulated_pipeline(world_size: int, sizes: dict[str, Any]) -> SimulatedCheckRow:
    """:func:`pipeline_in_this_process` in a fresh Python process."""
    return _in_a_fresh_process("pipeline_in_this_process", world_size, sizes)


def format_simulated_checks(rows: Sequence[SimulatedCheckRow], sizes: dict[str, Any]) -> str:
    """The table ``meshstate bench`` prints for the simulated checks (and pipeline step)."""
    lines = []
    checks = [row for row in rows if row.step == CHECK_STEP]
    if checks:
        lines.append(f"check --simulate (every rank in one process), {sizes_text(sizes)}; a fresh "
                     "process each, peak resident memory of the process and before the check:")
    for row in checks:
        result = "verified" if row.verified else "FAILED"
        lines.append(
            f"{row.world_size:>7} ranks {row.seconds:>8.2f} s  peak {row.peak_rss_mib:>7.0f} MiB "
            f"(before {row.before_rss_mib:.0f} MiB)  {result}"
        )
    for row in rows:
        if row.step != CHECK_STEP:
            result = "equal to one process" if row.verified else "DIFFERS from one process"
            lines.append(
                f"{row.step} (a process per stage, each simulating its ranks), in a fresh process; "
                f"peak resident memory of a stage's process:\n{row.world_size:>7} ranks "
                f"{row.seconds:>8.2f} s  peak {row.peak_rss_mib:>7.0f} MiB  {result}"
            )
    return "\n".join(lines)
