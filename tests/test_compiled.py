"""The JAX layer under torch.compile: one graph, no break, and the eager values and gradients.

Tracing is checked with ``torch._dynamo.explain`` on one rank of a fake world of 8
(fake backend, ``init_mesh(tp=2, cp=2)``, so dp=2): one graph and no break for
every collective over one axis, a joint key, a tuple in and against mesh order
and an undeclared tuple, in plain code and inside a typed shard_map body, and
for ``shard_map`` (in both modes, built outside the compiled function or
inside it) and ``reshard``. Values and gradients are checked on 4 gloo ranks and on 4 threads of one process
(``init_mesh(tp=2, cp=2)``, each rank's own values): the same function compiled with
``torch.compile(fullgraph=True, backend="aot_eager")`` (inductor's C++ compile
would cost minutes on two cores) and run eagerly.
"""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import meshstate
from meshstate import P, reshard, shard_map
from meshstate.jax import collectives as lax
from meshstate.testing import distributed, fake_world

from conftest import in_processes_and_threads

AXES = ["tp", "dp-cp", ("cp", "tp"), ("tp", "cp"), ("dp", "tp")]
"""One axis, a joint key, a declared tuple in and against mesh order, an undeclared tuple."""


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


COLLECTIVES = {
    "psum": lambda x, axes, n: lax.psum(x, axes),
    "pmean": lambda x, axes, n: lax.pmean(x, axes),
    "pmax": lambda x, axes, n: lax.pmax(x.detach(), axes),
    "pmin": lambda x, axes, n: lax.pmin(x.detach(), axes),
    "all_gather": lambda x, axes, n: lax.all_gather(x, axes, axis=1),
    "all_gather tiled": lambda x, axes, n: lax.all_gather(x, axes, axis=1, tiled=True),
    "psum_scatter": lambda x, axes, n: lax.psum_scatter(x, axes, tiled=True),
    "psum_scatter untiled": lambda x, axes, n: lax.psum_scatter(x[:n], axes),
    "all_to_all": lambda x, axes, n: lax.all_to_all(x, axes, 0, 1, tiled=True),
    "all_to_all untiled": lambda x, axes, n: lax.all_to_all(x[:n], axes, 0, 1),
    "ppermute": lambda x, axes, n: lax.ppermute(x, axes, ring(n)),
    # Index 0 and 1 swap, the others send and receive nothing (torch's fake backend
    # refuses a rank that receives without sending, which gloo and NCCL allow).
    "ppermute pair": lambda x, axes, n: lax.ppermute(x, axes, [(0, 1), (1, 0)]),
    "ppermute one way": lambda x, axes, n: lax.ppermute(x, axes, [(0, n - 1)]),
    "axis_index": lambda x, axes, n: x * lax.axis_index(axes),
    "pvary": lambda x, axes, n: lax.pvary(x, axes),
    "all_gather_invariant": lambda x, axes, n: lax.all_gather_invariant(x, axes, axis=1, tiled=True),
}


def every_collective(x, axes, names=tuple(COLLECTIVES)):
    """Each collective named over ``axes`` on ``x`` (shape (n*2, 3), n the axis size)."""
    n = lax.axis_size(axes)
    return {name: COLLECTIVES[name](x, axes, n) for name in names}


def loss_of(results):
    """A scalar that every differentiable result reaches, each with its own weights."""
    total = 0.0
    for number, (name, value) in enumerate(sorted(results.items())):
        if value.requires_grad:
            weights = torch.arange(value.numel(), dtype=value.dtype).view(value.shape) + number
            total = total + (value * weights).sum()
    return total


def explained(function, *args):
    torch._dynamo.reset()
    result = torch._dynamo.explain(function)(*args)
    return result.graph_count, result.graph_break_count


@pytest.fixture(scope="module")
def fake_mesh():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with mesh:
            yield mesh
        mesh.destroy()


