"""JAX's Explicit axes for DTensor code, against JAX 0.12.0.1's own answers.

Each program of ``jax_records/explicit_programs.py`` runs here in
``meshstate.explicit()`` on 8 ranks (``init_mesh(tp=4)``: ``(pp, dp, cp, tp) =
(1, 2, 1, 4)``), in processes and simulated, and is compared with what JAX gave
(``jax_records/explicit.json``, recorded by ``record_explicit.py``): the type
string, or the refusal and its text; the global value; each rank's shard.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import meshstate
from meshstate import P
from meshstate.testing import distributed, fake_world, simulated_world
from conftest import compiled_whole, in_both_worlds, in_processes_and_threads

_HERE = Path(__file__).parent / "jax_records"
_spec = importlib.util.spec_from_file_location("explicit_programs", _HERE / "explicit_programs.py")
programs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(programs)
RECORDS = json.loads((_HERE / "explicit.json").read_text())


def inputs():
    """The programs' inputs, built as the JAX side builds them."""
    made = {}
    for number, (name, (shape, dtype)) in enumerate(programs.INPUTS.items()):
        size = 1
        for n in shape:
            size *= n
        if dtype == "int32":
            made[name] = torch.tensor(programs.int_values(number, size), dtype=torch.int32)
        else:
            made[name] = torch.tensor(programs.input_values(number, size), dtype=torch.float32)
        made[name] = made[name].reshape(shape)
    return made


def namespace(values):
    """What the programs call, in meshstate's and torch's words, and the inputs ``values``."""
    return {
        **values,
        "S": lambda *dims, unreduced=(): P(*dims, unreduced=unreduced),
        "put": meshstate.device_put,
        "reshard": meshstate.reshard,
        "matmul": lambda a, b, out=None: meshstate.matmul(a, b, out_sharding=out),
        "einsum": lambda eq, *xs, out=None: meshstate.einsum(eq, *xs, out_sharding=out),
        "sum": lambda a, dims, keepdim=False: torch.sum(a, dims, keepdim=keepdim),
        "mean": lambda a, dims, keepdim=False: torch.mean(a, dims, keepdim=keepdim),
        "amax": lambda a, dims, keepdim=False: torch.amax(a, dims, keepdim=keepdim),
        "sin": torch.sin, "exp": torch.exp, "tanh": torch.tanh, "maximum": torch.maximum,
        "gelu": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "permute": torch.permute, "unsqueeze": torch.unsqueeze, "cat": torch.cat,
        "cast": lambda a, name: a.to(getattr(torch, name)),
        "auto": lambda f, out: meshstate.auto_axes(f, out_sharding=out),
        "explicit": lambda f, into: meshstate.explicit_axes(f, in_sharding=into),
    }


def run_program(name, values):
    """``(result, None)`` or ``(None, the refusal)`` of program ``name`` on ``values``."""
    scope = namespace(values)
    try:
        with meshstate.explicit():
            exec(programs.PROGRAMS[name], scope)
    except meshstate.ShardingTypeError as refusal:
        return None, refusal
    return scope["out"], None


def disagreement(name, rank, values):
    """How program ``name`` differs from JAX's record on ``rank`` ('' where it agrees)."""
    record = RECORDS[name]
    out, refusal = run_program(name, values)
    if "error" in record:
        if refusal is None:
            return f"ran ({meshstate.typeof(out)}) where JAX raised {record['error']}"
        wanted = record["message"].split(". ")[0]
        return "" if str(refusal).startswith(wanted) else f"said {refusal!s} where JAX said {wanted}"
    if refusal is not None:
        return f"refused: {refusal}"
    if str(meshstate.typeof(out)) != record["type"]:
        return f"typed {meshstate.typeof(out)} where JAX typed {record['type']}"
    local = out.to_local().float()
    ranks = range(torch.distributed.get_world_size())
    if "locals" in record:
        every = torch.stack([torch.tensor(record["locals"][str(r)]) for r in ranks])
        return "" if torch.allclose(local, every[rank], atol=1e-5) else "a rank's shard differs"
    whole = torch.tensor(record["value"], dtype=torch.float32)
    if not torch.allclose(out.full_tensor().float(), whole, atol=1e-5):
        return "global value differs"
    every = torch.stack([whole[tuple(slice(*bounds) for bounds in record["index"][str(r)])]
                         for r in ranks])
    return "" if torch.allclose(local, every[rank], atol=1e-5) else "a rank's shard differs"


