"""In-specs read from the arguments (``Infer``) and ``smap``, against JAX 0.12's answers.

Each program of ``jax_records/record_smap_infer.py`` is run on 8 ranks
(``init_mesh(tp=2, cp=2)``, so dp=2), its arguments DTensors laid out as JAX's were: the
outputs, their types, every input's gradient and JAX's refusals must equal
``jax_records/smap_infer.json`` (made by JAX 0.12.0.1, as its ``"jax"`` says). JAX refuses
an in-spec that disagrees with its argument's Explicit type; meshstate does inside
``meshstate.explicit()``, where the refusals run.
"""

import json
import re
from pathlib import Path

import pytest
import torch

import meshstate
from meshstate import P, Infer, reshard, shard_map, smap
from meshstate.jax import collectives as lax
from conftest import close, compiled_whole, in_both_worlds, in_processes_and_threads

RECORDS = json.loads((Path(__file__).parent / "jax_records" / "smap_infer.json").read_text())
ROWS, COLUMNS, BOTH, NONE = P("dp"), P(None, "tp"), P("dp", "tp"), P()


def infer(body, in_specs, out_specs, axis_names=frozenset()):
    return lambda: shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names)


def smapped(body, **options):
    return lambda: smap(body, **options)


# name: (the mapped function, made when run; argument layouts), as in the recorder
CASES = {
    "infer: rows": (infer(lambda x: x * 2, Infer, ROWS), (ROWS,)),
    "infer: row-parallel matmul": (infer(lambda x, w: lax.psum(x @ w, "tp"), Infer, ROWS),
                                   (BOTH, P("tp", None))),
    "infer: replicated": (infer(lambda v: v + 1, Infer, NONE), (NONE,)),
    "infer: columns summed": (infer(lambda x: lax.psum(x, "tp"), Infer, NONE), (COLUMNS,)),
    "infer: two layouts": (infer(lambda x, v: x * v.sum(), Infer, BOTH), (BOTH, NONE)),
    "infer: gathered": (infer(lambda x: lax.all_gather_invariant(x, "dp", tiled=True), Infer,
                              NONE), (ROWS,)),
    "infer: partial manual over tp": (infer(lambda x, w: lax.psum(x @ w, "tp"), Infer, NONE,
                                            {"tp"}), (BOTH, P("tp", None))),
    "infer: partial manual, out_specs naming dp refused": (
        infer(lambda x, w: lax.psum(x @ w, "tp"), Infer, ROWS, {"tp"}), (BOTH, P("tp", None))),
    "infer: given and agreeing": (infer(lambda x: x * 3, (BOTH,), BOTH), (BOTH,)),
    "infer: given and disagreeing refused": (infer(lambda x: x, (COLUMNS,), COLUMNS), (BOTH,)),
    "infer: P() for a split argument refused": (infer(lambda x: x, (NONE,), NONE), (ROWS,)),
    "smap: rows": (smapped(lambda x: x * 2, in_axes=0, out_axes=0, axis_name="dp"), (ROWS,)),
    "smap: rows inferred": (smapped(lambda x: x * 2, out_axes=0, axis_name="dp"), (ROWS,)),
    "smap: columns summed": (smapped(lambda x: lax.psum(x, "tp"), in_axes=1, out_axes=None,
                                     axis_name="tp"), (COLUMNS,)),
    "smap: columns inferred, summed": (smapped(lambda x: lax.psum(x, "tp"), out_axes=None,
                                               axis_name="tp"), (BOTH,)),
    "smap: two arguments": (smapped(lambda x, w: lax.psum(x @ w, "tp"), in_axes=(1, 0),
                                    out_axes=None, axis_name="tp"), (COLUMNS, P("tp", None))),
    "smap: an unmapped argument": (smapped(lambda x, v: x * v.sum(), in_axes=(0, None),
                                           out_axes=0, axis_name="dp"), (ROWS, NONE)),
    "smap: out on another dim": (smapped(lambda x: x.T, in_axes=0, out_axes=1, axis_name="dp"),
                                 (ROWS,)),
    "smap: axis_index": (smapped(lambda x: x * (lax.axis_index("cp") + 1), in_axes=0,
                                 out_axes=0, axis_name="cp"), (P("cp"),)),
    "smap: ppermute": (smapped(lambda x: lax.ppermute(x, "dp", [(0, 1), (1, 0)]), in_axes=0,
                               out_axes=0, axis_name="dp"), (ROWS,)),
    "smap: two results": (smapped(lambda x: (x, lax.psum(x, "dp")), in_axes=0,
                                  out_axes=(0, None), axis_name="dp"), (ROWS,)),
    "smap: psum over another axis refused": (smapped(lambda x: lax.psum(x, "tp"), in_axes=0,
                                                     out_axes=0, axis_name="dp"), (ROWS,)),
    "smap: in_axes None for a split argument refused": (
        smapped(lambda x: x, in_axes=None, out_axes=None, axis_name="dp"), (ROWS,)),
}
SHAPES = {name: [torch.tensor(g).shape for g in RECORDS[name]["grads"]]
          for name in CASES if "grads" in RECORDS[name]}


