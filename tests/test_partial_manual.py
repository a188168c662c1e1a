"""Partial manual: ``shard_map(..., axis_names={...})`` against JAX 0.12's answers.

Each program of ``jax_records/record_partial_manual.py`` is run on 8 ranks
(``init_mesh(tp=2, cp=2)``, so dp=2) in both modes: manual over its ``axis_names``, its
arguments DTensors with rows split over dp (global over dp inside the body, as an
FSDP2-sharded value is). The outputs, every input's gradient, the types the body noted
and JAX's refusals must equal ``jax_records/partial_manual.json`` (made by JAX 0.12.0.1,
as its ``"jax"`` says). An FSDP2 + manual-TP MLP trains 3 steps as JAX's one program does,
eager and compiled, in gloo processes and a thread per rank.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import meshstate
from meshstate import P, VaryingAxesError, shard_map
from meshstate.jax import collectives as lax
from meshstate.jax.typing import UnboundAxisError
from meshstate.jax.typing import type_text
from meshstate.testing import simulated_world
from conftest import close, compiled_whole, dynamo_graph_as_it_is, in_both_worlds, in_processes_and_threads

RECORDS = json.loads((Path(__file__).parent / "jax_records" / "partial_manual.json").read_text())
NOTED = []


def note(x):
    """Keep ``x``'s type as JAX prints it; ``x`` unchanged. Compiled, nothing is noted:
    dynamo replays the append to this module's list after the graph, and a thread per rank
    shares that list, so one rank's replay read items another rank had cleared (IndexError)."""
    if not torch.compiler.is_compiling():
        NOTED.append(type_text(x))
    return x


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


def mlp(x, up, down):
    hidden = note(torch.tanh(note(x @ up)))
    return lax.psum(note(hidden @ down), "tp")


TP = {"tp"}
# name: (body, in_specs, out_specs, axis_names), as in record_partial_manual.CASES
CASES = {
    "row-parallel matmul": (lambda x, w: lax.psum(note(note(x) @ w), "tp"),
                            (P(None, "tp"), P("tp", None)), P(), TP),
    "column then row parallel mlp": (mlp, (P(), P(None, "tp"), P("tp", None)), P(), TP),
    "identity": (lambda x: note(x), P("tp"), P("tp"), TP),
    "replicated in and out": (lambda v: note(v * 2), P(), P(), TP),
    "replicated in, split out": (lambda v: v, P(), P(None, "tp"), TP),
    "gathered over tp": (lambda x: note(lax.all_gather_invariant(x, "tp", axis=1, tiled=True)),
                         P(None, "tp"), P(), TP),
    "psum_scatter over tp": (lambda v: note(lax.psum_scatter(v, "tp", scatter_dimension=1,
                                                             tiled=True)),
                             P(), P(None, "tp"), TP),
    "all_to_all over tp": (lambda x: lax.all_to_all(x, "tp", 0, 1, tiled=True), P(None, "tp"),
                           P("tp"), TP),
    "ppermute over cp": (lambda x: lax.ppermute(x, "cp", ring(2)), P(None, "cp"),
                         P(None, "cp"), {"cp"}),
    "manual over cp and tp": (lambda x: note(lax.psum(x, ("cp", "tp"))), P(None, ("cp", "tp")),
                              P(), {"cp", "tp"}),
    "axis_index weights": (lambda x: note(x * (lax.axis_index("tp") + 1)), P(None, "tp"),
                           P(None, "tp"), TP),
    "sum over a global dim": (lambda x: note(note(x).sum(0)), P(None, "tp"), P("tp"), TP),
    "manual over dp only": (lambda x: note(lax.pmean(x, "dp")), P("dp"), P(), {"dp"}),
    "two results": (lambda x: (x, lax.psum(x, "tp")), P(None, "tp"), (P(None, "tp"), P()), TP),
    "dict specs": (lambda d: {"y": d["a"] * 3}, ({"a": P(None, "tp")},), {"y": P(None, "tp")},
                   TP),
    "explicit pvary": (lambda v: lax.psum(note(lax.pvary(v, "tp")) * (lax.axis_index("tp") + 1),
                                          "tp"), P(), P(), TP),
    "psum over dp refused": (lambda x: lax.psum(x, "dp"), P(None, "tp"), P(None, "tp"), TP),
    "axis_index of dp refused": (lambda x: x * lax.axis_index("dp"), P(None, "tp"),
                                 P(None, "tp"), TP),
    "all_gather over dp refused": (lambda x: lax.all_gather(x, "dp"), P(None, "tp"),
                                   P(None, "tp"), TP),
    "psum over dp and tp refused": (lambda x: lax.psum(x, ("dp", "tp")), P(None, "tp"), P(), TP),
    "in_specs naming dp refused": (lambda x: x, P("dp"), P("dp"), TP),
    "out_specs naming dp refused": (lambda x: x, P(None, "tp"), P("dp"), TP),
    "varying result under P() refused": (lambda x: x, P(None, "tp"), P(), TP),
}


