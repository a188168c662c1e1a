"""JAX's varying-axis types inside shard_map, and the gradients they pick.

The rules are JAX's (shard_map with check_vma=True, its default): a value varies over the mesh axes its in-spec names, constants and
closed-over values over none; an op gives the union of its operands' axes,
casting the less varying up with pvary; psum/pmean remove their axes,
all_gather keeps them, all_gather_invariant removes them, psum_scatter,
all_to_all and ppermute keep them, axis_index varies over its axes, and a
collective over an axis its input does not vary over pvarys it first.

Types are checked on one rank of a fake world of 8 (fake backend: collectives move no
data, types do not depend on it). Gradients taken inside the body, in both modes,
are checked on 4 ranks (``init_mesh(tp=2, cp=2)``), as gloo processes and simulated
in one process, against the values JAX gives for the same programs (x =
[1..8] split over tp, each rank's loss weighted by its tp index + 1).

``jax_records/record_vma.py`` runs the same programs in JAX (0.12.0.1, as the record's
``"jax"`` says); ``jax_records/vma.json`` keeps each value's type, each refusal's text and
every device's gradient in both modes.
"""

import json
from pathlib import Path


import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import meshstate
from meshstate import P, VaryingAxesError, shard_map, vma
from meshstate.jax import collectives as lax
from meshstate.testing import fake_world
from conftest import close, in_both_worlds

TP = frozenset({"tp"})
CP_TP = frozenset({"cp", "tp"})
NONE = frozenset()
RECORDS = json.loads((Path(__file__).parent / "jax_records" / "vma.json").read_text())


def jaxs_types(program):
    """The varying axes of each value JAX typed in ``program`` (``None`` where it refused)."""
    return {name: frozenset(typed["vma"]) if "vma" in typed else None
            for name, typed in RECORDS["types"][program].items()}


@pytest.fixture
def fake_mesh():
    with fake_world(1, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)  # dp=2
        with mesh:
            yield mesh
        mesh.destroy()


def types_inside(body, *args, in_specs=P("tp"), out_specs=P(("dp", "cp", "tp")), **options):
    """What ``body`` returns when run as a shard_map body (its result discarded)."""
    seen = []
    shard_map(lambda *blocks: seen.append(body(*blocks)) or blocks[0], in_specs=in_specs,
              out_specs=out_specs, **options)(*args)
    return seen[0]


def test_arguments_constants_and_ops(fake_mesh):
    closed_over = torch.ones(4)

    def body(x, w):
        y = x * 2
        z = x + torch.ones(4)            # a constant is cast up to x's axes
        both = x.unsqueeze(1) * w        # {tp} and {cp}: the union
        return {"x": vma(x), "w": vma(w), "constant": vma(torch.ones(3)),
                "closed over": vma(closed_over), "x * 2": vma(y), "x + constant": vma(z),
                "x and w": vma(both), "sum": vma(both.sum()), "split": vma(both.split(1)[0]),
                "max": vma(x.max(0).values)}

    types = types_inside(body, torch.zeros(8), torch.zeros(8), in_specs=(P("tp"), P("cp")),
                         out_specs=P(("dp", "cp", "tp")))
    assert types == jaxs_types("arguments, constants and ops")
    assert types["x and w"] == CP_TP


def test_in_place_ops_and_setitem_type_what_they_write(fake_mesh):
    def body(x):
        buffer = torch.zeros(4)
        before = vma(buffer)
        buffer.add_(x)
        other = torch.zeros(4)
        other[1:] = x[1:]
        total = torch.zeros(())
        total += x.sum()
        return before, vma(buffer), vma(other), vma(total)

    assert types_inside(body, torch.zeros(8)) == (NONE, TP, TP, TP)


