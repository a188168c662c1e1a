"""Issue 12 on 8 gloo ranks: any axis tuple without declaring it, shard_map, reshard, uneven shards.

Expected values come from JAX's definitions: over a tuple of axes a rank's index
is row-major in the tuple's order (first axis major); psum sums, all_gather
stacks in index order, psum_scatter keeps chunk ``index``, all_to_all sends
chunk ``j`` to index ``j``, ppermute moves source to destination and leaves
zeros where nothing arrives. Gradients are JAX's default transposes of each rank's
own ``(c_rank * y).sum()``, written out by hand for each collective: psum's is the
identity (the input is taken to vary over the axes), the others move the
cotangents of every rank of the group.
"""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import P, reshard, shard_map
from meshstate.testing.torch_internals import live_groups
from meshstate.errors import AxisError
from meshstate.jax.types.vma import VaryingAxesError
from meshstate.jax import collectives as lax
from meshstate.jax.sharding import NamedSharding, distribute
from meshstate.testing import distributed

# init_mesh(tp=2, pp=2, ep=2, etp=1) on 8 ranks: dp=2, cp=1, edp=2.
DENSE = {"tp": (1, 2), "dp": (2, 2), "pp": (4, 2)}  # axis: (stride, size)
EXPERT = {"ep": (1, 2), "edp": (2, 2), "pp": (4, 2)}


