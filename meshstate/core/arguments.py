"""The build options of :func:`meshstate.init_mesh`, :func:`meshstate.make_mesh` and
:func:`meshstate.adopt` (:class:`BuildArguments`, :class:`AdoptArguments`), checked here.

Every check runs before ``init_mesh`` touches the store or creates a group, so
a wrong type or value fails at once, on the rank that passed it, with a
:class:`~meshstate.errors.ConfigError` naming the parameter. The layout
itself (sizes, order, world) is :class:`~meshstate.layout.config.MeshConfig`'s to check;
the rest becomes one :class:`BuildOptions` value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, TypedDict, TypeVar, cast

import torch
import torch.distributed as dist

from meshstate.layout.config import SIZE_NAMES, SizeArguments, reject_unknown
from meshstate.errors import ConfigError
from meshstate.core.groups import GroupCreation, GroupOptions
from meshstate.layout.layout import DerivedGroup, Key

T = TypeVar("T")


class GroupArguments(TypedDict, total=False):
    """How a build makes its groups; :func:`~meshstate.init_mesh` and :func:`~meshstate.adopt` take them.

    ``backend`` and ``timeout`` reach every group created (``None``: the default
    group's backend, torch's default timeout); ``device_type`` is the
    DeviceMeshes' (``None``: see :func:`resolve_device_type`).
    """

    backend: str | None
    timeout: timedelta | None
    device_type: str | None


class BuildArguments(GroupArguments, total=False):
    """What :func:`~meshstate.init_mesh` takes beyond the layout and ``ranks``: extra keys,
    options by key, fields to agree on and how groups are made (see its docstring)."""

    joint_groups: Sequence[str]
    derived: Sequence[DerivedGroup]
    group_options: Mapping[Key, GroupOptions] | None
    agree_on: Mapping[str, object] | None
    group_creation: GroupCreation | None


class AdoptArguments(SizeArguments, GroupArguments, total=False):
    """Every keyword argument of :func:`~meshstate.adopt`."""


@dataclass(frozen=True)
class BuildOptions:
    """A build's arguments beyond the layout, checked: :class:`BuildArguments` as one value.

    A field left out is ``None`` or empty. Built by :meth:`check`; posted to the
    agreement as :meth:`agreed`.
    """

    backend: str | None = None
    timeout: timedelta | None = None
    device_type: str | None = None
    joint_groups: tuple[str, ...] = ()
    derived: tuple[DerivedGroup, ...] = ()
    group_options: Mapping[Key, GroupOptions] = field(default_factory=dict)
    agree_on: Mapping[str, object] = field(default_factory=dict)
    group_creation: GroupCreation | None = None

    @classmethod
    def check(cls, arguments: BuildArguments) -> BuildOptions:
        """``arguments`` checked, in the order of the fields; a ConfigError names the first wrong one."""
        return cls(
            backend=check_backend("backend", arguments.get("backend")),
            timeout=check_timeout(arguments.get("timeout")),
            device_type=check_device_type(arguments.get("device_type")),
            joint_groups=check_sequence("joint_groups", arguments.get("joint_groups", ()), str),
            derived=check_sequence("derived", arguments.get("derived", ()), DerivedGroup),
            group_options=check_group_options(arguments.get("group_options")),
            agree_on=check_agree_on(arguments.get("agree_on")),
            group_creation=check_group_creation(arguments.get("group_creation")),
        )

    def agreed(self) -> dict[str, object]:
        """What every rank posts to agree on these options: each field as JSON, and
        ``agree_on``'s fields beside them."""
        posted = {item.name: _as_json(getattr(self, item.name)) for item in fields(self)}
        del posted["agree_on"]
        return {**posted, **self.agree_on}


def split_arguments(
    where: str, arguments: Mapping[str, Any], options: type[GroupArguments]
) -> tuple[SizeArguments, BuildArguments]:
    """``arguments`` as the layout's sizes and the build's ``options``; a ``TypeError``
    for a keyword that is neither (Python's own message, for ``where``)."""
    option_names = options.__annotations__
    reject_unknown(where, arguments, (*SIZE_NAMES, *option_names))
    sizes = {name: value for name, value in arguments.items() if name in SIZE_NAMES}
    rest = {name: value for name, value in arguments.items() if name in option_names}
    return cast(SizeArguments, sizes), cast(BuildArguments, rest)


def resolve_device_type(device_type: str | None) -> str:
    """``device_type``, else the default group's: ``"cuda"`` on an NCCL world, ``"cpu"`` otherwise."""
    return device_type or ("cuda" if "nccl" in str(dist.get_backend()) else "cpu")


