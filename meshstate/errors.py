"""The exceptions meshstate raises.

Every error is a :class:`MeshStateError`. Each one also subclasses the builtin
exception that code written for torch or megatron-core already catches, so
``except ValueError`` around a bad config or ``except KeyError`` around an
unknown mesh axis keeps working.
"""

from __future__ import annotations


class MeshStateError(Exception):
    """Base class of every meshstate error."""


class ConfigError(MeshStateError, ValueError):
    """A parallel configuration that cannot be built.

    Raised before any process group exists; the message names the parameter
    and the numbers, e.g. ``world size 12 is not divisible by tp*cp*pp =
    2*1*8 = 16``.
    """


class ArgumentTypeError(MeshStateError, TypeError):
    """An argument of the wrong type: a string where a tensor belongs, an axis name that
    is not a string. Python's ``TypeError``; the message names the parameter and
    what was given.
    """


class AxisError(MeshStateError, KeyError):
    """An axis or joint-group name that the mesh or layout does not have.

    The message lists the valid names.
    """

    def __str__(self) -> str:
        # KeyError would print the message repr-quoted; show it as written.
        return str(self.args[0]) if self.args else ""


class NotInitializedError(MeshStateError, RuntimeError, AssertionError):
    """State asked for before it was built, or after it was destroyed.

    megatron-core answers a getter called before ``initialize_model_parallel``
    with an ``AssertionError``; code that catches that (or ``RuntimeError``)
    still catches this.
    """


class ConfigMismatchError(ConfigError, RuntimeError):
    """Ranks asked for different meshes; the message names the ranks and fields.

    Every rank raises the same message, before any process group is made.
    """


class MeshTimeoutError(MeshStateError, TimeoutError, RuntimeError):
    """Ranks did not arrive (or a group did not form) within the timeout.

    The message names the ranks that are missing.
    """


class AbandonedError(MeshStateError, RuntimeError):
    """A rank waiting for the others in a mesh build or a group's creation learned that
    they will not come: another rank failed and its world ended the run (a threaded
    world does). The message says why.
    """


class WrongMeshError(MeshStateError, TypeError, AttributeError):
    """A torch ``DeviceMesh`` where a :class:`~meshstate.ParallelMesh` belongs, or
    the other way round; the message names what was given and what to pass.

    A ``TypeError`` by meaning. Also an ``AttributeError``, because torch code
    handed a ParallelMesh (``fully_shard(model, mesh=mesh)``) meets it when it
    reads a DeviceMesh attribute (``mesh.ndim``), and there ``hasattr`` and
    ``getattr(mesh, name, default)`` must keep answering as for any missing name.
    """


class SimulationError(MeshStateError, NotImplementedError):
    """What a world simulated in one process (torch's ``LocalTensorMode``) cannot do.

    Raised instead of a wrong value: a Python branch on a value that differs
    between the simulated ranks, send/recv, a group that only some ranks have
    or that is no regular grid. The message names the values and ends with
    :data:`OTHER_WORLDS`, the worlds that can.
    """


OTHER_WORLDS = ("run it with a thread per rank (meshstate.testing.threaded_world) "
                "or in processes (meshstate.testing.local_world)")
"""The end of every :class:`SimulationError`: where a body one simulated program cannot follow runs."""


class AmbiguousMeshError(MeshStateError, RuntimeError):
    """More than one live mesh of the rank could answer a call, and none was picked.

    Raised by the Megatron façade where a getter would otherwise answer for one
    of several grids; ``with mesh:`` around the call picks the one meant.
    """
