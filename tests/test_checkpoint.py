"""Checkpoints across layouts: plain shards saved under one layout load under another.

A model of every kind of plain shard (a Megatron-style column/row-parallel pair, a
``shard_map`` MLP's weights over a joint axis tuple, experts over ``ep`` split over
``etp``, layers numbered by pipeline stage, a replicated table) and its AdamW state
is trained two steps at one layout, saved, loaded at another, and trained three more:
every rank's shards, moments and step equal the slices of one process's whole model
bit for bit after the load and after the steps. Each pair runs on 8 gloo processes
and on 8 threads of one process, through torch's DCP and through torch-checkpointing
(skipped where that optional package is absent).
"""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate import P
from meshstate.checkpoint import CheckpointError, Layout, load, save

from conftest import in_both_worlds

LAYERS, EXPERTS, HIDDEN, FFN = 4, 8, 8, 16

BACKENDS = pytest.mark.parametrize("backend", [
    "dcp",
    pytest.param("torch-checkpointing", marks=pytest.mark.skipif(
        importlib.util.find_spec("torch_checkpointing") is None,
        reason="torch-checkpointing is not installed (pip install 'meshstate[checkpointing]')")),
])

SPECS = {
    "*.up.weight": P("tp", None),            # Megatron's ColumnParallelLinear: partition dim 0
    "*.down.weight": P(None, "tp"),          # RowParallelLinear: partition dim 1
    "*.mlp.w1": P(None, ("cp", "tp")),       # a shard_map MLP's blocks over an axis tuple
    "*.mlp.w2": P(("tp", "cp"), None),       # ... and against mesh order
    "*.experts.*.w1": P(None, "etp"),        # each expert split over expert-tensor ranks
    "*.experts.*.w2": P("etp", None),
    "*.embed": P("dp"),                      # FSDP-style rows over dp
}
NUMBERED = {"layers": "pp", "experts": "ep"}
HSDP_SPECS = {**SPECS, "*.embed": P("dp_shard")}


def whole_model():
    """Every whole tensor of the model, by its whole-model key (float64)."""
    generator = torch.Generator().manual_seed(0)
    model = {"embed": torch.randn(16, HIDDEN, dtype=torch.float64, generator=generator)}
    shapes = {"up.weight": (FFN, HIDDEN), "down.weight": (HIDDEN, FFN), "mlp.w1": (HIDDEN, FFN),
              "mlp.w2": (FFN, HIDDEN)}
    for layer in range(LAYERS):
        for name, shape in shapes.items():
            model[f"layers.{layer}.{name}"] = torch.randn(*shape, dtype=torch.float64, generator=generator)
        for expert in range(EXPERTS):
            for name, shape in (("w1", (HIDDEN, 12)), ("w2", (12, HIDDEN))):
                model[f"layers.{layer}.experts.{expert}.{name}"] = torch.randn(
                    *shape, dtype=torch.float64, generator=generator)
    return model


def block(tensor, spec, mesh):
    """This rank's block of ``tensor`` under ``spec``: each split dim cut into the product
    of its axes' sizes, the first axis major (written out here, not asked of meshstate)."""
    for dim, entry in enumerate(spec.dims):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        index, count = 0, 1
        for axis in axes:
            index, count = index * mesh.size(axis) + mesh.rank(axis), count * mesh.size(axis)
        tensor = tensor.chunk(count, dim)[index]
    return tensor.contiguous()


def spec_for(key, specs):
    layout = Layout(specs)
    return layout.spec_of(key)


def local_model(whole, mesh, specs):
    """This rank's shards under its own local keys (its stage's layers and its experts
    numbered from 0)."""
    per_stage, per_rank = LAYERS // mesh.size("pp"), EXPERTS // mesh.size("ep")
    stage, ep = mesh.rank("pp"), mesh.rank("ep")
    local = {"embed": block(whole["embed"], spec_for("model.embed", specs), mesh)}
    for key, tensor in whole.items():
        parts = key.split(".")
        if parts[0] != "layers" or not stage * per_stage <= int(parts[1]) < (stage + 1) * per_stage:
            continue
        parts[1] = str(int(parts[1]) - stage * per_stage)
        if "experts" in parts:
            at = parts.index("experts") + 1
            if not ep * per_rank <= int(parts[at]) < (ep + 1) * per_rank:
                continue
            parts[at] = str(int(parts[at]) - ep * per_rank)
        local[".".join(parts)] = block(tensor, spec_for("model." + key, specs), mesh)
    return local