def test_each_collective_follows_its_rule(fake_mesh):
    def body(x):
        ring = [(0, 1), (1, 0)]
        invariant = torch.ones(4)
        return {
            "psum": vma(lax.psum(x, "tp")),
            "psum of invariant": vma(lax.psum(invariant, "tp")),
            "psum over cp of tp": vma(lax.psum(x, "cp")),
            "pmean": vma(lax.pmean(x, "tp")),
            "all_gather": vma(lax.all_gather(x, "tp", tiled=True)),
            "all_gather over cp": vma(lax.all_gather(x, "cp")),
            "all_gather_invariant": vma(lax.all_gather_invariant(x, "tp", tiled=True)),
            "all_gather_invariant of invariant": vma(lax.all_gather_invariant(invariant, "tp")),
            "psum_scatter": vma(lax.psum_scatter(x, "tp", tiled=True)),
            "psum_scatter of invariant": vma(lax.psum_scatter(invariant, "cp", tiled=True)),
            "all_to_all": vma(lax.all_to_all(x, "tp", 0, 0, tiled=True)),
            "ppermute": vma(lax.ppermute(x, "tp", ring)),
            "ppermute of invariant": vma(lax.ppermute(invariant, "cp", ring)),
            "pvary": vma(lax.pvary(x, "cp")),
            "pvary joint key": vma(lax.pvary(invariant, "dp-cp")),
            "axis_index": vma(lax.axis_index(("cp", "dp"))),
            "axis_index times x": vma(x * lax.axis_index("cp")),
        }

    jaxs = jaxs_types("each collective")
    refused_by_jax = {name for name, axes in jaxs.items() if axes is None}
    assert refused_by_jax == {"pmax mixed"}  # test_a_reduction_over_an_axis_not_varied_is_refused
    assert types_inside(body, torch.zeros(8)) == {
        name: axes for name, axes in jaxs.items() if name not in refused_by_jax}


def test_axis_index_is_a_typed_tensor_inside_and_an_int_outside(fake_mesh):
    index = types_inside(lambda x: lax.axis_index(("cp", "tp")), torch.zeros(8))
    assert isinstance(index, torch.Tensor) and index.dtype == torch.int64 and index.item() == 1
    assert lax.axis_index(("cp", "tp")) == 1 and type(lax.axis_index("tp")) is int
    legacy = types_inside(lambda x: lax.axis_index("tp"), torch.zeros(8), check_vma=False)
    assert type(legacy) is int


def test_nothing_is_typed_outside_a_body_or_with_check_vma_false(fake_mesh):
    x = torch.ones(4)
    assert vma(x) == NONE and vma(lax.psum(x, "tp")) == NONE
    assert types_inside(lambda b: vma(b * 2), torch.zeros(8), check_vma=False) == NONE
    # A block leaves the body without its type; the caller's tensors never get one.
    out = shard_map(lambda b: b * 2, in_specs=P("tp"), out_specs=P("tp"))(x.repeat(2))
    assert vma(out.to_local()) == NONE and vma(x) == NONE


def test_autograd_grad_gives_each_gradient_its_inputs_type(fake_mesh):
    def body(x):
        w = torch.ones(4, requires_grad=True)
        x = x.detach().requires_grad_()
        grad_x, grad_w = torch.autograd.grad((x * w).sum(), [x, w])
        return vma(grad_x), vma(grad_w)

    assert types_inside(body, torch.zeros(8)) == (TP, NONE)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x: lax.psum(x, ("cp", "tp")),
         r"meshstate.psum can only accept axis_name which corresponds to one of varying, "
         r"unreduced, reduced or invarying state of the input. Got input type: float32\[4\]\{V:tp\}, axes: \('cp', "
         r"'tp'\) and input state: \{'invarying', 'varying'\}"),
        (lambda x: lax.pmean(x, "dp-tp"), r"meshstate.pmean can only accept axis_name.*'dp-tp'"),
        (lambda x: lax.psum_scatter(x, ("tp", "cp"), tiled=True),
         r"meshstate.psum_scatter can only accept axis_name"),
        (lambda x: lax.pvary(x, ("cp", "tp")),
         r"meshstate.pvary can only accept axis_name which corresponds to one of varying"),
        (lambda x: lax.pvary(x, "tp"),
         r"meshstate.pvary: x of type float32\[4\]\{V:tp\} already varies over \{tp\}"),
    ],
    ids=["psum", "pmean", "psum_scatter", "pvary", "pvary a varying axis"],
)
def test_refused_collectives_name_the_types(fake_mesh, call, message):
    with pytest.raises(VaryingAxesError, match=message):
        types_inside(call, torch.zeros(8))


@pytest.mark.parametrize("reduction", [lax.pmax, lax.pmin], ids=["pmax", "pmin"])
def test_a_reduction_over_an_axis_not_varied_is_refused(fake_mesh, reduction):
    jaxs = RECORDS["types"]["each collective"]["pmax mixed"]["refused"]
    assert "can only accept axis_name which corresponds to one of varying" in jaxs
    with pytest.raises(VaryingAxesError, match=rf"meshstate.{reduction.__name__} can only accept"):
        types_inside(lambda x: reduction(x, ("cp", "tp")), torch.zeros(8))


