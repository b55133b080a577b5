"""``python -m autopar.cli``: the same as the ``autopar`` console script."""

from __future__ import annotations

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