def coordinate(rank, view):
    return {axis: rank // stride % size for axis, (stride, size) in view.items()}


def group_of(rank, axes, view):
    """Global ranks along ``axes`` through ``rank``, first axis major (JAX's order)."""
    base = rank - sum(coordinate(rank, view)[axis] * view[axis][0] for axis in axes)
    return [
        base + sum(c * view[axis][0] for c, axis in zip(point, axes))
        for point in itertools.product(*(range(view[axis][1]) for axis in axes))
    ]


def check_collectives(axes, view, mesh):
    rank = dist.get_rank()
    group = group_of(rank, axes, view)
    index, n = group.index(rank), len(group)
    c = {r: float(r + 1) for r in group}  # each rank's loss weight
    with mesh:
        assert lax.axis_index(axes) == index and lax.axis_size(axes) == n

        x = torch.tensor([float(rank)], requires_grad=True)
        y = lax.psum(x, axes)
        assert y.item() == sum(group)
        (c[rank] * y).sum().backward()
        assert x.grad.item() == c[rank]
        assert lax.pmean(torch.tensor([float(rank)]), axes).item() == sum(group) / n
        assert lax.pmax(torch.tensor([rank]), axes).item() == max(group)
        assert lax.pmin(torch.tensor([rank]), axes).item() == min(group)

        x = torch.tensor([float(rank), -float(rank)], requires_grad=True)
        y = lax.all_gather(x, axes)
        assert y.tolist() == [[r, -r] for r in group]
        weights = torch.arange(float(n)).unsqueeze(1) * c[rank]
        (weights * y).sum().backward()
        assert x.grad.tolist() == [index * sum(c.values())] * 2
        assert lax.all_gather(torch.tensor([rank]), axes, tiled=True).tolist() == group

        x = (torch.arange(float(n)) * (rank + 1)).requires_grad_()
        y = lax.psum_scatter(x, axes)
        assert y.item() == sum(index * (r + 1) for r in group)
        (c[rank] * y).sum().backward()
        assert x.grad.tolist() == [c[r] for r in group]

        x = torch.tensor([[rank * 10.0 + j] for j in range(n)], requires_grad=True)
        y = lax.all_to_all(x, axes, split_axis=0, concat_axis=0)
        assert y.tolist() == [[s * 10.0 + index] for s in group]
        (torch.arange(float(n)).unsqueeze(1) * c[rank] * y).sum().backward()
        assert x.grad.flatten().tolist() == [c[r] * index for r in group]

        # A shift that leaves index n-1 out as a source and index 0 as a destination.
        perm = [(i, i + 1) for i in range(n - 1)]
        x = torch.tensor([float(rank)], requires_grad=True)
        with meshstate.raise_on_ppermute_sort_diff(False):  # any tuple order, as JAX 0.12 with its check off
            y = lax.ppermute(x, axes, perm)
        assert y.item() == (group[index - 1] if index > 0 else 0.0)
        (c[rank] * y).sum().backward()
        assert x.grad.item() == (c[group[index + 1]] if index < n - 1 else 0.0)


@distributed(world_size=8)
def test_any_axis_tuple_without_declaring_it():
    groups_before = len(live_groups())
    mesh = meshstate.init_mesh(tp=2, pp=2, ep=2, etp=1)
    created = mesh.process_groups.creation_calls
    for axes in [("pp", "dp"), ("dp", "pp"), ("tp", "dp", "pp"), ("pp", "dp", "tp")]:
        check_collectives(axes, DENSE, mesh)
    # dp-pp: one group, shared by both orders; tp-dp-pp is the whole world, the default group.
    assert mesh.process_groups.creation_calls == created + 1
    for axes in [("pp", "edp"), ("edp", "pp"), ("edp", "ep"), ("ep", "edp")]:
        check_collectives(axes, EXPERT, mesh)
    for axes in [("pp",), ("tp", "dp")]:  # declared groups serve as before
        check_collectives(axes, DENSE, mesh)
    # edp-pp is new; ep-edp has the ranks of the declared tp-dp-cp and uses its group.
    assert mesh.process_groups.creation_calls == created + 2
    rank = dist.get_rank()
    with pytest.raises(AxisError, match="mixes dense and expert axes"):
        mesh.ordered(("tp", "ep"))
    # shard_map on the expert view: element ep*2 + edp lives on that rank, summed over both.
    experts = shard_map(
        lambda v: (v, lax.psum(v, ("edp", "ep"))), in_specs=P(("ep", "edp")),
        out_specs=(P(("ep", "edp")), P()), mesh=mesh,
    )
    block, total = experts(torch.arange(4.0))
    expert = coordinate(rank, EXPERT)
    assert block.device_mesh is mesh.expert and block.to_local().tolist() == [expert["ep"] * 2 + expert["edp"]]
    assert total.full_tensor().tolist() == [6.0]
    # Slicing: a flattened axis beside a plain one; against mesh order is refused.
    flat = mesh["dp-pp", "tp"]
    assert flat.mesh_dim_names == ("dp-pp", "tp")
    assert flat.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert flat.get_local_rank(0) == group_of(rank, ("pp", "dp"), DENSE).index(rank)
    with pytest.raises(AxisError, match=r"against mesh order.*P\(\('dp', 'pp'\)\)"):
        mesh["dp", "pp"]
    mesh.destroy()  # the groups made on first use go with it
    assert len(live_groups()) == groups_before


def row_parallel(x, w):
    return lax.psum(x @ w, "tp")


@distributed(world_size=8)
def test_shard_map_megatron_sequence_parallel_and_reshard():
    mesh = meshstate.init_mesh(tp=2, cp=2)  # dp=2; rank = tp + 2*cp + 4*dp
    rank = dist.get_rank()
    tp, cp, dp = rank % 2, rank // 2 % 2, rank // 4
    torch.manual_seed(0)
    x_full = torch.randn(4, 6, dtype=torch.float64)
    w_full = torch.randn(6, 3, dtype=torch.float64)
    with mesh:
        # Megatron row-parallel: x split on its last dim, w on its first, psum over tp.
        x, w = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
        matmul = shard_map(row_parallel, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
        y = matmul(x, w)
        assert y.placements == tuple(mesh.dense.ndim * [y.placements[0]])
        torch.testing.assert_close(y.full_tensor(), x_full @ w_full)
        (y.full_tensor() * 3).sum().backward()
        ones = torch.full((4, 3), 3.0, dtype=torch.float64)
        torch.testing.assert_close(w.grad, x_full.T @ ones)  # JAX's gradient, counted once
        torch.testing.assert_close(x.grad, ones @ w_full.T)
        # The same in plain code: psum's backward is the identity, so each tp rank's own
        # backward gives its rows of the single-process gradient (Megatron's convention).
        w_local = w_full[tp * 3 : tp * 3 + 3].clone().requires_grad_()
        plain = lax.psum(x_full[:, tp * 3 : tp * 3 + 3] @ w_local, "tp")
        (plain * 3).sum().backward()
        torch.testing.assert_close(w_local.grad, (x_full.T @ ones)[tp * 3 : tp * 3 + 3])

        # Input replicated over axes its spec leaves out: gradient summed over them (counted once).
        b = torch.ones(3, dtype=torch.float64, requires_grad=True)
        shard_map(lambda v: v * 2, in_specs=P(), out_specs=P())(b).full_tensor().sum().backward()
        assert b.grad.tolist() == [2.0] * 3

        # Sequence parallel: rows split over (cp, dp), all-gathered back in that order.
        seq = torch.arange(16.0).view(8, 2).requires_grad_()
        gather = shard_map(
            lambda s: (s, lax.all_gather_invariant(s, ("cp", "dp"), tiled=True)),
            in_specs=P(("cp", "dp")),
            out_specs=(P(("cp", "dp")), P()),
        )
        block, gathered = gather(seq)
        chunk = cp * 2 + dp
        assert block.to_local().tolist() == seq[2 * chunk : 2 * chunk + 2].tolist()
        assert gathered.full_tensor().tolist() == seq.tolist()
        (gathered.full_tensor() * torch.arange(16.0).view(8, 2)).sum().backward()
        assert seq.grad.tolist() == torch.arange(16.0).view(8, 2).tolist()

        # dict specs; the current mesh inside f is the shard_map's.
        other = meshstate.init_mesh(tp=4, cp=2)
        with other:
            out = shard_map(
                lambda d: {"i": torch.tensor([lax.axis_index(("dp", "tp"))])},
                in_specs=({"a": P("tp")},),
                out_specs={"i": P(("dp", "tp"))},
                mesh=mesh,
            )({"a": torch.zeros(4)})
        assert out["i"].full_tensor().tolist() == [0, 1, 2, 3]
        other.destroy()

        # check_vma (the default) refuses a result that varies over tp under P(), on every rank.
        unsummed = shard_map(lambda x, w: x @ w, in_specs=(P(None, "tp"), P("tp")), out_specs=P())
        with pytest.raises(VaryingAxesError, match=r"out_specs is P\(\) .* and not \{tp\}"):
            unsummed(x_full, w_full)
        with pytest.raises(AxisError, match="axis 'sp', which the mesh lacks"):
            shard_map(lambda v: v, in_specs=P("sp"), out_specs=P())(x_full)

        # reshard: tuples in and against mesh order, both directions, differentiable.
        table = torch.arange(32.0).view(8, 4)
        against = reshard(table, P(("cp", "dp"), "tp"))
        assert against.to_local().tolist() == table[2 * chunk : 2 * chunk + 2, 2 * tp : 2 * tp + 2].tolist()
        along = reshard(against, P(("dp", "cp")))
        chunk_along = dp * 2 + cp
        assert along.to_local().tolist() == table[2 * chunk_along : 2 * chunk_along + 2].tolist()
        assert reshard(along, P(None, ("tp", "cp"))).full_tensor().tolist() == table.tolist()
        source = table.clone().requires_grad_()
        reshard(reshard(source, P("tp")), P(("cp", "dp"))).full_tensor().sum().backward()
        assert source.grad.tolist() == torch.ones(8, 4).tolist()

        # Uneven: 5 rows over (dp, cp) cut as DTensor does, axis by axis: 3 | 2, then 2 | 1, 1 | 1.
        uneven = NamedSharding(mesh.dense, P(("dp", "cp")))
        assert uneven.shard_shape((5, 2)) == (2, 2)
        rows = {r: s[0] for r, s in uneven.index_map((5, 2)).items()}
        assert [(rows[r].start, rows[r].stop) for r in (0, 2, 4, 6)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
        five = torch.arange(10.0).view(5, 2)
        assert distribute(five, mesh.dense, P(("dp", "cp"))).to_local().tolist() == five[rows[rank]].tolist()
        assert reshard(five, P(("dp", "cp"))).to_local().tolist() == five[rows[rank]].tolist()
        rows_out = shard_map(lambda s: s + 1, in_specs=P(("dp", "cp")), out_specs=P(("dp", "cp")))(five)
        assert rows_out.shape == (5, 2) and rows_out.full_tensor().tolist() == (five + 1).tolist()
    mesh.destroy()


def ring(x):
    """One pipeline step: every stage hands its activation to the next (the last wraps)."""
    size = lax.axis_size(("pp",))
    return lax.ppermute(x, ("pp",), [(i, (i + 1) % size) for i in range(size)])


@pytest.mark.parametrize("check_vma", [False, True])
@distributed(world_size=8)
def test_shard_map_pipeline_ring(check_vma):
    mesh = meshstate.init_mesh(tp=2, pp=4)  # dp=1; rank = tp + 2*pp
    rank = dist.get_rank()
    stages = torch.arange(4.0).view(4, 1).repeat(1, 3).requires_grad_()  # stage i holds row i
    with mesh:
        step = shard_map(ring, in_specs=P("pp"), out_specs=P("pp"), check_vma=check_vma)
        moved = step(stages)
        assert moved.full_tensor()[:, 0].tolist() == [3.0, 0.0, 1.0, 2.0]
        (moved.full_tensor() * torch.arange(4.0).view(4, 1)).sum().backward()
        # Stage i's row went to stage i+1, weighted by i+1 (mod 4): the inverse permutation.
        assert stages.grad[:, 0].tolist() == [1.0, 2.0, 3.0, 0.0]
        if check_vma:
            with pytest.raises(VaryingAxesError, match=r"possibly varying over \{pp\}"):
                shard_map(ring, in_specs=P("pp"), out_specs=P(), check_vma=True)(stages)
        else:
            unchecked = shard_map(ring, in_specs=P("pp"), out_specs=P(), check_vma=False)
            assert math.isfinite(unchecked(stages).to_local().sum().item())
    assert rank in mesh.ranks("pp")
    mesh.destroy()


def test_a_spec_tree_that_does_not_fit_is_named_by_its_path():
    from meshstate.errors import ConfigError
    from meshstate.testing import fake_world

    with pytest.raises(ConfigError, match=r"^in_specs\[1\]\['a'\]: a spec tree holds P, None, .* not int$"):
        shard_map(lambda x, y: x, in_specs=(P("tp"), {"a": 3}), out_specs=P())
    with fake_world(0, 4), meshstate.init_mesh(tp=2):
        pair = shard_map(lambda x: x, in_specs=((P("tp"), P()),), out_specs=(P("tp"), P()))
        with pytest.raises(ConfigError, match=r"^in_specs\[0\] has 2 entries, the value is a tuple of 3$"):
            pair((torch.ones(4),) * 3)
        named = shard_map(lambda x: x, in_specs=({"a": P("tp")},), out_specs={"a": P("tp")})
        with pytest.raises(ConfigError, match=r"^in_specs\[0\] is a dict with keys \['a'\], the value is a dict with keys \['b'\]$"):
            named({"b": torch.ones(4)})
        assert named({"a": torch.arange(4.0)})["a"].to_local().tolist() == [0.0, 1.0]