def inputs_of(name):
    """The recorded program's inputs, the same on every rank."""
    grads = RECORDS[name]["legacy"].get("grads")
    shapes = [torch.tensor(g).shape for g in grads] if grads else [(4, 4)]
    return [(torch.arange(torch.Size(shape).numel(), dtype=torch.float64) * 0.37 + number)
            .sin().view(shape) for number, shape in enumerate(shapes)]


def flat(outputs):
    if isinstance(outputs, dict):
        return [outputs[key] for key in sorted(outputs)]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def loss_of(outputs):
    total = 0
    for number, value in enumerate(outputs):
        weights = torch.arange(value.numel(), dtype=value.dtype).view(value.shape) + number + 1
        total = total + (value * weights).sum()
    return total


def rows_over_dp(x):
    """``x`` as a DTensor on the dense view, rows split over dp (where they divide)."""
    view = meshstate.current_mesh().dense
    dp = view.mesh_dim_names.index("dp")
    placements = [Replicate()] * view.ndim
    if x.shape[0] % 2 == 0:
        placements[dp] = Shard(0)
    return DTensor.from_local(x, view, [Replicate()] * view.ndim, run_check=False).redistribute(
        view, placements)


def run(name, check_vma, graphs=None):
    """The full outputs, the full gradients and the noted types of the sharded run
    (compiled whole where ``graphs`` collects its graphs)."""
    body, in_specs, out_specs, axis_names = CASES[name]
    leaves = [x.clone().requires_grad_() for x in inputs_of(name)]
    args = [rows_over_dp(x) for x in leaves]
    mapped = shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names,
                       check_vma=check_vma)
    if graphs is not None:
        mapped = compiled_whole(mapped, graphs)
    NOTED.clear()
    outputs = flat(mapped({"a": args[0]}) if name == "dict specs" else mapped(*args))
    types = list(NOTED)
    whole = [y.full_tensor() for y in outputs]
    loss_of(whole).backward()
    return whole, [leaf.grad for leaf in leaves], types


def unnamed(text):
    """``text`` without the function's name (JAX names its own wrapper, '_rem_singleton')."""
    return re.sub(r"the function '[^']*'", "the function", text)


def jax_words(refusal):
    """JAX's refusal as meshstate words it: its own name for JAX's, up to where JAX's words
    go on to print what meshstate prints otherwise (the mesh, a set)."""
    return unnamed(refusal).split(": ", 1)[1].replace("`jax.shard_map`", "`meshstate.shard_map`").replace(
        "jax.lax.", "meshstate.").split(" but:")[0].split(" given the mesh")[0].split(
        " and input state")[0]  # JAX prints the states as a set, in no one order


