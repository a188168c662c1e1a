"""JAX's types survive torch's transforms inside a typed shard_map body, eager and compiled.

JAX's ``vmap``, ``grad`` and ``remat`` keep every value's type (a batch dim is no
mesh axis). Here ``torch.func.vmap``, ``grad``, ``vjp`` and ``jacrev`` carry
types in and out, forward mode (``jvp``) is refused by name, an op returning
several tensors and a collective inside ``torch.utils.checkpoint`` trace under
``torch.compile(fullgraph=True)`` with eager's values and gradients, and
reentrant checkpointing recomputes with the body's types. A lost type is a
silently wrong gradient: the pipeline below once got 4 of its 6 gradients wrong.
"""

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import meshstate
from meshstate import P, VaryingAxesError, shard_map, vma
from meshstate.jax import collectives as lax
from meshstate.testing import fake_world
from conftest import close, compiled_whole, in_both_worlds

TP = frozenset({"tp"})
NONE = frozenset()


@pytest.fixture
def fake_mesh():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with mesh:
            yield mesh
        mesh.destroy()


def types_inside(body, *args, in_specs=P("tp"), out_specs=P(("dp", "cp", "tp"))):
    seen = []
    shard_map(lambda *blocks: seen.append(body(*blocks)) or blocks[0], in_specs=in_specs,
              out_specs=out_specs)(*args)
    return seen[0]


def test_vmap_carries_types_in_and_out(fake_mesh):
    def body(x, w):
        inside = []

        def scale(row, weights):
            inside.append((vma(row), vma(weights)))
            return row * weights

        y = torch.func.vmap(scale)(x, w)
        y_of_invariant = torch.func.vmap(lambda row: row * 2)(w)
        return inside[0], vma(y), vma(y_of_invariant)

    types = types_inside(body, torch.ones(8, 3), torch.ones(4, 3), in_specs=(P("tp"), P()))
    assert types == ((TP, NONE), TP, NONE)


def test_reverse_mode_transforms_carry_types_and_forward_mode_is_refused(fake_mesh):
    def body(x):
        gradient = torch.func.grad(lambda v: (v * 2).sum())(x)
        out, vjp_of = torch.func.vjp(lambda v: v * 3, x)
        (cotangent,) = vjp_of(torch.ones_like(out))
        jacobian = torch.func.jacrev(lambda v: v * 4)(x)
        return vma(gradient), vma(out), vma(cotangent), vma(jacobian)

    assert types_inside(body, torch.ones(8)) == (TP,) * 4
    with pytest.raises(VaryingAxesError, match=r"^torch.func.jvp \(and jacfwd, hessian"):
        types_inside(lambda x: torch.func.jvp(lambda v: v * 2, (x,), (torch.ones_like(x),)),
                     torch.ones(8))


def test_an_out_spec_a_vmap_result_varies_against_is_refused(fake_mesh):
    body = shard_map(lambda x: torch.func.vmap(lambda row: row * 2)(x), in_specs=P("tp"),
                     out_specs=P())
    with pytest.raises(VaryingAxesError, match=r"not \{tp\}"):
        body(torch.ones(8, 3))


STAGES, MICROBATCHES, BATCH, FEATURES = 4, 4, 2, 3


def pipeline(w, xs):
    """JAX's SPMD pipeline: stage s applies its layer to what stage s-1 passed it."""
    stage = lax.axis_index("pp")
    state = torch.zeros(1, BATCH, FEATURES, dtype=xs.dtype)
    outs = []
    for i in range(MICROBATCHES + STAGES - 1):
        if i < MICROBATCHES:
            state = torch.where(stage == 0, xs[i].unsqueeze(0), state)
        state = torch.func.vmap(lambda wi, si: torch.tanh(si @ wi))(w, state)
        outs.append(state[0])
        state = lax.ppermute(state, "pp", [(j, (j + 1) % STAGES) for j in range(STAGES)])
    ys = torch.where(stage == STAGES - 1, torch.stack(outs[STAGES - 1:]), 0.0)
    return lax.psum(ys, "pp")


