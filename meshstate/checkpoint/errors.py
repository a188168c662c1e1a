"""The checkpoint's error."""

from meshstate.errors import MeshStateError


class CheckpointError(MeshStateError, ValueError):
    """A checkpoint that does not cover the state asked for, or a layout that cannot
    say where a shard lies. Raised on every rank before anything is loaded; the
    message names the key and the range."""