@pytest.mark.parametrize("axes", AXES, ids=str)
@pytest.mark.parametrize("name", [name for name in COLLECTIVES if name != "ppermute one way"])
def test_each_collective_traces_as_one_graph(fake_mesh, name, axes):
    x = torch.randn(2 * lax.axis_size(axes), 3, requires_grad=True)
    with meshstate.raise_on_ppermute_sort_diff(False):  # ppermute over a tuple against mesh order
        assert explained(lambda v: every_collective(v, axes, [name])[name] * 2, x) == (1, 0)


@pytest.mark.parametrize("name", [name for name in COLLECTIVES if name != "ppermute one way"])
def test_each_collective_inside_a_typed_body_traces_as_one_graph(fake_mesh, name):
    """Inside shard_map (check_vma=True), over an axis the block varies over (tp; not for
    pvary, which refuses it) and one it does not (cp, which the rules pvary first)."""
    over = ("cp",) if name == "pvary" else ("tp", "cp")

    def body(v):
        return {axes: every_collective(v, axes, [name])[name] * 2 for axes in over}

    mapped = shard_map(body, in_specs=P(None, "tp"), out_specs=P(None, ("dp", "cp", "tp")))
    x = torch.randn(4, 2 * 2, requires_grad=True)
    assert explained(lambda v: mapped(v)["cp"].to_local() + 1, x) == (1, 0)


@pytest.mark.parametrize("check_vma", [True, False], ids=["typed", "legacy"])
def test_shard_map_and_reshard_trace_as_one_graph(fake_mesh, check_vma):
    mapped = shard_map(
        lambda a, b: {"y": lax.psum(a @ b, "tp"), "a": a},
        in_specs=(P(None, "tp"), P("tp", None)),
        out_specs={"y": P(), "a": P(None, "tp")},
        check_vma=check_vma,
    )
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    assert explained(lambda a, b: mapped(a, b)["y"].to_local() + 1, x, w) == (1, 0)
    rows = reshard(torch.arange(32.0).view(8, 4), P(("dp", "cp")))
    assert explained(lambda t: reshard(t, P(None, ("tp", "cp"))).to_local() * 2, rows) == (1, 0)
    assert explained(lambda t: reshard(t, P(("cp", "dp"), "tp")).to_local() * 2, x) == (1, 0)


def row_parallel_built_inside(a, b, check_vma=True):
    """The shard_map made inside the function (JAX's ``jit(lambda x: shard_map(f, ...)(x))``)."""
    mapped = shard_map(lambda x, w: lax.psum(x @ w, "tp"), in_specs=(P(None, "tp"), P("tp", None)),
                       out_specs=P(), check_vma=check_vma)
    return {"y": mapped(a, b).full_tensor()}


@pytest.mark.parametrize("check_vma", [True, False], ids=["typed", "legacy"])
def test_a_shard_map_built_inside_the_compiled_function_traces(fake_mesh, check_vma):
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    assert explained(lambda a, b: row_parallel_built_inside(a, b, check_vma)["y"].sum(), x, w) == (1, 0)