@in_both_worlds(8)
def test_partial_manual_programs_are_jaxs():
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh:
        for name in CASES:
            for mode, check_vma in (("typed", True), ("legacy", False)):
                jaxs, where = RECORDS[name][mode], f"{name}, {mode}"
                if "refused" in jaxs:
                    error = pytest.raises((UnboundAxisError, VaryingAxesError, ValueError),
                                          match=None)
                    with error as refused:
                        run(name, check_vma)
                    assert jax_words(jaxs["refused"]) in unnamed(str(refused.value)), where
                    continue
                try:
                    outputs, grads, types = run(name, check_vma)
                except Exception as error:
                    error.add_note(f"in {where}")
                    raise
                if name == "varying result under P() refused":
                    continue  # legacy: JAX keeps one tp rank's block, meshstate each rank's own
                for got, want in zip(outputs, jaxs["outputs"], strict=True):
                    assert close(got, want), f"{where}: output"
                for got, want in zip(grads, jaxs["grads"], strict=True):
                    assert close(got, want), f"{where}: gradient"
                if check_vma:
                    assert types == jaxs["types"], where
    mesh.destroy()


COMPILED = ("row-parallel matmul", "gathered over tp", "ppermute over cp", "axis_index weights",
            "sum over a global dim")
"""A sum, a gather, a permutation, a rank's index and an op over a global dim."""


@in_processes_and_threads(8)
def test_partial_manual_programs_compiled_are_jaxs():
    """A program of each kind compiled whole (``fullgraph=True``), typed: one graph, JAX's
    values and gradients (a few: each compile costs seconds on a loaded machine)."""
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh:
        for name in COMPILED:
            jaxs = RECORDS[name]["typed"]
            graphs = []
            outputs, grads, _ = run(name, True, graphs)
            assert len(graphs) == 1, name
            for got, want in zip(outputs, jaxs["outputs"], strict=True):
                assert close(got, want), f"{name}, compiled: output"
            for got, want in zip(grads, jaxs["grads"], strict=True):
                assert close(got, want), f"{name}, compiled: gradient"
    mesh.destroy()


def test_at_least_twenty_programs_are_recorded():
    programs = [name for name in RECORDS if name not in ("jax", "mlp training")]
    assert len(programs) >= 20 and RECORDS["jax"] == "0.12.0.1"
    assert set(programs) == set(CASES)


def tanh_mlp(x, up, down):
    """JAX's recorded MLP: column- then row-parallel over tp."""
    return lax.psum(torch.tanh(x @ up) @ down, "tp")


class ManualTensorParallelMLP(torch.nn.Module):
    """An MLP whose matmuls are manual over tp: FSDP2 hands the body its weights whole over
    dp, the batch comes split over dp."""

    def __init__(self, up, down, compiled, graphs):
        super().__init__()
        self.up = torch.nn.Parameter(up.clone())
        self.down = torch.nn.Parameter(down.clone())
        mapped = shard_map(tanh_mlp, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P(),
                           axis_names={"tp"})
        self.mapped = compiled_whole(mapped, graphs) if compiled else mapped

    def forward(self, x):
        return self.mapped(x, self.up, self.down)


