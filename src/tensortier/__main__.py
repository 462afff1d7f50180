"""``python -m tensortier``: the ``tensortier`` command, where no console script is installed."""

import sys

from tensortier.cli import main

if __name__ == "__main__":
    sys.exit(main())
