"""``python -m pgcdc_dev.services …``: the local services' command line (pgcdc_dev.services.cli)."""

from __future__ import annotations

import sys

from pgcdc_dev.services.cli import main

if __name__ == "__main__":
    sys.exit(main())
