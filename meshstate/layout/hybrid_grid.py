"""Hybrid grids: ranks on axes that each split into an inter-node and an intra-node part.

Pure rank arithmetic, the layout layer's: nothing here touches
``torch.distributed``. :func:`meshstate.core.hybrid_mesh.init_hybrid_mesh` builds
the ``DeviceMesh`` of a :class:`HybridGrid`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import einops
import torch

from meshstate.layout.config import check_positive_int
from meshstate.errors import ConfigError
from meshstate.layout.grid import Grid


@dataclass(frozen=True, init=False)
class HybridGrid:
    """Ranks on named axes, each axis an inter-node part (major) times an intra-node part.

    JAX's ``mesh_utils.create_hybrid_device_mesh`` for ranks: axis ``a`` has size
    ``inter[a] * intra[a]`` and coordinate ``inter_index * intra[a] + intra_index``.
    The rank at a coordinate is ``node * ranks_per_node + local``, where ``node``
    numbers the inter indices and ``local`` the intra indices.
    ``axes_fastest_first`` is the order of ``node``, ``local`` and the groups
    alike: the axes of ``intra`` in the order given, then those only ``inter``
    names; ``axes_mesh_order`` is it reversed, as in :class:`~meshstate.layout.layout.Grid`.

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

    axes_fastest_first: tuple[str, ...]
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
        object.__setattr__(self, "axes_fastest_first", axes)
        object.__setattr__(self, "intra_sizes", intra_sizes)
        object.__setattr__(self, "inter_sizes", inter_sizes)
        sizes = tuple(i * n for i, n in zip(intra_sizes, inter_sizes))
        object.__setattr__(self, "_positions", Grid(axes, sizes))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Axis sizes (intra times inter), fastest first."""
        return self._positions.sizes

    @property
    def axes_mesh_order(self) -> tuple[str, ...]:
        """Axis names outer to inner (``axes_fastest_first`` reversed)."""
        return self._positions.axes_mesh_order

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
        for axis, intra_size, inter_size in zip(self.axes_fastest_first, self.intra_sizes, self.inter_sizes):
            node, inter_index = divmod(node, inter_size)
            local, intra_index = divmod(local, intra_size)
            coordinate[axis] = inter_index * intra_size + intra_index
        return coordinate

    def rank_grid(self) -> torch.Tensor:
        """All ranks as an int tensor of ``mesh_shape``: the rank at each coordinate."""
        inter = [f"n{i}" for i in range(len(self.axes_fastest_first))][::-1]
        intra = [f"l{i}" for i in range(len(self.axes_fastest_first))][::-1]
        merged = " ".join(f"({n} {l})" for n, l in zip(inter, intra))
        ranks = torch.arange(self.world_size).view(*self.inter_sizes[::-1], *self.intra_sizes[::-1])
        return einops.rearrange(ranks, f"{' '.join(inter)} {' '.join(intra)} -> {merged}")

    def groups(self, axes: Sequence[str]) -> torch.Tensor:
        """Every group of ``axes``, one row each, ordered as :meth:`Grid.groups` orders them.

        ``axes`` runs major to minor: the last one varies fastest inside a row.
        Rows are enumerated over the other axes, outer to inner.
        """
        return self.rank_grid().flatten()[self._positions.groups(axes)]

    def group_ranks(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The global ranks of the group of ``axes`` (major to minor) that holds ``rank``."""
        positions = self._positions.group_ranks(self._position(rank), axes)
        return tuple(self._rank_at(self._positions.coordinate(p)) for p in positions)

    def index_in_group(self, rank: int, axes: Sequence[str]) -> int:
        """Position of ``rank`` inside its group of ``axes`` (major to minor)."""
        return self._positions.index_in_group(self._position(rank), axes)

    def _position(self, rank: int) -> int:
        coordinate = self.coordinate(rank)
        return sum(coordinate[axis] * self._positions.stride(axis) for axis in self.axes_fastest_first)

    def _rank_at(self, coordinate: Mapping[str, int]) -> int:
        node = local = 0
        node_stride = local_stride = 1
        for axis, intra_size, inter_size in zip(self.axes_fastest_first, self.intra_sizes, self.inter_sizes):
            inter_index, intra_index = divmod(coordinate[axis], intra_size)
            node += inter_index * node_stride
            local += intra_index * local_stride
            node_stride *= inter_size
            local_stride *= intra_size
        return node * self.ranks_per_node + local
