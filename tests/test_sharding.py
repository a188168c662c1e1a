"""JAX partition specs on DeviceMeshes: every rank holds exactly what JAX's NamedSharding gives it.

The oracle is JAX's rule written out in plain Python: a dim split over axes
``(a1, ..., an)`` is cut into ``prod(sizes)`` equal chunks and a rank holds chunk
``row_major_index(coordinate on a1, ..., coordinate on an)``.
"""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import meshstate
from meshstate.errors import AxisError, ConfigError
from meshstate.jax.sharding import NamedSharding, P, distribute, to_placements
from meshstate.testing import distributed, fake_world

GLOBAL_SHAPE = (48, 24, 24)  # every dim divides by the largest mesh (2*3*2 = 12) and by 8


def jax_slices(dims, axis_sizes, coordinate, global_shape):
    """The slice of ``global_shape`` a rank at ``coordinate`` ({axis: index}) holds under JAX."""
    slices = []
    for dim, size in enumerate(global_shape):
        entry = dims[dim] if dim < len(dims) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        chunk = 0
        for axis in axes:
            chunk = chunk * axis_sizes[axis] + coordinate[axis]
        chunk_size = size // math.prod(axis_sizes[axis] for axis in axes)
        slices.append(slice(chunk * chunk_size, (chunk + 1) * chunk_size))
    return tuple(slices)


TWO_AXIS_SPECS = [
    P(),
    P("x"),
    P("y"),
    P(None, "x"),
    P("x", "y"),
    P("y", "x"),
    P(("x", "y")),
    P(("y", "x")),
    P(None, ("y", "x")),
    P(("y", "x"), None, None),
    P("x", unreduced={"y"}),
    P(None, None, "y", unreduced={"x"}),
    P(unreduced={"x", "y"}),
]
THREE_AXIS_SPECS = [
    *(P(order) for order in itertools.permutations("xyz")),
    *(P(None, order) for order in itertools.permutations("xyz")),
    P("x", "y", "z"),
    P("z", "y", "x"),
    P(("z", "x"), "y"),
    P(("y", "x"), None, "z"),
    P("z", ("y", "x")),
    P(("x", "z"), None, "y"),
    P(None, ("z", "y"), "x"),
    P(("z", "x"), unreduced={"y"}),
    P(None, ("z", "y"), unreduced={"x"}),
    P(unreduced={"x", "z"}),
]
MESH_SPECS = [
    ((2, 4), TWO_AXIS_SPECS),
    ((4, 2), TWO_AXIS_SPECS),
    ((2, 2, 2), THREE_AXIS_SPECS),
    ((2, 3, 2), THREE_AXIS_SPECS),
]


@pytest.mark.parametrize("mesh_shape, specs", MESH_SPECS, ids=[str(m[0]) for m in MESH_SPECS])
def test_every_rank_holds_the_jax_shard(mesh_shape, specs):
    names = ("x", "y", "z")[: len(mesh_shape)]
    axis_sizes = dict(zip(names, mesh_shape))
    world_size = math.prod(mesh_shape)
    global_tensor = torch.arange(math.prod(GLOBAL_SHAPE)).view(GLOBAL_SHAPE)
    for rank in range(world_size):
        with fake_world(rank, world_size):
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            coordinate = dict(zip(names, mesh.get_coordinate()))
            for spec in specs:
                expected = jax_slices(spec.dims, axis_sizes, coordinate, GLOBAL_SHAPE)
                sharding = NamedSharding(mesh, spec)
                placements = to_placements(spec, mesh)
                local_shape, global_offset = compute_local_shape_and_global_offset(
                    GLOBAL_SHAPE, mesh, placements
                )
                assert local_shape == tuple(s.stop - s.start for s in expected), (rank, spec)
                assert global_offset == tuple(s.start for s in expected), (rank, spec)
                assert sharding.shard_shape(GLOBAL_SHAPE) == local_shape
                assert sharding.index_map(GLOBAL_SHAPE)[rank] == expected, (rank, spec)
                assert [names[d] for d, p in enumerate(placements) if p == Partial()] == sorted(
                    spec.unreduced
                )
                # Torch's own split of the data (no collective): the values, not only the corner.
                summed = [Replicate() if isinstance(p, Partial) else p for p in placements]
                local = distribute_tensor(global_tensor, mesh, summed, src_data_rank=None)
                assert torch.equal(local.to_local(), global_tensor[expected]), (rank, spec)