def collectives_in_graphs(function, *args):
    """How many of torch's functional collectives the forward and backward graphs that
    AOTAutograd makes for ``function(*args)`` hold."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    counts = []

    def count(graph_module, example_inputs):
        counts.append(sum(
            1 for node in graph_module.graph.nodes
            if node.op == "call_function" and "_c10d_functional" in str(node.target)
            and "wait_tensor" not in str(node.target)
        ))
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    compiled = torch.compile(function, fullgraph=True,
                             backend=aot_autograd(fw_compiler=count, bw_compiler=count))
    loss_of(compiled(*args)).backward()
    return counts


def test_the_types_add_no_collective_to_the_graph(fake_mesh):
    """A shard_map'd MLP (column-parallel up, gelu, row-parallel down) compiled in both
    modes: the typed graph holds no more collectives, forward and backward, than the
    legacy one."""
    def mlp(check_vma):
        mapped = shard_map(
            lambda x, up, down: lax.psum(torch.nn.functional.gelu(x @ up) @ down, "tp"),
            in_specs=(P(("dp", "cp")), P(None, "tp"), P("tp", None)), out_specs=P(("dp", "cp")),
            check_vma=check_vma)
        return lambda x, up, down: {"y": mapped(x, up, down).to_local()}

    args = [torch.randn(8, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True),
            torch.randn(6, 4, requires_grad=True)]
    typed, legacy = (collectives_in_graphs(mlp(check_vma), *args) for check_vma in (True, False))
    # [forward, backward]. Backward: three gathers of the blocks' gradients in both; typed,
    # three pvary sums where x meets up (x over tp, up over dp-cp) and h meets down, and psum's
    # transpose sends nothing; legacy, psum's transpose and the three boundary sums.
    assert typed == [1, 6] and legacy == [1, 7], (typed, legacy)


def compiled_and_eager(function, *args):
    """``function(*args)`` and its gradients, eager and compiled: two (results, grads) pairs."""
    runs = []
    for run in (function, torch.compile(function, fullgraph=True, backend="aot_eager")):
        inputs = [arg.detach().clone().requires_grad_() for arg in args]
        results = run(*inputs)
        loss_of(results).backward()
        runs.append((results, [arg.grad for arg in inputs]))
    return runs


def assert_same(eager, compiled):
    (eager_results, eager_grads), (compiled_results, compiled_grads) = eager, compiled
    assert eager_results.keys() == compiled_results.keys()
    for name in eager_results:
        torch.testing.assert_close(compiled_results[name], eager_results[name], msg=name)
    for eager_grad, compiled_grad in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)


@in_processes_and_threads(4)
def test_compiled_collectives_equal_eager_values_and_gradients():
    mesh = meshstate.init_mesh(tp=2, cp=2)
    rank = dist.get_rank()
    # one compiled function over every axis set (one trace, not one per set); ppermute over a
    # tuple against mesh order reads perm in the tuple's order (JAX 0.12 with its check off)
    with mesh, meshstate.raise_on_ppermute_sort_diff(False):
        inputs = [torch.arange(2.0 * lax.axis_size(axes) * 3).view(-1, 3) * (rank + 1) for axes in AXES]

        def over_every_axis_set(*xs):
            return {f"{axes} {name}": value for axes, x in zip(AXES, xs)
                    for name, value in every_collective(x, axes).items()}

        eager, compiled = compiled_and_eager(over_every_axis_set, *inputs)
        assert_same(eager, compiled)
    mesh.destroy()


@pytest.mark.parametrize("check_vma", [True, False], ids=["typed", "legacy"])
@in_processes_and_threads(4)
def test_compiled_shard_map_and_reshard_equal_eager(check_vma):
    mesh = meshstate.init_mesh(tp=2, cp=2)
    torch.manual_seed(0)
    x_full, w_full = torch.randn(4, 6), torch.randn(6, 3)
    mapped = shard_map(
        lambda a, b: {"y": lax.psum(a @ b, "tp"), "a": a * 2},
        in_specs=(P(None, "tp"), P("tp", None)),
        out_specs={"y": P(), "a": P(None, "tp")},
        check_vma=check_vma,
    )

    def plain(a, b):
        out = mapped(a, b)
        return {name: value.full_tensor() for name, value in out.items()}

    def from_dtensors(a, b):
        out = mapped(reshard(a, P(None, "tp")), reshard(b, P("tp", None)))
        moved = reshard(out["a"], P(("cp", "tp"), None))
        return {"y": out["y"].full_tensor(), "moved": moved.to_local(), "back": moved.full_tensor()}

    def built_inside(a, b):
        return row_parallel_built_inside(a, b, check_vma)

    def all_three(a, b):  # one compiled function (one trace, not three)
        return {f"{function.__name__} {name}": value
                for function in (plain, from_dtensors, built_inside)
                for name, value in function(a, b).items()}

    with mesh:
        eager, compiled = compiled_and_eager(all_three, x_full, w_full)
        assert_same(eager, compiled)
        torch.testing.assert_close(eager[0]["plain y"], x_full @ w_full)
    mesh.destroy()


@in_processes_and_threads(4)
def test_a_compiled_function_follows_the_current_mesh():
    """Guards, not a stale trace: under another mesh the compiled function traces again."""
    compiled = torch.compile(lambda v: lax.psum(v, "tp") * lax.axis_size("tp"), fullgraph=True,
                             backend="aot_eager")
    first = meshstate.init_mesh(tp=2)
    with first:
        assert compiled(torch.ones(1)).item() == 4.0
    first.destroy()
    second = meshstate.init_mesh(tp=4)
    with second:
        assert compiled(torch.ones(1)).item() == 16.0
    # No current mesh: the guard fails, tracing again meets meshstate's error (which
    # torch.compile(fullgraph=True) reports as its own, with meshstate's message).
    with pytest.raises(Exception, match="there is no current mesh in this thread"):
        compiled(torch.ones(1))
    second.destroy()


@distributed(world_size=8)
def test_reshard_between_tuples_gathers_once_and_prints_nothing():
    """P(("dp", "cp")) -> P("tp") used to be two DTensor all-gathers, each warning to use a
    flattened mesh; reshard gathers once over the joint dp-cp group and warns of nothing."""
    import logging
    import warnings

    mesh = meshstate.init_mesh(tp=2, cp=2)  # dp=2
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    redistribute_log = logging.getLogger("torch.distributed.tensor")
    redistribute_log.addHandler(handler)
    table = torch.arange(64.0).view(16, 4)
    try:
        with mesh, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = reshard(table, P(("dp", "cp")))
            moved = reshard(rows, P("tp"))
            back = reshard(moved, P(None, ("cp", "dp")))
    finally:
        redistribute_log.removeHandler(handler)
    rank = dist.get_rank()
    tp, cp, dp = rank % 2, rank // 2 % 2, rank // 4
    assert moved.to_local().tolist() == table[8 * tp : 8 * tp + 8].tolist()
    assert back.to_local().tolist() == table[:, cp * 2 + dp : cp * 2 + dp + 1].tolist()
    assert [str(w.message) for w in caught] == [] and records == []
    mesh.destroy()


@distributed(world_size=4)
def test_reshard_on_a_mesh_built_again_uses_its_groups():
    """The second time: an equal mesh built after a destroy has equal DeviceMeshes, so what
    reshard keeps must be told apart by mesh, not by the DeviceMesh's value."""
    table = torch.arange(32.0).view(8, 4)
    rank = dist.get_rank()
    for _ in range(2):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with mesh:
            moved = reshard(reshard(table, P(("cp", "tp"))), P("tp"))
            assert moved.to_local().tolist() == table[4 * (rank % 2) : 4 * (rank % 2) + 4].tolist()
        mesh.destroy()


