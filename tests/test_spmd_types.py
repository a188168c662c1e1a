"""meshstate under spmd_types' strict checker (torchtitan's type system), and spmd_types read by meshstate.

Each collective is typed as spmd_types' table of megatron-core mappings says, on the
axes it names, the others kept; values and gradients equal the unchecked call. A
wrong input type is refused by the checker in its own words. shard_map's blocks are
``V`` on their in-spec's axes. On 4 ranks (``init_mesh(tp=2)``, dp=2), as gloo
processes and simulated in one process; the hooks are checked numerically by
``spmd_types.rulecheck`` (its own simulated world, in this process).
"""

import hashlib
import itertools
import sys
from pathlib import Path

import pytest
import spmd_types as spmd
import spmd_types.rulecheck as rulecheck_module
import torch
from spmd_types.checker import typecheck
from spmd_types.rulecheck import RuleCheckError, rulecheck

import meshstate
from meshstate import P, VaryingAxesError, shard_map, vma
from meshstate.errors import ConfigError
from meshstate.jax import collectives as lax
from meshstate.jax import torch_calls
from meshstate.jax.types.spmd_checker import CheckedCall, TypedCollective
from conftest import in_both_worlds

V, I, R = spmd.V, spmd.I, spmd.R
STRICT = dict(strict_mode="strict", local=True)

# name, the call, the input's type on tp, the result's, whether it is differentiable
COLLECTIVES = [
    ("psum", lambda v: lax.psum(v, "tp"), V, I, True),
    ("psum of a pending sum", lambda v: lax.psum(v, "tp"), spmd.P, I, True),
    ("pmean", lambda v: lax.pmean(v, "tp"), V, I, True),
    ("pmax", lambda v: lax.pmax(v, "tp"), V, I, False),
    ("pvary", lambda v: lax.pvary(v, "tp"), I, R, True),
    ("all_gather", lambda v: lax.all_gather(v, "tp"), V, R, True),
    ("all_gather tiled", lambda v: lax.all_gather(v, "tp", axis=1, tiled=True), V, R, True),
    ("all_gather_invariant", lambda v: lax.all_gather_invariant(v, "tp", tiled=True), V, I, True),
    ("psum_scatter", lambda v: lax.psum_scatter(v, "tp", tiled=True), V, V, True),
    ("psum_scatter of a pending sum", lambda v: lax.psum_scatter(v, "tp"), spmd.P, V, True),
    ("all_to_all", lambda v: lax.all_to_all(v, "tp", 0, 1, tiled=True), V, V, True),
    ("ppermute", lambda v: lax.ppermute(v, "tp", [(0, 1), (1, 0)]), V, V, True),
]


def types_of(value, mesh, axes=("dp", "tp")):
    """``value``'s spmd_types type on each of ``axes``, by meshstate's names."""
    found = spmd.get_local_type(value)
    return {axis: found.get(spmd.MeshAxis.of(mesh.group(axis))) for axis in axes}


@in_both_worlds(4)
def test_each_collective_gives_the_tables_type_and_the_unchecked_values():
    mesh = meshstate.init_mesh(tp=2)
    tp = mesh.rank("tp")
    with mesh, spmd.set_current_mesh(mesh.dense):
        for (name, call, given, gives, differentiable), other in itertools.product(COLLECTIVES, (I, V)):
            values = torch.arange(8.0).reshape(2, 4) + 10 * tp
            x = spmd.assert_type(values.clone().requires_grad_(differentiable),
                                 {"tp": given, "dp": other})
            with typecheck(**STRICT):
                y = call(x)
            assert types_of(y, mesh) == {"tp": gives, "dp": other}, name
            plain = values.clone().requires_grad_(differentiable)
            expected = call(plain)  # the checker off: nothing typed
            assert not spmd.has_local_type(expected), name
            torch.testing.assert_close(y, expected, rtol=0, atol=0, msg=name)
            if differentiable:
                cotangent = torch.ones_like(expected) * (tp + 1)
                (grad,) = torch.autograd.grad(y, x, cotangent)
                (expected_grad,) = torch.autograd.grad(expected, plain, cotangent)
                torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0, msg=name)
        both = spmd.assert_type(torch.ones(4), {"tp": V, "dp": V})
        with typecheck(**STRICT):
            total = lax.psum(both, ("dp", "tp"))
            gathered = lax.all_gather(both, ("dp", "tp"), tiled=True)
            stacked = lax.all_gather(both, ("dp", "tp"))
            scattered = lax.psum_scatter(both, ("dp", "tp"), tiled=True)
            with pytest.raises(ConfigError, match="pass tiled=True"):
                lax.psum_scatter(both, ("dp", "tp"))
        assert [types_of(y, mesh) for y in (total, gathered, stacked, scattered)] == [
            {"tp": I, "dp": I}, {"tp": R, "dp": R}, {"tp": R, "dp": R}, {"tp": V, "dp": V}]
        assert (gathered.shape, stacked.shape, scattered.shape) == ((16,), (4, 4), (1,))
        torch.testing.assert_close(total, torch.full((4,), 4.0))
    mesh.destroy()


