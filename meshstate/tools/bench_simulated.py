"""``meshstate bench``'s simulated check: ``check --simulate`` at each world size, timed.

Each world is checked in a fresh process, so its peak memory is its own: the
seconds from building every rank's mesh to the table's last row, the peak
resident memory of the process and what it held before the check (Python,
torch and meshstate imported).

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
from typing import Any

from meshstate.layout.config import sizes_text


@dataclass(frozen=True)
class SimulatedCheckRow:
    """``check --simulate`` of one world in a fresh process: seconds and memory."""

    world_size: int
    seconds: float
    peak_rss_mib: float
    before_rss_mib: float
    verified: bool


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
    code = (
        "import json, sys; from dataclasses import asdict; "
        "from meshstate.tools.bench_simulated import check_in_this_process; "
        "print(json.dumps(asdict(check_in_this_process(*json.loads(sys.argv[1])))))"
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


def format_simulated_checks(rows: Sequence[SimulatedCheckRow], sizes: dict[str, Any]) -> str:
    """The table ``meshstate bench`` prints for the simulated checks."""
    lines = [f"check --simulate (every rank in one process), {sizes_text(sizes)}; a fresh "
             "process each, peak resident memory of the process and before the check:"]
    for row in rows:
        result = "verified" if row.verified else "FAILED"
        lines.append(
            f"{row.world_size:>7} ranks {row.seconds:>8.2f} s  peak {row.peak_rss_mib:>7.0f} MiB "
            f"(before {row.before_rss_mib:.0f} MiB)  {result}"
        )
    return "\n".join(lines)