def test_a_compiled_ppermute_warns_nothing(fake_mesh):
    """Tracing ppermute asks no cached function (dynamo warns once per process about an
    ``lru_cache`` it traces through, so its record of what it warned is cleared first)."""
    import warnings

    import torch._dynamo.utils

    torch._dynamo.utils.warn_once_cache.clear()
    x = torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert explained(lambda v: lax.ppermute(v, "tp", ring(2)) * 2, x) == (1, 0)
    # torch's own note on Python 3.13.0, whatever is traced, is not a warning about ppermute
    python_note = "Guards may run slower on Python 3.13.0"
    assert [str(w.message) for w in caught if not str(w.message).startswith(python_note)] == []


TYPED_OPS = {
    "F.pad": lambda a: torch.nn.functional.pad(a, (0, 2)),
    "F.tanh": torch.nn.functional.tanh,
    "F.sigmoid": torch.nn.functional.sigmoid,
    "F.hardswish": torch.nn.functional.hardswish,
    "F.hardsigmoid": torch.nn.functional.hardsigmoid,
    "F.silu": torch.nn.functional.silu,
    "F.gelu": torch.nn.functional.gelu,
    "F.layer_norm": lambda a: torch.nn.functional.layer_norm(a, (4,)),
    "F.mse_loss": lambda a: torch.nn.functional.mse_loss(a, torch.zeros_like(a)),
    ".T": lambda a: a.T,
    ".mT": lambda a: a.mT,
    ".H": lambda a: a.H,
    ".mH": lambda a: a.mH,
    "torch.chunk": lambda a: torch.chunk(a, 2, 1)[1],
    "x[:, 1:]": lambda a: a[:, 1:],
}


