"""The gradient of a whole shard_map is the same in both modes, and one process's.

JAX: for every program that both ``check_vma=True`` (its default) and
``check_vma=False`` accept, ``jax.grad`` of the whole shard_map is the same;
what differs is which programs are accepted and the gradients taken inside.
Each case below is run in both modes on 8 ranks (``init_mesh(tp=2, cp=2)``, so
dp=2, and the expert view etp=2, edp=4), as gloo processes and simulated in one
process: the outputs and every input's gradient must equal a single-process
computation of the same function.
The last cases are refused by the default mode (the result varies over an axis
its out-spec leaves out) and accepted by the legacy one, as in JAX.

``jax_records/record_shard_map_modes.py`` runs each case in JAX (0.12.0.1, as the record's
``"jax"`` says) in both modes; ``jax_records/shard_map_modes.json`` keeps its outputs and
gradients, which the sharded runs must equal too. Under 0.12 the claim holds for
``all_gather_invariant`` as well (JAX 0.10.2 gave 1/(the gathered axes' size) of the
gradient with ``check_vma=False``; 0.12 wins, and meshstate follows it).
"""

import json
from pathlib import Path

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import meshstate
from meshstate import P, VaryingAxesError, reshard, shard_map
from meshstate.jax import collectives as lax
from conftest import close, in_both_worlds

RECORDS = json.loads((Path(__file__).parent / "jax_records" / "shard_map_modes.json").read_text())


@dataclass
class Case:
    body: Callable[..., Any]
    in_specs: Any
    out_specs: Any
    shapes: tuple[tuple[int, ...], ...]
    reference: Callable[..., Any] | None
    """The same function on one process: the full inputs in, full outputs out."""
    typed_refuses: bool = False
    prepare: Callable[..., Any] | None = None
    """Turns the full inputs into the arguments (DTensors, say); default: as they are."""


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


CONSTANT = torch.arange(4.0, dtype=torch.float64)


def on_tp_slice(x):
    """``x`` as a DTensor on the 1-D mesh ``mesh["tp"]``, rows split (differentiable in ``x``)."""
    tp_mesh = meshstate.current_mesh()["tp"]
    rows = x.shape[0] // tp_mesh.size()
    block = x.narrow(0, tp_mesh.get_local_rank() * rows, rows)
    return DTensor.from_local(block, tp_mesh, [Shard(0)], run_check=False)


def rows_scaled_by_block(x, blocks):
    return torch.cat([chunk * (i + 1) for i, chunk in enumerate(x.chunk(blocks))])


