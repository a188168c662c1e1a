"""The runtime layer's private torch APIs: those core touches, and the façades above it (jax,
megatron, titan) through it, kept in one place.

A torch upgrade that moves any of these is this file's work alone; each function says which
private name it relies on. One such module per layer that touches torch's privates: the
simulation's is :mod:`meshstate.simulation.local_compat`, the harness's and benchmark's
:mod:`meshstate.testing.torch_internals`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from datetime import timedelta
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
# Public as torch.distributed.Store, which torch does not declare exported: strict typing sees this.
from torch._C._distributed_c10d import PrefixStore, Store
# Imported for what it does on import: register the backward of torch.ops._c10d_functional.
import torch.distributed._functional_collectives  # noqa: F401
from torch.distributed import distributed_c10d as c10d
# The class of torch's higher-order ops (activation checkpointing, cond, ...), which hand a
# torch function mode their body whole: public as torch._ops only.
from torch._ops import HigherOrderOperator as HigherOrderOperator
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

from meshstate.layout.ranks import Ranks
if TYPE_CHECKING:  # DTensor loads in 0.4 s: only where one is made (the command line needs none)
    from torch.distributed.tensor import DTensor, Placement

# torch's traceable collectives: ops that return a new tensor, waited on by wait_tensor.
_functional = torch.ops._c10d_functional
_wait = _functional.wait_tensor


def new_member_group(
    ranks: Sequence[int],
    name: str,
    *,
    backend: str | None,
    timeout: timedelta | None,
    pg_options: Any,
    description: str,
) -> dist.ProcessGroup:
    """Create a process group that only its members call into (``ranks``: sorted, the
    caller among them).

    ``new_group(use_local_synchronization=True)`` names a group after its ranks and the
    number of groups the caller already has, so members that created different numbers
    of groups before would never meet. Here the caller picks the name (the same on every
    member), so only membership matters. torch's map from global to group rank is a view
    of ``ranks`` (``new_group`` builds a dict), so a ``Ranks`` of a huge group stays
    strides. Relies on ``c10d._new_process_group_helper`` and ``c10d._world``.
    """
    world = c10d._world
    world_group = default_group()
    default_backend = world.pg_map[world_group][0]
    resolved_backend = dist.Backend(backend or default_backend)
    resolved_timeout = timeout or c10d._get_default_timeout(resolved_backend)
    caller = world_group.rank()
    caller_index = ranks.index(caller)
    group = _torch_group(
        ranks, caller_index, resolved_backend, thread_store(), c10d.GroupName(name),
        backend_options=pg_options, timeout=resolved_timeout, group_desc=description,
    )
    world.pg_group_ranks[group] = (
        cast(dict[int, int], _GroupRanks(ranks, caller, caller_index))
        if isinstance(ranks, Ranks)
        else dict(zip(ranks, range(len(ranks))))
    )
    return cast(dist.ProcessGroup, group)


def _torch_group(ranks: Sequence[int], group_rank: int, *args: Any, **kwargs: Any) -> Any:
    """torch's group constructor, given the members as it takes them.

    It copies them into the backend's options, O(members) whatever we do; a
    ``range`` converts fastest, any other lattice is listed (and freed) here.
    """
    lattice = ranks.as_range() if isinstance(ranks, Ranks) else None
    members: Any = lattice if lattice is not None else list(ranks)  # torch types a list
    return c10d._new_process_group_helper(len(ranks), group_rank, members, *args, **kwargs)[0]


class _GroupRanks(Mapping[int, int]):
    """Global rank -> group rank of a group whose sorted members are ``ranks``.

    Stands where torch keeps a dict per group (``c10d._world.pg_group_ranks``),
    which torch reads with ``[]``, ``in``, ``keys()``, ``items()`` and ``len``;
    the caller's own entry (``dist.get_rank(group)``) is kept at hand.
    """

    def __init__(self, ranks: Ranks, caller: int, caller_index: int) -> None:
        self.ranks, self.caller, self.caller_index = ranks, caller, caller_index

    def __getitem__(self, rank: int) -> int:
        if rank == self.caller:
            return self.caller_index
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise KeyError(rank) from None

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)


_Function = TypeVar("_Function", bound=Callable[..., Any])


def constant_when_traced(function: _Function) -> _Function:
    """``function``, which ``torch.compile`` calls while tracing and keeps the result of
    as a constant (``torch.compiler.assume_constant_result``, typed here)."""
    return cast(_Function, torch.compiler.assume_constant_result(function))  # type: ignore[no-untyped-call]


def tracing() -> bool:
    """Whether a tracer of this thread is at work: dynamo traces the call
    (``torch.compiler.is_dynamo_compiling``, True only in its trace) or this thread is in a
    compile session (private ``torch._guards.TracingContext``, kept per thread).
    ``torch.compiler.is_compiling()`` alone reads one flag of the whole process, held for a
    whole compile since torch 2.13: a threaded world's other ranks would see it too."""
    if not _session_flag():  # eager code while no thread compiles: one call, as before
        return False
    if _dynamo_tracing():  # traced, both questions answer True without a guard
        return True
    from torch import _guards  # loads DTensor: asked only while some thread compiles

    return _guards.TracingContext.try_get() is not None