@in_both_worlds(8)
def test_every_program_types_and_runs_as_jax():
    mesh = meshstate.init_mesh(tp=4)
    meshstate.set_mesh(mesh)
    rank, values = torch.distributed.get_rank(), inputs()
    found = {name: disagreement(name, rank, values) for name in programs.PROGRAMS}
    mesh.destroy()
    assert {name: text for name, text in found.items() if text} == {}


COMMUNICATING = {
    # the program asked: reshard, out_sharding, auto_axes
    "reshard_moves", "reshard_all_reduces", "reshard_reduce_scatters", "matmul_out_replicated",
    "matmul_out_reduce_scattered", "matmul_out_all_replicated", "einsum_out", "auto_axes",
    "auto_axes_then_typed", "explicit_axes_inside_auto",
    # a reduction over a split dim, which JAX reduces at once
    "sum_split_dim", "sum_all", "sum_keepdim", "sum_joint", "sum_method", "mean_split_dim",
    "mean_all", "amax_split_dim", "amax_keepdim", "unreduced_sum",
    # JAX moves the data itself: a contracting dim split on one side is gathered, a merge
    # of split dims is an all-to-all, rows move along a split dim that is cut or joined
    "matmul_contracting_lhs_only", "matmul_contracting_rhs_only", "reshape_merge_split_dims",
    "reshape_round_trip", "cat_split_dim", "slice_split_dim", "slice_split_dim_offset",
}


def test_nothing_communicates_that_the_program_did_not_ask_for():
    from torch.distributed.tensor.debug import CommDebugMode

    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=4)
        meshstate.set_mesh(mesh)
        values, counted = inputs(), {}
        for name, source in programs.PROGRAMS.items():
            if "error" in RECORDS[name]:
                continue
            with CommDebugMode() as comms:
                run_program(name, values)
            counted[name] = comms.get_total_counts()
        mesh.destroy()
    assert {name for name, count in counted.items() if count} == COMMUNICATING


def mlp_steps(compiled):
    """Three SGD steps of a two-layer MLP in explicit style: the batch split on dp, the
    weights on tp, the second matmul a pending sum over tp that reshard reduces. Each
    step's loss and weights, whole, and the graphs compiled (none eagerly)."""
    torch.manual_seed(0)
    batch, target = torch.randn(8, 16), torch.randn(8, 16)
    first, second = torch.randn(16, 32) * 0.3, torch.randn(32, 16) * 0.3
    graphs, history = [], []

    def loss_of(x, y, w1, w2):
        hidden = torch.nn.functional.gelu(meshstate.matmul(x, w1, out_sharding=P("dp", "tp")))
        pending = meshstate.matmul(hidden, w2, out_sharding=P("dp", None, unreduced={"tp"}))
        return ((meshstate.reshard(pending, P("dp", None)) - y) ** 2).mean()

    step = compiled_whole(loss_of, graphs) if compiled else loss_of
    with meshstate.explicit():
        x, y = meshstate.device_put(batch, P("dp", None)), meshstate.device_put(target, P("dp", None))
        w1 = meshstate.device_put(first, P(None, "tp")).requires_grad_()
        w2 = meshstate.device_put(second, P("tp", None)).requires_grad_()
        for _ in range(3):
            loss = step(x, y, w1, w2)
            loss.backward()
            assert str(meshstate.typeof(w1.grad)) == "float32[16,32@tp]"
            with torch.no_grad():
                w1 -= 0.1 * w1.grad
                w2 -= 0.1 * w2.grad
            w1.grad = w2.grad = None
            history.append([loss.full_tensor(), w1.full_tensor(), w2.full_tensor()])
    return history, graphs


