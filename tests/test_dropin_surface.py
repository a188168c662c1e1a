"""The drop-ins have their originals' public names and signatures, and every name
megatron-core's own code reads of them.

A new megatron-core or torchtitan release that adds a name shows here as a
failing test. Each oracle is skipped when it is not installed.
"""

import ast
import dataclasses
import inspect
import pathlib
import warnings

import pytest

import meshstate.megatron.parallel_state as our_parallel_state
from meshstate.megatron.hyper_comm_grid import HyperCommGrid
from meshstate.megatron.process_groups import ProcessGroupCollection
from meshstate.testing import fake_world
from meshstate.titan import ParallelDims

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes about Transformer Engine and Apex
    megatron_core = pytest.importorskip("megatron.core")
    import megatron.core.parallel_state as megatron_parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid as MegatronGrid
    import megatron.core.process_groups_config as megatron_process_groups
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronCollection

# Where megatron-core's own code reads the three (its tests and examples excluded).
USERS = ("distributed", "optimizer", "pipeline_parallel", "transformer", "dist_checkpointing", "models")

# Read by megatron-core's code but not defined by megatron-core 0.16.1 either: a call there
# fails on megatron-core itself (param_and_grad_buffer.py, a buffer built without a
# pg_collection, which DistributedDataParallel never does). Absent from meshstate as well.
MEGATRON_CORE_LACKS = {"get_data_and_context_parallel_group"}