def jaxs_words(text):
    """A refusal from ``can only accept axis_name`` to ``input state:``, the op's name left out."""
    return text[text.index("can only accept axis_name"):text.index(" and input state:")]


@pytest.mark.parametrize(
    "name, call",
    [("psum", lambda x: lax.psum(x, ("cp", "tp"))),
     ("pmean", lambda x: lax.pmean(x, ("dp", "tp"))),
     ("psum_scatter", lambda x: lax.psum_scatter(x, ("tp", "cp"), tiled=True)),
     ("pvary", lambda x: lax.pvary(x, ("cp", "tp")))],
    ids=["psum", "pmean", "psum_scatter", "pvary"])
def test_refusals_say_what_jax_0_12_says(fake_mesh, name, call):
    with pytest.raises(VaryingAxesError) as refused:
        types_inside(call, torch.zeros(8))
    assert jaxs_words(RECORDS["refusals"][name]) in str(refused.value)


def test_strict_mode_refuses_a_mix_and_names_the_pvary(fake_mesh):
    with pytest.raises(VaryingAxesError, match=(
        r"torch.Tensor.add mixes operands of types float32\[4\]\{V:tp\}, float32\[4\] and "
        r"shard_map\(auto_pvary=False\) casts none; write meshstate.pvary\(operand, \('tp',\)\) "
        r"for the float32\[4\] operand"
    )):
        types_inside(lambda x: x + torch.ones(4), torch.zeros(8), auto_pvary=False)
    # Written out, the same program is accepted.
    typed = types_inside(lambda x: vma(x + lax.pvary(torch.ones(4), "tp")), torch.zeros(8),
                         auto_pvary=False)
    assert typed == TP


def test_out_specs_are_checked_against_the_types(fake_mesh):
    f = shard_map(lambda x: {"a": (x, lax.all_gather(x, "tp", tiled=True))}, in_specs=P("tp"),
                  out_specs={"a": (P("tp"), P())})
    with pytest.raises(VaryingAxesError) as refused:
        f(torch.arange(8.0))
    assert isinstance(refused.value, ValueError)
    assert str(refused.value) == (
        "shard_map applied to the function '<lambda>' was given out_specs which require "
        "replication which can't be statically inferred given the mesh of shape (1, 2, 2, 2) "
        "with axis names ('pp', 'dp', 'cp', 'tp'): out_specs['a'][1] is P() which implies that "
        "the corresponding output value is only varying across mesh axes {} and not {tp}, but "
        "it was inferred to be possibly varying over {tp}; name {tp} in that out_spec, reduce "
        "over it (psum, all_gather_invariant), or pass check_vma=False"
    )
    # all_gather_invariant (or psum) makes the same result acceptable under P().
    ok = shard_map(lambda x: lax.all_gather_invariant(x, "tp", tiled=True), in_specs=P("tp"),
                   out_specs=P())(torch.arange(8.0))
    assert ok.shape == (8,)


def test_out_spec_refusal_happens_while_tracing(fake_mesh):
    def replicated_sum(x):
        return shard_map(lambda b: b * 2, in_specs=P("tp"), out_specs=P())(x).to_local()

    torch._dynamo.reset()
    compiled = torch.compile(replicated_sum, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"out_specs which require replication.*not \{tp\}"):
        compiled(torch.arange(8.0))


def run_inside(op, check_vma, in_spec=P("tp")):
    """Each rank's gradient of its own ``sum(op(...))`` taken inside the body, x = [1..8]."""
    x = torch.arange(1.0, 9.0, dtype=torch.float64)

    def body(v):
        weight = torch.ones((), dtype=torch.float64) * (lax.axis_index("tp") + 1)
        v = v.detach().requires_grad_()
        (grad,) = torch.autograd.grad(op(v, weight).sum(), [v])
        return grad

    out = shard_map(body, in_specs=in_spec, out_specs=P(("dp", "cp", "tp")),
                    check_vma=check_vma)(x)
    return out.to_local()


