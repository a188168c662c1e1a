"""Init is O(own groups): a rank of a 4,194,304-rank world never builds a world-sized list.

The arithmetic that finds a rank's part of a derived group directly agrees with every group.

Counted, not timed: tracemalloc's peak while one rank of a fake world builds its
mesh. A sequence of the world's 4,194,304 ranks alone would take over 30 MB, a list of the
largest group's 65,536 members 2.5 MB: groups are kept as strides (``Ranks``), and only a
group that is not one progression is listed, for torch (the biggest here holds 1,024 ranks).
Torch's own group constructor is not traced: it walks the members, O(members) whatever the
caller passes (20 s under tracemalloc for the Megatron façade's world-sized group), and
what meshstate hands it is counted.
"""

import tracemalloc
from unittest import mock

import pytest

import meshstate
from meshstate import DerivedGroup
from meshstate.core import compat as _compat
from meshstate.layout.config import MeshConfig
from meshstate.layout.layout import Chunks, Instances, Level, ParallelLayout
from meshstate.megatron import parallel_state
from meshstate.testing import fake_world

WORLD = 2**22
PEAK_BOUND = 2 * 2**20
# Parts of a whole-world base (the expert axes, as megatron's distributed-optimizer instances),
# of a joint group, and a hierarchical level.
DERIVED = [
    DerivedGroup(("edp", "pp", "ep", "etp"), Instances(16384)),
    DerivedGroup("dp-cp", Instances(1)),
    DerivedGroup("cp", Level(1, (8, 8))),
]


def _peak_while(build):
    """tracemalloc's peak during ``build()``, torch's group constructor left out: tracing
    stops around it, and what was held when it stopped counts as held until the end."""
    peaks, held = [], [0]
    construct = _compat._torch_group

    def untraced(*args, **kwargs):
        current, peak = tracemalloc.get_traced_memory()
        peaks.append(held[0] + peak)
        held[0] += current
        tracemalloc.stop()
        try:
            return construct(*args, **kwargs)
        finally:
            tracemalloc.start()

    tracemalloc.start()
    try:
        with mock.patch.object(_compat, "_torch_group", untraced):
            result = build()
        return max(peaks + [held[0] + tracemalloc.get_traced_memory()[1]]), result
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("rank", [0, WORLD // 2 + 12345, WORLD - 1])
def test_init_mesh_allocates_no_world_sized_sequence(rank):
    with fake_world(rank, WORLD):
        peak, mesh = _peak_while(lambda: meshstate.init_mesh(
            tp=64, cp=64, pp=64, ep=16, etp=4, derived=DERIVED))
        try:
            assert max(mesh.tables.size.values()) == 65536
            assert [mesh.size(key) for key in DERIVED] == [256, 1024, 8]
            assert mesh.ranks("pp")[0] == rank % (WORLD // 64)
            assert peak < PEAK_BOUND, f"peak {peak / 2**20:.1f} MiB"
        finally:
            mesh.destroy()


def test_the_megatron_facade_allocates_no_world_sized_sequence():
    # One distributed-optimizer instance: its group is the world, served by the default
    # group. With k instances a rank's instance group holds world/k ranks, which torch
    # needs listed when they are not one progression.
    rank = WORLD // 2 + 12345
    with fake_world(rank, WORLD):
        peak, _ = _peak_while(lambda: parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=64, context_parallel_size=64,
            pipeline_model_parallel_size=64, expert_model_parallel_size=16,
            expert_tensor_parallel_size=4, hierarchical_context_parallel_sizes=[8, 8]))
        try:
            assert parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1024
            assert parallel_state.get_mesh().size("tp-dp-cp") == 65536
            assert parallel_state.get_pipeline_model_parallel_first_rank() == rank % (WORLD // 64)
            assert peak < PEAK_BOUND, f"peak {peak / 2**20:.1f} MiB"
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("key", [
    DerivedGroup(("edp", "pp", "ep", "etp"), Instances(4)),
    DerivedGroup(("edp", "pp", "ep", "etp"), Instances(4, inter=True)),
    DerivedGroup("dp-cp", Chunks(2)),
    DerivedGroup("tp-dp", Instances(2, inter=True)),
    DerivedGroup("cp", Level(0, (2, 2))),
    DerivedGroup("cp", Level(1, (2, 2))),
    DerivedGroup("dp", backend="gloo"),
])
def test_a_part_by_arithmetic_is_the_part_of_every_group_that_holds_the_rank(key):
    layout = ParallelLayout(MeshConfig(64, tp=2, cp=4, pp=2, ep=2, etp=1))
    for rank in range(64):
        holding = [tuple(group) for group in layout.every_group(key) if rank in group]
        assert [layout.members(rank, key)] == holding
