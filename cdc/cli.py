"""The ``cdc`` command line."""

from __future__ import annotations

import argparse
import sys

from cdc import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdc",
        description=(
            "PostgreSQL change data capture into compacted Kafka topics, "
            "and the derived views kept from them."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