def optimizer_of(parameters):
    """AdamW over ``parameters`` (a dict), its state made now (step 0, zero moments)."""
    optimizer = torch.optim.AdamW(list(parameters.values()), lr=0.1, foreach=False)
    for parameter in parameters.values():
        optimizer.state[parameter] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(parameter),
                                      "exp_avg_sq": torch.zeros_like(parameter)}
    return optimizer


def train(parameters, optimizer, steps):
    """``steps`` AdamW steps with gradient ``sin(w)``: elementwise, so a shard's steps are
    the slice of the whole model's, bit for bit."""
    for _ in range(steps):
        for parameter in parameters.values():
            parameter.grad = torch.sin(parameter.detach())
        optimizer.step()


def state_of(parameters, optimizer):
    moments = {f"{key}.{name}": value for key, parameter in parameters.items()
               for name, value in optimizer.state[parameter].items()}
    return {"model": parameters, "optim": moments}


def trained(steps):
    """One process's whole model and AdamW state after ``steps`` steps."""
    parameters = {key: tensor.requires_grad_() for key, tensor in whole_model().items()}
    optimizer = optimizer_of(parameters)
    train(parameters, optimizer, steps)
    return state_of(parameters, optimizer)


def run_at(sizes, specs):
    mesh = meshstate.init_mesh(**sizes)
    whole = trained(0)["model"]
    parameters = {k: v.detach().clone().requires_grad_() for k, v in local_model(whole, mesh, specs).items()}
    return mesh, parameters, optimizer_of(parameters)


def assert_slices_of(state, reference, mesh, specs):
    """Every local tensor of ``state`` equals the slice of ``reference``'s whole tensor."""
    layout = Layout(specs, NUMBERED)
    per_stage, per_rank = LAYERS // mesh.size("pp"), EXPERTS // mesh.size("ep")
    offsets = {("layers", "pp"): mesh.rank("pp") * per_stage, ("experts", "ep"): mesh.rank("ep") * per_rank}
    for part in ("model", "optim"):
        for key, value in state[part].items():
            whole_key = layout.global_key(f"{part}.{key}", offsets)
            want = reference[part][whole_key.split(".", 1)[1]]
            if value.dim():
                want = block(want, layout.spec_of(whole_key), mesh)
            assert torch.equal(value.detach(), want.detach()), (whole_key, dict(mesh.coordinate))


LAYOUTS = {
    "tp2 pp2 ep2": dict(tp=2, pp=2, ep=2, etp=1),
    "tp4": dict(tp=4, pp=2, ep=2, etp=1),
    "tp1": dict(tp=1, pp=2, ep=2, etp=1),
    "cp2": dict(tp=2, cp=2, pp=2, ep=2, etp=1),
    "etp2": dict(tp=2, pp=2, ep=2, etp=2),
    "pp4": dict(tp=2, pp=4, ep=1, etp=1),
    "pp1": dict(tp=2, pp=1, ep=2, etp=1),
    "ep4": dict(tp=2, pp=1, ep=4, etp=2),
    "ep2": dict(tp=2, pp=1, ep=2, etp=2),
    "ep8": dict(tp=1, pp=1, ep=8, etp=1),
    "hsdp": dict(tp=2, pp=1, ep=2, etp=1, dp_replicate=2),
}
PAIRS = [
    ("tp2 pp2 ep2", "tp2 pp2 ep2"),  # unchanged
    ("tp2 pp2 ep2", "tp4"), ("tp2 pp2 ep2", "tp1"), ("tp2 pp2 ep2", "cp2"),  # one axis each
    ("tp2 pp2 ep2", "etp2"), ("pp4", "tp2 pp2 ep2"), ("tp2 pp2 ep2", "pp1"),
    ("ep4", "ep2"), ("ep4", "ep8"), ("ep4", "ep4"),  # experts per rank: KempnerForge#202
    ("tp2 pp2 ep2", "ep8"), ("cp2", "ep4"),  # several at once
    ("hsdp", "tp2 pp2 ep2"), ("tp2 pp2 ep2", "hsdp"),  # HSDP <-> plain dp
]