def _as_json(value: object) -> object:
    """An option as the agreement posts it: a timeout in seconds, a derived group by its
    string, a key's GroupOptions as ``[backend, has pg_options, separate]``."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, tuple):
        return [_as_json(item) for item in value]
    if isinstance(value, DerivedGroup):
        return str(value)
    if isinstance(value, GroupOptions):
        return [value.backend, value.pg_options is not None, value.separate]
    if isinstance(value, Mapping):
        return {str(key): _as_json(item) for key, item in value.items()}
    return value


def check_backend(name: str, backend: object) -> str | None:
    """``backend`` if it is ``None`` or a backend torch knows (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise ConfigError(f"{name} must be a backend name such as 'gloo' or 'nccl', got {backend!r}")
    parts = [part.partition(":")[2] if ":" in part else part for part in backend.split(",")]
    unknown = [
        part for part in parts
        if part.lower() not in dist.Backend.backend_list or part.lower() == dist.Backend.UNDEFINED
    ]
    if unknown or not parts:
        raise ConfigError(
            f"{name} {backend!r} names no backend torch knows; known: "
            f"{', '.join(dist.Backend.backend_list)}"
        )
    return backend


def check_timeout(timeout: object) -> timedelta | None:
    """``timeout`` if it is ``None`` or a positive ``datetime.timedelta``."""
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ConfigError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")
    return timeout


def check_device_type(device_type: object) -> str | None:
    """``device_type`` if it is ``None`` or a torch device type without an index (``"cuda"``)."""
    if device_type is None:
        return None
    try:
        known = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:
        known = False
    if not known:
        raise ConfigError(
            f"device_type must be a torch device type such as 'cpu' or 'cuda', got {device_type!r}"
        )
    return device_type  # type: ignore[return-value]


def check_sequence(name: str, values: object, kind: type[T]) -> tuple[T, ...]:
    """``values`` as a tuple if it is a list or tuple of ``kind`` values."""
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{name} must be a list of {kind.__name__} values, got {values!r}")
    for value in values:
        if not isinstance(value, kind):
            raise ConfigError(f"{name} takes {kind.__name__} values, got {value!r}")
    return tuple(values)


def check_group_options(options: object) -> Mapping[Key, GroupOptions]:
    """``options`` if it is ``None`` (none) or a mapping of keys to :class:`GroupOptions`."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"group_options must be a dict of GroupOptions by key, got {options!r}")
    for key, value in options.items():
        if not isinstance(key, (str, DerivedGroup)) or not isinstance(value, GroupOptions):
            raise ConfigError(
                f"group_options maps a key (a string or DerivedGroup) to a GroupOptions, "
                f"got {key!r}: {value!r}"
            )
        check_backend(f"group_options[{str(key)!r}].backend", value.backend)
    return options


def check_agree_on(agree_on: object) -> Mapping[str, object]:
    """``agree_on`` if it is ``None`` (nothing) or a mapping with string keys."""
    if agree_on is None:
        return {}
    if not isinstance(agree_on, Mapping) or not all(isinstance(k, str) for k in agree_on):
        raise ConfigError(f"agree_on must be a dict with string keys, got {agree_on!r}")
    return agree_on


def check_group_creation(group_creation: object) -> GroupCreation | None:
    """``group_creation`` if it is ``"split"``, ``"local"`` or ``None``."""
    if group_creation not in (None, "split", "local"):
        raise ConfigError(
            f"group_creation must be 'split', 'local' or None (choose), got {group_creation!r}"
        )
    return group_creation


def check_ranks(ranks: object, world_size: int) -> range | tuple[int, ...] | None:
    """``ranks`` as a range where consecutive (a ``range`` is never listed), else a tuple;
    a ConfigError unless they are increasing ranks of a world of ``world_size``."""
    if ranks is None:
        return None
    wrong = (
        f"ranks must be increasing ranks of the world 0..{world_size - 1} (local rank i "
        "of the mesh is ranks[i]), got "
    )
    if isinstance(ranks, range):
        if ranks and ranks.step > 0 and 0 <= ranks[0] and ranks[-1] < world_size:
            return ranks if ranks.step == 1 else tuple(ranks)
        raise ConfigError(f"{wrong}{ranks!r}")
    listed = tuple(ranks) if isinstance(ranks, Sequence) and not isinstance(ranks, str) else ()
    if not listed or any(isinstance(r, bool) or not isinstance(r, int) for r in listed):
        raise ConfigError(f"ranks must be a non-empty range or list of ranks, got {ranks!r}")
    increasing = all(a < b for a, b in zip(listed, listed[1:]))
    if not increasing or not 0 <= listed[0] <= listed[-1] < world_size:
        shown = list(listed) if len(listed) <= 16 else f"{list(listed[:16])} ..."
        raise ConfigError(f"{wrong}{shown}")
    if listed[-1] - listed[0] + 1 == len(listed):
        return range(listed[0], listed[-1] + 1)
    return listed
