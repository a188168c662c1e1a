"""JAX-style named-axis collectives on 8 gloo ranks, single axes and both tuple orders.

Layout: init_mesh(tp=2, cp=2) on 8 ranks, default order, so dp=2 and
rank = tp + 2*cp + 4*dp. Expected values are computed here from that formula; JAX 0.12.0.1
gives the same for every collective over each pair of axes, ``ppermute`` against mesh order
only with ``jax_raise_on_ppermute_sort_diff`` off (``jax_records/record_idioms.py``, whose
``idioms.json`` keeps every device's ppermute; by default JAX 0.12 refuses it:
test_ppermute_against_mesh_order_is_refused_as_jax_0_12_refuses).
"""

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import meshstate
from meshstate.jax import collectives as lax
from meshstate.errors import AxisError, ConfigError, NotInitializedError
from meshstate.testing import distributed, fake_world

from conftest import in_both_worlds

IDIOMS = json.loads((Path(__file__).parent / "jax_records" / "idioms.json").read_text())


def coords(rank):
    return {"tp": rank % 2, "cp": rank // 2 % 2, "dp": rank // 4}


def rank_of(tp, cp, dp):
    return tp + 2 * cp + 4 * dp


def members(rank, axes):
    """Global ranks along ``axes`` (first major) through ``rank``, as JAX orders them."""
    mine = coords(rank)
    result = []
    for first in range(2):
        for second in range(2):
            point = dict(mine)
            point[axes[0]], point[axes[1]] = first, second
            result.append(rank_of(point["tp"], point["cp"], point["dp"]))
    return result


@pytest.mark.parametrize("axes", [("cp", "dp"), ("dp", "cp"), ("tp", "cp"), ("cp", "tp")])
@distributed(world_size=8)
def test_tuple_axes_follow_the_tuple_order(axes):
    mesh = meshstate.init_mesh(tp=2, cp=2, joint_groups=["tp-cp"])
    rank = dist.get_rank()
    group = members(rank, axes)
    index = group.index(rank)
    with mesh:
        assert lax.axis_index(axes) == coords(rank)[axes[0]] * 2 + coords(rank)[axes[1]] == index
        assert lax.axis_size(axes) == 4
        assert lax.psum(torch.tensor([float(rank)]), axes).item() == sum(group)
        assert lax.pmean(torch.tensor([float(rank)]), axes).item() == sum(group) / 4
        assert lax.pmax(torch.tensor([rank]), axes).item() == max(group)
        assert lax.pmin(torch.tensor([rank]), axes).item() == min(group)
        gathered = lax.all_gather(torch.tensor([rank, -rank]), axes)
        assert gathered.tolist() == [[r, -r] for r in group]
        assert lax.all_gather(torch.tensor([rank]), axes, tiled=True).tolist() == group
        values = torch.arange(4.0) * (rank + 1)
        expected = sum(index * (r + 1) for r in group)
        assert lax.psum_scatter(values, axes).item() == expected
        assert lax.psum_scatter(values.repeat_interleave(2), axes, tiled=True).tolist() == [expected] * 2
        outgoing = torch.tensor([[rank * 10 + j] for j in range(4)])
        received = lax.all_to_all(outgoing, axes, split_axis=0, concat_axis=0)
        assert received.tolist() == [[sender * 10 + index] for sender in group]
        tiled = lax.all_to_all(outgoing.view(1, 4), axes, split_axis=1, concat_axis=0, tiled=True)
        assert tiled.tolist() == [[sender * 10 + index] for sender in group]
        ring = [(i, (i + 1) % 4) for i in range(4)]
        jaxs = IDIOMS["tuple order"]["-".join(axes)]
        with meshstate.raise_on_ppermute_sort_diff(False):  # JAX 0.12 with its check off
            assert lax.ppermute(torch.tensor([rank]), axes, ring).item() == group[(index - 1) % 4]
            assert lax.ppermute(torch.tensor([float(rank)]), axes, ring).item() == jaxs["sort_diff raises=False"][rank]
            assert lax.ppermute(torch.tensor([rank]), axes, [(0, 3)]).item() == (group[0] if index == 3 else 0)
        if not isinstance(jaxs["sort_diff raises=True"], list):  # against mesh order: refused
            with pytest.raises(meshstate.ConfigError, match="in the same order as the axis_names"):
                lax.ppermute(torch.tensor([rank]), axes, ring)
    mesh.destroy()


@pytest.mark.parametrize("axes", [("cp", "dp"), ("tp", "cp")])
def test_ppermute_against_mesh_order_is_refused_as_jax_0_12_refuses(axes):
    jaxs = IDIOMS["tuple order"]["-".join(axes)]["sort_diff raises=True"]
    assert jaxs.startswith("RuntimeError: Make sure that the axis_name passed to jax.lax.ppermute")
    with fake_world(0, 8), meshstate.init_mesh(tp=2, cp=2):
        with pytest.raises(meshstate.MeshStateError, match=(
                r"the axis_name passed to .*ppermute is in the same order as the axis_names "
                r"declared on the mesh")):
            lax.ppermute(torch.ones(1), axes, [(i, (i + 1) % 4) for i in range(4)])
        # In mesh order it is JAX's answer.
        lax.ppermute(torch.ones(1), tuple(reversed(axes)), [(i, (i + 1) % 4) for i in range(4)])


@distributed(world_size=8)
def test_single_axes_and_joint_keys():
    mesh = meshstate.init_mesh(tp=2, cp=2)
    rank = dist.get_rank()
    c = coords(rank)
    with mesh:
        assert [lax.axis_index(a) for a in ("tp", "cp", "dp")] == [c["tp"], c["cp"], c["dp"]]
        assert lax.psum(torch.tensor([1.0]), "tp").item() == 2
        assert lax.axis_index("dp-cp") == c["dp"] * 2 + c["cp"]   # a joint key is mesh order
        assert lax.all_gather(torch.tensor([rank]), "dp-cp", tiled=True).tolist() == members(rank, ("dp", "cp"))
        assert lax.axis_index(("tp",)) == c["tp"]
    mesh.destroy()


@distributed(world_size=8)
def test_collectives_are_differentiable_as_their_transposes():
    mesh = meshstate.init_mesh(tp=2, cp=2)
    rank = dist.get_rank()
    axes = ("cp", "dp")
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with mesh:
        x = torch.tensor([float(rank)], requires_grad=True)
        (lax.all_gather(x, axes, tiled=True) * weights).sum().backward()
        # every rank of the group weighs my shard by weights[my index]
        assert x.grad.item() == 4 * weights[lax.axis_index(axes)].item()
        y = torch.ones(4, requires_grad=True)
        lax.psum_scatter(y, axes).backward()
        assert y.grad.tolist() == [1.0] * 4
        z = torch.ones(1, requires_grad=True)
        lax.psum(z * (rank + 1), "tp").backward()
        assert z.grad.item() == rank + 1  # psum's backward is the identity (JAX's default)
        w = torch.ones(1, requires_grad=True)
        ring = [(i, (i + 1) % 4) for i in range(4)]
        with meshstate.raise_on_ppermute_sort_diff(False):  # ("cp", "dp") is against mesh order
            (lax.ppermute(w, axes, ring) * (lax.axis_index(axes) + 1)).sum().backward()
        # my value went to index+1, which weighs it by index+2
        assert w.grad.item() == (lax.axis_index(axes) + 1) % 4 + 1
        with pytest.raises(ConfigError, match="pmax is not differentiable"):
            lax.pmax(torch.ones(1, requires_grad=True), "tp")
    mesh.destroy()


def test_current_mesh_and_errors():
    with fake_world(3, 8):
        with pytest.raises(NotInitializedError, match="there is no current mesh"):
            lax.axis_index("tp")
        mesh = meshstate.init_mesh(tp=2, cp=2)
        meshstate.set_mesh(mesh)
        assert lax.axis_index("tp") == 1 and meshstate.current_mesh() is mesh
        other = meshstate.init_mesh(tp=4)
        with other:
            assert lax.axis_size("tp") == 4
        assert lax.axis_size("tp") == 2
        assert lax.axis_index(("cp", "pp"), mesh=mesh) == 1  # not declared: made on first use
        with pytest.raises(AxisError, match="mixes dense and expert axes"):
            lax.axis_index(("cp", "ep"), mesh=mesh)
        with pytest.raises(ConfigError, match="must equal the axis size 2"):
            lax.psum_scatter(torch.ones(3), "tp", mesh=mesh)
        with pytest.raises(ConfigError, match="repeats a source or a destination"):
            lax.ppermute(torch.ones(1), "tp", [(0, 1), (1, 1)], mesh=mesh)
        other.destroy()
        mesh.destroy()
        with pytest.raises(NotInitializedError):
            meshstate.current_mesh()


def test_declared_joint_groups_work_like_megatron_kinds():
    with fake_world(5, 16):
        mesh = meshstate.init_mesh(tp=2, cp=2, pp=2, joint_groups=["pp-cp"])
        # rank 5: tp=1 cp=0 dp=1 pp=0; the cp-pp group varies cp (stride 2) and pp (stride 8)
        assert "cp-pp" in mesh.keys() and mesh.ranks("pp-cp") == (5, 7, 13, 15) == mesh.ranks("cp-pp")
        assert mesh["cp-pp"].mesh.tolist() == [5, 7, 13, 15]
        assert mesh.ordered(("cp", "pp")).ranks == (5, 13, 7, 15)
        mesh.destroy()


@distributed(world_size=2)
def test_eager_collectives_take_what_torchs_calls_take():
    """The eager path reaches the process group's op directly; what torch's own call treats
    apart (a complex tensor, an open coalescing manager) goes through torch's call."""
    mesh = meshstate.init_mesh(tp=2)
    rank = dist.get_rank()
    x = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
    with mesh:
        assert lax.psum(x, "tp").tolist() == (x / (rank + 1) * 3).tolist()
        both = torch.cat([x / (rank + 1), x / (rank + 1) * 2])
        assert lax.all_gather(x, "tp", tiled=True).tolist() == both.tolist()
        assert lax.psum_scatter(both, "tp", tiled=True).tolist() == (both[2 * rank:][:2] * 2).tolist()
        mine = both[2 * rank:][:2]
        assert lax.all_to_all(both * (rank + 1), "tp", 0, 0, tiled=True).tolist() == (
            torch.cat([mine, mine * 2]).tolist()
        )
        with dist._coalescing_manager(group=mesh.group("tp")) as coalesced:
            summed = lax.psum(torch.ones(2) * (rank + 1), "tp")
            waiting = summed.tolist()
        coalesced.wait()
    assert (waiting, summed.tolist()) == ([rank + 1.0] * 2, [3.0, 3.0])


def test_a_torch_function_mode_sees_each_eager_collective_as_torchs_call():
    seen = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    with fake_world(0, 4):
        mesh = meshstate.init_mesh(tp=2)
        x = torch.ones(4)
        with mesh, Seen():
            lax.psum(x, "tp")
            lax.all_gather(x, "tp", tiled=True)
            lax.psum_scatter(x, "tp", tiled=True)
            lax.all_to_all(x, "tp", 0, 0, tiled=True)
        mesh.destroy()
    assert {"all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single"} <= set(seen)


STRIDED_CALLS = {
    "psum": lambda v: lax.psum(v, "tp"),
    "pmax": lambda v: lax.pmax(v, "tp"),
    "all_gather": lambda v: lax.all_gather(v, "tp", axis=1),
    "all_gather tiled": lambda v: lax.all_gather(v, "tp", axis=0, tiled=True),
    "psum_scatter": lambda v: lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True),
    "all_to_all": lambda v: lax.all_to_all(v, "tp", 1, 0, tiled=True),
    "ppermute": lambda v: lax.ppermute(v, "tp", [(0, 1), (1, 0)]),
}
STRIDES = {  # each kind of block JAX has no word for: it has no memory layout
    "transposed": lambda x: x.T[:, :4],
    "a column block": lambda x: x[:, 1:5],
    "every other row": lambda x: x[::2, :4],
    "expanded": lambda x: x[:1, :4].expand(3, 4),
}


