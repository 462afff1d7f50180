"""Where bytes live: host RAM (:mod:`.host`), NVMe files (:mod:`.disk`) and other nodes' RAM
through Ray (:mod:`.remote`, which imports Ray only when a store is made)."""

from tensortier.tiers.disk import DiskHandle, DiskStats, DiskStore
from tensortier.tiers.host import HostBlock, HostPool, HostStats
from tensortier.tiers.remote import RemoteHandle, RemoteStats, RemoteStore

__all__ = [
    "DiskHandle",
    "DiskStats",
    "DiskStore",
    "HostBlock",
    "HostPool",
    "HostStats",
    "RemoteHandle",
    "RemoteStats",
    "RemoteStore",
]
