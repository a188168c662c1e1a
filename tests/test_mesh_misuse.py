"""The mesh as a container of axes, and what misusing it says.

Each test runs on a one-rank gloo world in this process (the layout questions do
not need more ranks); the default-group test runs a fresh interpreter, as
torchrun would start one.
"""

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import meshstate
from meshstate import GROUP_KINDS, DerivedGroup, Pick
from meshstate.megatron import parallel_state as mpu
from meshstate.errors import NotInitializedError, WrongMeshError


EMBEDDING = DerivedGroup("pp", Pick("embedding", list))


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = meshstate.init_mesh(joint_groups=["cp-pp"], derived=[EMBEDDING])
    yield mesh
    mesh.destroy()
    dist.destroy_process_group()


def test_in_len_and_iter_follow_keys(mesh):
    keys = mesh.keys()
    assert keys == GROUP_KINDS + ("cp-pp", EMBEDDING)
    assert tuple(mesh) == keys and len(mesh) == len(keys)
    assert all(key in mesh for key in keys)


# Every spelling group() accepts is `in` the mesh, and nothing else is.
SPELLINGS = [
    "tp", "cp-dp", "dp-cp", "pp-cp", "cp-pp", "dp-cp-tp", "pp-ep-etp", "edp", "embedding",
    "cp-tp-pp", "tp-ep", "xx", "", "dp-dp", "tp-", "Embedding",
]


@pytest.mark.parametrize("key", SPELLINGS)
def test_in_is_true_exactly_for_what_group_accepts(mesh, key):
    try:
        mesh.group(key)
        accepted = True
    except meshstate.AxisError:
        accepted = False
    assert (key in mesh) == accepted


@pytest.mark.parametrize("key", [3, None, ("tp",), ["tp"], b"tp"])
def test_in_is_false_for_what_is_not_a_string(mesh, key):
    assert key not in mesh


DEVICE_MESH_MISUSES = {
    "psum(mesh=...)": lambda m: meshstate.psum(torch.ones(1), "tp", mesh=m["tp"]),
    "axis_index(mesh=...)": lambda m: meshstate.axis_index("tp", mesh=m.dense),
    "all_gather(mesh=...)": lambda m: meshstate.all_gather(torch.ones(1), "dp", mesh=m["dp"]),
    "set_mesh()": lambda m: meshstate.set_mesh(m.dense),
}


@pytest.mark.parametrize("where", DEVICE_MESH_MISUSES)
def test_a_device_mesh_where_a_parallel_mesh_belongs_names_both(mesh, where):
    with pytest.raises(TypeError) as raised:
        DEVICE_MESH_MISUSES[where](mesh)
    assert isinstance(raised.value, WrongMeshError)
    assert str(raised.value).startswith(
        f"{where} takes a meshstate ParallelMesh, got DeviceMesh; pass the mesh that "
        "meshstate.init_mesh returned"
    )


def test_a_device_mesh_with_block_is_not_a_current_mesh(mesh):
    with mesh.dense, pytest.raises(NotInitializedError, match="a torch DeviceMesh's `with`"):
        meshstate.psum(torch.ones(1), "tp")


PARALLEL_MESH_MISUSES = {
    "distribute()": lambda m: meshstate.distribute(torch.ones(2), m, meshstate.P()),
    "to_placements()": lambda m: meshstate.to_placements(meshstate.P(), m),
    "NamedSharding()": lambda m: meshstate.NamedSharding(m, meshstate.P()),
}


@pytest.mark.parametrize("where", PARALLEL_MESH_MISUSES)
def test_a_parallel_mesh_where_a_device_mesh_belongs_says_what_to_pass(mesh, where):
    with pytest.raises(TypeError) as raised:
        PARALLEL_MESH_MISUSES[where](mesh)
    assert str(raised.value) == (
        f"{where} takes a torch DeviceMesh, got ParallelMesh; "
        'pass mesh.dense, mesh.expert or a slice such as mesh["dp"]'
    )


