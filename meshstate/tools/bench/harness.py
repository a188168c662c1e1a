"""``meshstate bench``'s harness start-up: how long a fresh pytest takes to run N-rank tests.

Each runner (pytest in one process, meshstate's ``@distributed``, torch's
``MultiProcessTestCase``) runs one all-reduce test, and each count of tests
asked for, in a fresh ``pytest`` process; the harnesses' rows show their cost
over the single process.

Example: ``time_test_run(MESHSTATE_HARNESS, tests=10, world_size=8)``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

@dataclass(frozen=True)
class HarnessRow:
    """A fresh ``pytest`` process running ``tests`` tests the way ``runner`` says: wall seconds."""

    runner: str
    world_size: int
    tests: int
    seconds: float


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


def measure_harness(
    test_counts: Sequence[int],
    world_size: int,
    notes: list[str],
    progress: Callable[[str], object],
) -> list[HarnessRow]:
    """A row per runner for one test (the start-up cost) and each count in ``test_counts``."""
    if not test_counts:
        return []
    runners = list(HARNESS_RUNNERS)
    if importlib.util.find_spec("expecttest") is None:
        runners.remove(MULTI_PROCESS_TEST_CASE)
        notes.append("torch's MultiProcessTestCase is left out: it needs expecttest")
    rows = []
    for tests in sorted({1, *test_counts}):
        for runner in runners:
            progress(f"harness start-up: {runner}, {tests} test(s)")
            rows.append(HarnessRow(runner, world_size, tests, time_test_run(runner, tests, world_size)))
    return rows
