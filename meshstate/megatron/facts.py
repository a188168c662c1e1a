"""The facts Megatron's getters read, and megatron-core's ``set_*`` overrides laid over them.

:class:`ServedFacts` reads the served mesh's four tables (``rank_in``,
``size_of``, ``group_of``, ``ranks_of``) by attribute, as the mesh's own
``facts`` do, for every key the getters ask, derived groups included; before
init its tables are stand-ins that give megatron-core's answers. The
``set_*`` functions record megatron-core's ``_MPU_*`` overrides, which are laid
over the rank and size tables. :data:`state` holds what the façade serves on a
rank (a thread of its own for each rank of a threaded world). Example::

    set_tensor_model_parallel_world_size(4)
    served_facts(None, OVERRIDES.values).tp_size      # 4, before any init
    served_facts(None, OVERRIDES.values).pp_size      # NotInitializedError: pipeline model parallel group ...
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, cast, overload

import torch.distributed as dist

from meshstate.errors import NotInitializedError
from meshstate.core.facts import FIELDS, Facts, answered
from meshstate.layout.layout import Key
from meshstate.core.mesh import ParallelMesh
from meshstate.core.which_mesh import mesh_for
from meshstate.megatron import derived as families

ProcessGroup = dist.ProcessGroup
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

__all__ = [
    "set_data_parallel_rank",
    "set_expert_model_parallel_rank",
    "set_expert_model_parallel_world_size",
    "set_expert_tensor_parallel_rank",
    "set_expert_tensor_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
]

# The joint keys, interned: the mesh's tables then find them by identity (a code constant
# with a "-" is not interned, and a lookup by an equal but distinct string is slower).
TP_PP, TP_CP, TP_DP, TP_DP_CP, DP_CP, ETP_EP, ETP_EP_PP = map(
    sys.intern, ("tp-pp", "tp-cp", "tp-dp", "tp-dp-cp", "dp-cp", "etp-ep", "etp-ep-pp")
)
GLOO = {key: families.gloo(key) for key in families.GLOO_KEYS}
# A key no mesh has: data parallel without context parallel, partial (only an override answers).
PARTIAL_DP = "dp (partial, without cp)"

# The name of each key in a ServedFacts attribute: ``tp_cp_size`` is size_of["tp-cp"].
KEY_OF_NAME: dict[str, Key] = {
    **{key.replace("-", "_"): key for key in ("tp", "pp", "dp", "cp", "ep", "etp", "edp", TP_PP,
                                             TP_CP, TP_DP, TP_DP_CP, DP_CP, ETP_EP, ETP_EP_PP)},
    "partial_dp": PARTIAL_DP,
    "intra_dp_cp": families.INTRA_DP_CP,
    "intra_edp": families.INTRA_EDP,
    "inter_edp": families.INTER_EDP,
    "dist_opt_instance": families.DIST_OPT_INSTANCE,
    "dp_cp_all_gather": families.DP_CP_ALL_GATHER,
    "embedding": families.EMBEDDING,
    "position_embedding": families.POSITION_EMBEDDING,
    "gtp": families.GTP_REMAT,
    "egtp": families.EXPERT_GTP_REMAT,
    "dp_gloo": GLOO["dp"],
    "dp_cp_gloo": GLOO[DP_CP],
    "edp_gloo": GLOO["edp"],
    "intra_dp_cp_gloo": GLOO[families.INTRA_DP_CP],
    "intra_edp_gloo": GLOO[families.INTRA_EDP],
}

# megatron-core's name of each group, for "... is not initialized".
WHAT: dict[Key, str] = {
    "tp": "tensor model parallel group",
    "pp": "pipeline model parallel group",
    TP_PP: "model parallel group",
    "dp": "data parallel group",
    PARTIAL_DP: "data parallel group",
    DP_CP: "data parallel group with context parallel",
    families.INTRA_DP_CP: "intra partial data parallel group with context parallel",
    families.DP_CP_ALL_GATHER: "all-gather data parallel group with context parallel",
    "cp": "context parallel group",
    TP_CP: "tensor and context parallel group",
    TP_DP: "tensor and data parallel group",
    TP_DP_CP: "tensor and data parallel group with context parallel",
    "ep": "expert model parallel group",
    "etp": "expert tensor parallel group",
    ETP_EP: "expert tensor and model parallel group",
    ETP_EP_PP: "expert tensor-model-pipeline parallel group",
    "edp": "expert data parallel group",
    families.INTRA_EDP: "intra partial expert data parallel group",
    families.INTER_EDP: "inter distributed optimizer instance group "
    "(needs num_distributed_optimizer_instances > 1)",
    families.DIST_OPT_INSTANCE: "intra distributed optimizer instance group",
    families.EMBEDDING: "embedding group",
    families.POSITION_EMBEDDING: "position embedding group",
    families.GTP_REMAT: "generalized tensor parallel group",
    families.EXPERT_GTP_REMAT: "expert generalized tensor parallel group",
}
WHAT.update({twin: f"gloo {WHAT[key]}" for key, twin in GLOO.items()})

# Sizes and ranks megatron-core answers with 0 before torch.distributed is initialized.
ZERO_UNLESS_DISTRIBUTED: frozenset[Key] = frozenset(
    {"dp", PARTIAL_DP, DP_CP, families.INTRA_DP_CP, "cp", TP_CP, "ep", ETP_EP, "edp",
     families.INTRA_EDP}
)

# megatron-core's override names -> the table and the keys each answers for.
OVERRIDDEN: dict[str, tuple[Literal["rank", "size"], tuple[Key, ...]]] = {
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": ("size", ("tp",)),
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": ("rank", ("tp",)),
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": ("size", ("pp",)),
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": ("rank", ("pp",)),
    "_MPU_DATA_PARALLEL_WORLD_SIZE": ("size", ("dp", PARTIAL_DP, DP_CP, families.INTRA_DP_CP)),
    "_MPU_DATA_PARALLEL_RANK": ("rank", ("dp", PARTIAL_DP, DP_CP, families.INTRA_DP_CP)),
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": ("size", ("ep",)),
    "_MPU_EXPERT_MODEL_PARALLEL_RANK": ("rank", ("ep",)),
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": ("size", ("etp",)),
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK": ("rank", ("etp",)),
}


def not_initialized(what: str, mesh: ParallelMesh | None) -> NotInitializedError:
    """megatron-core's "``what`` is not initialized", or where ``mesh`` was destroyed."""
    if mesh is not None and mesh.destroyed_at is not None:
        return NotInitializedError(
            f"{what} is gone: its mesh was destroyed at {mesh.destroyed_at}; call "
            "initialize_model_parallel() again"
        )
    return NotInitializedError(
        f"{what} is not initialized; call initialize_model_parallel() first"
    )


