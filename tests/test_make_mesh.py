"""make_mesh: JAX's jax.make_mesh, a mesh with the caller's axis names.

Axes run in mesh order, outer first, the last fastest: the rank at ``(x, y)`` of a
``(2, 4)`` mesh is ``4 x + y``, as JAX numbers devices. The groups, positions,
DeviceMeshes and collectives are those of the same grid; a mesh over fewer ranks
than the world covers the first ones (JAX's first devices) or ``ranks``, and
gives the others ``None``. Bad input is refused before any process group exists.
JAX 0.12.0.1's answers for the device order are in ``jax_records/idioms.json``
(``record_idioms.py``); JAX 0.12 names the sizes ``axis_sizes`` (0.10: ``axis_shapes``).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import (
    ArgumentTypeError, AxisError, ConfigError, MeshStateError, P, SimulationError, shard_map,
)
from meshstate.layout.named_layout import NamedLayout
from meshstate.jax import collectives as lax
from meshstate.testing import distributed, fake_world, simulated_world
from conftest import in_both_worlds

JAXS = json.loads((Path(__file__).parent / "jax_records" / "idioms.json").read_text())["make_mesh"]


def test_groups_follow_jaxs_device_order():
    layout = NamedLayout(("x", "y"), (2, 4))
    assert layout.groups("y").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("x").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coordinate(6) == {"y": 2, "x": 1}
    assert layout.canonical("y-x") == "x-y" and layout.group_ranks(6, "y-x") == tuple(range(8))


@pytest.mark.parametrize("rank", [0, 5, 6])
def test_a_ranks_queries_and_device_meshes(rank):
    with fake_world(rank, 8):
        mesh = meshstate.make_mesh((2, 4), ("batch", "feats"))
        x, y = divmod(rank, 4)
        assert mesh.keys() == ("batch", "feats")
        assert tuple(mesh.ranks("feats")) == tuple(range(4 * x, 4 * x + 4))
        assert tuple(mesh.ranks("batch")) == (y, 4 + y)
        assert mesh.rank("feats") == y and mesh.rank(("feats", "batch")) == y * 2 + x
        assert mesh.coordinate == {"batch": x, "feats": y}
        assert mesh.dense.mesh_dim_names == ("batch", "feats")
        assert mesh["batch", "feats"].mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert mesh["feats-batch"].mesh_dim_names == ("batch-feats",)
        assert repr(mesh) == "ParallelMesh(rank %d of 8, axes=('batch', 'feats') shape=(2, 4))" % rank
        with pytest.raises(AxisError, match=r"mesh has no axis 'tp'; valid are axes \('batch', 'feats'\)"):
            mesh["tp"]
        with pytest.raises(ConfigError, match="has no Megatron config"):
            mesh.config
        with pytest.raises(AxisError, match=r"one view, mesh.dense .* no expert view"):
            mesh.expert
        mesh.destroy()


@in_both_worlds(4)
def test_collectives_and_shard_map_over_any_names_and_size_one_axes():
    mesh = meshstate.make_mesh((2, 1, 2), ("x", "one", "y"))
    rank = dist.get_rank()
    with mesh:
        assert lax.psum(torch.ones(1), "one").item() == 1  # a group of one rank
        assert lax.psum(1, "x-y") == 4 and lax.axis_size(("y", "one")) == 2
        assert lax.axis_index(("y", "x")) == (rank % 2) * 2 + rank // 2
        assert JAXS["axis_index(('y', 'x'))"] == [(r % 2) * 2 + r // 2 for r in range(4)]
        gathered = lax.all_gather(torch.ones(1) * rank, ("y", "x"), tiled=True)
        assert gathered.tolist() == [0.0, 2.0, 1.0, 3.0] == JAXS["all_gather over ('y', 'x')"][0]
        matmul = shard_map(lambda a, b: lax.psum(a @ b, "y"),
                           in_specs=(P("x", "y"), P("y", None)), out_specs=P("x", None))
        a, b = torch.arange(16.0).reshape(4, 4), torch.arange(12.0).reshape(4, 3)
        assert torch.equal(matmul(a, b).full_tensor(), a @ b)
        moved = meshstate.reshard(meshstate.distribute(a, mesh.dense, P("x", "y")), P(None, ("y", "x")))
        assert torch.equal(moved.full_tensor(), a)
    mesh.destroy()


@distributed(8)
def test_a_mesh_over_part_of_the_world():
    rank = dist.get_rank()
    first = meshstate.make_mesh((4,), ("i",))
    assert (first is None) == (rank >= 4)
    odd = meshstate.make_mesh((2, 2), ("x", "y"), ranks=[1, 3, 5, 7])
    assert (odd is None) == (rank % 2 == 0)
    if first is not None:
        with first:
            assert lax.psum(torch.ones(1), "i").item() == 4
        first.destroy()
    if odd is not None:
        assert tuple(odd.ranks("x")) == ((1, 5) if rank in (1, 5) else (3, 7))
        with odd:
            assert lax.psum(torch.ones(1) * rank, "x-y").item() == 16
        odd.destroy()


BAD = [
    (((2, 2), ("x",)), ConfigError, r"^axis_sizes \(2, 2\) has 2 sizes but axis_names \('x',\) has 1 names$"),
    (((2, 2), ("x", "x")), ConfigError, r"^axis_names \('x', 'x'\) names 'x' twice$"),
    (((2, 2), ("x", "a-b")), ConfigError, r"^axis_names: 'a-b' cannot name an axis; .* \('x-y'\)$"),
    (((2, 0), ("x", "y")), ConfigError, r"^axis_sizes: the size of axis 'y' must be a positive integer, got 0$"),
    (((2, 8), ("x", "y")), ConfigError, r"^axis_sizes \(2, 8\) hold 16 ranks, more than the world's 8$"),
    (((2, 2), ("x", 3)), ArgumentTypeError, r"^axis_names: 3 is not a string$"),
    (((2, 2), "xy"), ArgumentTypeError, r"^axis_names must be a tuple of axis names"),
    (((2,), ("x",), {"tp": 2}), TypeError, r"^make_mesh\(\) got an unexpected keyword argument 'tp'$"),
]


@pytest.mark.parametrize("arguments, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_one_line_before_any_group(arguments, error, message):
    shapes, names, *options = arguments
    with fake_world(0, 8):
        before = dist.distributed_c10d._world.group_count
        with pytest.raises(error, match=message) as raised:
            meshstate.make_mesh(shapes, names, **(options[0] if options else {}))
        assert dist.distributed_c10d._world.group_count == before
    assert "\n" not in str(raised.value)


def test_make_mesh_spells_its_parameters_as_jax_0_12():
    assert JAXS["parameters"][:2] == ["axis_sizes", "axis_names"]
    with fake_world(0, 8):
        mesh = meshstate.make_mesh(axis_sizes=(2, 4), axis_names=("batch", "feats"))
        assert mesh.keys() == ("batch", "feats")
        mesh.destroy()
        with pytest.raises(ConfigError, match=r"^axis_sizes \(2, 8\) hold 16 ranks"):
            meshstate.make_mesh((2, 8), ("x", "y"))


def test_a_simulated_world_refuses_a_mesh_over_some_ranks():
    def body():
        meshstate.make_mesh((4,), ("i",))

    with simulated_world(8) as world, pytest.raises(SimulationError, match=r"^make_mesh\(\(4,\), ...\) over 4 of 8"):
        world.run(body)
    assert issubclass(SimulationError, MeshStateError)
