"""JAX programs ported line by line: JAX's own axis names on make_mesh meshes, JAX's answers.

Each program is a ``shard_map`` written the way JAX's documentation writes it
(``'i'``, ``'x'``/``'y'``, ``'batch'``/``'feats'``, ``'stages'``), and
``jax_records/record_porting.py`` is the same program in JAX (0.12.0.1, as the
record's ``"jax"`` says), whose answers ``jax_records/porting.json`` keeps: the global result, the gradient of
``sum(result ** 2)`` for each input (JAX's gradient of the whole function, one
process's), and the type (``jax.typeof``) of the values the body names. They run
on 4 ranks, as gloo processes and simulated in one process, eager (with and without
gradients); the four that once broke (``torch.func.vmap`` dropping types, ``chunk``
and checkpointed collectives under ``torch.compile``, the scaling book's ``ppermute``
of column blocks) also compiled, with no graph break, in processes and in threads, and
simulated as one graph for every rank that dynamo traces and torch's simulation runs
(AOTAutograd's ``aot_eager`` is refused there by name).
"""

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import meshstate
from meshstate import P, shard_map
from meshstate.jax import collectives as lax
from meshstate.jax.types.vma import type_text

from meshstate.testing import simulated_world

from conftest import close, compiled_whole, dynamo_graph_as_it_is, in_both_worlds, in_processes_and_threads

RECORDS = json.loads((Path(__file__).parent / "jax_records" / "porting.json").read_text())


def inputs(*shapes):
    """``arange(1, n + 1) / n`` in each shape, float64: what the JAX side builds."""
    made = []
    for shape in shapes:
        n = torch.Size(shape).numel()
        made.append(torch.arange(1, n + 1, dtype=torch.float64).reshape(shape) / n)
    return made


def note(types, *values):
    """Keep each value's type as JAX prints it (eager runs; ``types`` is None compiled)."""
    if types is not None:
        types.extend(type_text(v) if isinstance(v, torch.Tensor) else str(v) for v in values)


def ring(types):
    def body(x):
        n = lax.psum(1, "i")
        y = lax.ppermute(x, axis_name="i", perm=[(j, (j + 1) % 4) for j in range(4)])
        z = y * (lax.axis_index("i") + 1)
        mean = lax.psum(z, "i") / n
        note(types, y, z, mean, n)
        return z + mean
    return (4,), ("i",), body, (P("i"),), P("i"), inputs((8,))


def matmul(types):
    def body(a, b):
        partial_product = a @ b
        total = lax.psum(partial_product, "y")
        note(types, a, b, partial_product, total)
        return total
    return (2, 2), ("x", "y"), body, (P("x", "y"), P("y", None)), P("x", None), inputs((4, 4), (4, 3))


def mlp(types):
    def body(x, w1, w2):
        hidden = torch.tanh(x @ w1)
        y = lax.psum(hidden @ w2, "feats")
        loss = lax.psum((y ** 2).sum(), "batch")
        note(types, hidden, y, loss)
        return loss
    return ((2, 2), ("batch", "feats"), body, (P("batch", None), P(None, "feats"), P("feats", None)),
            P(), inputs((4, 3), (3, 4), (4, 2)))


STAGES, MICROBATCHES, BATCH, FEATURES = 4, 4, 2, 3


def pipeline(types):
    def layer(w, x):
        return torch.tanh(x @ w)

    def body(w, xs):
        stage = lax.axis_index("stages")
        state = torch.zeros(1, BATCH, FEATURES, dtype=xs.dtype)
        outs = []
        for i in range(MICROBATCHES + STAGES - 1):
            if i < MICROBATCHES:
                state = torch.where(stage == 0, xs[i].unsqueeze(0), state)
            state = torch.func.vmap(layer)(w, state)
            if i == 0:
                note(types, state)
            outs.append(state[0])
            state = lax.ppermute(state, "stages", [(j, (j + 1) % STAGES) for j in range(STAGES)])
        ys = torch.stack(outs[STAGES - 1:])
        ys = torch.where(stage == STAGES - 1, ys, torch.zeros_like(ys))
        total = lax.psum(ys, "stages")
        note(types, total)
        return total
    return ((4,), ("stages",), body, (P("stages"), P()), P(),
            inputs((STAGES, FEATURES, FEATURES), (MICROBATCHES, BATCH, FEATURES)))


def halves(types):
    def body(x):
        first, second = x.chunk(2)
        swapped = torch.cat([second * 2, first])
        note(types, first, swapped)
        return swapped
    return (2, 2), ("x", "y"), body, (P("x"),), P("x"), inputs((8, 2))


