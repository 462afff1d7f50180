"""Where bytes live: host RAM (:mod:`.host`), NVMe files (:mod:`.disk`) and other nodes' RAM
through Ray (:mod:`.remote`, which imports Ray only when a store is made). The stores follow one
contract (:mod:`.base`, ``STORE.md``); a client's tiers, directory, budgets and pool are one
:class:`~.placement.Placement`."""

from tensortier.tiers.base import Handle, Store
from tensortier.tiers.disk import DiskHandle, DiskStats, DiskStore
from tensortier.tiers.host import HostBlock, HostPool, HostStats
from tensortier.tiers.placement import Placement
from tensortier.tiers.remote import RemoteHandle, RemoteStats, RemoteStore

__all__ = [
    "DiskHandle",
    "DiskStats",
    "DiskStore",
    "Handle",
    "HostBlock",
    "HostPool",
    "HostStats",
    "Placement",
    "RemoteHandle",
    "RemoteStats",
    "RemoteStore",
    "Store",
]
