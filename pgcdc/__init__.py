"""The application layer: what a user runs and looks at, on top of the capture (``cdc``) and the sinks (``sinks``).

- ``pgcdc.cli``: the ``cdc`` command (``python -m pgcdc`` runs it too);
- ``pgcdc.sinks_cli``: its derived-views commands (``cdc sinks …``, ``cdc verify``);
- ``pgcdc._observe``: the capture's metrics endpoint, live dashboard and ``cdc status``;
- ``pgcdc._demo``: ``cdc demo``;
- ``pgcdc.spark_app``: the file ``spark-submit`` runs.

Only this layer imports both halves; they never import each other (tests/unit/test_layering.py).
"""
