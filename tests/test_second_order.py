"""Gradients of gradients through shard_map, every typed collective: each one's transpose
has a transpose of its own (JAX's: psum <-> pvary, gathering whole <-> keeping the block),
so ``torch.autograd.grad(..., create_graph=True)`` then ``grad`` again gives the
second-order gradient of the whole program, as one process computes it (what JAX gives).

On 4 ranks, ``init_mesh(tp=4)``; ``x`` of 16 values split over tp in blocks of 4.
``jax_records/record_second_order.py`` runs the programs in JAX (0.12.0.1, as the record's
``"jax"`` says) in both modes; ``jax_records/second_order.json`` keeps its second-order
gradients, each equal to one process's.
"""

import json
from pathlib import Path

import pytest
import torch

import meshstate
from meshstate import P, shard_map
from meshstate.jax import collectives as lax
from conftest import in_both_worlds

WEIGHTS = torch.arange(1.0, 17.0, dtype=torch.float64)
RECORDS = json.loads((Path(__file__).parent / "jax_records" / "second_order.json").read_text())


def gathered_cubes(x_block):
    """An invariant gather: every rank holds all of x**3 / 6."""
    return (lax.all_gather_invariant(x_block ** 3 / 6, "tp", tiled=True) * WEIGHTS).sum()


def scattered_sums(x_block):
    """Each rank's block sums x**2 over the tp blocks (psum_scatter of 4 copies)."""
    return lax.psum_scatter(torch.cat([x_block ** 2] * 4), "tp", tiled=True) ** 2


# name: (body, out_spec, the same program in one process on the whole x)
PROGRAMS = {
    "psum": (lambda b: lax.psum((b ** 3).sum() / 6, "tp"), P(), lambda x: (x ** 3).sum() / 6),
    "pvary of a replicated weight": (
        lambda b, w: lax.psum(((lax.pvary(w, "tp") * b) ** 2).sum() / 2, "tp"), P(),
        lambda x, w: ((w * x) ** 2).sum() / 2),
    "all_gather_invariant": (gathered_cubes, P(), lambda x: (x ** 3 / 6 * WEIGHTS).sum()),
    "all_gather": (
        lambda b: ((lax.all_gather(b, "tp", tiled=True) ** 3 * WEIGHTS).sum() / 6).reshape(1),
        P("tp"), lambda x: 4 * (x ** 3 * WEIGHTS).sum() / 6),
    "ppermute": (
        lambda b: lax.ppermute(b, "tp", [(i, (i + 1) % 4) for i in range(4)]) ** 3 / 6,
        P("tp"), lambda x: (torch.roll(x, 4) ** 3 / 6 * WEIGHTS).sum()),
    "psum_scatter": (scattered_sums, P("tp"),
                     lambda x: (((x.view(4, 4) ** 2).sum(0) ** 2).repeat(4) * WEIGHTS).sum()),
    "all_to_all": (
        lambda b: lax.all_to_all(b, "tp", 0, 0, tiled=True) ** 3 / 6, P("tp"),
        lambda x: (x.view(4, 4).T.flatten() ** 3 / 6 * WEIGHTS).sum()),
}


def weighted(out):
    """The loss of a program's whole result: its sum, weighted where it has 16 values."""
    return (out * WEIGHTS).sum() if out.numel() == 16 else out.sum()


def second_order(function, *inputs):
    """The gradient of (the sum of the gradients of ``function`` wrt every input) wrt each."""
    inputs = [value.clone().requires_grad_() for value in inputs]
    first = torch.autograd.grad(function(*inputs), inputs, create_graph=True)
    return torch.autograd.grad(sum(gradient.sum() for gradient in first), inputs)


CASES = [(name, check_vma) for name in PROGRAMS for check_vma in (True, False)]


def check_against_one_process_and_jax(name, check_vma):
    body, out_spec, whole = PROGRAMS[name]
    mesh = meshstate.init_mesh(tp=4)
    x = torch.linspace(-1.0, 2.0, 16, dtype=torch.float64)
    inputs = (x, torch.tensor([0.7], dtype=torch.float64))[: whole.__code__.co_argcount]
    in_specs = (P("tp"), P())[: len(inputs)]
    mapped = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)
    want = second_order(lambda *args: whole(*args), *inputs)
    got = second_order(lambda *args: weighted(mapped(*args).full_tensor()), *inputs)
    jaxs = RECORDS[name]["typed" if check_vma else "legacy"]["grads"]
    for g, w, j in zip(got, want, jaxs, strict=True):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(g, torch.tensor(j, dtype=torch.float64))
    mesh.destroy()


@pytest.mark.parametrize(("name", "check_vma"), CASES)
@in_both_worlds(4)
def test_a_gradient_of_a_gradient_equals_one_process(name, check_vma):
    check_against_one_process_and_jax(name, check_vma)