def remat(types):
    def body(a, b):
        summed = checkpoint(lambda p, q: lax.psum(torch.tanh(p @ q), "y"), a, b,
                            use_reentrant=False)
        scattered = checkpoint(
            lambda p, q: lax.psum_scatter(torch.tanh(p @ q), "y", scatter_dimension=0, tiled=True),
            a, b, use_reentrant=False,
        )
        note(types, summed, scattered)
        return summed + lax.all_gather_invariant(scattered, "y", axis=0, tiled=True)
    return (2, 2), ("x", "y"), body, (P(None, "y"), P("y", None)), P(), inputs((4, 4), (4, 4))


def collective_matmul(types):
    """The scaling book's collective matmul (its blocks are column blocks: strided)."""
    def body(lhs, rhs):
        n, index, chunk = lax.axis_size("tp"), lax.axis_index("tp"), lhs.shape[1]

        def rows_of(i):  # JAX's dynamic_slice_in_dim
            return rhs.index_select(0, (index + i) % n * chunk + torch.arange(chunk))

        accum = lhs @ rows_of(0)
        for i in range(1, n):
            lhs = lax.ppermute(lhs, "tp", [(j, (j - 1) % n) for j in range(n)])
            accum = accum + lhs @ rows_of(i)
        mean = lax.pmean(accum[:1], ("dp", "tp"))
        note(types, accum, mean)
        return accum + mean
    return ((2, 2), ("dp", "tp"), body, (P("dp", "tp"), P(None, "tp")), P("dp", "tp"),
            inputs((4, 8), (8, 6)))


PROGRAMS = {"ring": ring, "matmul": matmul, "mlp": mlp, "pipeline": pipeline,
            "halves": halves, "remat": remat, "collective_matmul": collective_matmul}


def run(name, *, compiled=False, compiler=compiled_whole):
    """The program's global result, each input's gradient of ``sum(result ** 2)`` and the
    types its body noted (eager only); ``compiler`` compiles it where ``compiled``."""
    types = None if compiled else []
    shape, names, body, in_specs, out_specs, args = PROGRAMS[name](types)
    mesh = meshstate.make_mesh(shape, names)
    mapped = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    leaves = [arg.clone().requires_grad_() for arg in args]

    def loss_of(*xs):
        whole = mapped(*xs).full_tensor()
        return whole, (whole ** 2).sum()

    graphs = []
    if compiled:
        loss_of = compiler(loss_of, graphs)
    whole, loss = loss_of(*leaves)
    loss.backward()
    assert len(graphs) == compiled, (name, graphs)
    mesh.destroy()
    return whole, [leaf.grad for leaf in leaves], types


def check(name, whole, grads, types):
    record = RECORDS[name]
    assert close(whole, record["result"]), name
    for number, (got, want) in enumerate(zip(grads, record["grads"], strict=True)):
        assert close(got, want), (name, number)
    if types is not None:
        assert types == record["types"], name


def forward_only(name):
    """The program's global result with no gradient asked (the eager calls: the scaling
    book's program met "Tensors must be contiguous" there, on its column blocks)."""
    shape, names, body, in_specs, out_specs, args = PROGRAMS[name](None)
    mesh = meshstate.make_mesh(shape, names)
    with torch.no_grad():
        whole = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args).full_tensor()
    mesh.destroy()
    return whole


@in_both_worlds(4)
def test_jax_documentation_programs_equal_jax():
    for name in PROGRAMS:
        check(name, *run(name))
        assert close(forward_only(name), RECORDS[name]["result"]), name


COMPILED = ["pipeline", "halves", "remat", "collective_matmul"]


@pytest.mark.parametrize("name", COMPILED)
@in_processes_and_threads(4)
def test_compiled_with_no_graph_break_equal_jax(name):
    check(name, *run(name, compiled=True))


@in_both_worlds(4, ("simulated",))
def test_compiled_in_the_simulated_world_is_one_graph_for_every_rank():
    """Simulated, dynamo traces one graph that carries no rank (a rank's block and index are
    read when it runs), which torch's simulation runs for every rank: JAX's values and
    gradients, dynamo's graph run as it is."""
    for name in COMPILED:
        check(name, *run(name, compiled=True, compiler=dynamo_graph_as_it_is))


def compiled_check(name):
    check(name, *run(name, compiled=True))


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_through_aot_autograd_in_the_simulated_world_is_refused_by_name(name):
    """AOTAutograd (``aot_eager``) meets torch's simulated tensors beside the block index the
    graph reads when it runs."""
    with pytest.raises(meshstate.SimulationError,
                       match="which its backend could not compile over torch's simulated tensors"):
        simulated_world(4).run(compiled_check, name)