@in_both_worlds(4, ("processes", "threads", "simulated"))
def test_every_collective_takes_a_block_of_any_strides():
    """Each collective on each kind of non-contiguous block equals it on the block made
    contiguous, values and gradients (a cotangent of any strides too), asked with and
    without gradients (the eager calls met "Tensors must be contiguous")."""
    mesh = meshstate.init_mesh(tp=2, cp=2)
    whole = torch.arange(36.0).view(6, 6) * (dist.get_rank() + 1)
    with mesh:
        for (stride, cut), (name, call) in itertools.product(STRIDES.items(), STRIDED_CALLS.items()):
            block = cut(whole)
            assert not block.is_contiguous()
            with torch.no_grad():
                assert torch.equal(call(block), call(block.contiguous())), (stride, name)
            if name == "pmax":  # not differentiable
                continue
            strided, dense = (whole.clone().requires_grad_() for _ in range(2))
            result = call(cut(strided))
            reversed_dims = range(result.dim() - 1, -1, -1)  # x.T of any rank (deprecated beyond 2)
            cotangent = torch.arange(float(result.numel())).view(result.shape[::-1]).permute(*reversed_dims)
            (result * cotangent).sum().backward()
            (call(cut(dense).contiguous()) * cotangent.contiguous()).sum().backward()
            assert torch.equal(strided.grad, dense.grad), (stride, name)
    mesh.destroy()