def specs_of(name):
    return HSDP_SPECS if name == "hsdp" else SPECS


@BACKENDS
@pytest.mark.parametrize("pairs", [PAIRS[:7], PAIRS[7:]], ids=["one axis", "experts, several, hsdp"])
@in_both_worlds(8, ("processes", "threads"))
def test_every_kind_of_shard_moves_between_layouts(pairs, backend, tmp_path):
    directory = str(tmp_path)
    after_two, after_five = trained(2), trained(5)
    for number, (saved_at, loaded_at) in enumerate(pairs):
        path = os.path.join(directory, str(number))
        mesh, parameters, optimizer = run_at(LAYOUTS[saved_at], specs_of(saved_at))
        train(parameters, optimizer, 2)
        save(state_of(parameters, optimizer), path, Layout(specs_of(saved_at), NUMBERED), mesh, backend)
        mesh.destroy()

        mesh, parameters, optimizer = run_at(LAYOUTS[loaded_at], specs_of(loaded_at))
        state = state_of(parameters, optimizer)
        load(state, path, Layout(specs_of(loaded_at), NUMBERED), mesh, backend)
        assert_slices_of(state, after_two, mesh, specs_of(loaded_at))
        train(parameters, optimizer, 3)
        assert_slices_of(state_of(parameters, optimizer), after_five, mesh, specs_of(loaded_at))
        mesh.destroy()


def unique_bytes(state):
    """The bytes of the whole model's tensors in ``state`` (each once)."""
    return sum(value.numel() * value.element_size() for part in state.values() for value in part.values())


@BACKENDS
@in_both_worlds(8, ("processes", "threads"))
def test_each_entry_is_written_once_and_read_once_per_replica_group(backend, tmp_path):
    """Summed over ranks, the tensor bytes written and the bytes read equal the whole
    model's, at the same layout and at another: a replicated entry (the AdamW steps, the
    table over tp) is written by one rank of its replica group and read by one, which
    broadcasts it (torchtitan#4035). Through torch-checkpointing, each rank's file holds
    the bytes it says it wrote."""
    directory, whole = str(tmp_path), unique_bytes(trained(0))
    for number, (saved_at, loaded_at) in enumerate([("tp2 pp2 ep2", "tp2 pp2 ep2"), ("ep4", "cp2")]):
        path = os.path.join(directory, str(number))
        mesh, parameters, optimizer = run_at(LAYOUTS[saved_at], SPECS)
        written = save(state_of(parameters, optimizer), path, Layout(SPECS, NUMBERED), mesh, backend)
        mesh.destroy()
        if backend == "torch-checkpointing":  # each rank's file holds what it wrote, nothing more
            mine = torch.load(os.path.join(path, f"meshstate_{dist.get_rank()}.pt"), weights_only=True)
            assert sum(value.numel() * value.element_size() for value in mine.values()) == written.bytes
        mesh, parameters, optimizer = run_at(LAYOUTS[loaded_at], SPECS)
        read = load(state_of(parameters, optimizer), path, Layout(SPECS, NUMBERED), mesh, backend)
        mesh.destroy()
        totals = torch.tensor([written.bytes, read.bytes])
        dist.all_reduce(totals)
        assert totals.tolist() == [whole, whole], (saved_at, loaded_at, totals.tolist(), whole)


