"""Where bytes live: host RAM (:mod:`.host`) and NVMe files (:mod:`.disk`)."""

from tensortier.tiers.disk import DiskHandle, DiskStats, DiskStore
from tensortier.tiers.host import HostBlock, HostPool, HostStats

__all__ = ["DiskHandle", "DiskStats", "DiskStore", "HostBlock", "HostPool", "HostStats"]
