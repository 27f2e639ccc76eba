"""tsvector and tsquery: their text output, rebuilt exactly from the binary send format.

Both are documents for a search engine to re-parse, not data to compute with, so their Avro value is the
canonical text PostgreSQL prints. The binary readers mirror tsvectorout and tsqueryout (infix()).
"""

from __future__ import annotations

from schemas._conv import I16, I32, FormatError, conv

_WEIGHT_LETTER = ("", "C", "B", "A")  # position weight 0 is D, which tsvectorout does not print
_QI_VAL, _QI_OPR = 1, 2
_OP_NOT, _OP_AND, _OP_OR, _OP_PHRASE = 1, 2, 3, 4
_PRIORITY = {_OP_NOT: 4, _OP_AND: 2, _OP_OR: 1, _OP_PHRASE: 3}  # tsearch_op_priority
_QUERY_WEIGHTS = ((8, "A"), (4, "B"), (2, "C"), (1, "D"))


def _quote(lexeme: str) -> str:
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


def _identity(text: str) -> str:
    return text


def _tsvector_bin(data: bytes) -> str:
    (count,) = I32.unpack_from(data)
    pos, out = 4, []
    for _ in range(count):
        end = data.index(b"\0", pos)
        entry = _quote(data[pos:end].decode())
        (npos,) = I16.unpack_from(data, end + 1)
        pos = end + 3
        if npos:
            positions = []
            for _ in range(npos):
                word = int.from_bytes(data[pos : pos + 2], "big")
                positions.append(f"{word & 0x3FFF}{_WEIGHT_LETTER[word >> 14]}")
                pos += 2
            entry += ":" + ",".join(positions)
        out.append(entry)
    return " ".join(out)


TSVECTOR = conv("string", _identity, _tsvector_bin, from_text=bytes.decode)

_Item = tuple[int, int, int, str]  # (QI_VAL, weight, prefix, operand) or (QI_OPR, operator, distance, "")


def _infix(items: list[_Item], at: int, parent_priority: int, right_phrase: bool) -> tuple[str, int]:
    """The text of the subtree at ``items[at]`` and the index after it, as tsqueryout's infix() prints.

    Items are in prefix order with a binary operator's right operand first, then its left operand.
    """
    kind, first, second, operand = items[at]
    if kind == _QI_VAL:
        text = _quote(operand)
        if first or second:
            text += ":" + ("*" if second else "") + "".join(w for bit, w in _QUERY_WEIGHTS if first & bit)
        return text, at + 1
    priority = _PRIORITY[first]
    if first == _OP_NOT:
        inner, after = _infix(items, at + 1, priority, False)
        text = "!" + inner
        return (f"( {text} )" if priority < parent_priority else text), after
    right, after_right = _infix(items, at + 1, priority, first == _OP_PHRASE)
    left, after = _infix(items, after_right, priority, False)
    if first == _OP_OR:
        text = f"{left} | {right}"
    elif first == _OP_AND:
        text = f"{left} & {right}"
    else:
        text = f"{left} <-> {right}" if second == 1 else f"{left} <{second}> {right}"
    parenthesise = priority < parent_priority or (first == _OP_PHRASE and right_phrase)
    return (f"( {text} )" if parenthesise else text), after


def _tsquery_bin(data: bytes) -> str:
    (size,) = I32.unpack_from(data)
    items: list[_Item] = []
    pos = 4
    for _ in range(size):
        kind = data[pos]
        if kind == _QI_VAL:
            end = data.index(b"\0", pos + 3)
            items.append((kind, data[pos + 1], data[pos + 2], data[pos + 3 : end].decode()))
            pos = end + 1
        elif kind == _QI_OPR:
            operator = data[pos + 1]
            if operator == _OP_PHRASE:
                items.append((kind, operator, I16.unpack_from(data, pos + 2)[0], ""))
                pos += 4
            else:
                items.append((kind, operator, 0, ""))
                pos += 2
        else:
            raise FormatError(f"unknown tsquery item type {kind}")
    return _infix(items, 0, -1, False)[0] if items else ""


TSQUERY = conv("string", _identity, _tsquery_bin, from_text=bytes.decode)
