"""What the capture service learns about a column's PostgreSQL type from the catalogs.

The replication stream names a column's type only by OID (and, for non-built-in types, a Type message
with its namespace and name). Converting values losslessly needs more: a domain's base type, an enum's
labels, a composite's attributes, an array's element type, a range's subtype. The capture service reads
these from ``pg_type`` and friends and describes each type with a :class:`PgType`; this package maps
PgType (+ the column's type modifier) to an Avro schema and a value converter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TypeKind = Literal["base", "enum", "domain", "composite", "array", "range", "multirange", "pseudo"]


@dataclass(frozen=True, slots=True)
class PgType:
    """A PostgreSQL type as far as value conversion needs it.

    ``oid``/``namespace``/``name`` identify it (``name`` is ``pg_type.typname``, e.g. ``int4``, ``_text``).
    Exactly the fields that matter for its ``kind`` are set:

    - ``array``: ``element`` (and ``delimiter``, ``,`` for every built-in type but ``box``);
    - ``domain``: ``base`` (and ``base_typmod``, the domain's own modifier, e.g. varchar(10) → 14);
    - ``enum``: ``labels`` in sort order;
    - ``composite``: ``fields`` as (attribute name, type, attribute typmod) in attribute order;
    - ``range``/``multirange``: ``element`` is the subtype (for a multirange, its range's subtype).
    """

    oid: int
    name: str
    namespace: str = "pg_catalog"
    kind: TypeKind = "base"
    element: PgType | None = None
    base: PgType | None = None
    base_typmod: int = -1
    labels: tuple[str, ...] = ()
    fields: tuple[tuple[str, PgType, int], ...] = field(default=())
    delimiter: str = ","

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"
