"""Old import path of the segment files (moved to :mod:`tensortier.tiers.segments`, shared with
the dataset catalog); kept so scripts written against it, such as the reliability reproducers
in ``shared/reviews``, still import."""

from tensortier.tiers.segments import *  # noqa: F403
from tensortier.tiers.segments import REC, TOMBSTONE, Segments  # noqa: F401