@in_both_worlds(4)
def test_a_vmapped_pipeline_trains_like_one_process():
    """Eagerly; ``tests/test_porting.py`` compiles the same pipeline (fullgraph) and checks its
    values and gradients against JAX's."""
    torch.manual_seed(0)
    w = torch.randn(STAGES, FEATURES, FEATURES, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(MICROBATCHES, BATCH, FEATURES, dtype=torch.float64)
    mesh = meshstate.init_mesh(pp=STAGES)
    mapped = shard_map(pipeline, in_specs=(P("pp"), P()), out_specs=P(), mesh=mesh)
    y = mapped(w, xs).to_local()
    (y ** 2).sum().backward()
    one = w.detach().clone().requires_grad_()
    h = xs
    for stage in range(STAGES):
        h = torch.tanh(h @ one[stage])
    (h ** 2).sum().backward()
    assert close(y, h.detach()) and close(w.grad, one.grad)
    mesh.destroy()


def compiled_once_equals_eager(fn, x):
    """``fn`` compiles whole (one graph, no break) and gives eager's value."""
    graphs = []
    assert torch.equal(compiled_whole(fn, graphs)(x), fn(x)) and len(graphs) == 1


SEVERAL_RESULTS = {
    "chunk": lambda p: torch.cat(p.chunk(2)[::-1]),
    "split": lambda p: torch.cat(torch.split(p, 1)[::-1]),
    "unbind": lambda p: torch.stack(p.unbind(0)[::-1]),
    "max(dim)": lambda p: p.max(1).values.unsqueeze(1).expand_as(p),
}


@pytest.mark.parametrize("name", SEVERAL_RESULTS)
def test_ops_returning_several_tensors_compile_typed(fake_mesh, name):
    body = SEVERAL_RESULTS[name]
    mapped = shard_map(lambda p: body(p) * 2, in_specs=P("tp"), out_specs=P("tp"))
    x = torch.arange(8.0).reshape(4, 2)
    compiled_once_equals_eager(lambda a: mapped(a).to_local(), x)
    assert types_inside(lambda p: [vma(t) for t in p.chunk(2)], x) == [TP, TP]


CHECKPOINTED = {
    "psum": (lambda p, q: lax.psum(torch.tanh(p @ q), "tp"), P()),
    "psum_scatter": (lambda p, q: lax.psum_scatter(torch.tanh(p @ q), "tp", tiled=True), P("tp")),
    "all_gather": (lambda p, q: lax.all_gather(torch.tanh(p @ q), "tp", tiled=True), P("tp")),
}


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_collectives_inside_checkpoint_compile_with_eagers_values_and_gradients(
    fake_mesh, name
):
    inner, out_spec = CHECKPOINTED[name]
    mapped = shard_map(lambda a, b: checkpoint(inner, a, b, use_reentrant=False),
                       in_specs=(P(None, "tp"), P("tp", None)), out_specs=out_spec)

    def loss_of(a, b):
        return mapped(a, b).to_local().sum()

    x, w = torch.randn(4, 8), torch.randn(8, 4)
    eager = [t.clone().requires_grad_() for t in (x, w)]
    loss_of(*eager).backward()
    traced, graphs = [t.clone().requires_grad_() for t in (x, w)], []
    compiled_whole(loss_of, graphs)(*traced).backward()
    assert len(graphs) == 1
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(eager, traced))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@in_both_worlds(2)
def test_checkpoint_recomputes_with_the_bodys_types(reentrant):
    """The invariant ``b`` is cast up inside the checkpointed function; its gradient is
    summed over tp only if the recompute is typed too."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    b = torch.randn(8, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    mesh = meshstate.init_mesh(tp=2)

    def body(xb, wb, bb):
        inner = checkpoint(lambda p, q, r: torch.tanh(p @ q) * r, xb, wb, bb,
                           use_reentrant=reentrant)
        return lax.psum(inner, "tp")

    mapped = shard_map(body, in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P(), mesh=mesh)
    mapped(*leaves).to_local().sum().backward()
    one = [t.clone().requires_grad_() for t in (x, w, b)]
    sum(torch.tanh(one[0][:, 4 * t:4 * t + 4] @ one[1][4 * t:4 * t + 4]) * one[2]
        for t in range(2)).sum().backward()
    for got, want in zip(leaves, one):
        assert close(got.grad, want.grad)
    mesh.destroy()


def test_narrow_at_an_axis_index_compiles(fake_mesh):
    mapped = shard_map(lambda p: p.narrow(0, lax.axis_index("tp") * 2, 2) * 2, in_specs=P(),
                       out_specs=P("tp"))
    compiled_once_equals_eager(lambda a: mapped(a).to_local(), torch.arange(4.0))


def test_control_flow_under_compile_is_refused_by_name(fake_mesh):
    mapped = shard_map(
        lambda p: torch.cond(p.sum() > 0, lambda q: q * 2, lambda q: q * 3, (p,)),
        in_specs=P("tp"), out_specs=P("tp"),
    )
    with pytest.raises(Exception, match=r"torch.cond inside a typed shard_map body"):
        torch.compile(lambda a: mapped(a).to_local(), fullgraph=True, backend="aot_eager")(
            torch.arange(4.0))
