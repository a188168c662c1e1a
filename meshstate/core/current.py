"""The meshes alive on each rank and the calling thread's current meshes: what
:mod:`meshstate.core.mesh` reads to pick a mesh, kept apart from the mesh class.

Example: ``destroy_every_mesh()`` between tests; ``watch_live_meshes(callback)``
to hear of every mesh built or destroyed on the calling rank.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist

from meshstate.core import compat as _compat

MeshT = TypeVar("MeshT")
"""The mesh class (:class:`~meshstate.core.mesh.ParallelMesh`, which imports this module)."""


class CurrentMeshes(threading.local, Generic[MeshT]):
    """The calling thread's current meshes: what set_mesh() set, under the meshes of the
    `with mesh:` blocks entered. Per thread, as JAX's mesh context is; a thread-local
    rather than a ContextVar because torch.compile traces (and guards on) a thread-local
    attribute, and cannot read a ContextVar.
    """

    def __init__(self) -> None:
        self.set_mesh: MeshT | None = None
        self.entered: tuple[MeshT, ...] = ()


current: CurrentMeshes[Any] = CurrentMeshes()
"""Typed as meshes of :class:`~meshstate.core.mesh.ParallelMesh` where that module reads it."""


class Destroyable(Protocol):
    def destroy(self) -> None: ...


# The meshes not destroyed yet, each with the default group of the rank that built it, for
# destroy_every_mesh(): a process, or a thread of a threaded world (a default group each).
_live_meshes: weakref.WeakKeyDictionary[Destroyable, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)


def track_mesh(mesh: Destroyable) -> None:
    """Let :func:`destroy_every_mesh` destroy ``mesh`` (a hybrid mesh, say) if it is alive
    then, on the rank that built it."""
    _live_meshes[mesh] = _compat.default_group()
    live_meshes_changed()


_watchers: list[Callable[[], None]] = []


def watch_live_meshes(watcher: Callable[[], None]) -> None:
    """Call ``watcher`` after a mesh of the calling rank is built or destroyed (a façade
    that reads faster while its mesh is the only live one, say)."""
    _watchers.append(watcher)


def live_meshes_changed() -> None:
    """Call every watcher: a mesh of the calling rank was built or destroyed."""
    for watcher in _watchers:
        watcher()


def forget_mesh(mesh: Destroyable) -> None:
    """``mesh`` was destroyed: :func:`destroy_every_mesh` leaves it, the watchers hear."""
    _live_meshes.pop(mesh, None)
    live_meshes_changed()


def this_ranks_meshes() -> list[Destroyable]:
    """The meshes of this rank not destroyed yet (hybrid meshes too): those built under its
    default group, all of them where none is initialised."""
    world = _compat.default_group() if dist.is_initialized() else None
    return [mesh for mesh, built_under in list(_live_meshes.items())
            if world is None or built_under is world]


def destroy_every_mesh() -> None:
    """Destroy every mesh of this rank not destroyed yet (hybrid meshes too), and forget
    the calling thread's current meshes.

    For harnesses that run many tests in one process (``meshstate.testing``
    does between tests): whatever a test left alive, Megatron's façade
    included, is gone before the next. A rank is a process, or a thread of a
    threaded world (each has a default group of its own): a rank's meshes are
    those built under its default group, all of them where none is initialised.
    """
    for mesh in this_ranks_meshes():
        mesh.destroy()
    current.set_mesh, current.entered = None, ()


def first_caller_outside_meshstate() -> str:
    """``file:line`` of the innermost frame of the calling stack outside meshstate."""
    package = os.path.dirname(os.path.dirname(__file__)) + os.sep  # meshstate/, not core/
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
    return "an unknown place" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
