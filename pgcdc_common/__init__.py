"""The layer under the capture (``cdc``) and the sinks (``sinks``): what both halves share and neither owns.

- ``common.errors``: the one error tree, its transient/terminal classes and exit codes;
- ``common.config``: reading the one configuration file, and the ``[kafka]``/``[registry]`` keys both read;
- ``common.security``: how both reach a secured Kafka and schema registry (settings only, no client);
- ``common.topics``: how tables are named and how their topics are named.

It imports nothing of pgcdc's other packages, so the capture and the sinks can stay peers that never import
each other; the application layer (``pgcdc``: command line, status, dashboard, demo) sits on top of both.
"""