def trained_mlp(compiled, steps=3):
    """The losses and the weights (whole) after ``steps`` SGD steps of the FSDP2-sharded
    MLP, and the graphs compiled."""
    from torch.distributed.fsdp import fully_shard

    x, up, down = inputs_of("column then row parallel mlp")
    graphs = []
    model = ManualTensorParallelMLP(up, down, compiled, graphs)
    fully_shard(model, mesh=meshstate.current_mesh().dense["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = (model(rows_over_dp(x)) ** 2).mean().full_tensor()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), model.up.full_tensor(), model.down.full_tensor(), graphs


def trained_on_one_process(steps=3):
    x, up, down = (value.clone().requires_grad_() for value in
                   inputs_of("column then row parallel mlp"))
    optimizer = torch.optim.SGD([up, down], lr=0.1)
    losses = []
    for _ in range(steps):
        loss = ((torch.tanh(x @ up) @ down) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), up.detach(), down.detach()


def fsdp2_mlp_trains_as_one_process(compiled):
    mesh = meshstate.init_mesh(tp=2, cp=2)
    with mesh:
        losses, up, down, graphs = trained_mlp(compiled)
    jaxs = RECORDS["mlp training"]
    one_losses, one_up, one_down = trained_on_one_process()
    assert close(losses, jaxs["losses"]) and close(losses, one_losses)
    assert close(up, jaxs["up"]) and close(up, one_up)
    assert close(down, jaxs["down"]) and close(down, one_down)
    assert len(graphs) == (1 if compiled else 0)
    mesh.destroy()


@in_both_worlds(8, ("processes", "threads", "simulated"))
def test_fsdp2_mlp_manual_over_tp_trains_as_one_process():
    """A fully_shard'ed MLP (weights over dp) whose body is manual over tp: 3 SGD steps
    give JAX's losses and weights and one process's."""
    fsdp2_mlp_trains_as_one_process(compiled=False)


@in_processes_and_threads(8)
def test_fsdp2_mlp_manual_over_tp_compiled_trains_as_one_process():
    """The same compiled whole (one graph)."""
    fsdp2_mlp_trains_as_one_process(compiled=True)


def test_fsdp2_mlp_compiled_by_dynamo_in_the_simulated_world_trains_as_one_process(monkeypatch):
    """Simulated, dynamo traces one graph for every rank (each rank's block and index read
    when it runs), which torch's simulation runs: dynamo's graph run as it is trains as
    one process does."""
    monkeypatch.setitem(globals(), "compiled_whole", dynamo_graph_as_it_is)
    simulated_world(8).run(fsdp2_mlp_trains_as_one_process, True)


def test_fsdp2_mlp_compiled_through_aot_autograd_in_the_simulated_world_is_refused_by_name():
    """AOTAutograd (``aot_eager``) cannot compile the graph over torch's simulated tensors."""
    with pytest.raises(meshstate.SimulationError,
                       match="torch.compile cannot trace this with every rank's values.*which its "
                             "backend could not compile over torch's simulated tensors"):
        simulated_world(8).run(fsdp2_mlp_trains_as_one_process, True)


@in_both_worlds(8, ("simulated",))
def test_fsdp2_of_a_parameter_cut_into_fewer_shards_than_ranks_is_refused_when_simulated():
    """torch pads the missing shards with empty ones: a shape per rank, which one
    simulated tensor cannot hold."""
    from torch.distributed.fsdp import fully_shard

    mesh = meshstate.init_mesh(tp=2, cp=2)
    with pytest.raises(meshstate.SimulationError,
                       match=r"fully_shard \(FSDP2\) of a \(1, 3\) parameter over 2 ranks"):
        fully_shard(torch.nn.Linear(3, 1, bias=False), mesh=mesh.dense["dp"])
    mesh.destroy()



def test_axis_size_of_an_axis_the_body_is_not_manual_over_is_refused_before_the_lookup():
    """JAX's ``axis_size`` inside a partial-manual body refuses any name it is not manual
    over, one the mesh lacks too, with 'unbound axis name' (a NameError), before anything
    looks the axes up."""
    from meshstate.testing.fake import fake_world

    with fake_world(0, 8):
        mesh = meshstate.init_mesh(tp=2, cp=2)
        with mesh:
            for axes in ("nope", "dp", ("dp", "cp")):
                mapped = shard_map(lambda a: a * lax.axis_size(axes), in_specs=P("tp"),
                                   out_specs=P("tp"), axis_names=TP)
                with pytest.raises(UnboundAxisError, match=r"^unbound axis name: (nope|dp|cp)\."):
                    mapped(torch.ones(4))
            assert meshstate.axis_size("tp") == 2
        mesh.destroy()