def test_every_op_keeps_its_type_in_a_compiled_typed_body(fake_mesh):
    """Dynamo hands some ops to no torch function mode (``F.pad``, ``F.tanh``, ``.T``...):
    their results lost their type there, and the lost type summed gradients again."""
    seen = {}

    def body(a):
        for name, op in TYPED_OPS.items():
            seen[name] = sorted(meshstate.vma(op(a)))
        return a * 2

    mapped = shard_map(body, in_specs=P("tp", None), out_specs=P("tp", None))
    torch._dynamo.reset()
    torch.compile(lambda x: mapped(x).to_local(), fullgraph=True, backend="aot_eager")(torch.ones(8, 4))
    assert seen == {name: ["tp"] for name in TYPED_OPS}


def bidirectional_matmul(lhs_block, rhs_block):
    """JAX's shard_map.md all-gather matmul, both directions: the halves of ``rhs`` go round
    the tp ring in opposite directions, padded into one matmul a step."""
    size, index = lax.axis_size("tp"), lax.axis_index("tp")
    up = [(i, (i + 1) % size) for i in range(size)]
    down = [(i, (i - 1) % size) for i in range(size)]
    half = lhs_block.shape[1] // size // 2

    def lhs_half(i, high):
        return lhs_block.index_select(1, torch.arange(half) + (2 * i + high) * half)

    def product(i_low, i_high, rhs_low, rhs_high):
        lhs = (torch.nn.functional.pad(lhs_half(i_low, 0), (0, half))
               + torch.nn.functional.pad(lhs_half(i_high, 1), (half, 0)))
        rhs = (torch.nn.functional.pad(rhs_low, (0, 0, 0, half))
               + torch.nn.functional.pad(rhs_high, (0, 0, half, 0)))
        return lhs @ rhs

    rhs_low, rhs_high = torch.chunk(rhs_block, 2, dim=0)
    out = product(index, index, rhs_low, rhs_high)
    for i in range(1, size):
        rhs_low, rhs_high = lax.ppermute(rhs_low, "tp", up), lax.ppermute(rhs_high, "tp", down)
        out += product((index - i) % size, (index + i) % size, rhs_low, rhs_high)
    return out


@in_processes_and_threads(4)
def test_the_bidirectional_all_gather_matmul_compiled_has_jaxs_gradients():
    mesh = meshstate.init_mesh(tp=4)
    generator = torch.Generator().manual_seed(0)
    lhs, rhs, cotangent = (torch.randn(*shape, dtype=torch.float64, generator=generator)
                           for shape in ((8, 16), (16, 4), (8, 4)))
    mapped = shard_map(bidirectional_matmul, in_specs=(P("tp", None), P("tp", None)),
                       out_specs=P("tp", None))

    def loss(a, b):
        return (mapped(a, b).full_tensor() * cotangent).sum()

    with mesh:
        for run in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
            a, b = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
            run(a, b).backward()
            # JAX's gradients of the program are the matmul's: ct @ rhs.T and lhs.T @ ct
            torch.testing.assert_close(a.grad, cotangent @ rhs.T)
            torch.testing.assert_close(b.grad, lhs.T @ cotangent)
    mesh.destroy()


