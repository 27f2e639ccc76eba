"""Every function of the product, of the dev tool (tools/pgcdc-dev) and of the benchmarks (bench/) fits on a screen
and takes a handful of parameters: a longer one is cut along what it does, not into pieces. There are no
exceptions. The C extension's Cython source (cdc/*.pyx) is held to the same length; Python's parser does not read
it, so its functions are found by their indentation."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pgcdc_common", "cdc", "decoders", "schemas", "sinks", "pgcdc", "tools/pgcdc-dev/pgcdc_dev", "bench")
MOST_LINES = 60
MOST_PARAMETERS = 6  # self and cls not counted


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, by its qualified name (Class.method, outer.inner)."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append((prefix + node.name, node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out += _functions(node, f"{prefix}{node.name}.")
    return out


def _over(source: str) -> list[str]:
    """The functions of ``source`` over the rule, each with its line, length and parameter count."""
    found = []
    for name, node in _functions(ast.parse(source)):
        args = node.args
        params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        params = [p for p in params if p not in ("self", "cls")]
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > MOST_LINES or len(params) > MOST_PARAMETERS:
            found.append(f"{node.lineno} {name}: {lines} lines, {len(params)} parameters")
    return found


# a def, cdef or cpdef of a function or method (not of a class, struct, enum, extern block or variable)
_CYTHON_DEF = re.compile(r"^(\s*)(?:def|cpdef|cdef)\s+(?!class\b|struct\b|enum\b|extern\b)[^=\n]*?(\w+)\s*\(")


def _cython_over(source: str) -> list[str]:
    """The functions of a Cython ``source`` longer than the rule: a function runs from its ``def`` line to its
    last line indented deeper (its signature's closing line included)."""
    lines = source.splitlines()
    found = []
    for number, line in enumerate(lines):
        match = _CYTHON_DEF.match(line)
        if not match:
            continue
        indent, last = len(match.group(1)), number
        for later in range(number + 1, len(lines)):
            text = lines[later]
            if text.strip() and len(text) - len(text.lstrip()) <= indent and not text.lstrip().startswith(")"):
                break
            if text.strip():
                last = later
        if last - number + 1 > MOST_LINES:
            found.append(f"{number + 1} {match.group(2)}: {last - number + 1} lines")
    return found


def test_no_function_is_longer_or_takes_more_than_the_rule() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{found}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for found in _over(path.read_text())
    ]
    offenders += [
        f"{path.relative_to(ROOT)}:{found}"
        for path in sorted((ROOT / "cdc").glob("*.pyx"))
        for found in _cython_over(path.read_text())
    ]
    assert offenders == []


def test_the_rule_finds_what_is_over_it() -> None:
    many = "class C:\n    def m(self, a, b, c, d, e, f, *, g): pass\n"
    long = "def f():\n" + "    x = 1\n" * 60
    fine = "def f(a, b, c, d, e, f):\n" + "    x = 1\n" * 59
    assert _over(many + long + fine) == ["2 C.m: 1 lines, 7 parameters", "3 f: 61 lines, 0 parameters"]


def test_the_rule_finds_a_long_cython_function() -> None:
    body = "    x = 1\n" * 59
    long = "cdef int put(\n    Buf* b, int n\n) except -1 nogil:\n" + body
    fine = "cdef class C:\n    cdef int n\n\n    def m(self) -> None:\n" + "    " + body.replace("\n", "\n    ")
    assert _cython_over(long + "\n" + fine.rstrip() + "\n") == ["1 put: 62 lines"]
