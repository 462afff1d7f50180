"""Moved to :mod:`tensortier.tiers.itemcodec` (shared with ``tensortier.data``); an alias for old imports."""

import sys

from tensortier.tiers import itemcodec as _moved

sys.modules[__name__] = _moved