def test_index_map_covers_every_rank_of_the_mesh():
    with fake_world(0, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        index_map = NamedSharding(mesh, P("tp", "dp")).index_map((8, 6))
    # rank = 4 * dp + tp; dim 0 is split over tp (rows of 2), dim 1 over dp (columns of 3)
    assert index_map == {
        4 * dp + tp: (slice(2 * tp, 2 * tp + 2), slice(3 * dp, 3 * dp + 3))
        for dp in range(2)
        for tp in range(4)
    }


@pytest.mark.parametrize("rank", [0, 5, 10, 15])
def test_slices_of_a_meshstate_mesh(rank):
    # 16 ranks, tp=2 cp=2 pp=2, so dp=2; the dense mesh is (pp, dp, cp, tp).
    shape = (16, 8)
    with fake_world(rank, 16):
        mesh = meshstate.init_mesh(tp=2, cp=2, pp=2)
        layout = mesh.layout
        sizes = {"pp": 2, "dp": 2, "cp": 2, "tp": 2, "dp-cp": 4}
        cases = [
            (mesh.dense, P(("tp", "dp"), ("cp", "pp"))),
            (mesh["dp", "cp"], P(("cp", "dp"))),
            (mesh["dp-cp"], P("dp-cp")),
        ]
        for device_mesh, spec in cases:
            index_map = NamedSharding(device_mesh, spec).index_map(shape)
            assert sorted(index_map) == list(range(16))
            for other in range(16):
                coordinate = layout.coordinate(other)
                coordinate["dp-cp"] = coordinate["dp"] * 2 + coordinate["cp"]
                expected = jax_slices(spec.dims, sizes, coordinate, shape)
                assert index_map[other] == expected, (other, spec)
            local_shape, offset = compute_local_shape_and_global_offset(
                shape, device_mesh, to_placements(spec, device_mesh)
            )
            mine = index_map[rank]
            assert (local_shape, offset) == (
                tuple(s.stop - s.start for s in mine),
                tuple(s.start for s in mine),
            )
        mesh.destroy()


def test_placements():
    with fake_world(0, 8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        assert to_placements(P(("dp", "cp"), "tp"), mesh) == (Shard(0), Shard(0), Shard(1))
        assert to_placements(P(None, "cp"), mesh) == (Replicate(), Shard(1), Replicate())
        assert to_placements(P("tp", unreduced={"dp"}), mesh) == (Partial(), Replicate(), Shard(0))
        assert [str(p) for p in to_placements(P(("cp", "dp")), mesh)] == ["_S(0, 2)", "S(0)", "R"]
        assert [str(p) for p in to_placements(P(("tp", "cp", "dp")), mesh)] == [
            "_S(0, 4)",
            "_S(0, 2)",
            "S(0)",
        ]
        assert [str(p) for p in to_placements(P(("cp", "tp", "dp")), mesh)] == [
            "_S(0, 4)",
            "S(0)",
            "S(0)",
        ]


def test_spec_is_a_value():
    assert P("dp", None, ("x", "y")) == P("dp", None, ("x", "y"))
    assert hash(P("dp", unreduced={"a", "b"})) == hash(P("dp", unreduced=("b", "a")))
    assert P(("dp",), ()) == P("dp", None)
    assert P("dp") != P("dp", None)
    assert P("dp") != P("dp", unreduced={"tp"})
    assert repr(P("dp", None, ("x", "y"))) == "P('dp', None, ('x', 'y'))"
    assert repr(P("x", unreduced={"z", "y"})) == "P('x', unreduced={'y', 'z'})"
    assert repr(P()) == "P()"
    spec = P("dp", ("cp", "tp"), unreduced={"pp"})
    assert spec.dims == ("dp", ("cp", "tp"))
    assert spec.unreduced == frozenset({"pp"})
    assert spec.axes == ("dp", "cp", "tp", "pp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dims = ()


def test_named_sharding_is_a_value():
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sharding = NamedSharding(mesh, P(("tp", "dp")))
        assert sharding == NamedSharding(mesh, P(("tp", "dp")))
        assert hash(sharding) == hash(NamedSharding(mesh, P(("tp", "dp"))))
        assert sharding != NamedSharding(mesh, P(("dp", "tp")))
        assert sharding.placements == to_placements(P(("tp", "dp")), mesh)
        assert sharding.shard_shape((8, 3)) == (2, 3)


def test_unreduced_keeps_dtype_and_autograd():
    # The rank at dp=0 holds the value, the others zeros: the sum over dp is exact.
    for rank, expected in [(0, [1, 2, 3, 4]), (4, [0, 0, 0, 0])]:
        with fake_world(rank, 8):
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            weights = torch.tensor([1, 2, 3, 4])
            dtensor = distribute(weights, mesh, P(unreduced={"dp"}))
            assert dtensor.placements == (Partial(), Replicate())
            assert dtensor.to_local().tolist() == expected
            assert dtensor.dtype == dtensor.to_local().dtype == torch.int64
            leaf = distribute(weights.double().requires_grad_(), mesh, P("tp", unreduced={"dp"}))
            assert leaf.requires_grad and leaf.is_leaf


def raises_exactly(error_type, message, call, *args, **kwargs):
    with pytest.raises(error_type) as raised:
        call(*args, **kwargs)
    assert type(raised.value) is error_type
    assert str(raised.value) == message


ENTRY = "each entry must be None, an axis name or a tuple of axis names"
TWICE = "a mesh axis splits at most one dim and cannot also be unreduced"
SPEC_ERRORS = [
    (("dp", 3), {}, f"P('dp', 3): dim 1 is 3; {ENTRY}"),
    ((("dp", 1),), {}, f"P(('dp', 1)): dim 0 is ('dp', 1); {ENTRY}"),
    ((["dp", "cp"],), {}, f"P(['dp', 'cp']): dim 0 is ['dp', 'cp']; {ENTRY}"),
    (
        ("dp",),
        {"unreduced": "tp"},
        "unreduced must be a collection of axis names, not the string 'tp'; write unreduced={'tp'}",
    ),
    ((), {"unreduced": {1}}, "P(unreduced={1}): unreduced holds 1, which is not an axis name"),
    (("dp", ("cp", "dp")), {}, f"P('dp', ('cp', 'dp')): axis 'dp' is used more than once; {TWICE}"),
    ((("tp", "tp"),), {}, f"P(('tp', 'tp')): axis 'tp' is used more than once; {TWICE}"),
    (
        ("dp",),
        {"unreduced": {"dp"}},
        f"P('dp', unreduced={{'dp'}}): axis 'dp' is used more than once; {TWICE}",
    ),
]


@pytest.mark.parametrize(
    "dims, options, message", SPEC_ERRORS, ids=[str(error[0]) for error in SPEC_ERRORS]
)
def test_spec_errors(dims, options, message):
    raises_exactly(ConfigError, message, P, *dims, **options)


def test_mesh_errors():
    with fake_world(0, 8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        valid = "valid axes are ('dp', 'cp', 'tp')"
        message = f"P('dp', 'tq'): mesh has no axis 'tq'; {valid}"
        raises_exactly(AxisError, message, to_placements, P("dp", "tq"), mesh)
        message = f"P(unreduced={{'ep'}}): mesh has no axis 'ep'; {valid}"
        raises_exactly(AxisError, message, NamedSharding, mesh, P(unreduced={"ep"}))
        message = f"P(('cp', 'xx')): mesh has no axis 'xx'; {valid}"
        raises_exactly(AxisError, message, distribute, torch.zeros(4), mesh, P(("cp", "xx")))

        uneven = NamedSharding(mesh, P(("cp", "dp")))
        message = (
            "P(('cp', 'dp')): dim 0 of shape (6, 8) has size 6, which is not divisible by "
            "cp*dp = 2*2 = 4; an uneven dim must be split over axes in mesh order ('dp', 'cp', 'tp')"
        )
        raises_exactly(ConfigError, message, uneven.shard_shape, (6, 8))
        raises_exactly(ConfigError, message, uneven.index_map, (6, 8))
        raises_exactly(ConfigError, message, distribute, torch.zeros(6, 8), mesh, P(("cp", "dp")))
        message = "P('dp', None, 'tp') has 3 dims but the shape (4, 4) has 2"
        too_long = P("dp", None, "tp")
        raises_exactly(ConfigError, message, distribute, torch.zeros(4, 4), mesh, too_long)


# 8 real gloo ranks: the mesh ("dp", "cp", "tp") of shape (2, 2, 2).
GLOO_SPECS = [
    P(("dp", "cp"), "tp"),
    P(("cp", "dp"), "tp"),
    P(("tp", "cp", "dp")),
    P(("cp", "tp", "dp")),
    P(None, ("tp", "dp"), unreduced={"cp"}),
]


@distributed(world_size=8)
def test_distribute_holds_jax_slices_and_round_trips():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    rank = dist.get_rank()
    global_tensor = torch.arange(16 * 8).view(16, 8)
    for spec in GLOO_SPECS:
        dtensor = distribute(global_tensor, mesh, spec)
        expected = global_tensor[NamedSharding(mesh, spec).index_map(global_tensor.shape)[rank]]
        holds_sum = all(mesh.get_local_rank(axis) == 0 for axis in spec.unreduced)
        if not holds_sum:
            expected = torch.zeros_like(expected)
        assert torch.equal(dtensor.to_local(), expected), spec
        assert dtensor.to_local().dtype == torch.int64
        assert torch.equal(dtensor.full_tensor(), global_tensor), spec


@distributed(world_size=8)
def test_distribute_on_meshstate_meshes():
    mesh = meshstate.init_mesh(tp=2, cp=2)  # dp=2, pp=1: dense mesh (pp, dp, cp, tp)
    global_tensor = torch.arange(8 * 4.0).view(8, 4)
    for device_mesh, spec in [
        (mesh.dense, P(("tp", "dp"), "cp")),
        (mesh["dp", "cp"], P(None, ("cp", "dp"))),
        (mesh["dp-cp"], P("dp-cp")),
    ]:
        dtensor = distribute(global_tensor, device_mesh, spec)
        index = NamedSharding(device_mesh, spec).index_map(global_tensor.shape)[dist.get_rank()]
        assert torch.equal(dtensor.to_local(), global_tensor[index]), spec
        assert torch.equal(dtensor.full_tensor(), global_tensor), spec
    mesh.destroy()