def one_process_steps():
    torch.manual_seed(0)
    batch, target = torch.randn(8, 16), torch.randn(8, 16)
    w1 = (torch.randn(16, 32) * 0.3).requires_grad_()
    w2 = (torch.randn(32, 16) * 0.3).requires_grad_()
    history = []
    for _ in range(3):
        loss = ((torch.nn.functional.gelu(batch @ w1) @ w2 - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            w1 -= 0.1 * w1.grad
            w2 -= 0.1 * w2.grad
        w1.grad = w2.grad = None
        history.append([loss.detach(), w1.detach().clone(), w2.detach().clone()])
    return history


def trains_like_one_process(compiled):
    # JAX's own kind of mesh, two axes: DTensor's sharding propagation, which runs the
    # recorded ops the first time, enumerates every mesh dim's strategies (0.3 s an op on
    # init_mesh's four dims, in each of 8 processes).
    mesh = meshstate.make_mesh((2, 4), ("dp", "tp"))
    meshstate.set_mesh(mesh)
    history, graphs = mlp_steps(compiled)
    mesh.destroy()
    assert len(graphs) == compiled
    for got, want in zip(history, one_process_steps(), strict=True):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


@in_both_worlds(8)
def test_an_explicit_mlp_trains_like_one_process():
    trains_like_one_process(compiled=False)


@in_processes_and_threads(8)
def test_an_explicit_mlp_trains_like_one_process_compiled():
    trains_like_one_process(compiled=True)


def several_typed_ops(x, y, b, w):
    """One of each kind of typed op, in one function."""
    z = torch.sin(x) * 2.0 + y + b                                   # elementwise, broadcast
    u = meshstate.matmul(z, w, out_sharding=P("dp", None, unreduced={"tp"}))
    v = meshstate.reshard(u, P("dp", "tp"))                          # a reduce-scatter
    merged = z.reshape(128).reshape(8, 16)                           # an all-to-all, then split
    back = meshstate.reshard(merged, P("dp", "tp"))
    picked = torch.cat([z[:, 0:8], back[:, 8:16]], 1).T              # slices, cat, transpose
    return v.sum(0) + torch.unsqueeze(picked.sum(1), 0).mean(), picked


def test_typed_ops_compile_whole_with_eagers_values():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=4)
        meshstate.set_mesh(mesh)
        values, graphs = inputs(), []
        with meshstate.explicit():
            x, y = (meshstate.device_put(values[n], P("dp", "tp")) for n in "xy")
            b, w = meshstate.device_put(values["b"], P("tp")), meshstate.device_put(values["w"], P("tp", None))
            eager = several_typed_ops(x, y, b, w)
            traced = compiled_whole(several_typed_ops, graphs)(x, y, b, w)
            assert [str(meshstate.typeof(t)) for t in traced] == ["float32[4@tp]", "float32[16@tp,8@dp]"]
            for fullgraph, raised in [(False, meshstate.ShardingTypeError), (True, Exception)]:
                with pytest.raises(raised, match="Contracting dimensions are sharded"):
                    torch.compile(lambda p, q: p @ q, fullgraph=fullgraph, backend="aot_eager")(x, w)
        mesh.destroy()
    assert len(graphs) == 1
    assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(eager, traced))


def test_a_mesh_built_again_gets_its_own_values():
    """An op the fast table knows, after its mesh is destroyed and an equal one built."""
    with fake_world(1, 8):
        views = []
        for _ in range(2):
            mesh = meshstate.init_mesh(tp=4)
            with meshstate.explicit(mesh):
                x = meshstate.device_put(torch.ones(8, 16), P("dp", "tp"), mesh)
                results = [x + x for _ in range(3)]
            views.append(mesh.dense)
            assert all(r.device_mesh is mesh.dense for r in results)
            mesh.destroy()
        assert views[0] is not views[1]


def test_misuse_is_refused_by_name():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=4)
        with meshstate.explicit(mesh):
            x = meshstate.device_put(torch.ones(8, 16), P("dp", "tp"), mesh)
            with pytest.raises(meshstate.ShardingTypeError, match=r"torch.cumsum on an explicitly sharded value.*auto_axes"):
                torch.cumsum(x, 0)
            with pytest.raises(meshstate.ArgumentTypeError, match="device_put.spec=.... takes a P"):
                meshstate.device_put(torch.ones(8), "dp")
            with pytest.raises(meshstate.ShardingTypeError, match="einsum of 3 operands"):
                meshstate.einsum("ij,jk,kl->il", x, x.T, x)
            assert meshstate.device_put(torch.ones(8), P("dp")).device_mesh is mesh.dense  # its mesh is current
            y = meshstate.auto_axes(torch.cumsum, out_sharding=P("dp", "tp"))(x, 0)
            assert str(meshstate.typeof(y)) == "float32[8@dp,16@tp]"
        with pytest.raises(meshstate.WrongMeshError):
            with meshstate.explicit(mesh.dense):
                pass
        mesh.destroy()


