"""The application file ``spark-submit`` runs: the ``cdc`` command line, inside a Spark application.

spark-submit starts Python applications from a file, not from a console script. Its arguments are those
of ``cdc`` (``sinks run``, ``sinks rebuild NAME``, ``verify NAME``); ``cdc sinks spark-app`` prints where
this file is installed::

    spark-submit --master spark://HOST:7077 [options] "$(cdc sinks spark-app)" sinks run --config cdc.toml

The sinks' session then takes its master, jars and settings from spark-submit.
"""

from __future__ import annotations

import sys

from pgcdc.cli import main as cdc_main


def main() -> int:
    return cdc_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