@BACKENDS
@in_both_worlds(8, ("processes", "threads"))
def test_a_checkpoint_that_does_not_cover_the_layout_is_refused_before_anything_loads(backend, tmp_path):
    directory = str(tmp_path)
    mesh, parameters, optimizer = run_at(LAYOUTS["ep4"], SPECS)
    save({"model": parameters}, directory, Layout(SPECS, NUMBERED), mesh, backend)
    mesh.destroy()

    mesh = meshstate.init_mesh(tp=2, ep=4, etp=2)
    wider = {f"layers.{layer}.experts.{expert}.w1": torch.zeros(HIDDEN, 6, dtype=torch.float64)
             for layer in range(LAYERS) for expert in range(4)}  # 16 experts: 4 a rank
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.experts\.(8|12)\.w1 .* is not in the "
                       r"checkpoint \(it has model\.layers\.0\.experts 0-7\).*nothing was loaded"):
        load({"model": wider}, directory, Layout(SPECS, NUMBERED), mesh, backend)
    assert all(not value.any() for value in wider.values())
    mesh.destroy()

    mesh, parameters, _ = run_at(LAYOUTS["ep4"], SPECS)
    parameters["embed"] = torch.zeros(4, 4, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"model\.embed: the checkpoint's whole shape is "
                       r"\(16, 8\), this layout's is \(16, 4\)"):
        load({"model": parameters}, directory, Layout(SPECS, NUMBERED), mesh, backend)
    mesh.destroy()


@BACKENDS
@in_both_worlds(8, ("processes", "threads"))
def test_a_block_held_by_other_ranks_than_its_replica_group_is_refused_before_anything_is_written(
    backend, tmp_path
):
    """A key only the last stage holds (its replica group spans the stages), and a block
    two tp ranks hold under different specs: refused on every rank, naming the key and
    the ranks, and no file is written; loaded into such a state, refused before anything
    is read."""
    directory = str(tmp_path)
    mesh, parameters, _ = run_at(LAYOUTS["tp2 pp2 ep2"], SPECS)
    if mesh.rank("pp") == 1:
        parameters["final_norm"] = torch.ones(HIDDEN, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"^model\.final_norm: its block at \(0,\) is held by "
                       r"ranks (2-3, 6-7|4-7), but rank \d's replica group is ranks 0-7; a key must "
                       r"be held by exactly its replica group .*\); nothing was written$"):
        save({"model": parameters}, os.path.join(directory, "a"), Layout(SPECS, NUMBERED), mesh, backend)
    parameters.pop("final_norm", None)
    specs = {**SPECS, "*.embed": P("dp") if mesh.rank("tp") == 0 else P()}
    with pytest.raises(CheckpointError, match=r"^model\.embed: its block at \(0, 0\) is held by ranks "):
        save({"model": parameters}, os.path.join(directory, "b"), Layout(specs, NUMBERED), mesh, backend)
    assert [files for _, _, files in os.walk(directory) if files] == []  # DCP makes the folders only

    whole = {**parameters, "final_norm": torch.ones(HIDDEN, dtype=torch.float64)}
    save({"model": whole}, os.path.join(directory, "c"), Layout(SPECS, NUMBERED), mesh, backend)
    if mesh.rank("pp") == 0:
        del whole["final_norm"]
    emptied = {key: torch.zeros_like(value) for key, value in whole.items()}
    with pytest.raises(CheckpointError, match=r"^model\.final_norm: its block .*; nothing was loaded$"):
        load({"model": emptied}, os.path.join(directory, "c"), Layout(SPECS, NUMBERED), mesh, backend)
    assert all(not value.any() for value in emptied.values())
    mesh.destroy()