def aten_graphs(fn, graphs):
    """``fn`` compiled (``fullgraph=True``), each forward graph AOTAutograd makes (aten ops on
    the local tensors, DTensor's own work written out) appended to ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def forward(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=lambda gm, example_inputs: aot_module_simplified(
        gm, example_inputs, fw_compiler=forward))


def test_a_compiled_typed_op_is_the_dtensor_ops_graph():
    """Where JAX's layout is DTensor's, the rules leave nothing in the graph."""
    def step(x, y, a, w):
        return torch.nn.functional.gelu(torch.sin(x) * 2.0 + y), (a @ w).t()

    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=4)
        values, typed, plain = inputs(), [], []
        x, y = (meshstate.device_put(values[n], P("dp", "tp"), mesh) for n in "xy")
        a, w = meshstate.device_put(values["x"], P("dp", None), mesh), meshstate.device_put(values["w"], P(None, "tp"), mesh)
        with meshstate.explicit(mesh):
            aten_graphs(step, typed)(x, y, a, w)
        aten_graphs(step, plain)(x, y, a, w)
        mesh.destroy()
    ops = [[str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
           for graph in (*typed, *plain)]
    assert len(ops) == 2 and ops[0] == ops[1] and "aten.mm.default" in ops[0]


@in_both_worlds(8)
def test_max_and_min_over_every_dim_are_typed_and_by_a_dim_refused():
    mesh = meshstate.init_mesh(tp=4)
    with meshstate.explicit(mesh):
        x = meshstate.device_put(inputs()["x"], P("dp", "tp"))
        for whole, values in [(x.max(), torch.amax(x, (0, 1))), (torch.min(x), torch.amin(x, (0, 1)))]:
            assert str(meshstate.typeof(whole)) == "float32[]"
            assert torch.equal(whole.full_tensor(), values.full_tensor())
        with pytest.raises(meshstate.ShardingTypeError, match=r"max\(x, dim\) .* gives indices"):
            x.max(0)
    mesh.destroy()


def _explicit_slice():
    mesh = meshstate.make_mesh((2, 4), ("dp", "tp"))
    with meshstate.explicit(mesh):
        sliced = meshstate.device_put(torch.ones(8, 16), P("dp", "tp"), mesh)[:, 0:8]
    mesh.destroy()
    return str(meshstate.typeof(sliced))


def test_an_explicit_program_after_a_simulated_world_is_typed():
    """The second time: the table of typed ops, and torch's table of function names, first
    built inside a simulated world, held the world's replacements, and a slice after the
    world was refused as untyped."""
    torch.overrides._get_overridable_functions.cache_clear()  # as in a fresh process
    with simulated_world(8) as world:
        assert world.run(_explicit_slice) == ["float32[8@dp,8@tp]"] * 8
    assert torch.overrides.resolve_name(torch.Tensor.__getitem__) == "torch.Tensor.__getitem__"
    with fake_world(0, 8):
        assert _explicit_slice() == "float32[8@dp,8@tp]"


@in_both_worlds(8)
def test_autograd_grad_types_each_gradient_as_its_input():
    """JAX's cotangent carries its primal's type: ``torch.autograd.grad`` under explicit
    gives what ``.grad`` after ``backward()`` holds (DTensor's own is gathered whole)."""
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh, meshstate.explicit():
        whole = torch.arange(8.0 * 16).view(8, 16)
        x = meshstate.device_put(whole, P("dp", "tp")).requires_grad_()
        w = meshstate.device_put(torch.ones(16), P("tp")).requires_grad_()
        grad_x, grad_w = torch.autograd.grad((x * w * x).sum(), inputs=[x, w])
        (only,) = torch.autograd.grad((x * 3).sum(), x)
        assert [str(meshstate.typeof(g)) for g in (grad_x, grad_w, only)] == [
            "float32[8@dp,16@tp]", "float32[16@tp]", "float32[8@dp,16@tp]"]
        torch.testing.assert_close(grad_x.full_tensor(), 2 * whole)
        torch.testing.assert_close(grad_w.full_tensor(), (whole * whole).sum(0))
    mesh.destroy()
