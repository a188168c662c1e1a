"""Where each plain shard of a state dict lies: pure key and shape arithmetic.

A :class:`Layout` says, for the keys of a flattened state dict, how each local
tensor's dims are split over the mesh's axes (a :class:`~meshstate.P`) and
which numbered items of a key (pipeline layers, local experts) are numbered per
rank along an axis. Nothing here touches ``torch.distributed``: the counts each
rank holds come in as numbers (:mod:`meshstate.checkpoint.saving` gathers them).

Example::

    layout = Layout(specs={"*.up.weight": P("tp", None), "*.down.weight": P(None, "tp")},
                    numbered={"layers": "pp", "experts": "ep"})
    layout.spec_of("layers.0.up.weight")               # P('tp', None)
    layout.global_key("layers.1.up.weight", {("layers", "pp"): 2})   # 'layers.3.up.weight'
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshstate.checkpoint.errors import CheckpointError
from meshstate.jax.sharding import P

_NUMBER = re.compile(r"^(0|[1-9][0-9]*)$")

Numbering = tuple[str, str]
"""A numbered key path and the axis that numbers its items: ``("layers", "pp")``."""


@dataclass(frozen=True)
class Layout:
    """How the plain shards of a state dict lie on the mesh.

    ``specs`` maps key patterns (``fnmatch``: ``*`` is any text, dots too) to the
    spec of the local tensors they match; a pattern also matches the keys under
    it (an AdamW moment ``<param key>.exp_avg`` follows its parameter). The first
    pattern that matches wins; a key none matches, and any 0-dim tensor, is
    replicated. ``numbered`` maps key paths (dotted segments, ``"decoder.layers"``)
    to the axis whose ranks number the items after them: the item a rank holds as
    its ``i``-th is the whole model's ``offset + i``, where ``offset`` counts the
    items of the ranks before it along the axis (uneven stages too).
    """

    specs: Mapping[str, P] = field(default_factory=dict)
    numbered: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pattern, spec in self.specs.items():
            if not isinstance(spec, P):
                raise CheckpointError(
                    f"Layout specs[{pattern!r}] must be a meshstate.P, got {type(spec).__name__}"
                )
        for path, axis in self.numbered.items():
            if not path or not isinstance(axis, str):
                raise CheckpointError(
                    f"Layout numbered[{path!r}] must name a key path and an axis, got {axis!r}"
                )

    def spec_of(self, key: str) -> P:
        """The spec of the local tensor at ``key``: the first pattern that matches it or a
        key above it; ``P()`` (replicated) if none does."""
        for pattern, spec in self.specs.items():
            if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, pattern + ".*"):
                return spec
        return P()

    def numberings_in(self, key: str) -> list[tuple[int, Numbering]]:
        """Each numbered item of ``key``: the position of its number among the key's
        dotted segments, and its path and axis."""
        segments = key.split(".")
        found = []
        for path, axis in self.numbered.items():
            wanted = path.split(".")
            for start in range(len(segments) - len(wanted)):
                end = start + len(wanted)
                if segments[start:end] == wanted and _NUMBER.match(segments[end]):
                    found.append((end, (path, axis)))
        return found

    def numbering_axes(self, key: str) -> frozenset[str]:
        """The axes that number ``key``'s items (ranks along them hold other items)."""
        return frozenset(axis for _, (_, axis) in self.numberings_in(key))

    def counts(self, keys: Iterable[str]) -> dict[Numbering, int]:
        """How many items each numbering has among ``keys`` (the local numbers must be
        ``0..n-1``, as a rank's own modules number them)."""
        seen: dict[Numbering, set[int]] = {}
        for key in keys:
            segments = key.split(".")
            for position, numbering in self.numberings_in(key):
                seen.setdefault(numbering, set()).add(int(segments[position]))
        for (path, axis), numbers in seen.items():
            if numbers != set(range(len(numbers))):
                raise CheckpointError(
                    f"the items under {path!r} (numbered along {axis!r}) are "
                    f"{ranges_text(numbers)} on this rank; a rank's own must be 0-{len(numbers) - 1}"
                )
        return {numbering: len(numbers) for numbering, numbers in seen.items()}

    def global_key(self, key: str, offsets: Mapping[Numbering, int]) -> str:
        """``key`` with each numbered item's local number moved by its offset."""
        segments = key.split(".")
        for position, numbering in self.numberings_in(key):
            segments[position] = str(int(segments[position]) + offsets.get(numbering, 0))
        return ".".join(segments)


