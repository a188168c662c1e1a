"""Nodes: which groups stay inside one, a better order when they don't, hybrid layouts.

Ranks sit on nodes the way torchrun places them: node ``n`` holds ranks
``n*ranks_per_node .. (n+1)*ranks_per_node - 1``. :func:`locality_report` says,
for every group kind of a :class:`~meshstate.core.layout.ParallelLayout`, how many
nodes one group spans, and warns when a bandwidth-hungry axis (tp, cp, ep, etp)
crosses nodes while another order would keep it inside one. :class:`HybridGrid`
lays ranks out JAX-style, every axis split into an inter-node and an intra-node
part, which no order string can express in general; :func:`init_hybrid_mesh`
builds its ``DeviceMesh``.

Everything but :func:`init_hybrid_mesh` is pure rank arithmetic.

Example (16 ranks, 8 per node)::

    >>> layout = ParallelLayout(MeshConfig(16, order="dp-tp-pp", tp=8))
    >>> report = locality_report(layout, 8)    # also warns NodeCrossingWarning
    >>> report.nodes_spanned["tp"], report.suggested_order
    (2, 'tp-dp-pp')
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import einops
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshstate.core.arguments import resolve_device_type
from meshstate.core.config import MeshConfig, check_positive_int
from meshstate.core.errors import AxisError, ConfigError, MeshStateError
from meshstate.core.groups import ProcessGroupSet, create_group_family
from meshstate.core.layout import GROUP_KINDS, Grid, ParallelLayout

BANDWIDTH_HUNGRY_KINDS = ("tp", "cp", "ep", "etp")
"""Group kinds whose traffic should stay on a node's fast links."""


class NodeCrossingWarning(UserWarning):
    """A bandwidth-hungry axis crosses nodes although another order keeps it inside one."""


def check_ranks_per_node(world_size: int, ranks_per_node: object) -> int:
    """Return ``ranks_per_node`` if it is a positive integer dividing ``world_size``.

    Example: ``check_ranks_per_node(16, 3)`` raises ``ConfigError: world size 16
    is not divisible by 3 ranks per node``.
    """
    checked = check_positive_int("ranks per node", ranks_per_node)
    if world_size % checked:
        raise ConfigError(f"world size {world_size} is not divisible by {checked} ranks per node")
    return checked


def ranks_per_node_from_env() -> int:
    """Ranks per node from torchrun's ``LOCAL_WORLD_SIZE``.

    Example: under ``torchrun --nproc-per-node 8`` this returns 8.
    """
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None:
        raise ConfigError(
            "LOCAL_WORLD_SIZE is not set; launch with torchrun or pass ranks_per_node"
        )
    if not text.strip().isdecimal() or int(text) < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE must be a positive integer, got {text!r}")
    return int(text)