@in_both_worlds(4)
def test_a_wrong_input_type_is_refused_by_the_checker():
    mesh = meshstate.init_mesh(tp=2)
    wrong = [
        (lambda v: lax.psum(v, "tp"), I, "rules.all_reduce"),
        (lambda v: lax.pmax(v, "tp"), spmd.P, "rules.all_reduce"),
        (lambda v: lax.pvary(v, "tp"), V, "rules.convert"),
        (lambda v: lax.all_gather(v, "tp"), I, "rules.all_gather"),
        (lambda v: lax.all_gather_invariant(v, "tp", tiled=True), R, "rules.all_gather"),
        (lambda v: lax.psum_scatter(v, "tp", tiled=True), R, "rules.reduce_scatter"),
        (lambda v: lax.all_to_all(v, "tp", 0, 0, tiled=True), I, "rules.all_to_all"),
    ]
    with mesh, spmd.set_current_mesh(mesh.dense):
        for call, given, rule in wrong:
            x = spmd.assert_type(torch.ones(2, 4), {"tp": given, "dp": I})
            with typecheck(**STRICT), pytest.raises(spmd.SpmdTypeError) as refusal:
                call(x)
            message = str(refusal.value)
            assert message.startswith(rule) or "SPMD type mismatch on axis" in message, message
            assert f"meshstate:tp: {str(given).rsplit('.', 1)[-1]}" in message, message
    mesh.destroy()


@in_both_worlds(4)
def test_a_row_parallel_shard_map_type_checks_strictly():
    mesh = meshstate.init_mesh(tp=2)
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, generator=generator), torch.randn(4, 5, generator=generator)
    seen = []

    def row(x_block, w_block):
        seen.append([types_of(block, mesh) for block in (x_block, w_block)])
        y = lax.psum(x_block @ w_block, "tp")
        seen.append(types_of(y, mesh))
        return y

    with mesh, spmd.set_current_mesh(mesh.dense):
        typed = [spmd.assert_type(value.clone(), {"tp": I, "dp": I}) for value in (x, w)]
        with typecheck(**STRICT):
            out = shard_map(row, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())(*typed)
        assert seen == [[{"tp": V, "dp": I}] * 2, {"tp": I, "dp": I}]
        torch.testing.assert_close(out.full_tensor(), x @ w)
        with typecheck(**STRICT), pytest.raises(ConfigError, match="check_vma=False"):
            shard_map(row, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(),
                      check_vma=False)(*typed)
    mesh.destroy()


@in_both_worlds(4)
def test_a_typed_bodys_casts_and_axis_index_carry_spmd_types_types():
    """JAX casts an operand up to the others' axes (pvary) where spmd_types refuses the mix
    (an invariant value whose gradient is recorded): the checker sees the cast
    (convert(I -> R)). axis_index is V on its axes."""
    mesh = meshstate.init_mesh(tp=2)
    seen = []

    def body(x_block):
        mixed, scaled = x_block @ matrix, x_block * lax.axis_index("tp")
        seen.extend([types_of(mixed, mesh), types_of(scaled, mesh)])
        return mixed + scaled

    with mesh, spmd.set_current_mesh(mesh.dense):
        matrix = spmd.assert_type((torch.eye(4) * 2).requires_grad_(), {"tp": I, "dp": I})
        x = spmd.assert_type(torch.arange(8.0), {"tp": I, "dp": I})
        with typecheck(**STRICT):
            out = shard_map(body, in_specs=P("tp"), out_specs=P("tp"))(x)
        assert seen == [{"tp": V, "dp": I}] * 2
        tp_index = torch.tensor([0.0, 1.0]).repeat_interleave(4)
        torch.testing.assert_close(out.full_tensor(), torch.arange(8.0) * (2 + tp_index))
        out.full_tensor().sum().backward()  # the cast's backward: the gradient summed over tp
        torch.testing.assert_close(matrix.grad, torch.arange(8.0).reshape(2, 4).sum(0).expand(4, 4).T)
    mesh.destroy()


