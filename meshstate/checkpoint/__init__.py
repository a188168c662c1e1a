"""Checkpoints that know the layout: plain shards saved under one layout load under another.

``save(state, path, layout)`` and ``load(state, path, layout)`` take each rank's own
shards (Megatron-style TP weights, ``shard_map`` blocks, local experts, a pipeline
stage's layers, AdamW moments) and a :class:`Layout` saying how they lie; torch's DCP
(``backend="dcp"``) or meta-pytorch's torch-checkpointing (``backend="torch-checkpointing"``,
the ``meshstate[checkpointing]`` extra) writes the files. See docs/reference.md,
"Checkpoints across layouts".
"""

from meshstate.checkpoint.errors import CheckpointError
from meshstate.checkpoint.layout import Layout, megatron_specs
from meshstate.checkpoint.entries import Transfer
from meshstate.checkpoint.saving import BACKENDS, load, save

__all__ = ["BACKENDS", "CheckpointError", "Layout", "Transfer", "load", "megatron_specs", "save"]
