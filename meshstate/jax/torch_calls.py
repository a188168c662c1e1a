"""The torch calls behind each JAX-style collective, and the autograd pieces they need.

Two paths, one meaning: torch's traceable functional collectives (through
:mod:`meshstate.core.compat`) while tracing, where autograd records the input or
where the input is a tensor subclass (a simulated world's), the in-place c10d call
in tensor form in plain eager code. :mod:`meshstate.jax.collectives` picks the
types and the group; this module moves the data.

Example (8 ranks, ``init_mesh(tp=2)``)::

    group = mesh.ordered("tp")
    sum_over(torch.ones(2), group, "psum")    # tensor([2., 2.])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from meshstate.core import compat as _compat
from meshstate.errors import ArgumentTypeError, ConfigError
from meshstate.core.one_rank import (
    index_when_run,
    refuse_for_every_rank,
    tracing_for_a_simulated_world,
    tracing_for_every_rank,
)
from meshstate.core.ordered import OrderedGroup
from meshstate.core.world import each_rank


def use_functional(x: object, name: str) -> bool:
    """Whether ``x`` must go through torch's traceable collectives: torch.compile is
    tracing, ``x`` is a tensor subclass (a tracer's fake or functional tensor, a DTensor),
    autograd records ``x``, or a torch.func transform runs (its wrappers are plain tensors
    to Python that only functional ops handle). A ConfigError if ``x`` is not a tensor."""
    if type(x) not in _PLAIN_TENSORS:
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"{name} takes a torch.Tensor, got {type(x).__name__}")
        return True
    return (
        (cast(torch.Tensor, x).requires_grad and _grad_enabled())
        or _compiling()
        or _transforms_active()
    )


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
# The checks of every eager call, as module names: each dotted lookup costs it time.
_grad_enabled = torch.is_grad_enabled
_compiling = _compat.tracing
_transforms_active = _compat.transforms_active


def recorded(x: torch.Tensor) -> bool:
    """Whether autograd records ``x`` (it requires grad and grad mode is on)."""
    return x.requires_grad and torch.is_grad_enabled()


def device_for(device_type: str) -> torch.device:
    """The device a mesh of ``device_type`` computes on: the current CUDA device for ``"cuda"``."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def reduce(x: torch.Tensor, group: OrderedGroup, op: str, name: str) -> torch.Tensor:
    traced = use_functional(x, name)
    if x.requires_grad:
        raise ConfigError(f"{name} is not differentiable; call it on x.detach()")
    if traced:
        return _compat.traced_all_reduce(x, op, group.group_name)
    result = x.clone()
    _compat.all_reduce(result, group.group, _REDUCE_OPS[op])
    return result


def all_gather_on(x: torch.Tensor, group: OrderedGroup, axis: int, tiled: bool) -> torch.Tensor:
    traced = use_functional(x, "all_gather")
    shape = x.shape
    if tiled and axis == 0 and shape and not traced and _in_order(x, group):
        gathered = _with_rows(x, len(group.ranks) * shape[0])
        _compat.all_gather(gathered, x, group.group)
        return gathered
    axis = checked_dim(axis, x.dim() + (not tiled), "all_gather", "axis")
    return gather(x, group, axis, tiled=tiled, traced=traced)


def gather_invariant(x: torch.Tensor, group: OrderedGroup, axis: int, tiled: bool) -> torch.Tensor:
    if not recorded(x):
        return all_gather_on(x, group, axis, tiled)
    axis = checked_dim(axis, x.dim() + (not tiled), "all_gather_invariant", "axis")
    return gather_whole(x if tiled else x.unsqueeze(axis), axis, group)


def gather(
    x: torch.Tensor, group: OrderedGroup, axis: int, *, tiled: bool, traced: bool
) -> torch.Tensor:
    """:func:`all_gather` over ``group`` with ``axis`` checked (non-negative); ``traced``
    picks torch's traceable collective over the in-place one."""
    n = len(group.ranks)
    source = x.contiguous()
    if traced:
        stacked = _compat.traced_all_gather(source, n, group.group_name)
    else:
        stacked = source.new_empty((n * source.numel(),))
        _compat.all_gather(stacked, source.view(-1), group.group)
    stacked = stacked.view(n, *x.shape)
    if group.by_group_rank is not None:
        stacked = stacked[list(group.group_rank_at)]
    if not tiled:
        return stacked.movedim(0, axis)
    if axis == 0:
        return stacked.view(n * x.shape[0], *x.shape[1:])
    return stacked.movedim(0, axis).flatten(axis, axis + 1)


def scatter(x: torch.Tensor, group: OrderedGroup, scatter_dimension: int, tiled: bool) -> torch.Tensor:
    traced = use_functional(x, "psum_scatter")
    n, shape = len(group.ranks), x.shape
    if tiled and scatter_dimension == 0 and shape and not traced and shape[0] % n == 0 and (
        _in_order(x, group)
    ):
        scattered = _with_rows(x, shape[0] // n)
        _compat.reduce_scatter(scattered, x, group.group)
        return scattered
    chunks = _chunks(x, group, scatter_dimension, tiled, "psum_scatter", "scatter_dimension")
    if traced:
        flat = _compat.traced_reduce_scatter(chunks.reshape(-1), n, group.group_name)
    else:
        flat = x.new_empty((chunks[0].numel(),))
        _compat.reduce_scatter(flat, chunks.reshape(-1), group.group)
    return flat.view(chunks.shape[1:])


def exchange(
    x: torch.Tensor, group: OrderedGroup, split_axis: int, concat_axis: int, tiled: bool
) -> torch.Tensor:
    traced = use_functional(x, "all_to_all")
    shape = x.shape
    if tiled and split_axis == 0 and concat_axis == 0 and shape and not traced and (
        shape[0] % len(group.ranks) == 0 and _in_order(x, group)
    ):
        exchanged = torch.empty_like(x)
        _compat.all_to_all(exchanged, x, group.group)
        return exchanged
    chunks = _chunks(x, group, split_axis, tiled, "all_to_all", "split_axis")
    concat_axis = checked_dim(concat_axis, chunks.dim() - 1 + (not tiled), "all_to_all", "concat_axis")
    n = len(group.ranks)
    if traced:
        splits = [chunks[0].numel()] * n
        flat = _compat.traced_all_to_all(chunks.reshape(-1), splits, splits, group.group_name)
    else:
        flat = torch.empty_like(chunks).view(-1)
        _compat.all_to_all(flat, chunks.reshape(-1), group.group)
    received = flat.view(chunks.shape)
    if group.by_group_rank is not None:
        received = received[list(group.group_rank_at)]
    if not tiled:
        return received.movedim(0, concat_axis)
    return received.movedim(0, concat_axis).flatten(concat_axis, concat_axis + 1)


def permute(
    x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    # One all_to_all_single whose only non-empty pieces go to the destination and come
    # from the source: a point-to-point exchange that traces, and whose backward (the
    # splits swapped) is the inverse permutation.
    if use_functional(x, "ppermute"):
        if tracing_for_a_simulated_world():
            return _permuted_when_run(x, group, pairs)
        if tracing_for_every_rank():
            refuse_for_every_rank(
                "ppermute cannot be in a graph every rank runs: its split sizes are each "
                "rank's own; compile this step with torch.compile on each rank"
            )
        return _traced_ppermute(x, group, pairs)
    if not x.dim():
        return permute(x.view(1), group, pairs).view(())
    receives, sends, receiving, sending = _eager_splits(
        group.index, pairs, group.group_rank_at, x.shape[0]
    )
    x = x.contiguous()  # a block of any strides: torch's call takes rows of dense memory
    arrived = torch.zeros_like(x)
    _compat.all_to_all(
        arrived if receiving else arrived[:0], x if sending else x[:0], group.group, receives,
        sends,
    )
    return arrived


@functools.lru_cache(maxsize=256)
def _eager_splits(
    index: int, pairs: tuple[tuple[int, int], ...], group_rank_at: tuple[int, ...], rows: int
) -> tuple[list[int], list[int], bool, bool]:
    """The rows the rank at axis ``index`` receives from each group rank and sends to
    each for ``pairs``, and whether it receives and sends any (a pure function, kept)."""
    receives, sends = [0] * len(group_rank_at), [0] * len(group_rank_at)
    for source, destination in pairs:
        if source == index:
            sends[group_rank_at[destination]] = rows
        if destination == index:
            receives[group_rank_at[source]] = rows
    return receives, sends, any(receives), any(sends)


def _traced_ppermute(
    x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """ppermute with the same shapes on every rank, as a compiled graph needs.

    A compiled backward orders independent collectives by its graph, which must
    then be the same on every rank: the perm is completed to a whole one (each
    index that sends nothing sends to one that receives nothing) and a rank
    outside ``pairs`` as a destination masks what it gets to zeros (no gradient
    goes back through the mask). The split sizes are each rank's own, also for
    every rank of a simulated world.
    """
    n, numel = len(group.ranks), x.numel()
    pieces = _exchange_pieces(group.index, pairs, group.group_rank_at)
    sends = [piece * numel for piece in pieces[:n]]
    receives = [piece * numel for piece in pieces[n : 2 * n]]
    received = pieces[2 * n]
    arrived = _compat.traced_all_to_all(x.contiguous().view(-1), receives, sends, group.group_name)
    mask = torch.full((), received, dtype=torch.bool, device=x.device)
    return arrived.view(x.shape).where(mask, 0)


def _permuted_when_run(
    x: torch.Tensor, group: OrderedGroup, pairs: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """ppermute in a graph that carries no rank, for a simulated world: every rank sends
    ``x`` to every rank of its group, and keeps its source's piece, chosen when the graph
    runs (zeros where ``pairs`` sends it none). The backward sends each piece's gradient
    back the same way. ``n`` times one exchange's traffic, all inside one process."""
    n = len(group.ranks)
    splits = [x.numel()] * n
    arrived = _compat.traced_all_to_all(x.contiguous().view(-1).repeat(n), splits, splits, group.group_name)
    pieces = torch.cat([arrived.view(n, *x.shape), torch.zeros_like(x).unsqueeze(0)])
    source_of = [n] * n  # the group rank each axis index receives from; n: the zeros
    for source, destination in pairs:
        source_of[destination] = group.group_rank_at[source]
    row = torch.tensor(source_of, device=x.device).index_select(
        0, index_when_run(group).to(x.device).view(1)
    )
    return pieces.index_select(0, row).view(x.shape)


@_compat.constant_when_traced
@each_rank
def _exchange_pieces(
    index: int, pairs: tuple[tuple[int, int], ...], group_rank_at: tuple[int, ...]
) -> list[int]:
    """Whether the rank at axis ``index`` sends its piece to each group rank in the
    completed perm (1 or 0), then whether it receives one from each, then whether
    ``pairs`` sends it anything: one flat list, as a simulated world makes per-rank
    values of."""
    n = len(group_rank_at)
    destination_of = dict(pairs)
    idle_sources = [i for i in range(n) if i not in destination_of]
    idle_destinations = [i for i in range(n) if i not in set(destination_of.values())]
    destination_of.update(zip(idle_sources, idle_destinations))
    source = next(s for s, d in destination_of.items() if d == index)
    sends, receives = [0] * n, [0] * n
    sends[group_rank_at[destination_of[index]]] = 1
    receives[group_rank_at[source]] = 1
    return [*sends, *receives, int((source, index) in pairs)]


def sum_over(
    x: torch.Tensor, group: OrderedGroup, name: str, legacy: bool = False
) -> torch.Tensor:
    """``x`` summed over ``group``: backward the identity, or a sum with ``legacy`` (in a
    ``shard_map(check_vma=False)`` body: JAX's legacy transpose)."""
    if not use_functional(x, name):
        result: torch.Tensor = x.clone()
        _compat.all_reduce(result, group.group)
        return result
    if recorded(x) and not legacy:
        return _sum_with_identity_gradient(x, group.group_name)
    return _compat.traced_all_reduce(x, "sum", group.group_name)


class _SumWithIdentityGradient(torch.autograd.Function):
    """``psum`` with JAX's default transpose: the gradient passes through unchanged.

    Hand-written: torch's functional all-reduce has the legacy transpose (another
    all-reduce) as its registered backward. Each Function here sets up its context
    apart from ``forward`` and has torch generate its vmap rule, so torch.func's
    transforms (vmap, grad, vjp) run it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return _compat.traced_all_reduce(x, "sum", group_name)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.group_name = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return summed_gradient(grad, ctx.group_name), None  # pvary: a gradient of it sums


class _SummedGradient(torch.autograd.Function):
    """``pvary``: the identity forward; backward sums the gradient over the group.

    Hand-written: torch's functional collectives have no identity-forward op."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.group_name = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sum_with_identity_gradient(grad.contiguous(), ctx.group_name), None  # psum


def block(x: torch.Tensor, split_dims: Sequence[tuple[int, OrderedGroup]]) -> torch.Tensor:
    """The caller's block of ``x``: each split dim narrowed to its chunk along the dim's axes."""
    every_rank = tracing_for_every_rank()
    for dim, group in split_dims:
        step = x.shape[dim] // len(group.ranks)
        if every_rank:  # the offset read when the graph runs
            rows = index_when_run(group).to(x.device) * step + torch.arange(step, device=x.device)
            x = x.index_select(dim, rows)
        else:
            x = x.narrow(dim, group.index * step, step)
    return x


class _TakeBlock(torch.autograd.Function):
    """The caller's block of a value every rank holds whole; backward gathers the
    gradient whole again (:func:`gather_whole`, so a gradient of the gradient takes the
    block again). Hand-written: torch has no slice whose backward gathers."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, split_dims: Sequence[tuple[int, OrderedGroup]]) -> torch.Tensor:
        return block(x, split_dims)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.split_dims = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        for dim, group in reversed(ctx.split_dims):
            grad = gather_whole(grad, dim, group)
        return grad, None


class _GatherWhole(torch.autograd.Function):
    """Dim ``dim`` gathered whole over ``group``; backward keeps the caller's block
    (:func:`take_block`), as DTensor's Shard -> Replicate does and as
    ``all_gather_invariant``'s transpose is: every replica holds the whole cotangent.
    torch's all-gather would sum the copies instead."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int, group: OrderedGroup) -> torch.Tensor:
        return gather(x, group, dim, tiled=True, traced=True)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.dim, ctx.group = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return take_block(grad, [(ctx.dim, ctx.group)]), None, None


# Function.apply is untyped; these name each one's signature.
_sum_with_identity_gradient: Callable[[torch.Tensor, str], torch.Tensor] = (
    _SumWithIdentityGradient.apply
)


summed_gradient: Callable[[torch.Tensor, str], torch.Tensor] = _SummedGradient.apply


take_block: Callable[
    [torch.Tensor, Sequence[tuple[int, OrderedGroup]]], torch.Tensor
] = _TakeBlock.apply


gather_whole: Callable[[torch.Tensor, int, OrderedGroup], torch.Tensor] = _GatherWhole.apply




def _with_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """An empty tensor like ``x`` with ``rows`` along dim 0 (a 1-D one without slicing the
    shape: slicing and unpacking a ``torch.Size`` costs a third of a microsecond)."""
    if x.dim() == 1:
        return x.new_empty(rows)
    return x.new_empty(rows, *x.shape[1:])


def _in_order(x: torch.Tensor, group: OrderedGroup) -> bool:
    """Whether an eager tiled collective along dim 0 can run on ``x`` as it is: contiguous,
    its chunks in the group's rank order."""
    return group.by_group_rank is None and x.is_contiguous()


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def checked_dim(dim: int, ndim: int, name: str, parameter: str) -> int:
    """``dim`` as a non-negative dim of a tensor of ``ndim`` dims, else a ConfigError."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ConfigError(f"{name}: {parameter}={dim!r} is not a dim of a {ndim}-dim result")
    return dim % ndim


def _chunks(
    x: torch.Tensor, group: OrderedGroup, dim: int, tiled: bool, name: str, parameter: str
) -> torch.Tensor:
    """``x`` cut along ``dim`` into one chunk per rank, stacked on a new dim 0 in group-rank
    order (the chunk for axis index ``i`` at group rank ``group_rank_at[i]``); contiguous."""
    n = len(group.ranks)
    dim = checked_dim(dim, x.dim(), name, parameter)
    size = x.shape[dim]
    if tiled:
        if size % n:
            raise ConfigError(
                f"{name}: dim {dim} of shape {tuple(x.shape)} has size {size}, "
                f"not divisible by the axis size {n}"
            )
        chunks = x.reshape(*x.shape[:dim], n, size // n, *x.shape[dim + 1 :]).movedim(dim, 0)
    else:
        if size != n:
            raise ConfigError(
                f"{name}: dim {dim} of shape {tuple(x.shape)} has size {size}, but without "
                f"tiled=True it must equal the axis size {n}"
            )
        chunks = x.movedim(dim, 0)
    if group.by_group_rank is not None:
        chunks = chunks[list(group.by_group_rank)]
    return chunks.contiguous()


def check_perm(perm: Sequence[tuple[int, int]], size: int) -> tuple[tuple[int, int], ...]:
    """``perm`` as a tuple of ``(source, destination)`` pairs of indices below ``size``,
    each index once as a source and once as a destination at most; a ConfigError else.
    Traced, the check runs uncached (dynamo warns of a cache it traces through)."""
    if _compiling():
        return _checked_perm.__wrapped__(tuple(map(tuple, perm)), size)
    try:
        return _checked_perm(tuple(perm), size)
    except TypeError:  # a pair given as a list: no key to keep the answer under
        return _checked_perm.__wrapped__(tuple(map(tuple, perm)), size)


@functools.lru_cache(maxsize=256)
def _checked_perm(perm: tuple[tuple[int, int], ...], size: int) -> tuple[tuple[int, int], ...]:
    pairs = tuple((int(source), int(destination)) for source, destination in perm)
    sources = [source for source, _ in pairs]
    destinations = [destination for _, destination in pairs]
    for index in sources + destinations:
        if not 0 <= index < size:
            raise ConfigError(f"ppermute pair index {index} is outside 0..{size - 1} in {list(perm)}")
    if len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations):
        raise ConfigError(f"ppermute perm {list(perm)} repeats a source or a destination")
    return pairs


Axes = str | tuple[str, ...]
"""One axis, a joint key (mesh order) or a tuple of axes of one view, the first major."""