_dynamo_tracing = torch.compiler.is_dynamo_compiling
_session_flag = torch.compiler.is_compiling


torch_function_mode_on: Callable[[], bool] = torch._C._is_torch_function_mode_enabled
"""Whether a torch function mode is on in this thread (private
``torch._C._is_torch_function_mode_enabled``): one C call, which dynamo answers as a
constant while it traces (guarded as it guards the mode stack anyway)."""


def modes_see_every_op() -> bool:
    """Have ``torch.compile`` hand every torch op to torch function modes, as eager code
    does, so that a mode that types results (a typed shard_map body, Explicit axes) types
    them compiled too. Once per process; each later call costs a flag read.

    Dynamo dispatches to modes only the functions of its own overridable set (private
    ``torch._dynamo.variables.torch.get_overridable_functions``): ``F.pad``, ``F.tanh``,
    ``F.sigmoid``, ``F.hardswish`` and the rest of ``torch._C._nn`` reach no mode there, nor
    do the properties ``.T``, ``.mT``, ``.H`` and ``.mH`` (private ``TensorVariable``'s
    attribute read):
    their results came out untyped, and an untyped value's gradient was summed again.
    Callers wrap it in :func:`constant_when_traced`, so that traced it runs when the trace
    reaches it (before the ops it is for); wrapped here it would load dynamo at import."""
    global _every_op_seen
    if _every_op_seen:
        return True
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import torch as dynamo_torch
    from torch._dynamo.variables.tensor import TensorVariable

    overridable = dynamo_torch.get_overridable_functions()
    overridable.update(
        function for function, rule in trace_rules.get_torch_obj_rule_map().items()
        if rule is dynamo_torch.TorchInGraphFunctionVariable and _tensor_op(function)
    )
    # the attribute read is var_getattr in torch 2.13, tp_getattro_impl from 2.14
    read = "var_getattr" if "var_getattr" in vars(TensorVariable) else "tp_getattro_impl"
    setattr(TensorVariable, read, _getattr_through_modes(getattr(TensorVariable, read)))
    _every_op_seen = True
    return True


_every_op_seen = False


_TENSOR_OP_MODULES = frozenset({"torch.nn.functional", "torch._C._nn", "torch.functional"})


def _tensor_op(function: Any) -> bool:
    """Whether ``function`` is one of torch's tensor ops: a function of ``torch.nn.functional``
    or ``torch._C._nn``, or one of ``torch``'s generated ops."""
    name = getattr(function, "__name__", "")
    if name.startswith("_") or not callable(function):
        return False
    if getattr(function, "__module__", None) in _TENSOR_OP_MODULES:
        return True
    return getattr(torch._C._VariableFunctions, name, None) is function


_PROPERTY_AS_METHOD: dict[str, Callable[[int], tuple[str, tuple[int, ...]]]] = {
    "T": lambda ndim: ("permute", tuple(range(ndim - 1, -1, -1))),
    "mT": lambda ndim: ("transpose", (-2, -1)),
    "H": lambda ndim: ("adjoint", ()) if ndim == 2 else ("permute", tuple(range(ndim - 1, -1, -1))),
    "mH": lambda ndim: ("adjoint", ()),
}