class CheckedGetter(Protocol[T_co]):
    """A getter of megatron-core's ``check_initialized``: ``False`` may answer ``None``."""

    @overload
    def __call__(self, check_initialized: Literal[True] = True, **options: bool) -> T_co: ...
    @overload
    def __call__(self, check_initialized: bool, **options: bool) -> T_co | None: ...


def checked_getter(getter: Callable[..., T | None]) -> CheckedGetter[T]:
    """``getter`` itself, typed as never ``None`` unless ``check_initialized=False``."""
    return cast(CheckedGetter[T], getter)


class MaybeFacts(Protocol):
    """``ServedFacts.maybe``'s attributes the getters read: ``None`` where there is none."""

    tp_group: ProcessGroup | None
    pp_group: ProcessGroup | None
    cp_group: ProcessGroup | None
    ep_group: ProcessGroup | None
    etp_group: ProcessGroup | None
    edp_group: ProcessGroup | None
    tp_pp_group: ProcessGroup | None
    tp_cp_group: ProcessGroup | None
    tp_dp_group: ProcessGroup | None
    tp_dp_cp_group: ProcessGroup | None
    dp_cp_group: ProcessGroup | None
    etp_ep_group: ProcessGroup | None
    etp_ep_pp_group: ProcessGroup | None
    intra_edp_group: ProcessGroup | None
    inter_edp_group: ProcessGroup | None
    dist_opt_instance_group: ProcessGroup | None
    dp_cp_all_gather_group: ProcessGroup | None
    embedding_group: ProcessGroup | None
    position_embedding_group: ProcessGroup | None
    gtp_group: ProcessGroup | None
    egtp_group: ProcessGroup | None
    gtp_rank: int | None
    gtp_size: int | None
    egtp_rank: int | None
    egtp_size: int | None
    gtp_ranks: Sequence[int] | None
    egtp_ranks: Sequence[int] | None
    etp_rank: int | None
    etp_size: int | None
    cp_ranks: Sequence[int] | None
    embedding_ranks: Sequence[int] | None
    position_embedding_ranks: Sequence[int] | None



