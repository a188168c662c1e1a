"""Which mesh a call uses: the calling thread's current mesh (``with mesh:``,
:func:`set_mesh`, JAX's :func:`get_mesh`), the mesh that answers a façade's call among the
rank's live meshes (:func:`mesh_for`), and the check that an argument is a meshstate mesh.

Example::

    with mesh:
        current_mesh() is mesh            # True
    require_parallel_mesh(mesh["tp"], "psum(mesh=...)")   # WrongMeshError: ... got DeviceMesh
"""

from __future__ import annotations

from meshstate.core.current import this_ranks_meshes
from meshstate.core.mesh import ParallelMesh, current
from meshstate.errors import AmbiguousMeshError, NotInitializedError, WrongMeshError


def live_meshes() -> list[ParallelMesh]:
    """This rank's meshes not destroyed yet (those built under its default group)."""
    return [mesh for mesh in this_ranks_meshes() if isinstance(mesh, ParallelMesh)]


def mesh_for(asking: str, default: ParallelMesh | None, default_name: str) -> ParallelMesh | None:
    """The mesh that answers a façade's call ``asking`` on this rank: the innermost ``with
    mesh:`` block's in this thread, else ``default`` (``None`` for none) where no other
    live mesh of the rank could answer instead.

    Raises :class:`~meshstate.errors.AmbiguousMeshError` naming the meshes and the
    call that picks one: no answer for the wrong grid. Example, with the mesh
    ``initialize_model_parallel`` built and another one alive::

        mesh_for("get_tensor_model_parallel_rank()", served, "the mesh initialize_model_parallel built")
        # AmbiguousMeshError: 2 live meshes on rank 5 could answer ...
    """
    if current.entered:
        return current.entered[-1]
    others = [mesh for mesh in live_meshes() if mesh is not default]
    if not others or default is None or default.destroyed_at is not None:
        return default
    named = [f"{default_name}, {default!r} (built at {default.built_at})",
             *(f"{mesh!r} built at {mesh.built_at}" for mesh in others)]
    raise AmbiguousMeshError(
        f"{len(named)} live meshes on rank {default.global_rank} could answer {asking}: "
        f"{'; '.join(named)}. Pick one with `with mesh:` around the call, or destroy the "
        "meshes not meant"
    )


def require_parallel_mesh(mesh: object, where: str) -> ParallelMesh:
    """``mesh`` if it is a :class:`ParallelMesh`, else a ``WrongMeshError`` naming ``where``.

    Example: ``require_parallel_mesh(mesh["tp"], "psum(mesh=...)")`` raises
    ``psum(mesh=...) takes a meshstate ParallelMesh, got DeviceMesh; ...``.
    """
    if isinstance(mesh, ParallelMesh):
        return mesh
    raise WrongMeshError(
        f"{where} takes a meshstate ParallelMesh, got {type(mesh).__name__}; pass the mesh "
        "that meshstate.init_mesh returned (its DeviceMeshes, such as mesh[\"tp\"], are for "
        "torch's own APIs)"
    )


def set_mesh(mesh: ParallelMesh | None) -> MeshSetting:
    """Make ``mesh`` the current mesh outside any ``with mesh:`` block (``None`` clears it);
    as ``with set_mesh(mesh):``, only until the block ends.

    Like ``with mesh:``, it holds for the calling thread (a thread-local value,
    which ``torch.compile`` guards on): a new thread starts with no current mesh.
    It sets the mesh at once; the value it returns, used in a ``with``
    statement, also makes ``mesh`` the innermost current mesh inside the block
    and, on leaving it, gives back the mesh set before.

    Example::

        meshstate.set_mesh(meshstate.init_mesh(tp=2))
        meshstate.current_mesh().size("tp")   # 2
        with meshstate.set_mesh(other):
            meshstate.current_mesh() is other   # True
        meshstate.current_mesh().size("tp")   # 2 again
    """
    checked = None if mesh is None else require_parallel_mesh(mesh, "set_mesh()")
    setting = MeshSetting(checked, current.set_mesh)
    current.set_mesh = checked
    return setting


class MeshSetting:
    """What :func:`set_mesh` returns: the mesh it set and the one set before, which a
    ``with`` block around the call gives back on exit."""

    def __init__(self, mesh: ParallelMesh | None, previous: ParallelMesh | None) -> None:
        self.mesh = mesh
        self.previous = previous

    def __enter__(self) -> ParallelMesh | None:
        if self.mesh is not None:
            self.mesh.__enter__()
        return self.mesh

    def __exit__(self, *exc_info: object) -> None:
        if self.mesh is not None:
            self.mesh.__exit__(*exc_info)
        current.set_mesh = self.previous


def get_mesh() -> ParallelMesh | None:
    """JAX's ``jax.get_mesh()``: the current mesh (as :func:`current_mesh`), or ``None``
    where none is set (JAX answers an empty mesh there, which meshstate has not).

    Example: ``with mesh: assert get_mesh() is mesh``; ``get_mesh()`` outside is ``None``.
    """
    return current_mesh() if current.entered or current.set_mesh is not None else None


def current_mesh() -> ParallelMesh:
    """The innermost mesh of a ``with mesh:`` block, else the one :func:`set_mesh` set.

    Both are per thread. Where that mesh was destroyed, the error names the
    line that did it. ``initialize_model_parallel`` sets its mesh too.
    """
    entered = current.entered
    mesh = entered[-1] if entered else current.set_mesh
    if mesh is not None:
        if mesh.destroyed_at is not None:
            mesh.check_alive()  # raises, naming the line that destroyed it
        return mesh
    raise NotInitializedError(
        "there is no current mesh in this thread; call meshstate.set_mesh(mesh) or use "
        "`with mesh:` on the ParallelMesh from meshstate.init_mesh (a torch DeviceMesh's "
        "`with` does not count)"
    )