def parameters(function):
    """(name, kind, default) of each parameter: what callers can rely on."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def public_functions_and_classes(module):
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == module.__name__}


def test_parallel_state_has_megatron_cores_public_names_and_signatures():
    names = public_functions_and_classes(megatron_parallel_state)
    assert names - set(dir(our_parallel_state)) == set()
    differing = [name for name in sorted(names) if inspect.isfunction(getattr(megatron_parallel_state, name))
                 and parameters(getattr(megatron_parallel_state, name))
                 != parameters(getattr(our_parallel_state, name))]
    assert differing == []


def public_methods(cls):
    return {name: value for name, value in inspect.getmembers(cls)
            if not name.startswith("_") and callable(value)}


def test_process_group_collection_has_megatron_cores_methods_fields_and_signatures():
    assert [f.name for f in dataclasses.fields(ProcessGroupCollection)] == [
        f.name for f in dataclasses.fields(MegatronCollection)]
    theirs, ours = public_methods(MegatronCollection), public_methods(ProcessGroupCollection)
    assert set(theirs) - set(ours) == set()
    assert {name: parameters(method) for name, method in theirs.items()} == {
        name: parameters(ours[name]) for name in theirs}
    assert {n for n in theirs if isinstance(inspect.getattr_static(MegatronCollection, n), staticmethod)} == {
        n for n in theirs if isinstance(inspect.getattr_static(ProcessGroupCollection, n), staticmethod)}


def test_hyper_comm_grid_has_megatron_cores_methods_attributes_and_signatures():
    theirs, ours = public_methods(MegatronGrid), public_methods(HyperCommGrid)
    assert set(theirs) - set(ours) == set()
    for name, method in theirs.items():
        expected = parameters(method)
        if name == "create_pg":
            # megatron-core passes **kwargs to new_subgroups_by_enumeration and documents
            # three of them; meshstate names those three (an unknown keyword is a TypeError).
            assert expected[-1][1] is inspect.Parameter.VAR_KEYWORD
            expected = expected[:-1] + [(keyword, inspect.Parameter.KEYWORD_ONLY, None)
                                        for keyword in ("timeout", "pg_options", "group_desc")]
        assert parameters(ours[name]) == expected, name
    assert parameters(HyperCommGrid.__init__) == parameters(MegatronGrid.__init__)


def grids():
    """megatron-core's and meshstate's grid of the same shape (on rank 3 of a simulated 8)."""
    return MegatronGrid([2, 4], ["tp", "dp"], rank_offset=0), HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=0)


def test_hyper_comm_grid_has_megatron_cores_attributes():
    with fake_world(3, 8):
        theirs, ours = grids()
        attributes = {name for name in vars(theirs) if not name.startswith("_")}
        assert attributes == {"rank_offset", "size", "shape", "dim_names", "backend"}
        assert {name: getattr(ours, name) for name in attributes} == {
            name: getattr(theirs, name) for name in attributes}


class ReadsOnTheDropIns(ast.NodeVisitor):
    """Every attribute megatron-core's code reads on ``parallel_state`` (however imported),
    on the ``ProcessGroupCollection`` class and its instances (``pg_collection.tp``),
    and on ``HyperCommGrid`` instances (parameters annotated so, names ending in ``grid``)."""

    def __init__(self):
        self.reads = {"parallel_state": set(), "ProcessGroupCollection": set(), "HyperCommGrid": set()}
        self.aliases = {}

    def visit_ImportFrom(self, node):
        module = node.module or ""
        for alias in node.names:
            local = alias.asname or alias.name
            if alias.name == "parallel_state" or (alias.name == "mpu" and module.endswith("core")):
                self.aliases[local] = "parallel_state"
            elif alias.name in ("ProcessGroupCollection", "HyperCommGrid"):
                self.aliases[local] = alias.name
            elif module.endswith("parallel_state"):
                self.reads["parallel_state"].add(alias.name)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.endswith("parallel_state") and alias.asname:
                self.aliases[alias.asname] = "parallel_state"

    def visit_Attribute(self, node):
        value = node.value
        if isinstance(value, ast.Name):
            if value.id in self.aliases:
                self.reads[self.aliases[value.id]].add(node.attr)
            elif value.id in ("pg_collection", "process_groups") and not isinstance(node.ctx, ast.Store):
                self.reads["ProcessGroupCollection"].add(node.attr)
            elif value.id.endswith("grid") and "HyperCommGrid" in self.aliases.values():
                self.reads["HyperCommGrid"].add(node.attr)
        elif isinstance(value, ast.Attribute) and value.attr == "parallel_state":
            self.reads["parallel_state"].add(node.attr)
        self.generic_visit(node)


@pytest.fixture(scope="module")
def megatron_core_reads():
    root = pathlib.Path(megatron_core.__file__).parent
    reads = {"parallel_state": set(), "ProcessGroupCollection": set(), "HyperCommGrid": set()}
    for folder in USERS:
        for path in (root / folder).rglob("*.py"):
            visitor = ReadsOnTheDropIns()
            visitor.visit(ast.parse(path.read_text(), str(path)))
            for kind, names in visitor.reads.items():
                reads[kind] |= names
    return reads


def test_megatron_cores_code_finds_every_parallel_state_name_it_reads(megatron_core_reads):
    reads = megatron_core_reads["parallel_state"]
    assert len(reads) > 25 and "get_tensor_model_parallel_group" in reads
    assert {name for name in reads if not hasattr(megatron_parallel_state, name)} == MEGATRON_CORE_LACKS
    assert {name for name in reads - MEGATRON_CORE_LACKS if not hasattr(our_parallel_state, name)} == set()


def test_megatron_cores_code_finds_every_process_group_collection_name_it_reads(megatron_core_reads):
    reads = megatron_core_reads["ProcessGroupCollection"]
    assert {"setup_process_groups_for_ddp", "setup_process_groups_for_optimizer", "tp"} <= reads
    # megatron-core 0.19 also names its MultiModuleProcessGroupCollection `pg_collection`
    multi_module = getattr(megatron_process_groups, "MultiModuleProcessGroupCollection", None)
    reads = reads - (set(dir(multi_module)) if multi_module is not None else set())
    fields = {f.name for f in dataclasses.fields(ProcessGroupCollection)}
    assert {name for name in reads if name not in fields and not hasattr(ProcessGroupCollection, name)} == set()


def test_megatron_cores_code_finds_every_hyper_comm_grid_name_it_reads(megatron_core_reads):
    reads = megatron_core_reads["HyperCommGrid"]
    assert {"rank_offset", "dim_names", "shape", "size", "get_pg", "_gen_rank_enum"} <= reads
    with fake_world(3, 8):
        theirs, ours = grids()
        assert {name for name in reads if hasattr(theirs, name) and not hasattr(ours, name)} == set()


def test_parallel_dims_has_torchtitans_public_surface():
    titan = pytest.importorskip("torchtitan.distributed.parallel_dims")
    theirs = {name: inspect.getattr_static(titan.ParallelDims, name)
              for name in dir(titan.ParallelDims) if not name.startswith("_")}
    assert set(theirs) - set(dir(ParallelDims)) == set()
    properties = {name for name, value in theirs.items() if isinstance(value, property)}
    assert properties == {name for name in theirs if isinstance(inspect.getattr_static(ParallelDims, name), property)}
    for name in sorted(set(theirs) - properties):
        if callable(getattr(titan.ParallelDims, name)):
            assert parameters(getattr(ParallelDims, name)) == parameters(getattr(titan.ParallelDims, name)), name
    public_fields = [(n, k, d) for n, k, d in parameters(titan.ParallelDims) if not n.startswith("_")]
    assert parameters(ParallelDims) == public_fields
