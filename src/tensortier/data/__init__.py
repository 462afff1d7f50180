"""Dataset catalog: millions of read-only records, opened in O(1), read in a known order at disk speed.

``Catalog.build(directory, records)`` streams records (bytes, str, arrays, tensors, dicts of those) into
append-only segment files plus a fixed-width index; ``Catalog.open(directory)`` maps the index;
``cat.epochs(...)`` is a :class:`Loader` that reads a seeded, rank-split order ahead on I/O threads
and resumes mid-epoch exactly. PyTorch datasets: :class:`CatalogDataset`, :class:`EpochDataset`. The settings of the epochs are
one :class:`EpochConfig`.
Protocols: ``PROTOCOL.md``.
"""

from tensortier.data._epochs import EpochConfig
from tensortier.data._pipeline import EpochBatch, LoaderStats
from tensortier.data.catalog import Catalog, VerifyReport
from tensortier.data.loader import Loader
from tensortier.data.pytorch import CatalogDataset, EpochDataset

__all__ = [
    "Catalog",
    "CatalogDataset",
    "EpochBatch",
    "EpochConfig",
    "EpochDataset",
    "Loader",
    "LoaderStats",
    "VerifyReport",
]
