"""Checkpoints that do not stall training and survive crashes (CheckFreq, done safely).

Public: :class:`Checkpointer`, :class:`CheckpointState`, :class:`CheckpointStats`,
:class:`CheckpointConfig`. Format and commit protocol: ``PROTOCOL.md`` in this directory.
"""

from tensortier.checkpoint.checkpointer import (
    CheckpointConfig,
    Checkpointer,
    CheckpointState,
    CheckpointStats,
)

__all__ = ["CheckpointConfig", "CheckpointState", "CheckpointStats", "Checkpointer"]
