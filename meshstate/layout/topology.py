"""Nodes: which groups stay inside one, and a better order when they don't.

Ranks sit on nodes the way torchrun places them: node ``n`` holds ranks
``n*ranks_per_node .. (n+1)*ranks_per_node - 1``. :func:`locality_report` says,
for every group kind of a :class:`~meshstate.layout.layout.ParallelLayout`, how many
nodes one group spans, and warns when a bandwidth-hungry axis (tp, cp, ep, etp)
crosses nodes while another order would keep it inside one. Pure rank
arithmetic. :class:`~meshstate.layout.hybrid_grid.HybridGrid` (JAX-style layouts,
every axis split into an inter-node and an intra-node part) and
:func:`~meshstate.core.hybrid_mesh.init_hybrid_mesh` are ``meshstate.HybridGrid``
and ``meshstate.init_hybrid_mesh``.

Example (16 ranks, 8 per node; the report also warns, caught here)::

    >>> layout = ParallelLayout(MeshConfig(16, order="dp-tp-pp", tp=8))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     report = locality_report(layout, 8)
    >>> report.nodes_spanned["tp"], report.suggested_order, caught[0].category.__name__
    (2, 'tp-dp-pp', 'NodeCrossingWarning')
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from meshstate.layout.config import MeshConfig, check_positive_int
from meshstate.errors import AxisError, ConfigError
from meshstate.layout.layout import GROUP_KINDS, ParallelLayout

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
        key = (kind, *((a, s) for a, s in zip(grid.axes_fastest_first, grid.sizes) if s > 1))
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
