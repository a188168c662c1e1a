"""torchtitan 0.3's ``ParallelDims`` on one meshstate mesh.

torchtitan unflattens its world mesh four times and lets every DeviceMesh
create its own groups. Here every axis name is a key of one
:class:`~meshstate.core.mesh.ParallelMesh` (order ``tp-cp-ep-dp-pp``, ``etp=1``,
its ``dp_replicate``, ``dp_shard`` and ``dp_shard-cp`` keys for torchtitan's
``dp_replicate``, ``dp_shard`` and ``fsdp``) and each DeviceMesh is assembled
from its groups, so a rank set gets one communicator however many names share it.

Example (``torchrun --nproc-per-node 8``)::

    from meshstate.titan import ParallelDims
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=8)
    dims.get_mesh(["dp_replicate", "dp_shard"])   # 2-D DeviceMesh for FSDP2's HSDP
    dims.get_mesh("tp")                           # on rank 5: ranks [4, 5]

torchtitan's trainer builds it with ``ParallelDims.from_config(config.parallelism,
world_size)`` and its model code asks ``resolve_mesh``, ``resolve_shared_mesh``,
``spmd_meshes``, ``spmd_dense_mesh`` and friends: all are here, with its answers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from torch.distributed.device_mesh import DeviceMesh

from meshstate.core import compat as _compat
from meshstate.layout.config import check_positive_int
from meshstate.errors import AxisError, ConfigError
from meshstate.layout.layout import HSDP_KINDS, Chunks, DerivedGroup, Key
from meshstate.core.build import init_mesh
from meshstate.core.mesh import ParallelMesh

SpmdBackend = Literal["partial_dtensor", "full_dtensor", "spmd_types"]


class DimNameError(AxisError, ValueError):
    """An axis name where code written for torchtitan catches ``ValueError``.

    Example: ``ParallelDims(...).get_mesh("fsdp")`` under the default backend.
    """


class ParallelDimsError(ConfigError, AssertionError):
    """Degrees torchtitan's ``ParallelDims`` refuses: a ``ValueError`` as every
    meshstate config error, and the ``AssertionError`` torchtitan raises.
    """


class ParallelismConfig(Protocol):
    """What :meth:`ParallelDims.from_config` reads of torchtitan's ``ParallelismConfig``."""

    data_parallel_replicate_degree: int
    data_parallel_shard_degree: int
    context_parallel_degree: int
    tensor_parallel_degree: int
    pipeline_parallel_degree: int
    expert_parallel_degree: int
    spmd_backend: SpmdBackend