CASES = {
    "row-parallel matmul": Case(
        lambda x, w: lax.psum(x @ w, "tp"), (P(None, "tp"), P("tp", None)), P(),
        ((4, 6), (6, 3)), lambda x, w: x @ w),
    "column then row parallel mlp": Case(
        lambda x, up, down: lax.psum(F.gelu(x @ up) @ down, "tp"),
        (P(("dp", "cp")), P(None, "tp"), P("tp", None)), P(("dp", "cp")),
        ((8, 4), (4, 6), (6, 4)), lambda x, up, down: F.gelu(x @ up) @ down),
    "identity": Case(lambda x: x, P("tp"), P("tp"), ((8, 2),), lambda x: x),
    "replicated in and out": Case(lambda v: v * 2, P(), P(), ((3,),), lambda v: v * 2),
    "replicated in, split out": Case(
        lambda v: v, P(), P("tp"), ((3,),), lambda v: torch.cat([v, v])),
    "closed-over constant": Case(
        lambda x: x * CONSTANT, P("tp"), P("tp"), ((8, 4),), lambda x: x * CONSTANT),
    "sequence gathered invariant": Case(
        lambda s: lax.all_gather_invariant(s, ("cp", "dp"), tiled=True),
        P(("cp", "dp")), P(), ((8, 2),), lambda s: s),
    "gathered, still split": Case(
        lambda x: lax.all_gather(x, "tp", tiled=True), P("tp"), P("tp"), ((4,),),
        lambda x: torch.cat([x, x])),
    "psum_scatter of a replicated value": Case(
        lambda v: lax.psum_scatter(v, "tp", tiled=True), P(), P("tp"), ((4, 2),),
        lambda v: 2 * v),
    "psum_scatter of blocks": Case(
        lambda x: lax.psum_scatter(x, "tp", tiled=True), P("tp"), P("tp"), ((8,),),
        lambda x: torch.cat([x[:2] + x[4:6], x[2:4] + x[6:]])),
    "all_to_all columns to rows": Case(
        lambda x: lax.all_to_all(x, "tp", 1, 0, tiled=True), P("tp"), P(None, "tp"), ((4, 4),),
        lambda x: x),
    "ppermute ring": Case(
        lambda x: lax.ppermute(x, "cp", ring(2)), P("cp"), P("cp"), ((4, 3),),
        lambda x: torch.roll(x, 2, 0)),
    "pmean over dp": Case(
        lambda x: lax.pmean(x, "dp"), P("dp"), P(), ((4, 3),), lambda x: (x[:2] + x[2:]) / 2),
    "psum over a tuple": Case(
        lambda x: lax.psum(x, ("cp", "dp")), P(("cp", "dp")), P(), ((8,),),
        lambda x: x.view(4, 2).sum(0)),
    "axis_index weights": Case(
        lambda x: x * (lax.axis_index("tp") + 1), P("tp"), P("tp"), ((4, 2),),
        lambda x: rows_scaled_by_block(x, 2)),
    "expert view": Case(
        lambda x: lax.psum(x * 2, "edp"), P("edp"), P(), ((8,),),
        lambda x: 2 * x.view(4, 2).sum(0)),
    "dict specs": Case(
        lambda d: {"y": d["a"] * 3}, ({"a": P("tp")},), {"y": P(("dp", "tp"))}, ((4,),),
        lambda a: {"y": torch.cat([a, a]) * 3},
        prepare=lambda x: ({"a": x},)),
    "uneven rows": Case(
        lambda s: s + 1, P(("dp", "cp")), P(("dp", "cp")), ((5, 2),), lambda s: s + 1),
    "DTensor arguments": Case(
        lambda x, w: lax.psum(x @ w, "tp"), (P(None, "tp"), P("tp", None)), P(),
        ((4, 6), (6, 3)), lambda x, w: x @ w,
        prepare=lambda x, w: (reshard(x, P(None, "tp")), reshard(w, P("tp", None)))),
    "DTensor on a slice": Case(
        lambda x: x * 2, P("tp"), P("tp"), ((4, 3),), lambda x: x * 2,
        prepare=lambda x: (on_tp_slice(x),)),
    "two results": Case(
        lambda x: (x, lax.psum(x, "tp")), P("tp"), (P("tp"), P()), ((4,),),
        lambda x: (x, x[:2] + x[2:])),
    "explicit pvary": Case(
        lambda v: lax.psum(lax.pvary(v, "tp") * (lax.axis_index("tp") + 1), "tp"), P(), P(),
        ((3,),), lambda v: 3 * v),
    "megatron gather along the last dim": Case(
        lambda x: lax.all_gather_invariant(x, "tp", axis=-1, tiled=True), P(None, "tp"), P(),
        ((3, 4),), lambda x: x),
    "stacked gather, invariant": Case(
        lambda x: lax.all_gather_invariant(x, "cp"), P("cp"), P(), ((4,),),
        lambda x: x.view(2, 2)),
    # Refused by the default mode: the value varies over the axis its out-spec leaves out.
    "all_gather under P()": Case(
        lambda s: lax.all_gather(s, ("cp", "dp"), tiled=True), P(("cp", "dp")), P(), ((8, 2),),
        lambda s: s, typed_refuses=True),
    "unsummed row-parallel": Case(
        lambda x, w: x @ w, (P(None, "tp"), P("tp", None)), P(("dp", "cp", "tp")),
        ((4, 6), (6, 3)), None, typed_refuses=False),
}