def test_torch_fully_shard_given_a_parallel_mesh_says_what_to_pass(mesh):
    with pytest.raises(TypeError, match=re.escape(
        "a ParallelMesh is not a torch DeviceMesh (it has no 'ndim'); pass one of its "
        'DeviceMeshes: mesh.dense, mesh.expert or a slice such as mesh["dp-cp"]'
    )):
        fully_shard(torch.nn.Linear(2, 2), mesh=mesh)
    assert not hasattr(mesh, "mesh_dim_names") and getattr(mesh, "get_group", None) is None
    with pytest.raises(AttributeError) as raised:
        mesh.sise("tp")
    assert not isinstance(raised.value, WrongMeshError)


def destroy_here(mesh):
    mesh.destroy()


DESTROYED_AT = f"this mesh was destroyed at {__file__}:{destroy_here.__code__.co_firstlineno + 1};"

USES = {
    "group": lambda m: m.group("tp"),
    "rank": lambda m: m.rank("dp-cp"),
    "size": lambda m: m.size("cp-dp"),
    "ranks": lambda m: m.ranks("pp"),
    "next_rank": lambda m: m.next_rank("pp"),
    "prev_rank": lambda m: m.prev_rank("cp"),
    "first_rank": lambda m: m.first_rank("pp"),
    "last_rank": lambda m: m.last_rank("pp"),
    "is_first": lambda m: m.is_first("pp"),
    "is_last": lambda m: m.is_last("pp"),
    "tables": lambda m: m.tables.rank["tp"],
    "ordered": lambda m: m.ordered(("cp", "dp")),
    "has_group": lambda m: m.has_group("tp"),
    "coordinate": lambda m: m.coordinate,
    "keys": lambda m: m.keys(),
    "in": lambda m: "tp" in m,
    "len": len,
    "iter": list,
    "getitem": lambda m: m["tp"],
    "getitem joint": lambda m: m["dp-cp"],
    "getitem 2-D": lambda m: m["dp", "cp"],
    "dense": lambda m: m.dense,
    "expert": lambda m: m.expert,
    "process_groups": lambda m: m.process_groups,
    "with": lambda m: m.__enter__(),
    "psum": lambda m: meshstate.psum(torch.ones(1), "tp", mesh=m),
    "fully_shard": lambda m: fully_shard(torch.nn.Linear(2, 2), mesh=m),
}


@pytest.mark.parametrize("use", USES)
def test_every_use_of_a_destroyed_mesh_names_where_it_was_destroyed(mesh, use):
    mesh["dp-cp"]
    destroy_here(mesh)
    with pytest.raises(NotInitializedError, match=re.escape(DESTROYED_AT)):
        USES[use](mesh)
    assert repr(mesh) == "ParallelMesh(rank 0 of 1, order='tp-cp-ep-dp-pp', tp=1 cp=1 ep=1 etp=1 pp=1 dp=1 edp=1)"
    mesh.destroy()
    assert dist.is_initialized()


def test_destroy_model_parallel_names_its_callers_line():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mpu.initialize_model_parallel()
        mesh = mpu.get_mesh()
        line = sys._getframe().f_lineno + 1
        mpu.destroy_model_parallel()
        with pytest.raises(NotInitializedError, match=re.escape(f"destroyed at {__file__}:{line};")):
            mesh.group("dp")
    finally:
        dist.destroy_process_group()


def test_the_default_group_init_mesh_made_outlives_destroy_until_exit():
    script = textwrap.dedent("""
        import atexit, torch, torch.distributed as dist, meshstate
        atexit.register(lambda: print("at exit, initialized:", dist.is_initialized()))
        with meshstate.init_mesh() as mesh:
            assert meshstate.psum(torch.ones(1), "tp").item() == 1.0
            mesh.destroy()
        world = dist.group.WORLD
        assert world is not None  # kept: torchrun's store could not form it again
        with meshstate.init_mesh(joint_groups=["cp-pp"]) as mesh:
            mesh["dp-cp"]
        mesh.destroy()
        mesh.destroy()
        assert dist.group.WORLD is world
        dist.destroy_process_group()  # asked for: gone, and the next mesh makes its own
        meshstate.init_mesh().destroy()
        assert dist.group.WORLD is not None and dist.group.WORLD is not world
        print("done")
    """)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stdout) == (
        0, "done\nat exit, initialized: False\n"), result.stderr