class SpmdLayoutLike(Protocol):
    """What :meth:`ParallelDims.resolve_shared_mesh` reads of torchtitan's ``SpmdLayout``."""

    def axes(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class _GlobalMesh:
    """One of torchtitan's global meshes: the axes it shows, over the world's (pp, ...) grid."""

    visible: tuple[str, ...]
    axes: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass
class ParallelDims:
    """torchtitan's ``ParallelDims``: the same constructor, names, meshes and errors.

    ``dp_shard=-1`` takes what the other degrees leave of ``world_size``. Bad
    degrees raise :class:`ParallelDimsError` (a ``ValueError`` and, as in
    torchtitan, an ``AssertionError``); an ``ep`` that does not divide
    ``dp_shard * cp * tp`` is refused when the meshes are built, as torchtitan's
    fails there. An unknown axis name raises a ``ValueError``
    (:class:`~meshstate.errors.DimNameError`).

    Example, on rank 5 of 8::

        dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=8)
        dims.get_mesh("dp_replicate").mesh    # tensor([1, 5])
        dims.get_mesh(["dp_replicate", "dp_shard"]).mesh   # tensor([[1, 3], [5, 7]])
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    spmd_backend: SpmdBackend = "spmd_types"
    _mesh: ParallelMesh | None = field(default=None, init=False, repr=False)
    _key_of: dict[str, Key] = field(default_factory=dict, init=False, repr=False)
    _size_of: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_config(cls, parallelism_config: ParallelismConfig, world_size: int) -> ParallelDims:
        """The dims of torchtitan's ``config.parallelism`` (read by attribute, not imported).

        Example: ``ParallelDims.from_config(job_config.parallelism, world_size=8)``
        with ``tensor_parallel_degree=2`` and the rest at torchtitan's defaults
        gives ``tp=2, dp_shard=4``.
        """
        return cls(
            dp_replicate=parallelism_config.data_parallel_replicate_degree,
            dp_shard=parallelism_config.data_parallel_shard_degree,
            cp=parallelism_config.context_parallel_degree,
            tp=parallelism_config.tensor_parallel_degree,
            pp=parallelism_config.pipeline_parallel_degree,
            ep=parallelism_config.expert_parallel_degree,
            world_size=world_size,
            spmd_backend=parallelism_config.spmd_backend,
        )

    def __post_init__(self) -> None:
        try:
            for name in ("dp_replicate", "cp", "tp", "pp", "ep", "world_size"):
                check_positive_int(name, getattr(self, name))
            if self.dp_shard != -1:
                check_positive_int("dp_shard (or -1)", self.dp_shard)
        except ConfigError as error:
            raise ParallelDimsError(str(error)) from None
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            self.dp_shard = self.world_size // others
            if self.dp_shard < 1:
                raise ParallelDimsError(
                    f"dp_shard=-1 leaves no rank: world size {self.world_size} < "
                    f"dp_replicate*cp*tp*pp = {others}"
                )
        degrees = (self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp)
        if math.prod(degrees) != self.world_size:
            raise ParallelDimsError(
                "dp_replicate*dp_shard*cp*tp*pp = "
                f"{'*'.join(map(str, degrees))} = {math.prod(degrees)} is not the world size "
                f"{self.world_size}"
            )
        if self.spmd_backend not in ("partial_dtensor", "full_dtensor", "spmd_types"):
            raise ParallelDimsError(
                f"spmd_backend must be 'partial_dtensor', 'full_dtensor' or 'spmd_types', "
                f"got {self.spmd_backend!r}"
            )
        self._key_of = self._keys()
        self._size_of = self._sizes()

    def build_mesh(self) -> DeviceMesh:
        """Create the groups (every rank calls it) and return the 1-D world mesh ``("world",)``.

        Every DeviceMesh these dims hand out is kept in the mesh's store: after
        ``dims.mesh.destroy()`` each request raises, naming the line that destroyed it.
        """
        if self._mesh is None:
            if (self.dp_shard * self.cp * self.tp) % self.ep:
                raise ParallelDimsError(
                    f"ep={self.ep} does not divide dp_shard*cp*tp = "
                    f"{self.dp_shard}*{self.cp}*{self.tp} = {self.dp_shard * self.cp * self.tp}"
                )
            self._mesh = init_mesh(
                "tp-cp-ep-dp-pp", tp=self.tp, cp=self.cp, ep=self.ep, etp=1, pp=self.pp,
                dp_replicate=self.dp_replicate, joint_groups=HSDP_KINDS,
                derived=[key for key in self._key_of.values() if isinstance(key, DerivedGroup)],
            )
        store = self._store()
        world: DeviceMesh | None = store.get(("titan", "world"))
        if world is None:
            world = store[("titan", "world")] = DeviceMesh.from_group(
                _compat.default_group(), self.mesh.device_type, mesh_dim_names=("world",)
            )
        return world

    @property
    def mesh(self) -> ParallelMesh:
        """The meshstate mesh behind every DeviceMesh (built on first use)."""
        if self._mesh is None:
            self.build_mesh()
        assert self._mesh is not None
        return self._mesh

    def _store(self) -> dict[Hashable, Any]:
        """The mesh's store, where these dims keep their DeviceMeshes; refuses a destroyed mesh."""
        mesh = self.mesh
        mesh.check_alive()
        return mesh.store

    @property
    def world_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the whole world."""
        return self.build_mesh()

    def get_optional_mesh(
        self, dims: str | list[str], *, include_singleton_axes: bool = False
    ) -> DeviceMesh | None:
        """The DeviceMesh of ``dims``, or ``None`` where one of them is not enabled.

        Example: ``get_optional_mesh(["dp_replicate", "efsdp", "ep"])`` is a 3-D mesh
        when ``ep > 1``; ``get_optional_mesh("cp")`` is ``None`` when ``cp == 1``.
        """
        names = [dims] if isinstance(dims, str) else list(dims)
        keys = self._key_of
        for name in names:
            if name not in keys:
                raise DimNameError(f"Invalid mesh dim: {name!r}. Valid dimensions are: {list(keys)}")
        if not names:
            raise DimNameError(f"dims names no axis; valid dimensions are: {list(keys)}")
        if not include_singleton_axes and not all(self._exists(name) for name in names):
            return None
        return self._device_mesh(tuple(names))

    def get_mesh(self, dims: str | list[str]) -> DeviceMesh:
        """The DeviceMesh of ``dims``; a ``ValueError`` where one of them is not enabled."""
        mesh = self.get_optional_mesh(dims)
        if mesh is None:
            sizes = {name: self._size_of[name] for name in ([dims] if isinstance(dims, str) else dims)}
            raise DimNameError(f"mesh {dims!r} is not available: sizes {sizes}; it needs each > 1")
        return mesh

    def get_all_one_dimensional_meshes(self) -> dict[str, DeviceMesh]:
        """Every enabled axis of size > 1 by name, e.g. ``dp_replicate``, ``tp``, ``batch``, ``loss``."""
        return {
            name: self._device_mesh((name,))
            for name, size in self._size_of.items()
            if size > 1 and self._exists(name)
        }

    def get_activated_mesh(self, axes: list[str]) -> DeviceMesh | None:
        """The mesh of those ``axes`` that are enabled; ``None`` if none is.

        Unlike :meth:`get_optional_mesh`, a disabled (or unknown) axis is left
        out rather than making the answer ``None``. Example with ``tp=2, cp=1``:
        ``get_activated_mesh(["cp", "tp"])`` is the 1-D ``tp`` mesh.
        """
        enabled = [a for a in axes if a in self._key_of and self.get_optional_mesh(a) is not None]
        return self.get_optional_mesh(enabled) if enabled else None

    def spmd_meshes(self) -> list[DeviceMesh]:
        """The enabled parts of the dense and the sparse SPMD meshes (each where any axis is).

        The dense axes are ``dp, cp, tp`` under ``spmd_types``, ``dp_replicate,
        dp_shard, cp, tp`` under ``full_dtensor`` and ``dp_replicate, fsdp, tp``
        under ``partial_dtensor``; the sparse ones ``dp_replicate, efsdp, ep``.
        The same meshes every call, so ``mesh in dims.spmd_meshes()`` works.
        """
        dense = {
            "spmd_types": ["dp", "cp", "tp"],
            "full_dtensor": ["dp_replicate", "dp_shard", "cp", "tp"],
            "partial_dtensor": ["dp_replicate", "fsdp", "tp"],
        }[self.spmd_backend]
        activated = (self.get_activated_mesh(axes) for axes in (dense, list(_SPARSE_AXES)))
        return [mesh for mesh in activated if mesh is not None]

    def spmd_dense_mesh(self) -> DeviceMesh:
        """The 3-D ``(dp, cp, tp)`` mesh, size-1 axes kept, that ``spmd_types`` checks types on.

        Only under ``spmd_backend="spmd_types"``; otherwise a ``KeyError``
        (:class:`~meshstate.errors.AxisError`), as torchtitan's.
        """
        if self.spmd_backend != "spmd_types":
            raise AxisError(
                f"spmd_dense_mesh needs spmd_backend='spmd_types', this one is {self.spmd_backend!r}"
            )
        return self._device_mesh(("dp", "cp", "tp"))

    def spmd_sparse_mesh(self) -> DeviceMesh | None:
        """The ``(dp_replicate, efsdp, ep)`` mesh of expert dispatch under ``spmd_types``
        with ``ep > 1``; ``None`` otherwise."""
        if self.spmd_backend != "spmd_types" or self.ep == 1:
            return None
        return self._device_mesh(_SPARSE_AXES)

    def get_dense_tp_mesh(self) -> DeviceMesh:
        """The ``tp`` axis of the dense forward/backward mesh (a ``ValueError`` under
        ``partial_dtensor`` when ``tp == 1``, as ``get_mesh("tp")``)."""
        if self.spmd_backend == "spmd_types":
            return self.spmd_dense_mesh()["tp"]
        if self.spmd_backend == "full_dtensor":
            return self.spmd_meshes()[0]["tp"]
        return self.get_mesh("tp")

    def resolve_mesh(self, axes: Iterable[str]) -> DeviceMesh | None:
        """The SPMD mesh for a layout over ``axes`` (torchtitan's ``MeshAxisName`` or str).

        Only the axes the backend keeps in band count (``tp, ep`` under
        ``partial_dtensor``; ``dp, cp, tp, ep`` under ``spmd_types``; every axis,
        ``dp`` unfolded into ``dp_replicate, dp_shard``, under ``full_dtensor``),
        then :meth:`get_activated_mesh`. Under ``full_dtensor`` the result must be
        one of :meth:`spmd_meshes`, else a ``ValueError``.

        Example with ``tp=2`` under ``spmd_types``: ``resolve_mesh(["dp", "tp"])``
        is the 1-D ``tp`` mesh; with ``tp=1`` too it is ``None``.
        """
        names = [_axis_name(axis) for axis in axes]
        if self.spmd_backend == "full_dtensor":
            names = [n for name in names for n in (("dp_replicate", "dp_shard") if name == "dp" else (name,))]
        else:
            in_band = ("tp", "ep") if self.spmd_backend == "partial_dtensor" else ("dp", "cp", "tp", "ep")
            names = [name for name in names if name in in_band]
        mesh = self.get_activated_mesh(names)
        if mesh is None or self.spmd_backend != "full_dtensor":
            return mesh
        if not any(mesh is spmd_mesh for spmd_mesh in self.spmd_meshes()):
            raise DimNameError(
                f"Resolved mesh {list(mesh.mesh_dim_names or ())} does not match any SPMD mesh. "
                f"Valid meshes: {[list(m.mesh_dim_names or ()) for m in self.spmd_meshes()]}."
            )
        return mesh

    def resolve_shared_mesh(self, placements: Iterable[SpmdLayoutLike | None]) -> DeviceMesh | None:
        """The mesh of a boundary's layouts: :meth:`resolve_mesh` of their common axes.

        ``None`` entries are skipped, and all ``None`` gives ``None``. Layouts
        naming different axes raise :class:`ParallelDimsError` (torchtitan asserts).
        """
        layouts = [layout for layout in placements if layout is not None]
        if not layouts:
            return None
        axes = layouts[0].axes()
        for layout in layouts[1:]:
            if layout.axes() != axes:
                raise ParallelDimsError(
                    f"Inconsistent mesh axes within a boundary: {sorted(map(_axis_name, axes))} "
                    f"vs {sorted(map(_axis_name, layout.axes()))}"
                )
        return self.resolve_mesh(axes)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def non_data_parallel_size(self) -> int:
        """``cp * tp * pp``."""
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """What a sequence length must divide by: ``tp`` (sequence parallel) times ``2 * cp``."""
        return self.tp * (self.cp * 2)

    def _keys(self) -> dict[str, Key]:
        """Each valid axis name and the mesh key of its groups, in torchtitan's order."""
        efsdp = self.dp_shard * self.cp * self.tp // self.ep
        keys: dict[str, Key] = {
            "pp": "pp",
            "batch": "dp",
            "loss": "dp-cp",
            "dp_replicate": "dp_replicate",
            "cp": "cp",
            "tp": "tp",
            "ep": "ep",
            "efsdp": DerivedGroup("edp", Chunks(efsdp)),
        }
        if self.spmd_backend == "full_dtensor":
            keys["dp_shard"] = "dp_shard"
        elif self.spmd_backend == "spmd_types":
            keys.update(dp="dp", dp_shard="dp_shard")
        else:
            keys["fsdp"] = "dp_shard-cp"
        return keys

    def _sizes(self) -> dict[str, int]:
        batch = self.dp_replicate * self.dp_shard
        sizes = {
            "pp": self.pp, "batch": batch, "loss": batch * self.cp,
            "dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp, "ep": self.ep,
            "efsdp": self.dp_shard * self.cp * self.tp // self.ep,
            "dp": batch, "dp_shard": self.dp_shard, "fsdp": self.dp_shard * self.cp,
        }
        return {name: sizes[name] for name in self._key_of}

    def _exists(self, name: str) -> bool:
        """torchtitan's ``_mesh_exist``: size > 1, except the FSDP axes kept at size 1."""
        if name == "fsdp" or (name == "dp_shard" and self.spmd_backend != "partial_dtensor"):
            return True
        if name == "efsdp":
            return self.ep > 1
        return self._size_of[name] > 1

    def _global_meshes(self) -> list[_GlobalMesh]:
        """torchtitan's global meshes in its order (the loss mesh joins no other axis)."""
        pp, dpr, dps, cp, tp, ep = self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep
        dense: tuple[tuple[str, ...], tuple[int, ...]]
        dataloading = ("pp", "batch", "cp", "tp"), (pp, dpr * dps, cp, tp)
        if self.spmd_backend == "partial_dtensor":
            dense = ("pp", "dp_replicate", "fsdp", "tp"), (pp, dpr, dps * cp, tp)
        else:
            dense = ("pp", "dp_replicate", "dp_shard", "cp", "tp"), (pp, dpr, dps, cp, tp)
        sparse = ("pp", "dp_replicate", "efsdp", "ep"), (pp, dpr, dps * cp * tp // ep, ep)
        meshes = [_GlobalMesh(axes, axes, shape) for axes, shape in (dataloading, dense, sparse)]
        if self.spmd_backend == "spmd_types":
            meshes.append(_GlobalMesh(("dp", "cp", "tp"), ("pp", "dp", "cp", "tp"), (pp, dpr * dps, cp, tp)))
            if ep > 1:
                meshes.append(_GlobalMesh(sparse[0][1:], *sparse))
        return meshes

    def _device_mesh(self, names: tuple[str, ...]) -> DeviceMesh:
        """The DeviceMesh of ``names``, a view of the world mesh; the same request, the same object."""
        store = self._store()
        cached: DeviceMesh | None = store.get(("titan", "view", names))
        if cached is not None:
            return cached
        if names == ("loss",):
            loss = self._unflattened(("pp", "loss_mesh", "tp"), (self.pp, -1, self.tp), ("pp", "dp-cp", "tp"))
            view = loss["loss_mesh"]
        else:
            candidates = [m for m in self._global_meshes() if set(names) <= set(m.visible)]
            if not candidates:
                raise DimNameError(f"Invalid mesh name combinations {list(names)}.")
            chosen = candidates[0]
            keys = self._key_of
            root = self._unflattened(chosen.axes, chosen.shape, tuple(keys[a] for a in chosen.axes))
            try:
                view = root[names]
            except KeyError as error:
                raise DimNameError(
                    f"mesh dims {list(names)} must follow the order of {list(chosen.visible)}: {error}"
                ) from error
        store[("titan", "view", names)] = view
        return view

    def _unflattened(
        self, axes: tuple[str, ...], shape: tuple[int, ...], keys: tuple[Key, ...]
    ) -> DeviceMesh:
        """The world mesh unflattened into ``axes`` (one ``-1`` size inferred), each using its key's group."""
        store = self._store()
        cached: DeviceMesh | None = store.get(("titan", "root", axes))
        if cached is None:
            mesh = self.mesh
            sizes = tuple(self.world_size // -math.prod(shape) if size == -1 else size for size in shape)
            cached = store[("titan", "root", axes)] = _compat.unflatten_with_groups(
                self.world_mesh, sizes, axes, [mesh.group(key) for key in keys]
            )
        return cached


_SPARSE_AXES = ("dp_replicate", "efsdp", "ep")


def _axis_name(axis: object) -> str:
    """A mesh axis name, from torchtitan's ``MeshAxisName`` (a ``StrEnum``) or a str."""
    return str(getattr(axis, "value", axis))