class _NotInitialized(dict[Key, Any]):
    """A table before init: empty, and a lookup by ``[]`` is megatron-core's answer.

    That answer is an error naming the group or, for the sizes and ranks that
    megatron-core gives as 0 while torch.distributed is not initialized, 0.
    ``get`` answers ``None``, as for a group the caller is not in.
    """

    def __init__(self, zero_keys: frozenset[Key] = frozenset()) -> None:
        super().__init__()
        self.zero_keys = zero_keys

    def __missing__(self, key: Key) -> Any:
        if key in self.zero_keys and not dist.is_initialized():
            return 0
        raise not_initialized(WHAT[key], None)


class Overrides:
    """megatron-core's ``_MPU_*`` values in the served state, set by the ``set_*``
    functions; ``None`` is unset.

    ``values`` are :data:`state`'s (each thread's while a threaded world runs);
    ``changed`` is called after each change (the getters re-read their tables).
    """

    def __init__(self) -> None:
        self.changed: Callable[[], None] = lambda: None

    @property
    def values(self) -> dict[str, int | None]:
        return state.overrides

    def set(self, name: str, value: int | None) -> None:
        self.values[name] = value
        self.changed()

    def clear(self) -> None:
        self.values.update(dict.fromkeys(self.values))


def _override_layers(
    values: Mapping[str, int | None], initialized: bool
) -> dict[str, dict[Key, int]]:
    """The ranks and sizes that ``values`` (the ``_MPU_*`` overrides) override, by key, in
    the tables ``"rank"`` and ``"size"``."""
    layers: dict[str, dict[Key, int]] = {"rank": {}, "size": {}}
    for name, value in values.items():
        if value is not None:
            table, keys = OVERRIDDEN[name]
            layers[table].update(dict.fromkeys(keys, value))
    for layer in layers.values():
        if not initialized and "tp" in layer:  # megatron-core's etp falls back to the tp override
            layer.setdefault("etp", layer["tp"])
    return layers


OVERRIDES = Overrides()


class ServedFacts(Facts):
    """What every getter reads: the served mesh's tables (stand-ins before init) under
    the overrides, by attribute.

    ``tp_rank`` is ``rank_in["tp"]``, ``dp_cp_size`` is ``size_of["dp-cp"]``,
    ``embedding_group`` the embedding group (names in :data:`KEY_OF_NAME`). A name
    the tables answer is copied from them, for Python's fastest read; any other is
    answered when read, by the tables, as megatron-core answers it: a group the
    caller is not in raises its "not initialized", a size before init may be 0.
    ``maybe`` reads the same names but answers ``None`` where there is none. The
    mesh keeps the served facts in its store, so its ``destroy()`` forgets them.

    Example, before any init::

        set_tensor_model_parallel_world_size(4)
        served_facts(None, OVERRIDES.values).tp_size      # 4
        served_facts(None, OVERRIDES.values).pp_size      # NotInitializedError: pipeline model parallel group ...
    """

    rank_in: Mapping[Key, int]
    size_of: Mapping[Key, int]
    group_of: Mapping[Key, ProcessGroup]
    ranks_of: Mapping[Key, Sequence[int]]
    maybe: MaybeFacts
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int
    ep_size: int
    tp_cp_rank: int
    tp_cp_size: int
    dp_cp_rank: int
    dp_cp_size: int
    etp_ep_rank: int
    etp_ep_size: int
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    cp_group: ProcessGroup
    ep_group: ProcessGroup
    etp_group: ProcessGroup
    tp_cp_group: ProcessGroup
    dp_cp_group: ProcessGroup
    tp_pp_group: ProcessGroup
    etp_ep_group: ProcessGroup
    etp_ep_pp_group: ProcessGroup
    tp_ranks: Sequence[int]
    pp_ranks: Sequence[int]
    ep_ranks: Sequence[int]
    tp_pp_ranks: Sequence[int]
    edp_rank: int
    edp_size: int
    intra_dp_cp_rank: int
    intra_dp_cp_size: int
    intra_edp_rank: int
    intra_edp_size: int
    tp_dp_group: ProcessGroup
    tp_dp_cp_group: ProcessGroup
    edp_group: ProcessGroup
    intra_dp_cp_group: ProcessGroup
    intra_edp_group: ProcessGroup
    inter_edp_group: ProcessGroup
    dist_opt_instance_group: ProcessGroup
    dp_cp_all_gather_group: ProcessGroup
    embedding_group: ProcessGroup
    position_embedding_group: ProcessGroup
    dp_gloo_group: ProcessGroup
    dp_cp_gloo_group: ProcessGroup
    edp_gloo_group: ProcessGroup
    intra_dp_cp_gloo_group: ProcessGroup
    intra_edp_gloo_group: ProcessGroup
    dp_ranks: Sequence[int]
    dp_cp_ranks: Sequence[int]
    gtp_group: ProcessGroup
    egtp_group: ProcessGroup
    gtp_ranks: Sequence[int]
    egtp_ranks: Sequence[int]

    def __init__(
        self, mesh: ParallelMesh | None, tables: _Tables, answers: dict[str, Any],
        maybe: ServedFacts | None,
    ) -> None:
        """Not called directly: :func:`served_facts` makes them, of the class that answers
        the names ``answers`` lacks."""
        self.mesh: Callable[[], ParallelMesh | None] = (
            (lambda: None) if mesh is None else weakref.ref(mesh)
        )
        self.optional = maybe is None
        self.rank_in, self.size_of, self.group_of, self.ranks_of = tables
        self.__dict__.update(answers)
        self.maybe = cast(MaybeFacts, self if maybe is None else maybe)  # typed possibly None


