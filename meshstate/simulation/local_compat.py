"""The private torch names behind simulated worlds, kept in one place.

``torch.distributed._local_tensor`` (torch 2.13) runs every rank of a world in
one process: under ``LocalTensorMode`` a tensor holds one value per rank and a
collective computes every group's result. Nothing of it is public yet; each
function here says which private name it relies on. Importing this module
imports torch's; :mod:`meshstate.core.world` tells, without importing
either, whether a simulation is on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed._local_tensor as _simulation
from torch.distributed import ProcessGroup
# The per-rank integer node torch's simulation maps to each rank's value in every op;
# meshstate's per-rank integers subclass it so they reach aten ops as torch's do.
from torch.distributed._local_tensor import LocalIntNode as LocalIntNode
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    _int_on_rank,
    enabled_local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed._local_tensor._c10d import _prepare_collective_groups


def enabled_ranks() -> frozenset[int] | None:
    """The ranks the enabled ``LocalTensorMode`` of this thread simulates, or ``None``.

    Uses ``enabled_local_tensor_mode`` and the mode's ``ranks``.
    """
    mode = enabled_local_tensor_mode()
    return None if mode is None else frozenset(mode.ranks)


def local_tensor_mode(ranks: frozenset[int]) -> LocalTensorMode:
    """torch's mode that runs every op and collective once per rank of ``ranks``."""
    return LocalTensorMode(ranks)


def simulation_paused() -> contextlib.AbstractContextManager[None]:
    """A block in which tensor ops run once, as in a plain process, not once per rank
    (to read each rank's values). Uses ``maybe_disable_local_tensor_mode``."""
    paused: contextlib.AbstractContextManager[None] = maybe_disable_local_tensor_mode()
    return paused


def per_rank_rows(rows: torch.Tensor) -> torch.Tensor:
    """A tensor whose value on simulated rank ``r`` is ``rows[r]`` (a view of it): made for
    every rank at once, where ``LocalTensorMode.rank_map`` would run an op per rank.
    Builds a ``LocalTensor`` from its per-rank dict.
    """
    with maybe_disable_local_tensor_mode():
        local: torch.Tensor = LocalTensor(dict(enumerate(rows.unbind(0))))  # type: ignore[no-untyped-call]
    return local


def replicated(tensor: torch.Tensor, ranks: frozenset[int]) -> torch.Tensor:
    """``tensor`` held by every simulated rank of ``ranks`` (a copy each): what
    ``torch.tensor`` makes for every rank in a simulated body. Builds a ``LocalTensor``."""
    if isinstance(tensor, LocalTensor):
        return tensor
    with maybe_disable_local_tensor_mode():
        local: torch.Tensor = LocalTensor({rank: tensor.clone() for rank in ranks})  # type: ignore[no-untyped-call]
    return local


def is_simulated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds a value per simulated rank (a ``LocalTensor``)."""
    return isinstance(tensor, LocalTensor)


def tensor_by_rank(tensor: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Each simulated rank's value of ``tensor``, or ``None`` for a plain tensor.

    Reads ``LocalTensor._local_tensors``.
    """
    if isinstance(tensor, LocalTensor):
        values: dict[int, torch.Tensor] = tensor._local_tensors
        return values
    return None


def int_on_rank(node: Any, rank: int) -> int:
    """Simulated rank ``rank``'s value of an integer ``SymInt`` node (a per-rank
    ``LocalIntNode``, a constant) or of a plain int. Uses ``_local_tensor._int_on_rank``.
    """
    value: int = _int_on_rank(node, rank)
    return value


def local_ints(node: LocalIntNode) -> dict[int, int]:
    """Each simulated rank's value of a per-rank integer node: ``LocalIntNode._local_ints``."""
    values: dict[int, int] = node._local_ints
    return values


def constant_bool_node(value: bool) -> Any:
    """torch's constant ``SymBool`` node: what a per-rank comparison that every rank
    answers alike returns. Uses ``torch._C._get_constant_bool_symnode``, as
    ``LocalIntNode``'s own comparisons do."""
    return torch._C._get_constant_bool_symnode(value)


def collective_groups(group: ProcessGroup) -> list[tuple[int, ...]]:
    """The rank sets the simulation runs each collective over ``group`` on.

    torch infers them from the group the process holds (rank 0's): its ranks
    read as a strided grid, repeated over the rest of the world. Raises
    ``AssertionError`` where they are no such grid. Uses
    ``_local_tensor._c10d._prepare_collective_groups``.
    """
    relative, offsets, _ = _prepare_collective_groups(group)
    return [tuple(offset + rank for rank in relative) for offset in offsets]


def raised_inside(error: BaseException) -> bool:
    """Whether ``error`` was raised inside torch's simulation (its innermost frame is in
    ``torch/distributed/_local_tensor``), as an op it cannot simulate is."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(os.path.dirname(_simulation.__file__))


def failed_compiling(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.compile`` failing inside itself
    (``torch._dynamo.exc.InternalTorchDynamoError``), as it does on a simulated world's
    per-rank sizes (dynamo reads ``has_hint`` of every symbolic integer's node)."""
    dynamo_errors = sys.modules.get("torch._dynamo.exc")
    return dynamo_errors is not None and isinstance(error, dynamo_errors.InternalTorchDynamoError)


def ints_made_as(combine: Callable[[dict[int, int]], Any]) -> contextlib.AbstractContextManager[Any]:
    """A block in which every per-rank integer torch's simulation makes from an op's
    results (``.item()``, a size) is ``combine(values by rank)`` instead of its own.
    Replaces ``_local_tensor._combine_int_rank_results``, whose ``LocalIntNode`` answers
    ``==`` for all ranks at once."""
    return mock.patch.object(_simulation, "_combine_int_rank_results", combine)


def run_for_each_rank(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` once per simulated rank, each with that rank's values of the
    per-rank integers in ``args``; results combined into per-rank values. Uses
    ``_local_tensor.maybe_run_for_local_tensor``."""
    return _simulation.maybe_run_for_local_tensor(function)(*args)


def forget_random_state() -> None:
    """Drop the RNG tracker DTensor keeps once a simulated world used it (a per-rank
    one), as torch's own simulated tests do. Resets ``tensor._random._rng_tracker``."""
    random = sys.modules.get("torch.distributed.tensor._random")
    if random is not None:
        setattr(random, "_rng_tracker", None)
