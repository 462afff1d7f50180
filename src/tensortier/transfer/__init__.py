"""The transfer engine: asynchronous moves between tiers (``engine.py``) and the CUDA side
streams, events and copy sequence every tier move uses (``streams.py``; ``TRANSFER.md``).

A package of two modules so that "the engine owns the streams" is a folder: ``streams.py`` is
the one file that makes CUDA streams and events, small enough to read whole, and the clients
(optimizer, checkpointer, planner) import it without reaching into the engine's internals.
"""

from tensortier.transfer.engine import (
    DIRECTIONS,
    Encoded,
    HostTensor,
    Transfer,
    TransferEngine,
    TransferStats,
)

__all__ = ["DIRECTIONS", "Encoded", "HostTensor", "Transfer", "TransferEngine", "TransferStats"]