def nodes_spanned(groups: torch.Tensor, ranks_per_node: int) -> int:
    """The most nodes any one group (a row of ``groups``) spans.

    Example: ``nodes_spanned(torch.tensor([[0, 1], [2, 9]]), 8)`` is 2.
    """
    nodes = (groups // ranks_per_node).to(torch.int32).sort(dim=1).values
    return int((nodes[:, 1:] != nodes[:, :-1]).sum(dim=1).max()) + 1


@dataclass(frozen=True)
class LocalityReport:
    """Where the groups of one layout fall on nodes of ``ranks_per_node`` ranks.

    ``nodes_spanned`` maps every kind of ``GROUP_KINDS`` to the most nodes one of
    its groups spans (1: inside a node). ``suggested_order`` keeps more
    bandwidth-hungry axes inside a node than the layout's order, and ``advice``
    says so in words; both are ``None`` when no order does better.
    """

    ranks_per_node: int
    nodes_spanned: dict[str, int]
    suggested_order: str | None
    advice: str | None

    def intra_node(self, kind: str) -> bool:
        """Whether every group of ``kind`` stays inside one node."""
        if kind not in self.nodes_spanned:
            raise AxisError(f"no group kind {kind!r}; valid kinds are {', '.join(GROUP_KINDS)}")
        return self.nodes_spanned[kind] == 1


def locality_report(layout: ParallelLayout, ranks_per_node: int) -> LocalityReport:
    """How many nodes the groups of every kind span, and a better order if one exists.

    When tp, cp, ep or etp crosses nodes, every other order of the same tokens
    with the same sizes is tried; the best keeps tp inside a node first, then
    ep and etp, then cp, then spans the fewest nodes (tp, then ep+etp, then cp),
    then moves the fewest axes past each other. If it keeps more of those axes
    inside than the layout's order, the advice is also issued as a
    :class:`NodeCrossingWarning`.

    Example: for ``MeshConfig(16, order="dp-tp-pp", tp=8)`` and 8 ranks per node
    the advice is ``"tp groups span 2 nodes, etp groups span 2 nodes in order
    'dp-tp-pp' at 8 ranks per node; order 'tp-dp-pp' keeps tp, etp inside one node"``.
    """
    config = layout.config
    check_ranks_per_node(config.world_size, ranks_per_node)
    spans = {kind: nodes_spanned(layout.groups(kind), ranks_per_node) for kind in GROUP_KINDS}
    hungry_spans = {kind: spans[kind] for kind in BANDWIDTH_HUNGRY_KINDS}
    better = _better_order(config, ranks_per_node, hungry_spans)
    if better is None:
        return LocalityReport(ranks_per_node, spans, None, None)
    suggested_order, suggested_spans = better
    advice = _advice(config.order, suggested_order, ranks_per_node, hungry_spans, suggested_spans)
    warnings.warn(advice, NodeCrossingWarning, stacklevel=2)
    return LocalityReport(ranks_per_node, spans, suggested_order, advice)


def _hungry_spans(
    config: MeshConfig, ranks_per_node: int, known: dict[tuple[object, ...], int]
) -> dict[str, int]:
    """Nodes spanned by each bandwidth-hungry kind; ``known`` caches them by grid.

    Orders that differ only where size-1 axes go give the same groups, so the
    cache key leaves those axes out.
    """
    layout = ParallelLayout(config)
    spans = {}
    for kind in BANDWIDTH_HUNGRY_KINDS:
        _, grid, axes = layout.resolve(kind)
        key = (kind, *((a, s) for a, s in zip(grid.axes, grid.sizes) if s > 1))
        if key not in known:
            known[key] = nodes_spanned(grid.groups(axes), ranks_per_node)
        spans[kind] = known[key]
    return spans


def _crossing_rank(spans: Mapping[str, int]) -> tuple[int, int, int]:
    crosses = {kind: int(spans[kind] > 1) for kind in BANDWIDTH_HUNGRY_KINDS}
    return crosses["tp"], crosses["ep"] + crosses["etp"], crosses["cp"]


def _span_rank(spans: Mapping[str, int]) -> tuple[int, int, int]:
    return spans["tp"], spans["ep"] + spans["etp"], spans["cp"]


def _moves(order: Sequence[str], candidate: Sequence[str]) -> int:
    """How many pairs of axes ``candidate`` puts the other way round than ``order``."""
    position = {axis: index for index, axis in enumerate(candidate)}
    return sum(position[a] > position[b] for a, b in itertools.combinations(order, 2))


def _better_order(
    config: MeshConfig, ranks_per_node: int, spans: Mapping[str, int]
) -> tuple[str, dict[str, int]] | None:
    if all(span == 1 for span in spans.values()):
        return None
    tokens = config.order.split("-")
    known: dict[tuple[object, ...], int] = {}
    ranked = []
    for candidate_tokens in itertools.permutations(tokens):
        try:
            candidate = MeshConfig(
                config.world_size, order="-".join(candidate_tokens), tp=config.tp,
                cp=config.cp, ep=config.ep, etp=config.etp, pp=config.pp,
            )
        except ConfigError:
            continue
        candidate_spans = _hungry_spans(candidate, ranks_per_node, known)
        rank = (
            _crossing_rank(candidate_spans),
            _span_rank(candidate_spans),
            _moves(tokens, candidate_tokens),
        )
        ranked.append((rank, candidate.order, candidate_spans))
    best_rank, best_order, best_spans = min(ranked)
    if best_rank[0] >= _crossing_rank(spans):
        return None
    return best_order, best_spans


def _advice(
    order: str,
    suggested_order: str,
    ranks_per_node: int,
    spans: Mapping[str, int],
    suggested_spans: Mapping[str, int],
) -> str:
    crossing = [kind for kind in BANDWIDTH_HUNGRY_KINDS if spans[kind] > 1]
    kept_inside = [kind for kind in crossing if suggested_spans[kind] == 1]
    pushed_out = [
        kind for kind in BANDWIDTH_HUNGRY_KINDS if spans[kind] == 1 and suggested_spans[kind] > 1
    ]
    now = ", ".join(f"{kind} groups span {spans[kind]} nodes" for kind in crossing)
    advice = (
        f"{now} in order {order!r} at {ranks_per_node} ranks per node; "
        f"order {suggested_order!r} keeps {', '.join(kept_inside)} inside one node"
    )
    if pushed_out:
        then = ", ".join(f"{kind} groups span {suggested_spans[kind]} nodes" for kind in pushed_out)
        advice += f" ({then} there)"
    return advice


@dataclass(frozen=True, init=False)
class HybridGrid:
    """Ranks on named axes, each axis an inter-node part (major) times an intra-node part.

    JAX's ``mesh_utils.create_hybrid_device_mesh`` for ranks: axis ``a`` has size
    ``inter[a] * intra[a]`` and coordinate ``inter_index * intra[a] + intra_index``.
    The rank at a coordinate is ``node * ranks_per_node + local``, where ``node``
    numbers the inter indices and ``local`` the intra indices. ``axes`` run
    fastest first, for ``node``, ``local`` and the groups alike: the axes of
    ``intra`` in the order given, then those only ``inter`` names. ``mesh_axes``
    is that order reversed, as in :class:`~meshstate.core.layout.Grid`.

    Example (16 ranks on 2 nodes of 8; data parallel twice inside a node and
    twice across nodes; a dp group ``[0, 1, 8, 9]`` is no order string's)::

        >>> grid = HybridGrid(intra={"dp": 2, "tp": 4}, inter={"dp": 2})
        >>> grid.sizes, grid.ranks_per_node
        ((4, 4), 8)
        >>> grid.groups(["dp"]).tolist()
        [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
        >>> grid.groups(["tp"]).tolist()
        [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
        >>> grid.coordinate(9)
        {'dp': 3, 'tp': 0}
    """

    axes: tuple[str, ...]
    intra_sizes: tuple[int, ...]
    inter_sizes: tuple[int, ...]
    _positions: Grid = field(repr=False, compare=False)

    def __init__(self, intra: Mapping[str, int], inter: Mapping[str, int]) -> None:
        axes = tuple(intra) + tuple(axis for axis in inter if axis not in intra)
        if not axes:
            raise ConfigError("a hybrid grid needs at least one axis in intra or inter")
        for part, part_sizes in (("intra", intra), ("inter", inter)):
            for axis, size in part_sizes.items():
                check_positive_int(f"{part} size of axis {axis!r}", size)
        intra_sizes = tuple(intra.get(axis, 1) for axis in axes)
        inter_sizes = tuple(inter.get(axis, 1) for axis in axes)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "intra_sizes", intra_sizes)
        object.__setattr__(self, "inter_sizes", inter_sizes)
        sizes = tuple(i * n for i, n in zip(intra_sizes, inter_sizes))
        object.__setattr__(self, "_positions", Grid(axes, sizes))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Axis sizes (intra times inter), fastest first."""
        return self._positions.sizes

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Axis names outer to inner (``axes`` reversed)."""
        return self._positions.mesh_axes

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Axis sizes outer to inner."""
        return self._positions.mesh_shape

    @property
    def world_size(self) -> int:
        """Number of ranks on the grid."""
        return self._positions.world_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks on one node: the product of the intra sizes."""
        return math.prod(self.intra_sizes)

    @property
    def num_nodes(self) -> int:
        """Number of nodes: the product of the inter sizes."""
        return math.prod(self.inter_sizes)

    def size(self, axis: str) -> int:
        """Size of one axis."""
        return self._positions.size(axis)

    def coordinate(self, rank: int) -> dict[str, int]:
        """The position of ``rank`` on every axis."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the grid's ranks 0..{self.world_size - 1}")
        node, local = divmod(rank, self.ranks_per_node)
        coordinate = {}
        for axis, intra_size, inter_size in zip(self.axes, self.intra_sizes, self.inter_sizes):
            node, inter_index = divmod(node, inter_size)
            local, intra_index = divmod(local, intra_size)
            coordinate[axis] = inter_index * intra_size + intra_index
        return coordinate

    def rank_grid(self) -> torch.Tensor:
        """All ranks as an int tensor of ``mesh_shape``: the rank at each coordinate."""
        inter = [f"n{i}" for i in range(len(self.axes))][::-1]
        intra = [f"l{i}" for i in range(len(self.axes))][::-1]
        merged = " ".join(f"({n} {l})" for n, l in zip(inter, intra))
        ranks = torch.arange(self.world_size).view(*self.inter_sizes[::-1], *self.intra_sizes[::-1])
        return einops.rearrange(ranks, f"{' '.join(inter)} {' '.join(intra)} -> {merged}")

    def groups(self, axes: Sequence[str]) -> torch.Tensor:
        """Every group of ``axes``, one row each, ordered as :meth:`Grid.groups` orders them.

        ``axes`` runs major to minor: the last one varies fastest inside a row.
        Rows are enumerated over the other axes, outer to inner.
        """
        return self.rank_grid().flatten()[self._positions.groups(axes)]

    def group_of(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The group of ``axes`` (major to minor) that contains ``rank``."""
        positions = self._positions.group_of(self._position(rank), axes)
        return tuple(self._rank_at(self._positions.coordinate(p)) for p in positions)

    def index_in_group(self, rank: int, axes: Sequence[str]) -> int:
        """Position of ``rank`` inside its group of ``axes`` (major to minor)."""
        return self._positions.index_in_group(self._position(rank), axes)

    def _position(self, rank: int) -> int:
        coordinate = self.coordinate(rank)
        return sum(coordinate[axis] * self._positions.stride(axis) for axis in self.axes)

    def _rank_at(self, coordinate: Mapping[str, int]) -> int:
        node = local = 0
        node_stride = local_stride = 1
        for axis, intra_size, inter_size in zip(self.axes, self.intra_sizes, self.inter_sizes):
            inter_index, intra_index = divmod(coordinate[axis], intra_size)
            node += inter_index * node_stride
            local += intra_index * local_stride
            node_stride *= inter_size
            local_stride *= intra_size
        return node * self.ranks_per_node + local