def _getattr_through_modes(var_getattr: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo's attribute read of a traced tensor, with ``.T``, ``.mT``, ``.H`` and ``.mH``
    traced as the method each one is, which dynamo hands to a mode when one is on."""
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.torch_function import can_dispatch_torch_function

    def read(self: Any, tx: Any, name: str) -> Any:
        as_method = _PROPERTY_AS_METHOD.get(name)
        if as_method is None or self.ndim is None or not can_dispatch_torch_function(tx, (self,), {}):
            return var_getattr(self, tx, name)
        method, dims = as_method(self.ndim)
        return self.call_method(tx, method, [ConstantVariable.create(dim) for dim in dims], {})

    return read


def torch_functions_off() -> Any:
    """A context in which no ``__torch_function__`` runs (modes and subclasses alike):
    ``torch._C.DisableTorchFunction``, which ``torch.compile`` traces."""
    return torch._C.DisableTorchFunction()


def _torchs_call(tensor: torch.Tensor, name: str) -> Callable[..., None] | None:
    """``dist.<name>`` where an eager collective below must go through it, else None (then
    it calls the group's op as ``dist.<name>`` does, without the checks meshstate made:
    a plain tensor, a group this rank is in, an output like ``tensor``). It must for a
    tensor a torch function sees, a complex one, an open coalescing manager
    (``c10d._world``), or a call replaced since import (a simulated world's, a mock)."""
    call: Callable[..., None] = getattr(dist, name)
    if (
        call is not _TORCHS[name]
        or c10d._world.pg_coalesce_state
        or _has_torch_function((tensor,))
        or tensor.dtype.is_complex
    ):
        return call
    return None


_TORCHS = {name: getattr(dist, name) for name in (
    "all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")}
_has_torch_function = torch._C._has_torch_function


def _reducing(options: Any, op: dist.ReduceOp.RedOpType) -> Any:
    options.reduceOp = op  # as torch's calls set it
    return options


# Eager calls' options, made once (setting reduceOp costs 0.5 us); torch only reads them.
_ALL_REDUCE = {op: _reducing(c10d.AllreduceOptions(), op) for op in
               (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)}
_SUM_SCATTER = _reducing(c10d.ReduceScatterOptions(), dist.ReduceOp.SUM)
_ALL_GATHER, _ALL_TO_ALL = torch._C._distributed_c10d.AllgatherOptions(), c10d.AllToAllOptions()


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> None:
    """``dist.all_reduce(tensor, op, group=group)``: ``tensor`` reduced in place."""
    if (call := _torchs_call(tensor, "all_reduce")) is not None:
        return call(tensor, op=op, group=group)
    options = _ALL_REDUCE.get(op) or _reducing(c10d.AllreduceOptions(), op)
    group.allreduce([tensor], options).wait()


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``dist.all_gather_single(output, tensor, group=group)``."""
    if (call := _torchs_call(tensor, "all_gather_single")) is not None:
        return call(output, tensor, group=group)
    group.all_gather_single(output, tensor, _ALL_GATHER).wait()


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``dist.reduce_scatter_single(output, tensor, group=group)``: a sum."""
    if (call := _torchs_call(tensor, "reduce_scatter_single")) is not None:
        return call(output, tensor, group=group)
    group.reduce_scatter_single(output, tensor, _SUM_SCATTER).wait()


def all_to_all(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup,
    output_splits: list[int] | None = None, input_splits: list[int] | None = None,
) -> None:
    """``dist.all_to_all_single(output, tensor, output_splits, input_splits, group=group)``."""
    if (call := _torchs_call(tensor, "all_to_all_single")) is not None:
        return call(output, tensor, output_splits, input_splits, group=group)
    group.all_to_all_single(output, tensor, output_splits or [], input_splits or [], _ALL_TO_ALL).wait()


def traced_all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """``x`` reduced with ``op`` (``"sum"``, ``"max"``, ``"min"``) over the group; a new tensor.

    torch's traceable collective ``_c10d_functional.all_reduce`` (private), then its
    ``wait_tensor``; differentiable for ``"sum"`` (the backward is the same all-reduce).
    """
    return cast(torch.Tensor, _wait(_functional.all_reduce(x, op, group_name)))


def traced_all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every group rank's ``x`` concatenated along dim 0, in group-rank order.

    ``_c10d_functional.all_gather_into_tensor`` (private); the backward is a reduce-scatter.
    """
    return cast(torch.Tensor, _wait(_functional.all_gather_into_tensor(x, group_size, group_name)))


def traced_reduce_scatter(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """The sum over the group of ``x``'s dim-0 chunk numbered by the caller's group rank.

    ``_c10d_functional.reduce_scatter_tensor`` (private); the backward is an all-gather.
    """
    scattered = _functional.reduce_scatter_tensor(x, "sum", group_size, group_name)
    return cast(torch.Tensor, _wait(scattered))


def traced_all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str
) -> torch.Tensor:
    """``x``'s dim-0 pieces of ``input_splits`` sent to group ranks 0, 1, ...; what arrives,
    joined along dim 0 in sender order (sizes ``output_splits``).

    ``_c10d_functional.all_to_all_single`` (private); the backward swaps the splits.
    """
    exchanged = _functional.all_to_all_single(x, output_splits, input_splits, group_name)
    return cast(torch.Tensor, _wait(exchanged))


def name_for_every_rank(group: dist.ProcessGroup, name: str) -> None:
    """Register ``group`` under ``name`` too, the name torch's traceable collectives then
    resolve to it in this process (private ``_register_process_group``)."""
    torch._C._distributed_c10d._register_process_group(c10d.GroupName(name), group)


def forget_name(name: str) -> None:
    """Undo :func:`name_for_every_rank` (private ``_unregister_process_group``)."""
    torch._C._distributed_c10d._unregister_process_group(c10d.GroupName(name))


def group_named(name: str) -> dist.ProcessGroup:
    """The group registered under ``name`` (private ``_resolve_process_group``)."""
    return torch._C._distributed_c10d._resolve_process_group(c10d.GroupName(name))


def compile_to_bytes(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: str
) -> bytes:
    """``function`` compiled whole for ``args`` and ``kwargs``, as bytes another process
    loads with :func:`load_compiled`: ``torch.compile(...).aot_compile`` and its
    ``serialize`` (experimental; their module is private ``torch._dynamo.aot_compile``)."""
    from torch.utils import _pytree

    # An example argument's .grad would go into the artifact, which then fails to load.
    with_grads = [leaf for leaf in _pytree.tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor) and leaf.grad is not None]
    grads = [leaf.grad for leaf in with_grads]
    for leaf in with_grads:
        leaf.grad = None
    try:
        with _coordinates_read_when_run():
            compiled = torch.compile(function, fullgraph=True, backend=backend).aot_compile(  # type: ignore[attr-defined]
                (args, kwargs)
            )
        return cast(bytes, type(compiled).serialize(compiled).serialized_data)
    finally:
        for leaf, grad in zip(with_grads, grads):
            leaf.grad = grad


@contextlib.contextmanager
def _coordinates_read_when_run() -> Iterator[None]:
    """A block in which a traced DTensor reads its rank's mesh coordinates when the graph
    runs, as torch's ``compile_on_one_rank`` makes it (private
    ``DeviceMesh._sym_get_coordinate`` answering from the op that flag uses); the flag itself
    would also put process groups in the graph, which a compiled artifact cannot hold."""
    original = DeviceMesh._sym_get_coordinate

    def read_when_run(mesh: DeviceMesh, index: int) -> Any:
        with torch_compiling_on_one_rank():
            return original(mesh, index)

    DeviceMesh._sym_get_coordinate = read_when_run  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        DeviceMesh._sym_get_coordinate = original  # type: ignore[method-assign]


def torch_compiling_on_one_rank() -> contextlib.AbstractContextManager[None]:
    """A block in which torch's ``compile_on_one_rank`` flag is on (:func:`_one_rank_config`):
    traced, a DeviceMesh reads its coordinates when the graph runs."""
    flag_on: contextlib.AbstractContextManager[None] = _one_rank_config().patch(compile_on_one_rank=True)
    return flag_on


def torch_compiles_on_one_rank() -> bool:
    """Whether torch's ``compile_on_one_rank`` flag is on (:func:`_one_rank_config`)."""
    return bool(_one_rank_config().compile_on_one_rank)


def _one_rank_config() -> Any:
    """The config module that holds torch's ``compile_on_one_rank``:
    ``torch.compiler.config`` from torch 2.14, ``torch.distributed.config`` before."""
    import torch.compiler.config as compiler_config

    if hasattr(compiler_config, "compile_on_one_rank"):
        return compiler_config
    import torch.distributed.config as distributed_config

    return distributed_config


def load_compiled(data: bytes) -> Callable[..., Any]:
    """The function :func:`compile_to_bytes` compiled (``torch.compiler.load_compiled_function``)."""
    import io

    # The op a graph reads DTensor coordinates with (_coordinates_read_when_run), registered
    # on import of torch's private torch.distributed._ops.device_mesh.
    import torch.distributed._ops.device_mesh  # noqa: F401

    return torch.compiler.load_compiled_function(io.BytesIO(data))


def default_group() -> dist.ProcessGroup:
    """The default (world) process group. Uses ``c10d._get_default_group``."""
    return c10d._get_default_group()


def default_store() -> Store:
    """The store the default group was initialised with. Uses ``c10d._world.pg_map``."""
    return c10d._world.pg_map[default_group()][1]


def rendezvous_keys(group_name: str, backend: str, size: int) -> list[str]:
    """The store keys torch leaves behind for a formed group of ``size`` ranks.

    ``c10d._new_process_group_helper`` prefixes ``f"{group_name}/"`` and then
    ``f"{device}/"``; gloo posts each rank's address under ``"{device index}/{rank}"``.
    Other backends' keys are not listed.
    """
    if backend != "gloo":
        return []
    return [f"{group_name}//{device}//0/{rank}" for device in ("cpu", "cuda") for rank in range(size)]


_per_thread = threading.local()


def root_store(store: Store) -> Store:
    """The store under each ``PrefixStore`` of ``store``'s chain (public as
    ``torch.distributed.PrefixStore``, which torch does not declare exported)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def thread_store() -> Store:
    """The default group's store, for this thread to block on.

    A store client serves one request at a time, and a blocking ``wait`` holds
    it, so two threads forming groups at once on one client would wait for
    each other forever; a thread other than the main one gets a copy of its own
    (``Store.clone``: a second connection), kept while the default group lasts.
    """
    store = default_store()
    if threading.current_thread() is threading.main_thread():
        return store
    kept: tuple[Store, Store] | None = getattr(_per_thread, "store", None)
    if kept is None or kept[0] is not store:
        kept = _per_thread.store = (store, store.clone())  # type: ignore[attr-defined, unused-ignore]
    return kept[1]


def default_timeout(backend: str) -> timedelta:
    """torch's default process-group timeout for ``backend``. Uses ``c10d._get_default_timeout``."""
    return c10d._get_default_timeout(dist.Backend(backend))


def set_group_timeout(timeout: timedelta, group: dist.ProcessGroup | None) -> None:
    """Change the timeout of ``group`` (``None``: the default group). Uses ``c10d._set_pg_timeout``."""
    c10d._set_pg_timeout(timeout, group)


def symmetric_memory(
    size_in_bytes: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor | None, Any]:
    """A symmetric-memory byte buffer over ``group`` and its handle, or ``(None, None)``.

    Needs CUDA; a group outside one NVLink domain also gives ``(None, None)``.
    Uses ``torch.distributed._symmetric_memory``.
    """
    if not torch.cuda.is_available():
        return None, None
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        symm_mem.enable_symm_mem_for_group(group.group_name)
        buffer = symm_mem.empty(size_in_bytes, dtype=torch.uint8, device=torch.device("cuda"))
        return buffer, symm_mem.rendezvous(buffer, group)
    except RuntimeError:
        return None, None


def forget_sharding_decisions() -> None:
    """Clear DTensor's sharding-propagation caches, which key on a DeviceMesh's layout and
    names, not its groups: after a mesh is destroyed and an equal one built, a cached
    decision would hand out DTensors on the destroyed mesh. What ``torch.distributed.
    tensor.debug._clear_sharding_prop_cache`` does without importing it (it needs numpy):
    clears ``DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding``'s lru cache
    and the C++ fast path's (``torch._C._clear_DTensor_sharding_propagator_cache``). Before
    DTensor is first imported nothing is cached, so this imports nothing."""
    dtensor_api = sys.modules.get("torch.distributed.tensor._api")
    if dtensor_api is None:
        return
    dtensor_api.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def bound_device(group: dist.ProcessGroup) -> torch.device | None:
    """The device a group was bound to at init (``device_id=``), if any."""
    return cast("torch.device | None", getattr(group, "bound_device_id", None))


def destroy_group(group: dist.ProcessGroup) -> None:
    """Destroy ``group`` if torch still knows it, leaving nothing behind.

    ``destroy_process_group`` keeps an empty entry per group in
    ``c10d._world.tags_to_pg``; this drops it too.
    """
    world = c10d._world
    if group not in world.pg_map:
        return
    tag = world.pg_to_tag.get(group)
    dist.destroy_process_group(group)
    if tag is not None and not world.tags_to_pg.get(tag, True):
        del world.tags_to_pg[tag]


def share_rank_map(mesh: DeviceMesh, source: DeviceMesh) -> None:
    """Let ``mesh`` hold ``source``'s rank map instead of an equal copy.

    Every DeviceMesh keeps its root's rank map as a tensor and as a tuple of
    world-size Python ints (``_rank_map``, ``_flatten_rank_map``); meshes with
    equal maps can share one. Maps that differ are left alone.
    """
    if mesh._rank_map is not source._rank_map and not torch.equal(mesh._rank_map, source._rank_map):
        return
    mesh._rank_map = source._rank_map
    mesh._flatten_rank_map = source._flatten_rank_map


def call_groups_by(
    device_mesh: DeviceMesh, group_names: list[str], groups: list[dist.ProcessGroup]
) -> None:
    """Have ``device_mesh`` call its dims' ``groups`` by ``group_names`` (registered for them,
    :func:`name_for_every_rank`), the names DTensor's traced collectives then take. Sets
    ``DeviceMesh._dim_group_names`` and ``_pg_registry``."""
    device_mesh._dim_group_names = [c10d.GroupName(name) for name in group_names]
    for name, group in zip(group_names, groups):
        device_mesh._pg_registry[name] = group


def flatten_with_group(
    root: DeviceMesh, axes: tuple[str, ...], name: str, group: dist.ProcessGroup,
    group_name: str | None = None,
) -> DeviceMesh:
    """Flatten ``root[axes]`` into a 1-D mesh named ``name`` that uses ``group``, called
    ``group_name`` (default: its own name; see :func:`call_groups_by`).

    Torch's ``DeviceMesh._flatten`` would create the flattened dimension's
    groups for every rank of the world; this registers the one group the caller
    already has instead, so ``root[name]`` and FSDP's same-root checks work as
    after ``_flatten``. Relies on ``DeviceMesh._get_slice_mesh_layout``,
    ``_layout``, ``_rank_map``, ``_flatten_rank_map``, ``_flatten_mapping``,
    ``_pg_registry`` and ``_dim_group_names``.
    """
    flat_layout = _MeshLayout([root._get_slice_mesh_layout(axes).collapse()])
    flattened = DeviceMesh(
        root.device_type,
        _layout=flat_layout,
        _rank_map=root._rank_map,
        mesh_dim_names=(name,),
        _root_mesh=root,
        _init_backend=False,
    )
    group_name = group.group_name if group_name is None else group_name
    flattened._dim_group_names = [c10d.GroupName(group_name)]
    root._pg_registry[group_name] = group
    root._flatten_mapping[name] = flattened
    share_rank_map(flattened, root)
    return flattened


def slice_with_flattened(root: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``root[names]``, where a name may be a dim flattened from ``root`` (``("dp-cp", "tp")``).

    Torch warns that slicing a flattened dim from the root will be deprecated
    (``DeviceMesh.__getitem__``, PT 2.11) but offers no other way to put one
    beside a plain dim; the warning is silenced here until it does.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        return root[names]


def strided_shard(dim: int, split_factor: int) -> torch.distributed.tensor.Placement:
    """Torch's strided shard of tensor dim ``dim``. Uses the private ``_StridedShard``.

    On a mesh dim of size ``n`` it views the rank's current run of ``dim`` as
    ``(split_factor, n, rest)`` and keeps ``[:, coordinate, :]``, leaving the
    ``split_factor`` major chunks to later mesh dims; with ``split_factor=1``
    it is ``Shard(dim)``.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def sharded_dim(placement: torch.distributed.tensor.Placement) -> int | None:
    """The tensor dim a ``Shard`` or torch's strided shard (private ``_StridedShard``,
    not a ``Shard`` subclass) splits; ``None`` for any other placement."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def local_tensor(x: DTensor) -> torch.Tensor:
    """``x.to_local()``, without the autograd node where nothing needs one: the DTensor's
    own local tensor (private ``DTensor._local_tensor``) when autograd does not record
    ``x`` and nothing traces. ``to_local`` costs an autograd apply even then."""
    if recorded_or_traced(x):
        return x.to_local()
    local: torch.Tensor = x._local_tensor
    return local


def recorded_or_traced(x: torch.Tensor) -> bool:
    """Whether autograd records ``x`` or a tracer is at work: where neither, a DTensor's
    block is read (:func:`local_tensor`) and wrapped (:func:`dtensor_of`) without
    ``to_local``'s or ``from_local``'s autograd apply."""
    return (x.requires_grad and torch.is_grad_enabled()) or tracing()


def even_spec(
    device_mesh: DeviceMesh, placements: tuple[Placement, ...], local: torch.Tensor
) -> Any:
    """The DTensor spec of blocks like ``local`` laid out by ``placements``, every rank's
    block of that shape (what ``from_local`` computes each call, with
    ``torch.distributed.tensor._utils.compute_global_tensor_info``)."""
    from torch.distributed.tensor._utils import compute_global_tensor_info

    shape, stride = compute_global_tensor_info(local, device_mesh, list(placements))
    return dtensor_spec(device_mesh, placements, shape, stride, local.dtype)


def dtensor_spec(
    device_mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int],
    stride: Sequence[int], dtype: torch.dtype,
) -> Any:
    """The DTensor spec (private ``DTensorSpec``, ``TensorMeta``) of a DTensor of global
    ``shape`` and ``stride`` laid out by ``placements``: what ``from_local(...,
    shape=shape, stride=stride)`` makes each call, for :func:`dtensor_of`."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), dtype)
    return DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta)


def spec_and_block(x: DTensor) -> tuple[Any, torch.Tensor]:
    """``x``'s private ``DTensorSpec`` (mesh, placements, shape, stride, dtype; hashed once)
    and local tensor: ``DTensor._spec`` and ``_local_tensor``, for code autograd skips."""
    return x._spec, x._local_tensor


def dtensor_of(local: torch.Tensor, spec: Any, fresh: bool = False) -> DTensor:
    """A DTensor of ``local`` (a view of it, unless ``fresh``: made for it) with the spec
    ``even_spec`` made, as ``from_local`` makes one autograd does not record, without its
    autograd apply (the private ``DTensor(local, spec, requires_grad=False)``)."""
    from torch.distributed.tensor import DTensor
    return DTensor(local if fresh else local.view_as(local), spec, requires_grad=False)  # type: ignore[no-untyped-call, unused-ignore]


def root_of(device_mesh: DeviceMesh) -> DeviceMesh:
    """The DeviceMesh ``device_mesh`` was sliced or flattened from (itself for a root).
    Uses ``DeviceMesh._get_root_mesh``."""
    return device_mesh._get_root_mesh()


def mesh_copies(device_mesh: DeviceMesh) -> torch.Tensor:
    """Global ranks of every copy of ``device_mesh`` in its root mesh, shape ``(copies,
    *device_mesh.shape)`` (``.mesh`` of a slice such as ``root["dp", "cp"]`` is the caller's
    copy only). Relies on ``DeviceMesh._layout``, ``_rank_map``, ``_MeshLayout.remap_to_tensor``.
    """
    every_copy = device_mesh._layout.remap_to_tensor(device_mesh._rank_map)
    return every_copy.reshape(-1, *device_mesh.shape)


def unflatten_with_groups(
    world: DeviceMesh,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    groups: list[dist.ProcessGroup],
) -> DeviceMesh:
    """The 1-D root ``world`` split into dims of ``shape`` named ``names``, dim i using ``groups[i]``.

    Like ``DeviceMesh._unflatten`` (its views share ``world`` as root, so FSDP's
    same-root checks pass between them), but registers the groups the caller
    already has instead of creating every group of the world. Relies on
    ``_MeshLayout``, ``_layout``, ``_rank_map``, ``_pg_registry`` and ``_dim_group_names``.
    """
    inner = world._layout[0].composition(_MeshLayout.from_sizes_strides(shape))
    unflattened = DeviceMesh(
        world.device_type,
        _layout=world._layout.splice(0, 1, inner),
        _rank_map=world._rank_map,
        mesh_dim_names=names,
        _root_mesh=world,
        _init_backend=False,
    )
    unflattened._dim_group_names = [group.group_name for group in groups]
    for group in groups:
        world._pg_registry[group.group_name] = group
    share_rank_map(unflattened, world)
    return unflattened


class TransformHooks:
    """What :func:`follow_functorch_transforms` calls around torch.func's transforms.

    ``entered(sources, wrapped)``: the tensors a transform wrapped (BatchedTensors,
    GradTrackingTensors) beside the values they wrap. ``left(wrapped, results)``: the
    values a transform unwraps beside what it returns for them. ``forward_mode(name)``:
    a forward-mode transform (jvp, and jacfwd, hessian, linearize through it) is about
    to run; it may refuse.
    """

    def entered(self, sources: Sequence[Any], wrapped: Sequence[Any]) -> None: ...
    def left(self, wrapped: Sequence[Any], results: Sequence[Any]) -> None: ...
    def forward_mode(self, name: str) -> None: ...


def follow_functorch_transforms(hooks: TransformHooks) -> None:
    """Make torch.func's vmap, grad and vjp (jacrev, grad_and_value, hessian's inner part
    through them) call ``hooks`` where they wrap and unwrap values; jvp calls
    ``hooks.forward_mode`` first. Once per process; a second call changes nothing.

    torch.func wraps a transform's inputs as new C++ tensors, so a Python attribute on
    an input is not on what the function sees, nor on what it returns. Relies on
    ``torch._functorch.vmap._flat_vmap`` and ``torch._functorch.eager_transforms``'
    ``_wrap_all_tensors``, ``_undo_create_differentiable`` and ``_jvp_with_argnums``
    (module globals, read at call time; spmd_types patches ``_flat_vmap`` the same way).
    Under ``torch.compile`` the replacements are traced like the originals.
    """
    from torch._functorch import eager_transforms, vmap
    from torch.utils._pytree import tree_flatten

    if getattr(vmap._flat_vmap, "_meshstate_follows", False):
        return
    flat_vmap = vmap._flat_vmap
    wrap_all = eager_transforms._wrap_all_tensors
    undo_differentiable = eager_transforms._undo_create_differentiable
    jvp_with_argnums = eager_transforms._jvp_with_argnums

    def followed_flat_vmap(
        func: Callable[..., Any], batch_size: int, flat_in_dims: Any, flat_args: list[Any],
        args_spec: Any, out_dims: Any, randomness: str, **kwargs: Any,
    ) -> Any:
        batched_outputs: list[Any] = []

        def batched_func(*args: Any, **func_kwargs: Any) -> Any:
            hooks.entered(flat_args, tree_flatten(args)[0])
            output = func(*args, **func_kwargs)
            batched_outputs.extend(tree_flatten(output)[0])
            return output

        result = flat_vmap(batched_func, batch_size, flat_in_dims, flat_args, args_spec,
                           out_dims, randomness, **kwargs)
        hooks.left(batched_outputs, tree_flatten(result)[0])
        return result

    def followed_wrap_all(tensor_pytree: Any, level: int) -> Any:
        wrapped = wrap_all(tensor_pytree, level)
        hooks.entered(tree_flatten(tensor_pytree)[0], tree_flatten(wrapped)[0])
        return wrapped

    def followed_undo(inps: Any, level: int | None = None) -> Any:
        results = undo_differentiable(inps, level)
        hooks.left(tree_flatten(inps)[0], tree_flatten(results)[0])
        return results

    def followed_jvp(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hooks.forward_mode("torch.func.jvp")
        return jvp_with_argnums(func, *args, **kwargs)

    followed_flat_vmap._meshstate_follows = True  # type: ignore[attr-defined]
    vmap._flat_vmap = followed_flat_vmap
    eager_transforms._wrap_all_tensors = followed_wrap_all
    eager_transforms._undo_create_differentiable = followed_undo
    eager_transforms._jvp_with_argnums = followed_jvp


transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
"""Whether a torch.func transform (vmap, grad, ...) runs in this thread, so that values are
wrappers only torch's functional ops handle (torch's own function: no call layer)."""


def follow_reentrant_checkpoint(
    wrap: Callable[[Callable[..., Any], tuple[Any, ...]], Callable[..., Any]],
) -> None:
    """Make ``torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=True)`` call
    ``wrap(f, args)`` in its forward and run what it returns there and again in the
    backward, where it recomputes ``f`` on detached copies of ``args`` (new tensors)
    after the forward's context is gone. Once per process. Relies on
    ``torch.utils.checkpoint.CheckpointFunction.forward`` (the non-reentrant variant and
    ``torch.compile``'s checkpointing run ``f`` in the caller's context)."""
    from torch.utils.checkpoint import CheckpointFunction

    forward: Callable[..., Any] = CheckpointFunction.forward
    if getattr(forward, "_meshstate_follows", False):
        return

    def followed_forward(
        ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any
    ) -> Any:
        return forward(ctx, wrap(run_function, args), preserve_rng_state, *args)

    followed_forward._meshstate_follows = True  # type: ignore[attr-defined]
    CheckpointFunction.forward = staticmethod(followed_forward)  # type: ignore[method-assign]


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, group_src: int, bucket_bytes: int,
) -> None:
    """Broadcast ``tensors`` in place from the group's rank ``group_src``, flattened into
    buckets of up to ``bucket_bytes`` (one broadcast a bucket, not a tensor). Uses
    ``torch._C._distributed_c10d._broadcast_coalesced``, which DDP syncs a module's states
    with."""
    torch._C._distributed_c10d._broadcast_coalesced(group, list(tensors), bucket_bytes, group_src)
