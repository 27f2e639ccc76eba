"""Geometric types as Avro records of doubles.

A record reads better than the text ("(1,2)") everywhere, and it is exact: the text carries the shortest
decimal that round-trips each float8 (extra_float_digits >= 1), the binary format the float8 itself.
"""

from __future__ import annotations

import re
import struct
from typing import Any

from schemas._conv import I32, Conv, FormatError, conv
from schemas._names import avro_fullname

_NUMBER = re.compile(r"[^(),\[\]{}<>\s]+")  # float8 tokens: 1.5, -1e+300, NaN, -Infinity
_TWO = struct.Struct(">2d")
_THREE = struct.Struct(">3d")
_FOUR = struct.Struct(">4d")

POINT_NAME = avro_fullname("pg_catalog", "point")
_POINT: dict[str, Any] = {
    "type": "record",
    "name": POINT_NAME,
    "fields": [{"name": "x", "type": "double"}, {"name": "y", "type": "double"}],
}


def _floats(text: str) -> list[float]:
    try:
        return [float(token) for token in _NUMBER.findall(text)]
    except ValueError as exc:
        raise FormatError(f"not a geometric value: {text!r}") from exc


def _points(values: list[float] | tuple[float, ...]) -> list[dict[str, float]]:
    return [{"x": values[i], "y": values[i + 1]} for i in range(0, len(values), 2)]


def _record(name: str, fields: list[tuple[str, Any]]) -> dict[str, Any]:
    return {
        "type": "record",
        "name": avro_fullname("pg_catalog", name),
        "fields": [{"name": field, "type": schema} for field, schema in fields],
    }


def _point_str(text: str) -> dict[str, float]:
    x, y = _floats(text)
    return {"x": x, "y": y}


def _point_bin(data: bytes) -> dict[str, float]:
    x, y = _TWO.unpack(data)
    return {"x": x, "y": y}


def _line_str(text: str) -> dict[str, float]:
    a, b, c = _floats(text)
    return {"a": a, "b": b, "c": c}


def _line_bin(data: bytes) -> dict[str, float]:
    a, b, c = _THREE.unpack(data)
    return {"a": a, "b": b, "c": c}


def _two_points(first: str, second: str) -> tuple[Any, Any]:
    def from_str(text: str) -> dict[str, Any]:
        p, q = _points(_floats(text))
        return {first: p, second: q}

    def from_binary(data: bytes) -> dict[str, Any]:
        p, q = _points(_FOUR.unpack(data))
        return {first: p, second: q}

    return from_str, from_binary


def _path_str(text: str) -> dict[str, Any]:
    return {"closed": text[:1] == "(", "points": _points(_floats(text))}


def _path_bin(data: bytes) -> dict[str, Any]:
    (count,) = I32.unpack_from(data, 1)
    return {"closed": data[0] != 0, "points": _points(struct.unpack_from(f">{2 * count}d", data, 5))}


def _polygon_str(text: str) -> dict[str, Any]:
    return {"points": _points(_floats(text))}


def _polygon_bin(data: bytes) -> dict[str, Any]:
    (count,) = I32.unpack_from(data)
    return {"points": _points(struct.unpack_from(f">{2 * count}d", data, 4))}


def _circle_str(text: str) -> dict[str, Any]:
    x, y, radius = _floats(text)
    return {"center": {"x": x, "y": y}, "radius": radius}


def _circle_bin(data: bytes) -> dict[str, Any]:
    x, y, radius = _THREE.unpack(data)
    return {"center": {"x": x, "y": y}, "radius": radius}


_POINTS = {"type": "array", "items": _POINT}
_lseg_str, _lseg_bin = _two_points("start", "end")
_box_str, _box_bin = _two_points("high", "low")

GEOMETRIC: dict[str, Conv] = {
    "point": conv(_POINT, _point_str, _point_bin),
    "line": conv(_record("line", [("a", "double"), ("b", "double"), ("c", "double")]), _line_str, _line_bin),
    # lseg and box keep PostgreSQL's order; box is normalised by PostgreSQL to (upper right, lower left).
    "lseg": conv(_record("lseg", [("start", _POINT), ("end", _POINT)]), _lseg_str, _lseg_bin),
    "box": conv(_record("box", [("high", _POINT), ("low", _POINT)]), _box_str, _box_bin),
    "path": conv(_record("path", [("closed", "boolean"), ("points", _POINTS)]), _path_str, _path_bin),
    "polygon": conv(_record("polygon", [("points", _POINTS)]), _polygon_str, _polygon_bin),
    "circle": conv(_record("circle", [("center", _POINT), ("radius", "double")]), _circle_str, _circle_bin),
}