def inputs_of(case):
    """The same inputs on every rank (no random generator: a simulated world would draw
    each rank's from the one generator in turn)."""
    inputs = []
    for number, shape in enumerate(case.shapes):
        count = torch.Size(shape).numel()
        values = (torch.arange(count, dtype=torch.float64) * 0.37 + number).sin()
        inputs.append(values.view(shape))
    return inputs


def flat(outputs):
    if isinstance(outputs, dict):
        return [outputs[key] for key in sorted(outputs)]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def loss_of(outputs):
    total = 0
    for number, value in enumerate(outputs):
        total = total + (value * (torch.arange(value.numel(), dtype=value.dtype).view(value.shape)
                                  + number + 1)).sum()
    return total


def run(case, check_vma):
    """The outputs (full) and the inputs' gradients (full) of the sharded run; a DTensor
    argument's gradient is its own (a DTensor, gathered whole here)."""
    leaves = [x.clone().requires_grad_() for x in inputs_of(case)]
    args = case.prepare(*leaves) if case.prepare else leaves
    for arg in args:
        if isinstance(arg, DTensor):
            arg.retain_grad()
    mapped = shard_map(case.body, in_specs=case.in_specs, out_specs=case.out_specs,
                       check_vma=check_vma)
    outputs = [y.full_tensor() for y in flat(mapped(*args))]
    loss_of(outputs).backward()
    grads = [arg.grad.full_tensor() if isinstance(arg, DTensor) else leaf.grad
             for arg, leaf in zip(args, leaves)]
    return outputs, grads


def expected(case):
    assert case.reference is not None
    leaves = [x.clone().requires_grad_() for x in inputs_of(case)]
    outputs = flat(case.reference(*leaves))
    loss_of(outputs).backward()
    return [y.detach() for y in outputs], [leaf.grad for leaf in leaves]


@in_both_worlds(8)
def test_whole_function_gradients_are_one_process_in_both_modes():
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh:
        for name, case in CASES.items():
            if case.reference is None:
                continue
            want_outputs, want_grads = expected(case)
            for check_vma in (True, False):
                if check_vma and case.typed_refuses:
                    assert "out_specs which require replication" in RECORDS[name]["typed"]["refused"]
                    with pytest.raises(VaryingAxesError, match="out_specs which require replication"):
                        run(case, check_vma)
                    continue
                outputs, grads = run(case, check_vma)
                where = f"{name}, check_vma={check_vma}"
                for got, want in zip(outputs, want_outputs):
                    assert close(got, want), f"{where}: output"
                for got, want in zip(grads, want_grads):
                    assert close(got, want), f"{where}: gradient"
                jaxs = RECORDS[name]["typed" if check_vma else "legacy"]
                if "refused" in jaxs:  # uneven rows: JAX refuses every uneven dim
                    assert name == "uneven rows", f"{where}: {jaxs['refused']}"
                    continue
                for got, want in zip(outputs, jaxs["outputs"], strict=True):
                    assert close(got, want), f"{where}: JAX's output"
                for got, want in zip(grads, jaxs["grads"], strict=True):
                    assert close(got, want), f"{where}: JAX's gradient"
    mesh.destroy()


@in_both_worlds(8)
def test_a_result_typed_varying_keeps_each_ranks_block():
    """x @ w over blocks of tp, returned split over every axis it varies over: each rank's
    partial product, the same in both modes."""
    mesh = meshstate.init_mesh(tp=2, cp=2)
    case = CASES["unsummed row-parallel"]
    x, w = inputs_of(case)
    tp = mesh.rank("tp")
    with mesh:
        for check_vma in (True, False):
            y = shard_map(case.body, in_specs=case.in_specs, out_specs=case.out_specs,
                          check_vma=check_vma)(x, w)
            assert close(y.to_local(), x.narrow(1, 3 * tp, 3) @ w.narrow(0, 3 * tp, 3))
            (jaxs,) = RECORDS["unsummed row-parallel"]["typed" if check_vma else "legacy"]["outputs"]
            position = mesh.rank(("dp", "cp", "tp"))
            assert close(y.to_local(), torch.tensor(jaxs, dtype=torch.float64).narrow(0, 4 * position, 4))
    mesh.destroy()