def megatron_specs(module: Any, prefix: str = "") -> dict[str, P]:
    """The spec of each tensor-parallel parameter of ``module``, as megatron-core's layers
    declare it on the parameter (``tensor_model_parallel``, ``partition_dim``): split over
    ``tp``, or ``etp`` for an expert's (``allreduce=False``); keys as ``state_dict()`` names
    them after ``prefix``. For :class:`Layout`'s ``specs``.

    Example: ``megatron_specs(model, "model.")`` ->
    ``{"model.decoder.layers.0.mlp.linear_fc1.weight": P("tp", None), ...}``.
    """
    specs = {}
    for name, parameter in module.named_parameters():
        if not getattr(parameter, "tensor_model_parallel", False):
            continue
        axis = "tp" if getattr(parameter, "allreduce", True) else "etp"
        dims: list[str | None] = [None] * parameter.dim()
        dims[parameter.partition_dim] = axis
        specs[prefix + name] = P(*dims)
    return specs


def global_shape(local_shape: Iterable[int], spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The whole tensor's shape of a local block laid out by ``spec`` over axes of
    ``sizes`` (each split dim is the block's times its axes' sizes).

    Example: ``global_shape((4, 6), P("tp", None), {"tp": 2}) == (8, 6)``."""
    shape = list(local_shape)
    if len(spec.dims) > len(shape):
        raise CheckpointError(f"{spec!r} has {len(spec.dims)} dims but the shard has {len(shape)}")
    for dim, entry in enumerate(spec.dims):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        shape[dim] *= math.prod(sizes[axis] for axis in axes)
    return tuple(shape)


def global_offsets(
    local_shape: Iterable[int], spec: P, coordinate: Mapping[str, int], sizes: Mapping[str, int],
) -> tuple[int, ...]:
    """Where a local block laid out by ``spec`` starts in the whole tensor, on the rank at
    ``coordinate``: along each split dim, the block's index over its axes (the first axis
    major) times its size.

    Example: ``global_offsets((4, 6), P(("cp", "tp"), None), {"cp": 1, "tp": 1},
    {"cp": 2, "tp": 2}) == (12, 0)`` (block 1 * 2 + 1 = 3 of 4 rows each)."""
    offsets = [0] * len(tuple(local_shape))
    for dim, (size, entry) in enumerate(zip(local_shape, spec.dims)):
        index = 0
        for axis in (entry,) if isinstance(entry, str) else tuple(entry or ()):
            index = index * sizes[axis] + coordinate[axis]
        offsets[dim] = index * size
    return tuple(offsets)


Holding = tuple[tuple[int, ...], tuple[int, ...]]
"""What a rank says of one saved key: its block's offsets (``()`` for a plain value) and
the ranks of its replica group."""


def first_stray(held: Sequence[Mapping[str, Holding]]) -> str | None:
    """The first saved key whose block is held by ranks other than exactly its replica
    group, as one line naming the key and the ranks; ``None`` if every key's holders are
    its replica group. ``held[rank]`` is what that rank holds.

    Example: ranks 0 and 1 both hold ``embed``'s block at ``(0,)``, but each says its
    replica group is itself: ``first_stray([{"embed": ((0,), (0,))}, {"embed": ((0,), (1,))}])``
    -> ``"embed: its block at (0,) is held by ranks 0-1, but rank 0's replica group is rank 0; ..."``
    (the caller says what was not done).
    """
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for rank, keys in enumerate(held):
        for key, (offsets, _) in keys.items():
            holders.setdefault((key, offsets), []).append(rank)
    for (key, offsets), ranks in holders.items():
        for rank in ranks:
            group = held[rank][key][1]
            if set(group) != set(ranks):
                return (f"{key}: its block at {offsets} is held by {_ranks_text(ranks)}, but rank {rank}'s "
                        f"replica group is {_ranks_text(group)}; a key must be held by exactly "
                        "its replica group (number items that differ along an axis in Layout.numbered, "
                        "give every rank the same spec)")
    return None


def _ranks_text(ranks: Iterable[int]) -> str:
    listed = sorted(set(ranks))
    return f"{'rank' if len(listed) == 1 else 'ranks'} {ranges_text(listed)}"


def ranges_text(numbers: Iterable[int]) -> str:
    """Numbers as short ranges: ``{0, 1, 2, 5}`` -> ``"0-2, 5"``."""
    ordered = sorted(set(numbers))
    parts: list[str] = []
    first = 0
    while first < len(ordered):
        last = first
        while last + 1 < len(ordered) and ordered[last + 1] == ordered[last] + 1:
            last += 1
        parts.append(str(ordered[first]) if first == last else f"{ordered[first]}-{ordered[last]}")
        first = last + 1
    return ", ".join(parts) or "none"


def flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict of dicts as one dict of dotted keys (lists and other values are leaves)."""
    flat: dict[str, Any] = {}
    for name, value in state.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, key + "."))
        else:
            flat[key] = value
    return flat