_Tables = tuple[
    Mapping[Key, int], Mapping[Key, int], Mapping[Key, ProcessGroup], Mapping[Key, Sequence[int]]
]


def served_facts(mesh: ParallelMesh | None, overrides: Mapping[str, int | None]) -> ServedFacts:
    """The facts the getters read while ``mesh`` is served (stand-ins when ``None``), with
    the ``overrides`` (megatron-core's ``_MPU_*`` values) laid over its ranks and sizes;
    see :class:`ServedFacts`."""
    layers = _override_layers(overrides, initialized=mesh is not None)
    if mesh is None:
        tables: _Tables = (
            _layered(layers["rank"], _NotInitialized(ZERO_UNLESS_DISTRIBUTED)),
            _layered(layers["size"], _NotInitialized(ZERO_UNLESS_DISTRIBUTED)),
            _NotInitialized(), _NotInitialized(),
        )
    else:
        tables = (_layered(layers["rank"], mesh.tables.rank),
                  _layered(layers["size"], mesh.tables.size), mesh.tables.group, mesh.tables.ranks)
    answers = answered(KEY_OF_NAME, tables)
    answering = _answering(frozenset(_NAMES.keys() - answers.keys()))
    maybe = answering(mesh, tables, answers, None)  # ``None`` where there is none
    return answering(mesh, tables, answers, maybe)


class _Unanswered:
    """A name the served tables lacked: read, the tables answer it as megatron-core does."""

    def __init__(self, key: Key, field: str) -> None:
        self.key, self.field = key, field

    def __get__(self, facts: ServedFacts | None, owner: type | None = None) -> Any:
        if facts is None:
            return self
        table: Mapping[Key, Any] = getattr(facts, _TABLE_OF_FIELD[self.field])
        if facts.optional:
            return table.get(self.key)
        if self.field == "group":  # a group the caller is not in: megatron-core's "not initialized"
            if table.get(self.key) is None:
                raise not_initialized(WHAT[self.key], facts.mesh())
        return table[self.key]


_TABLE_OF_FIELD = dict(zip(FIELDS, ("rank_in", "size_of", "group_of", "ranks_of")))
# Every attribute name of served facts -> its key and field: ``tp_cp_size`` -> ("tp-cp", "size").
_NAMES = {f"{name}_{field}": (key, field) for name, key in KEY_OF_NAME.items() for field in FIELDS}


@functools.cache
def _answering(lacking: frozenset[str]) -> type[ServedFacts]:
    """:class:`ServedFacts` with a class attribute that answers each name in ``lacking``,
    made once per set of such names.

    Only those names: a class attribute of a name, even one an instance
    shadows, costs CPython 3.11 its specialised read of that name (9.5 ns
    becomes 24 ns), so the names a mesh answers have none; and served facts are
    made as this class, never turned into it.
    """
    answers = {name: _Unanswered(*_NAMES[name]) for name in lacking}
    return cast(type[ServedFacts], type(ServedFacts.__name__, (ServedFacts,), answers))


