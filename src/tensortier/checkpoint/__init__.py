"""Checkpoints that do not stall training and survive crashes (CheckFreq, done safely).

Public: :class:`Checkpointer`, :class:`CheckpointState`, :class:`CheckpointStats`,
:class:`CheckpointConfig`; :func:`export_dcp` / :func:`import_dcp` convert to and from
``torch.distributed.checkpoint``. Format and commit protocol: ``PROTOCOL.md`` in this directory.
"""

from tensortier.checkpoint._dcp import export_dcp, import_dcp
from tensortier.checkpoint.checkpointer import (
    CheckpointConfig,
    Checkpointer,
    CheckpointState,
    CheckpointStats,
)

__all__ = [
    "CheckpointConfig",
    "CheckpointState",
    "CheckpointStats",
    "Checkpointer",
    "export_dcp",
    "import_dcp",
]