def each_collective_twice(x):
    """Every collective whose backward depends on an argument, twice with different
    arguments, on pieces cut by chunk, split and pad."""
    n = lax.axis_size("tp")
    first, second = torch.chunk(x, 2, dim=0)
    left, right = torch.split(torch.nn.functional.pad(x, (1, 1)), [2, 3], dim=1)
    return {
        "ppermute up": lax.ppermute(first, "tp", [(i, (i + 1) % n) for i in range(n)]),
        "ppermute down": lax.ppermute(second, "tp", [(i, (i - 1) % n) for i in range(n)]),
        "all_to_all 0 1": lax.all_to_all(left, "tp", 0, 1, tiled=True),
        "all_to_all 1 0": lax.all_to_all(right[:, :2], "tp", 1, 0, tiled=True),
        "psum_scatter 0": lax.psum_scatter(first, "tp", scatter_dimension=0, tiled=True),
        "psum_scatter 1": lax.psum_scatter(left, "tp", scatter_dimension=1, tiled=True),
        "all_gather 0": lax.all_gather(second, "tp", axis=0, tiled=True),
        "all_gather 1": lax.all_gather(right, "tp", axis=1),
    }


@pytest.mark.parametrize("check_vma", [True, False], ids=["typed", "legacy"])
@in_processes_and_threads(4)
def test_each_collective_twice_with_other_arguments_compiled_equals_eager(check_vma):
    mesh = meshstate.init_mesh(tp=2, cp=2)
    rank = dist.get_rank()
    mapped = shard_map(each_collective_twice, in_specs=P(("cp", "tp")), out_specs=P(("cp", "tp")),
                       check_vma=check_vma)

    def whole(x):
        return {name: value.to_local() for name, value in mapped(x).items()}

    with mesh:
        plain = torch.arange(8.0 * 4 * 3).view(8 * 4, 3) * (rank + 1)
        eager, compiled = compiled_and_eager(each_collective_twice, plain[:8])
        assert_same(eager, compiled)
        eager, compiled = compiled_and_eager(whole, torch.arange(16.0 * 3).view(16, 3))
        assert_same(eager, compiled)
    mesh.destroy()


def test_a_compiled_function_finds_every_plan_it_makes_while_tracing(fake_mesh):
    """A compiled function's first call (no eager call before) makes a plan for each
    shard_map and reshard while tracing, after torch has read the mesh's store for the
    first: each is found, one graph (the store read once gave a KeyError for the second)."""
    fresh = meshstate.init_mesh(tp=2, cp=2)  # its store holds no plan yet
    mapped = shard_map(lambda a, b: lax.psum(a @ b, "tp"), in_specs=(P(None, "tp"), P("tp", None)),
                       out_specs=P())

    def two_plans(a, b):
        y = mapped(reshard(a, P(None, "tp")), reshard(b, P("tp", None)))
        return reshard(y, P(("cp", "tp"), None)).to_local()

    with fresh:
        args = torch.randn(4, 6, requires_grad=True), torch.randn(6, 3, requires_grad=True)
        assert explained(two_plans, *args) == (1, 0)
    fresh.destroy()


@pytest.mark.parametrize("where", ["plain code", "a typed shard_map body"])
def test_a_compiled_collective_is_not_traced_again_after_an_import(fake_mesh, monkeypatch, where):
    """Where dynamo's trace reads ``sys.modules`` (is spmd_types' checker there?), it guards
    on its size: every import after the compile traced the function again."""
    import sys
    import types

    def summed(x):
        return lax.psum(x, "tp") * 2

    function = summed if where == "plain code" else shard_map(summed, in_specs=P("tp"), out_specs=P())
    torch._dynamo.reset()
    step = torch.compile(function, backend="eager", fullgraph=True)
    step(torch.ones(4))
    monkeypatch.setitem(sys.modules, "meshstate_imported_after_the_compile",
                        types.ModuleType("meshstate_imported_after_the_compile"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(torch.ones(4))