def inputs_of(name):
    shapes = SHAPES.get(name, [(8, 4), (4, 3)][: len(CASES[name][1])])
    return [(torch.arange(torch.Size(shape).numel(), dtype=torch.float64) * 0.37 + number)
            .sin().view(shape) for number, shape in enumerate(shapes)]


def flat(outputs):
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def loss_of(outputs):
    total = 0
    for number, value in enumerate(outputs):
        weights = torch.arange(value.numel(), dtype=value.dtype).view(value.shape) + number + 1
        total = total + (value * weights).sum()
    return total


def run(name, graphs=None):
    """The outputs (whole), their types and the inputs' gradients (whole); compiled whole
    where ``graphs`` collects its graphs."""
    make, layouts = CASES[name]
    leaves = [x.clone().requires_grad_() for x in inputs_of(name)]
    args = [reshard(x, layout) for x, layout in zip(leaves, layouts)]
    mapped = make() if graphs is None else compiled_whole(make(), graphs)
    outputs = flat(mapped(*args))
    types = [str(meshstate.typeof(y)) for y in outputs]
    whole = [y.full_tensor() for y in outputs]
    loss_of(whole).backward()
    return whole, types, [leaf.grad for leaf in leaves]


def jax_words(refusal):
    """JAX's refusal as meshstate words it, up to where JAX prints its own set."""
    words = refusal.split(": ", 1)[1].replace("jax.", "meshstate.").split(" but:")[0]
    return re.sub(r"\(frozenset\(\{'tp'\}\)\)", "(frozenset({'tp'}))", words)


@in_both_worlds(8)
def test_smap_and_inferred_specs_are_jaxs():
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh:
        for name in CASES:
            jaxs = RECORDS[name]
            if "refused" in jaxs:
                with meshstate.explicit(mesh), pytest.raises(
                        (meshstate.UnboundAxisError, meshstate.ConfigError)) as refused:
                    run(name)
                assert jax_words(jaxs["refused"]) in str(refused.value), name
                continue
            try:
                outputs, types, grads = run(name)
            except Exception as error:
                error.add_note(f"in {name}")
                raise
            assert types == jaxs["types"], name
            for got, want in zip(outputs, jaxs["outputs"], strict=True):
                assert close(got, want), f"{name}: output"
            for got, want in zip(grads, jaxs["grads"], strict=True):
                assert close(got, want), f"{name}: gradient"
    mesh.destroy()


COMPILED = ("infer: rows", "infer: row-parallel matmul", "infer: columns summed",
            "infer: partial manual over tp", "smap: rows inferred", "smap: two arguments")
""""infer: row-parallel matmul" (DTensor arguments that need gradients, psum'd in the body
before the plan's groups are read again) failed in dynamo while a plan held the very groups
collectives hand torch as constants: "Guard failed on the same frame it was created"."""


@in_processes_and_threads(8)
def test_smap_and_inferred_specs_compiled_are_jaxs():
    """Inferred in-specs and smap compiled whole (``fullgraph=True``): one graph, JAX's
    values and gradients."""
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh:
        for name in COMPILED:
            graphs = []
            outputs, _, grads = run(name, graphs)
            assert len(graphs) == 1, name
            for got, want in zip(outputs, RECORDS[name]["outputs"], strict=True):
                assert close(got, want), f"{name}, compiled: output"
            for got, want in zip(grads, RECORDS[name]["grads"], strict=True):
                assert close(got, want), f"{name}, compiled: gradient"
    mesh.destroy()


def test_ten_programs_of_each_are_recorded():
    assert RECORDS["jax"] == "0.12.0.1" and set(RECORDS) - {"jax"} == set(CASES)
    assert sum(name.startswith("smap:") for name in CASES) >= 10
    assert sum(name.startswith("infer:") for name in CASES) >= 10