@in_both_worlds(8, ("processes",))
def test_through_dcp_the_files_are_those_dcp_writes_of_the_same_dtensors(tmp_path):
    """meshstate writes each block as DCP writes a DTensor's local shard: the files and the
    metadata are, byte for byte, DCP's own of DTensors over the same blocks (a DTensor user
    loads them as its own), for a block over one axis, over an axis tuple in mesh order and
    against it, a replicated tensor and a plain value."""
    import pickle

    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.tensor import DTensor

    from meshstate.jax.sharding import to_placements

    mesh = meshstate.init_mesh(tp=2, cp=2)
    specs = {"rows": P("tp", None), "columns": P(None, ("cp", "tp")), "against": P(("tp", "cp"), None)}
    generator = torch.Generator().manual_seed(dist.get_rank())
    blocks = {key: torch.randn(4, 6, generator=generator) for key in specs}
    state = {"model": {**blocks, "norm": torch.ones(6), "step": 3}}
    layout = Layout({f"model.{key}": spec for key, spec in specs.items()})
    save(state, os.path.join(str(tmp_path), "meshstate"), layout, mesh)
    device_mesh = mesh["dp", "cp", "tp"]
    dtensors = {f"model.{key}": DTensor.from_local(
        block, device_mesh, to_placements(specs[key], device_mesh), run_check=False)
        for key, block in blocks.items()}
    dcp_save({**dtensors, "model.norm": torch.ones(6), "model.step": 3},
             checkpoint_id=os.path.join(str(tmp_path), "dcp"))
    dist.barrier()
    if dist.get_rank() == 0:
        ours, theirs = (os.path.join(str(tmp_path), name) for name in ("meshstate", "dcp"))
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
        for name in os.listdir(ours):
            with open(os.path.join(ours, name), "rb") as mine, open(os.path.join(theirs, name), "rb") as other:
                if name == ".metadata":  # the same but for the checkpoint's path and save id
                    mine_read, other_read = pickle.load(mine), pickle.load(other)
                    assert mine_read.state_dict_metadata == other_read.state_dict_metadata
                    assert mine_read.storage_data == other_read.storage_data
                else:
                    assert mine.read() == other.read(), name
    mesh.destroy()


def test_a_layout_names_what_it_cannot_use():
    with pytest.raises(CheckpointError, match=r"Layout specs\['\*\.up'\] must be a meshstate\.P, got tuple"):
        Layout({"*.up": ("tp", None)})
    layout = Layout(numbered={"layers": "pp"})
    with pytest.raises(CheckpointError, match=r"the items under 'layers' \(numbered along 'pp'\) are "
                       r"0-1, 3 on this rank; a rank's own must be 0-2"):
        layout.counts(["layers.0.w", "layers.1.w", "layers.3.w"])
    assert layout.global_key("optim.layers.1.w.exp_avg", {("layers", "pp"): 2}) == "optim.layers.3.w.exp_avg"
    assert Layout({"*.w": P("tp")}).spec_of("optim.layers.1.w.exp_avg") == P("tp")


def test_a_backend_is_named_and_the_optional_one_names_its_extra(monkeypatch):
    import sys

    with pytest.raises(CheckpointError, match=r"^backend must be one of 'dcp', 'torch-checkpointing', "
                       r"got 'orbax'$"):
        save({}, "/nonexistent", backend="orbax")
    for name in [name for name in sys.modules if name.startswith("torch_checkpointing.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch_checkpointing", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "meshstate.checkpoint.checkpointing", raising=False)
    monkeypatch.delattr(meshstate.checkpoint, "checkpointing", raising=False)
    with pytest.raises(CheckpointError, match=r"^backend='torch-checkpointing' needs the torch-checkpointing "
                       r"package: pip install 'meshstate\[checkpointing\]'$"):
        load({}, "/nonexistent", backend="torch-checkpointing")


def test_the_simulated_world_refuses_a_checkpoint_by_name():
    from meshstate.testing import simulated_world

    def body():
        mesh = meshstate.init_mesh(tp=2)
        try:
            save({"w": torch.ones(2)}, "/nonexistent", Layout(), mesh)
        finally:
            mesh.destroy()

    with simulated_world(2) as world, pytest.raises(Exception, match="meshstate.checkpoint.save"):
        world.run(body)


def test_megatron_layers_say_how_their_parameters_lie():
    """The attributes megatron-core's layers set on a parameter (its own helper sets them
    here) are the spec: partition dim 0 or 1 over tp; an expert's over etp."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from meshstate.checkpoint import megatron_specs

    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(4, 8), "fc2": torch.nn.Linear(8, 4),
                                 "expert": torch.nn.Linear(4, 8), "norm": torch.nn.LayerNorm(4)})
    for name, dim in (("fc1", 0), ("fc2", 1), ("expert", 0)):
        set_tensor_model_parallel_attributes(model[name].weight, True, dim, 1)
    model["expert"].weight.allreduce = False
    assert megatron_specs(model, "model.") == {
        "model.fc1.weight": P("tp", None), "model.fc2.weight": P(None, "tp"),
        "model.expert.weight": P("etp", None)}
    assert Layout(megatron_specs(model)).spec_of("fc2.weight.exp_avg") == P(None, "tp")
