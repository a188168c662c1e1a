"""The layout's keyword arguments (:class:`SizeArguments`) and their validated value, :class:`MeshConfig`: world size, order string, sizes.

Pure Python: nothing here touches ``torch.distributed``. Every check runs when a
:class:`MeshConfig` is constructed, so a bad config fails before any process
group exists.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from collections.abc import Iterable, Mapping
from typing import TypedDict, Unpack

from meshstate.errors import ConfigError

ORDER_AXES = ("tp", "cp", "ep", "dp", "pp")
"""Axis names an order string may contain (Megatron's tokens)."""

DEFAULT_ORDER = "tp-cp-ep-dp-pp"

MAX_WORLD_SIZE = 2**31 - 1
"""The largest world torch.distributed numbers (ranks are 32-bit signed integers)."""

# Megatron's RankGenerator appends axes missing from the order in this order.
_MISSING_AXIS_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp")


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an ``int`` if it is a positive integer, else a ConfigError naming ``name``.

    Any integer type counts (``numpy.int64(2)``, as megatron-core takes it); a bool,
    a float or a string does not.
    """
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


def _order_tokens(order: object) -> tuple[str, ...]:
    if not isinstance(order, str):
        raise ConfigError(f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}")
    tokens = [token.strip().lower() for token in order.split("-")]
    for token in tokens:
        if not token:
            raise ConfigError(f"order {order!r} has an empty axis name")
        if token not in ORDER_AXES:
            raise ConfigError(
                f"order {order!r} has unknown axis {token!r}; valid axes are {', '.join(ORDER_AXES)}"
            )
        if tokens.count(token) > 1:
            raise ConfigError(f"order {order!r} names axis {token!r} twice")
    return tuple(tokens)


def parse_order(order: object) -> tuple[str, ...]:
    """Split an order string into axis names, first (fastest-varying) first.

    Axes the string leaves out are appended the way megatron-core does, so the
    result always names all five axes.

    Example: ``parse_order("tp-dp-pp") == ("tp", "dp", "pp", "ep", "cp")``.
    """
    tokens = _order_tokens(order)
    return tokens + tuple(a for a in _MISSING_AXIS_APPEND_ORDER if a not in tokens)


def sizes_text(sizes: Mapping[str, object]) -> str:
    """Sizes for a message: ``{"tp": 2, "pp": 4}`` -> ``"tp=2 pp=4"``."""
    return " ".join(f"{name}={size}" for name, size in sizes.items())


class SizeArguments(TypedDict, total=False):
    """The axis sizes of a layout by keyword, as :func:`meshstate.init_mesh`,
    :func:`meshstate.adopt`, :class:`MeshConfig`, the command line and the bench take them.

    The one list of them: a size added here reaches every one of those. A size
    left out is 1; ``etp`` left out (or ``None``) is ``tp``.
    """

    tp: int
    cp: int
    ep: int
    etp: int | None
    pp: int
    dp_replicate: int


SIZE_NAMES = tuple(SizeArguments.__annotations__)
"""The names of :class:`SizeArguments`, in declaration order."""


class MeshArguments(SizeArguments, total=False):
    """The keyword arguments of :func:`meshstate.init_mesh` that say the layout: the order and the sizes."""

    order: str


def reject_unknown(where: str, given: Mapping[str, object], known: Iterable[str]) -> None:
    """A ``TypeError`` naming the first of ``given``'s keywords not in ``known``, as Python's
    own for a function ``where`` without ``**kwargs``."""
    unknown = [name for name in given if name not in set(known)]
    if unknown:
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}")


@dataclass(frozen=True, init=False)
class MeshConfig:
    """A validated parallel layout: world size, order and the size of every axis.

    ``dp`` is inferred as ``world_size // (tp*cp*pp)`` and the expert data-parallel
    size ``edp`` as ``world_size // (etp*ep*pp)``; ``etp`` defaults to ``tp``.
    ``dp_replicate`` splits ``dp`` for HSDP into ``dp_replicate`` (outer) times
    ``dp_shard = dp // dp_replicate`` (inner, the faster part of ``dp``).
    Compares and hashes by value.

    Example::

        >>> cfg = MeshConfig(16, tp=2, pp=2, ep=2, etp=1)
        >>> cfg.dp, cfg.edp
        (4, 4)
        >>> MeshConfig(12, tp=2, pp=8)
        Traceback (most recent call last):
        ...
        meshstate.errors.ConfigError: world size 12 is not divisible by tp*cp*pp = 2*1*8 = 16
    """

    world_size: int
    order: str
    tp: int
    cp: int
    ep: int
    etp: int
    pp: int
    dp_replicate: int

    def __init__(
        self, world_size: int, *, order: str = DEFAULT_ORDER, **sizes: Unpack[SizeArguments]
    ) -> None:
        reject_unknown("MeshConfig.__init__()", sizes, SIZE_NAMES)
        world_size = check_positive_int("world size", world_size)
        if world_size > MAX_WORLD_SIZE:
            raise ConfigError(
                f"world size {world_size} is above {MAX_WORLD_SIZE}, the most ranks "
                "torch.distributed numbers"
            )
        checked = {
            name: check_positive_int(name, sizes.get(name, 1))
            for name in SIZE_NAMES
            if name != "etp"
        }
        etp = sizes.get("etp")
        checked["etp"] = checked["tp"] if etp is None else check_positive_int("etp", etp)
        tokens = _order_tokens(order)
        if order.lower() != "-".join(tokens):
            raise ConfigError(
                f"order {order!r} has spaces around its axis names; megatron-core refuses "
                f"them too (write {'-'.join(tokens)!r})"
            )
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "order", "-".join(tokens))
        for name, size in checked.items():
            object.__setattr__(self, name, size)
        self._check_divisible()
        self._check_axes_in_order()
        self._check_pipeline_groups_agree()

    @property
    def order_axes(self) -> tuple[str, ...]:
        """All five order axes, fastest first, missing ones appended Megatron-style."""
        return parse_order(self.order)

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def dp_shard(self) -> int:
        """The inner, faster part of ``dp`` under HSDP: ``dp // dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def edp(self) -> int:
        """Data-parallel size of the expert layers."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def arguments(self) -> MeshArguments:
        """What to pass :func:`meshstate.init_mesh` to build this layout on a world of its size.

        Example: ``init_mesh(**MeshConfig(8, tp=2).arguments())``.
        """
        arguments = MeshArguments(order=self.order)
        for name in SIZE_NAMES:
            arguments[name] = getattr(self, name)  # type: ignore[literal-required]
        return arguments

    def sizes(self) -> dict[str, int]:
        """Every axis size by name: ``tp cp ep etp pp dp edp``, then ``dp_replicate
        dp_shard`` where ``dp_replicate > 1``."""
        hsdp = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        return {
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "etp": self.etp,
            "pp": self.pp,
            "dp": self.dp,
            "edp": self.edp,
            **(hsdp if self.dp_replicate > 1 else {}),
        }

    def dense_sizes(self) -> dict[str, int]:
        """Size of each order axis in the dense view (``ep`` is 1 there)."""
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    def hsdp_sizes(self) -> dict[str, int]:
        """Size of each axis of the HSDP view: the dense view with ``dp`` split in two."""
        return {
            "tp": self.tp,
            "cp": self.cp,
            "dp_shard": self.dp_shard,
            "dp_replicate": self.dp_replicate,
            "pp": self.pp,
        }

    def expert_sizes(self) -> dict[str, int]:
        """Size of each order axis in the expert view (``tp`` is etp, ``dp`` is edp, ``cp`` is 1)."""
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    def _check_divisible(self) -> None:
        for names, values in (
            ("tp*cp*pp", (self.tp, self.cp, self.pp)),
            ("etp*ep*pp", (self.etp, self.ep, self.pp)),
        ):
            product = math.prod(values)
            if self.world_size % product:
                factors = "*".join(map(str, values))
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by "
                    f"{names} = {factors} = {product}"
                )
        if self.dp % self.dp_replicate:
            raise ConfigError(
                f"dp = {self.dp} (world size {self.world_size} / tp*cp*pp = "
                f"{self.tp * self.cp * self.pp}) is not divisible by dp_replicate = "
                f"{self.dp_replicate}"
            )

    def _check_axes_in_order(self) -> None:
        named = self.order.split("-")
        needs = (
            ("tp", "tp", self.tp, ""),
            ("cp", "cp", self.cp, ""),
            ("ep", "ep", self.ep, ""),
            ("pp", "pp", self.pp, ""),
            ("tp", "etp", self.etp, " (expert layers use the 'tp' slot)"),
            (
                "dp",
                "dp",
                self.dp,
                f" (world size {self.world_size} / tp*cp*pp = {self.tp * self.cp * self.pp})",
            ),
            (
                "dp",
                "edp",
                self.edp,
                f" (world size {self.world_size} / etp*ep*pp = {self.etp * self.ep * self.pp}; "
                "expert layers use the 'dp' slot)",
            ),
        )
        for token, name, size, why in needs:
            if size > 1 and token not in named:
                raise ConfigError(
                    f"{name}={size}{why} needs axis {token!r} in order {self.order!r}"
                )

    def _check_pipeline_groups_agree(self) -> None:
        if self.pp == 1:
            return
        axes = self.order_axes
        before_pp = axes[: axes.index("pp")]
        if not self.order.endswith("pp") and self.dp != self.edp:
            raise ConfigError(
                f"order {self.order!r} does not end with 'pp', which needs equal dense and "
                f"expert data-parallel sizes, but dp = {self.dp} and edp = {self.edp}"
            )
        dense_names = [{"tp": "tp", "cp": "cp", "dp": "dp"}[a] for a in before_pp if a != "ep"]
        expert_names = [{"tp": "etp", "ep": "ep", "dp": "edp"}[a] for a in before_pp if a != "cp"]
        sizes = self.sizes()
        dense_span = math.prod(sizes[name] for name in dense_names)
        expert_span = math.prod(sizes[name] for name in expert_names)
        if dense_span != expert_span:
            raise ConfigError(
                f"order {self.order!r} gives different pipeline groups to dense and expert "
                f"layers: ranks one stage apart differ by {'*'.join(dense_names) or '1'} = "
                f"{dense_span} in dense layers but {'*'.join(expert_names) or '1'} = "
                f"{expert_span} in expert layers; put 'pp' last"
            )