@dataclass
class HybridMesh:
    """The calling rank's ``DeviceMesh`` of a :class:`HybridGrid` and the groups behind it."""

    grid: HybridGrid
    device_mesh: DeviceMesh
    process_groups: ProcessGroupSet

    def destroy(self) -> None:
        """Destroy the process groups this build created; safe to call twice."""
        self.process_groups.destroy()


def init_hybrid_mesh(
    grid: HybridGrid,
    *,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> HybridMesh:
    """Build ``grid``'s ``DeviceMesh`` (dims ``grid.mesh_axes``); every rank must call it.

    Creates one group per axis through :func:`meshstate.core.groups.create_group_family`
    and builds the mesh from them (``DeviceMesh.from_group`` creates none).
    ``device_type`` defaults to ``"cuda"`` on an NCCL world and ``"cpu"`` otherwise.

    Example, on rank 9 of 16 with ``HybridGrid(intra={"dp": 2, "tp": 4}, inter={"dp": 2})``::

        hybrid = init_hybrid_mesh(grid)
        hybrid.device_mesh["dp"].mesh.tolist()   # [0, 1, 8, 9]
        hybrid.device_mesh["tp"].mesh.tolist()   # [9, 11, 13, 15]
        hybrid.device_mesh.get_coordinate()      # (0, 3): tp=0, dp=3
        hybrid.destroy()
    """
    if not dist.is_initialized():
        raise MeshStateError("torch.distributed is not initialized; call init_process_group first")
    if dist.get_world_size() != grid.world_size:
        raise ConfigError(
            f"hybrid grid has {grid.world_size} ranks "
            f"({' '.join(f'{a}={s}' for a, s in zip(grid.axes, grid.sizes))}) "
            f"but the world has {dist.get_world_size()}"
        )
    device_type = resolve_device_type(device_type)
    process_groups = ProcessGroupSet(by_name={})
    try:
        for axis in grid.mesh_axes:
            create_group_family(
                grid.groups([axis]).tolist(),
                description=axis,
                backend=backend,
                timeout=timeout,
                owner=process_groups,
            )
        device_mesh = DeviceMesh.from_group(
            [process_groups.by_name[axis] for axis in grid.mesh_axes],
            device_type,
            mesh=grid.rank_grid(),
            mesh_dim_names=grid.mesh_axes,
        )
    except BaseException:
        process_groups.destroy()
        raise
    return HybridMesh(grid, device_mesh, process_groups)