RING = [(0, 1)]
INSIDE = {
    # name: op(v, weight); JAX's per-device gradients (typed: JAX's default; legacy:
    # check_vma=False) are in vma.json's "inside"
    "psum weighted after": lambda v, w: lax.psum(v, "tp") * w,
    "psum weighted before": lambda v, w: lax.psum(v * w, "tp"),
    "pmean weighted after": lambda v, w: lax.pmean(v, "tp") * w,
    "pmean weighted before": lambda v, w: lax.pmean(v * w, "tp"),
    "psum over cp of a tp block": lambda v, w: lax.psum(v * w, "cp"),
    "all_gather": lambda v, w: lax.all_gather(v, "tp", tiled=True) * w,
    "all_gather over cp": lambda v, w: lax.all_gather(v * w, "cp", tiled=True),
    "all_gather_invariant": lambda v, w: lax.all_gather_invariant(v, "tp", tiled=True) * w,
    "psum_scatter": lambda v, w: lax.psum_scatter(v, "tp", tiled=True) * w,
    "ppermute": lambda v, w: lax.ppermute(v, "tp", RING) * w,
    "all_to_all": lambda v, w: lax.all_to_all(v, "tp", 0, 0, tiled=True) * w,
}

INVARIANT = {
    # The input replicated (P()): whole on every rank, typed invariant (vma.json's "invariant").
    "pvary": lambda v, w: lax.pvary(v, "tp") * w,
    "cast up by the product": lambda v, w: v * w,
}

def jaxs_gradient(family, name, mode, mesh):
    """This rank's block of JAX's gradient (every device's, laid out over (dp, cp, tp))."""
    every = torch.tensor(RECORDS[family][name][mode], dtype=torch.float64)
    position = mesh.rank(("dp", "cp", "tp"))
    block = every.numel() // mesh.size("dp-cp-tp")
    return every.narrow(0, block * position, block)


@pytest.mark.parametrize("check_vma", [True, False], ids=["typed", "legacy"])
@in_both_worlds(4)
def test_gradients_inside_the_body_are_jaxs(check_vma):
    mesh = meshstate.init_mesh(tp=2, cp=2)
    mode = "typed" if check_vma else "legacy"
    with mesh:
        for name, op in INSIDE.items():  # legacy all_gather_invariant: JAX 0.12's sum (0.10: a slice)
            want = jaxs_gradient("inside", name, mode, mesh)
            assert close(run_inside(op, check_vma), want), name
        for name, op in INVARIANT.items():
            want = jaxs_gradient("invariant", name, mode, mesh)
            assert close(run_inside(op, check_vma, in_spec=P()), want), name
    mesh.destroy()


@in_both_worlds(4)
def test_outside_a_body_gradients_are_jaxs_default_transposes():
    """Plain code: each input is taken to vary over the axes named; pvary's backward sums."""
    mesh = meshstate.init_mesh(tp=2, cp=2)
    rank, tp = dist.get_rank(), mesh.rank("tp")
    weight = torch.ones((), dtype=torch.float64) * (tp + 1)
    with mesh:
        x = torch.full((2,), rank, dtype=torch.float64, requires_grad=True)
        (lax.pvary(x, "tp") * weight).sum().backward()
        assert close(x.grad, [3.0, 3.0])  # summed over tp: 1 + 2
        x.grad = None
        (lax.pmean(x * weight, "tp")).sum().backward()
        assert close(x.grad, torch.ones(2, dtype=torch.float64) * weight / 2)
        x.grad = None
        gathered = lax.all_gather_invariant(x, "tp", tiled=True)
        (gathered * torch.tensor([1.0, 2, 3, 4], dtype=torch.float64)).sum().backward()
        mine = torch.tensor([1.0, 2, 3, 4], dtype=torch.float64).narrow(0, 2 * tp, 2)
        assert close(x.grad, mine)  # my slice, not summed
    mesh.destroy()


@in_both_worlds(4)
def test_vma_reads_the_types_spmd_types_gave():
    """spmd_types' V, R and P vary (JAX's varying, pvary'd and unreduced values), I does not;
    named as the current mesh names its axes."""
    import spmd_types as spmd

    mesh = meshstate.init_mesh(tp=2)
    with mesh, spmd.set_current_mesh(mesh.dense):
        typed = {}
        for name, kind in [("V", spmd.V), ("R", spmd.R), ("P", spmd.P), ("I", spmd.I)]:
            typed[name] = spmd.assert_type(torch.ones(3), {"tp": kind, "dp": spmd.I})
        assert {name: vma(t) for name, t in typed.items()} == {
            "V": {"tp"}, "R": {"tp"}, "P": {"tp"}, "I": frozenset()}
        assert vma(torch.ones(3)) == frozenset()
    mesh.destroy()
