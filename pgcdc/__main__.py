"""``python -m pgcdc …`` runs the ``cdc`` command."""

from __future__ import annotations

import sys

from pgcdc.cli import main

if __name__ == "__main__":
    sys.exit(main())
