"""meshstate's ProcessGroupCollection against megatron-core's: which fields exist, repr, errors.

megatron-core 0.16's collection has no attribute for a group that was never set,
0.19's reads ``None`` there, and its own code tests ``vars(collection)``; meshstate's
must answer as the installed one.
Both run in this process on torch's fake backend; groups compare by their ranks.
"""

import dataclasses
import warnings

import pytest
import torch.distributed as dist

from meshstate.megatron import parallel_state as ours
from meshstate.errors import ConfigError, WrongMeshError
from meshstate.megatron.process_groups import ProcessGroupCollection
from meshstate.testing import fake_world

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as megatron
    from megatron.core.process_groups_config import ProcessGroupCollection as Theirs

FIELDS = [f.name for f in dataclasses.fields(Theirs)]
UNSET = object()
NEWER = "gtp_remat" in FIELDS  # megatron-core 0.19: a field never set reads None


def reset_megatron():
    """megatron-core's destroy leaves some module names stale; start each run clean."""
    megatron.destroy_model_parallel()
    for name in dir(megatron):
        if name.startswith("_") and name.upper() == name and name.strip("_"):
            if "MEMORY_BUFFER" not in name:
                setattr(megatron, name, {} if name == "_HYBRID_DP_CP_GROUPS" else None)


def ranks_of(value):
    if isinstance(value, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(value))
    if isinstance(value, list):
        return [ranks_of(group) for group in value]
    return value


def seen(collection):
    """What code reading ``collection`` sees: every field's ranks, or UNSET."""
    return {name: ranks_of(getattr(collection, name, UNSET)) for name in FIELDS}


def test_same_fields_in_the_same_order():
    assert [f.name for f in dataclasses.fields(ProcessGroupCollection)] == FIELDS


def build(cls, kwargs, changes):
    """``cls(**kwargs)``, then each ``(field, value)`` of ``changes`` set (UNSET: deleted)."""
    collection = cls(**kwargs)
    for name, value in changes:
        if value is UNSET:
            delattr(collection, name)
        else:
            setattr(collection, name, value)
    return collection


# name: (constructor kwargs, then (field, value or UNSET to delete) in order, the fields set)
BUILDS = {
    "empty": ({}, [], set()),
    "tp set to None": ({"tp": None}, [], {"tp"}),
    "set after creation": ({}, [("cp", None), ("hcp", None)], {"cp", "hcp"}),
    "set then deleted": ({"tp": None, "dp": None}, [("tp", UNSET)], {"dp"}),
}


@pytest.mark.parametrize("kwargs, changes, present", BUILDS.values(), ids=BUILDS.keys())
def test_fields_never_set_read_as_in_megatron(kwargs, changes, present):
    mine = build(ProcessGroupCollection, kwargs, changes)
    theirs = build(Theirs, kwargs, changes)
    assert {name for name in FIELDS if name in vars(mine)} == present
    assert seen(mine) == seen(theirs)
    assert getattr(mine, "ep", "default") == getattr(theirs, "ep", "default") == (None if NEWER else "default")
    assert repr(mine) == repr(theirs)


def test_groups_in_repr_and_equality():
    with fake_world(5, 8):
        world = dist.group.WORLD
        mine = ProcessGroupCollection(tp=world, cp=None)
        shown = "ProcessGroupCollection(tp(8))" if NEWER else "ProcessGroupCollection(tp(8), cp(None))"
        assert repr(mine) == repr(Theirs(tp=world, cp=None)) == shown
        assert mine == ProcessGroupCollection(cp=None, tp=world)
        assert mine != ProcessGroupCollection(tp=world)
        assert ProcessGroupCollection() == ProcessGroupCollection()
        mine.hcp = [world, world]
        assert repr(mine) == shown[:-1] + ", hcp([8, 8]))"


def test_unknown_fields_are_value_errors_as_in_megatron():
    with pytest.raises(ValueError, match="Unknown attribute: tpp"):
        Theirs(tpp=None)
    with pytest.raises(ConfigError) as raised:
        ProcessGroupCollection(tpp=None)
    assert isinstance(raised.value, ValueError)
    assert str(raised.value).startswith("unknown process groups ['tpp']; fields are ['tp', 'pp'")


# tp=2, pp=4 on 8 ranks: rank 5 is a middle pipeline stage, so its embd is None.
KWARGS = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)


@pytest.mark.parametrize("required", [None, ["tp", "dp"], ["embd", "hcp", "inter_dist_opt"], []])
@pytest.mark.parametrize("rank", [0, 5])
def test_use_mpu_process_groups_and_from_mesh_set_what_megatron_sets(required, rank):
    with fake_world(rank, 8):
        reset_megatron()
        megatron.initialize_model_parallel(create_gloo_process_groups=False, **KWARGS)
        theirs = Theirs.use_mpu_process_groups(required)
        expected, expected_repr = seen(theirs), repr(theirs)
        reset_megatron()
        ours.initialize_model_parallel(create_gloo_process_groups=False, **KWARGS)
        mine = ProcessGroupCollection.use_mpu_process_groups(required)
        assert seen(mine) == expected
        assert repr(mine) == expected_repr
        assert ProcessGroupCollection.from_mesh(ours.get_mesh(), required) == mine
        assert ("embd" in vars(mine)) == (required is None or "embd" in required)
        if "embd" in vars(mine):
            assert (mine.embd is None) == (rank == 5)
        ours.destroy_model_parallel()


def test_unknown_required_groups_are_value_errors_as_in_megatron():
    with fake_world(0, 8):
        ours.initialize_model_parallel(**KWARGS)
        for cls in (Theirs, ProcessGroupCollection):
            with pytest.raises(ValueError, match="^Invalid process groups requested: \\['nonsense'\\]"):
                cls.use_mpu_process_groups(["tp", "nonsense"])
        with pytest.raises(ConfigError):
            ProcessGroupCollection.from_mesh(ours.get_mesh(), ["nonsense"])
        ours.destroy_model_parallel()


@pytest.mark.parametrize("mesh", [None, "tp"])
def test_from_mesh_of_no_parallel_mesh_is_a_meshstate_error(mesh):
    with fake_world(0, 8):
        ours.initialize_model_parallel(**KWARGS)
        given = ours.get_mesh()[mesh] if mesh else mesh
        with pytest.raises(WrongMeshError, match="^ProcessGroupCollection.from_mesh\\(mesh=...\\) takes "
                           f"a meshstate ParallelMesh, got {type(given).__name__}"):
            ProcessGroupCollection.from_mesh(given)
        ours.destroy_model_parallel()
