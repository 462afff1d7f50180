"""Moved to :mod:`tensortier.tiers.segments` (shared with ``tensortier.data``); an alias for old imports."""

import sys

from tensortier.tiers import segments as _moved

sys.modules[__name__] = _moved
