"""One compile for every rank: ``meshstate.compile_on_one_rank``.

A step of a 4-axis layout (``tp-cp-ep-dp-pp``, tp=2 cp=2 dp=1 pp=2 on 8 gloo ranks) with
a typed ``shard_map`` (blocks over cp and tp, ``axis_index``, ``psum``), a DTensor
gathered whole, ``axis_index`` and ``pmean`` in plain code: traced and compiled by one
rank, loaded by the others, each rank's loss and gradients equal to its own eager run,
bit for bit; one graph traced in the whole world, not 8. Threads, where the ranks share one
process and so cannot share group names, compile a graph each. What a graph cannot carry
(``ppermute``'s per-rank split sizes) is refused on every rank by name.
"""

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import P, axis_index, pmean, ppermute, psum, shard_map
from meshstate.core import compat
from meshstate.testing import distributed, simulated_world
from meshstate.testing.torch_internals import graphs_traced


def step(x, w1, w2):
    def body(x, w1, w2):
        h = torch.tanh(x @ w1) * (axis_index("cp") + 1)
        return psum(h @ w2, "tp")

    y = shard_map(body, in_specs=(P("cp", None), P(None, "tp"), P("tp", None)),
                  out_specs=P("cp", None))(x, w1, w2)
    loss = (y.full_tensor() ** 2).mean() * (axis_index("pp") + 1)
    return pmean(loss, ("cp", "dp"))


def loss_and_gradients(function, x, w1, w2):
    w1.grad = w2.grad = None
    loss = function(x, w1, w2)
    loss.backward()
    return [loss.detach(), w1.grad, w2.grad]


def compiled_once_equals_eager():
    mesh = meshstate.init_mesh("tp-cp-ep-dp-pp", tp=2, cp=2, pp=2)
    with mesh:
        torch.manual_seed(mesh.rank("pp"))  # each stage its own data
        x = torch.randn(8, 6)
        w1, w2 = torch.randn(6, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
        eager = loss_and_gradients(step, x, w1, w2)
        traced_before = graphs_traced()
        compiled = meshstate.compile_on_one_rank(step, (x, w1, w2), backend="aot_eager")
        for _ in range(2):
            got = loss_and_gradients(compiled, x, w1, w2)
            assert all(torch.equal(a, b) for a, b in zip(got, eager)), (got, eager)
    mesh.destroy()
    return graphs_traced() - traced_before


@distributed(world_size=8)
def test_a_step_traced_on_one_rank_gives_every_rank_its_own_values():
    traced = compiled_once_equals_eager()
    counts = [None] * 8
    dist.all_gather_object(counts, traced)
    assert counts == [1, 0, 0, 0, 0, 0, 0, 0]


@distributed(world_size=8, threads=True)
def test_in_threads_each_rank_compiles_its_own_and_gets_its_values():
    compiled_once_equals_eager()


@distributed(world_size=4)
def test_what_a_graph_for_every_rank_cannot_carry_is_refused_on_every_rank():
    with meshstate.init_mesh(tp=2) as mesh:
        x = torch.ones(2, 3)
        swap = lambda x: ppermute(x, "tp", [(0, 1), (1, 0)])  # noqa: E731
        mine = "compile_on_one_rank: ppermute cannot be in a graph every rank runs"
        theirs = "compile_on_one_rank: rank 1 could not compile .*: ppermute cannot be"
        with pytest.raises(meshstate.MeshStateError, match=mine if dist.get_rank() == 1 else theirs):
            meshstate.compile_on_one_rank(swap, (x,), backend="aot_eager", rank=1)
        # the world goes on: the next compile for every rank works
        compiled = meshstate.compile_on_one_rank(lambda x: psum(x, "tp"), (x,), backend="aot_eager")
        assert torch.equal(compiled(x), psum(x, "tp"))
    mesh.destroy()


@distributed(world_size=4)
def test_groups_have_one_name_on_every_rank_for_traced_graphs_until_destroyed():
    for _ in range(2):  # and again after a destroy
        mesh = meshstate.init_mesh(tp=2)
        names = [None] * 4
        dist.all_gather_object(names, (mesh.ordered("tp").group_name, mesh.group("tp").group_name))
        assert len({traced for traced, _ in names}) == 1  # one name, every rank's own group
        assert len({own for _, own in names}) == 2  # torch's names: one per group
        traced = names[0][0]
        assert compat.group_named(traced) is mesh.group("tp")
        assert mesh["tp"]._dim_group_names == [traced]  # what DTensor's traced calls take
        mesh.destroy()
        with pytest.raises(RuntimeError, match="Could not resolve"):
            compat.group_named(traced)


@distributed(world_size=2)
def test_bad_arguments_are_refused_before_anything_compiles():
    with meshstate.init_mesh(tp=2):
        x = torch.ones(2)
        with pytest.raises(meshstate.ArgumentTypeError, match=r"rank must be a rank of the world \(0 to 1\), got 2"):
            meshstate.compile_on_one_rank(torch.sin, (x,), rank=2)
        with pytest.raises(meshstate.ArgumentTypeError, match="args must be a tuple of example arguments, got Tensor"):
            meshstate.compile_on_one_rank(torch.sin, x)
        with pytest.raises(meshstate.ArgumentTypeError, match="function must be callable, got 3"):
            meshstate.compile_on_one_rank(3, (x,))


def test_a_simulated_world_refuses_it_by_name():
    def body():
        with meshstate.init_mesh(tp=2):
            meshstate.compile_on_one_rank(torch.sin, (torch.ones(2),))

    with pytest.raises(meshstate.SimulationError, match=r"compile_on_one_rank\(\) cannot run in a simulated world"):
        simulated_world(4).run(body)


@distributed(world_size=4)
def test_under_torchs_own_flag_a_traced_axis_index_is_read_when_the_graph_runs():
    from meshstate.core.compat import _one_rank_config

    graphs = []

    def recording(graph, example_inputs):
        graphs.append(graph.code)
        return graph.forward

    with meshstate.init_mesh(tp=2) as mesh, _one_rank_config().patch(compile_on_one_rank=True):
        scaled = torch.compile(lambda x: x * axis_index("tp"), fullgraph=True, backend=recording)
        assert torch.equal(scaled(torch.ones(2)), torch.full((2,), float(mesh.rank("tp"))))
    mesh.destroy()
    assert "meshstate.index_in_group" in graphs[0]