@in_both_worlds(4)
def test_a_value_spmd_types_typed_enters_a_typed_body_with_its_type():
    mesh = meshstate.init_mesh(tp=2)
    with mesh, spmd.set_current_mesh(mesh.dense):
        varying = spmd.assert_type(torch.ones(2) * (mesh.rank("tp") + 1), {"tp": V, "dp": I})
        seen = []

        def body(x):
            seen.extend([vma(varying), vma(x * varying), vma(torch.ones(2) + varying)])
            return varying

        with pytest.raises(VaryingAxesError, match=r"possibly varying over \{tp\}"):
            shard_map(body, in_specs=P("dp"), out_specs=P())(torch.zeros(4))
        assert seen == [{"tp"}, {"dp", "tp"}, {"tp"}]
        out = shard_map(body, in_specs=P("dp"), out_specs=P("tp"))(torch.zeros(4))
        torch.testing.assert_close(out.full_tensor(), torch.tensor([1.0, 1.0, 2.0, 2.0]))
    mesh.destroy()


@in_both_worlds(4)
def test_the_torchtitan_style_mlp_type_checks_strictly_and_trains_like_one_process():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import spmd_checked_mlp as example

    result = example.train(steps=2)
    assert result.output_type == {"dp": "V", "tp": "I"}
    assert result.losses[1] < result.losses[0]
    torch.testing.assert_close(result.losses, result.single_losses, rtol=0, atol=example.TOLERANCE)
    torch.testing.assert_close(result.grads, result.single_grads, rtol=0, atol=example.TOLERANCE)


def _noise(like, *key):
    """rulecheck's own fallback noise (a seeded CPU generator): its stateless PRNG needs
    ``aten::_philox_normal_``, which torch's CPU build lacks."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=like.dtype)


HOOKS = [  # each collective of the table in its form with a global reading (S(i) for V)
    ("psum", CheckedCall("sum", lambda v, on: torch_calls.sum_over(v, on, "psum")), spmd.P),
    ("pvary", CheckedCall("convert", lambda v, on: torch_calls.summed_gradient(v, on.group_name)), I),
    ("all_gather", CheckedCall("gather", lambda v, on: torch_calls.all_gather_on(v, on, 1, True),
                              dims=(1,), tiled=True), spmd.S(1)),
    ("all_gather_invariant", CheckedCall(
        "gather_invariant", lambda v, on: torch_calls.gather_invariant(v, on, 0, True), tiled=True),
     spmd.S(0)),
    ("psum_scatter", CheckedCall("scatter", lambda v, on: torch_calls.scatter(v, on, 0, True),
                                tiled=True), spmd.P),
    ("all_to_all", CheckedCall("exchange", lambda v, on: torch_calls.exchange(v, on, 0, 1, True),
                              dims=(0, 1), tiled=True), spmd.S(1)),
]


@pytest.mark.parametrize("name, call, placement", HOOKS, ids=[hook[0] for hook in HOOKS])
def test_each_hook_passes_rulecheck(name, call, placement, monkeypatch):
    monkeypatch.setattr(rulecheck_module, "_seeded_noise", _noise)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rulecheck(TypedCollective, (x, "tp", call), placements={"x": {"tp": placement}},
              mesh={"tp": 2}, local_tensor_mode=True)


def test_rulecheck_refuses_a_kernel_its_hook_does_not_describe(monkeypatch):
    monkeypatch.setattr(rulecheck_module, "_seeded_noise", _noise)
    skips_the_sum = CheckedCall("sum", lambda v, on: v.clone())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(RuleCheckError):
        rulecheck(TypedCollective, (x, "tp", skips_the_sum), placements={"x": {"tp": spmd.P}},
                  mesh={"tp": 2}, local_tensor_mode=True)


@in_both_worlds(4)
def test_vma_outside_with_mesh_reads_the_mesh_spmd_types_types_over():
    mesh = meshstate.init_mesh(tp=2)
    with spmd.set_current_mesh(mesh.dense):
        varying = spmd.assert_type(torch.ones(2) * (mesh.rank("tp") + 1), {"tp": V, "dp": I})
        assert vma(varying) == {"tp"}  # no `with mesh:`: the one live mesh of those axes
        other = meshstate.init_mesh(tp=2)  # a second grid of the same axes: no guess
        with pytest.raises(meshstate.MeshStateError, match="2 live meshes"):
            vma(varying)
        other.destroy()
    mesh.destroy()