def _layered(overrides: dict[Key, int], table: Mapping[Key, int]) -> Mapping[Key, int]:
    return ChainMap(overrides, cast(dict[Key, int], table)) if overrides else table


class ServedState:
    """What the Megatron façade keeps for one rank beside the mesh's own facts: the mesh
    served (weakly: no destroyed mesh is kept alive), its facts (``own_facts``), the
    facts every getter reads (``facts``: its own, or while another live mesh could
    answer, :class:`FactsOfThePickedMesh`), megatron-core's overrides, virtual
    pipeline stage and count, and memory buffers.

    Example, before any init: ``state.facts.tp_size`` raises megatron-core's "not
    initialized", ``state.vpp_size`` is ``None``.
    """

    def __init__(self) -> None:
        self.mesh: Callable[[], ParallelMesh | None] = lambda: None
        self.overrides: dict[str, int | None] = dict.fromkeys(OVERRIDDEN)
        self.own_facts = served_facts(None, self.overrides)
        self.facts: ServedFacts = self.own_facts
        self.vpp_rank: int | None = None
        self.vpp_size: int | None = None
        # buffers.py's GlobalMemoryBuffer and GlobalSymmetricMemoryBuffer, which it types
        self.memory_buffer: object | None = None
        self.symmetric_buffer: object | None = None


class ServedStatePerThread(threading.local, ServedState):
    """A :class:`ServedState` of each thread's own: fresh (not initialised) in every
    thread that reads it first, as a rank of a threaded world starts."""


state: ServedState = ServedState()
"""The façade's state: the process's, or while a threaded world runs (a rank a thread),
a :class:`ServedStatePerThread` (:func:`meshstate.megatron.getters.state_per_thread`)."""


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-model-parallel size the getters report."""
    OVERRIDES.set("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", world_size)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline-model-parallel size the getters report."""
    OVERRIDES.set("_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", world_size)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-model-parallel rank the getters report."""
    OVERRIDES.set("_MPU_TENSOR_MODEL_PARALLEL_RANK", rank)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline-model-parallel rank the getters report."""
    OVERRIDES.set("_MPU_PIPELINE_MODEL_PARALLEL_RANK", rank)


def set_data_parallel_rank(rank: int | None) -> None:
    """Override the data-parallel rank the getters report."""
    OVERRIDES.set("_MPU_DATA_PARALLEL_RANK", rank)


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-model-parallel size the getters report."""
    OVERRIDES.set("_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", world_size)


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert-model-parallel rank the getters report."""
    OVERRIDES.set("_MPU_EXPERT_MODEL_PARALLEL_RANK", rank)


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-tensor-parallel size the getters report."""
    OVERRIDES.set("_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", world_size)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert-tensor-parallel rank the getters report."""
    OVERRIDES.set("_MPU_EXPERT_TENSOR_PARALLEL_RANK", rank)


class FactsOfTheCallingThread:
    """``_facts`` while each thread serves its own state: every attribute is the calling
    thread's facts' (``__getattribute__``: no failed lookup first, as ``__getattr__`` has)."""

    def __getattribute__(self, name: str) -> Any:
        return getattr(state.facts, name)


class FactsOfThePickedMesh:
    """``_facts`` while another live mesh of the rank could answer instead of the one
    served: every attribute is the facts of the mesh :func:`~meshstate.core.which_mesh.mesh_for`
    picks for the calling getter (the innermost ``with mesh:`` block's, else the
    served one where no other could answer), and a getter without a pick refuses.
    """

    def __getattribute__(self, name: str) -> Any:
        getter = sys._getframe(1).f_code.co_name
        mesh = mesh_for(f"{getter}()", state.mesh(), "the mesh initialize_model_parallel built")
        if mesh is None or mesh is state.mesh():
            return getattr(state.own_facts, name)
        facts = mesh.store.get(FactsOfThePickedMesh)  # forgotten by the mesh's destroy()
        if facts is None:
            facts = mesh.store[FactsOfThePickedMesh] = served_facts(mesh, state.overrides)
        return getattr(facts, name)


def served_mesh() -> ParallelMesh | None:
    """The mesh served, destroyed or not; ``None`` before init (or once a destroyed one is gone)."""
    return state.mesh()


def set_virtual_pipeline_stages(rank: int | None, size: int | None) -> None:
    """Set the virtual pipeline stage and stage count (``initialize_model_parallel`` does)."""
    state.vpp_rank, state.vpp_size = rank, size
