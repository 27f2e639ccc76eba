"""The packages' import rules: data flows one way, the capture and the sinks are peers, and the capture service
never loads Spark.

    pgcdc                    the application layer: command line, status, dashboard, demo, spark-submit's file
      ├── cdc                the capture service            ─┐ peers: neither imports the other
      └── sinks              the derived views              ─┘
    decoders, schemas        the wire format in, the event format out
    pgcdc_common             errors, the configuration file, security settings, topic naming

There is no allow-list: an import is seen wherever it is written (at the top, inside a function, under
``if TYPE_CHECKING``, or by name through ``importlib.import_module``/``__import__``), and every crossing fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pgcdc_common", "decoders", "schemas", "cdc", "sinks", "pgcdc")

# package -> top-level modules it must never import
FORBIDDEN = {
    "pgcdc_common": {
        "cdc",
        "decoders",
        "schemas",
        "sinks",
        "pgcdc",
        "confluent_kafka",
        "pyspark",
        "psycopg",
        "fastavro",
    },
    "decoders": {"cdc", "schemas", "sinks", "pgcdc", "confluent_kafka", "pyspark", "fastavro"},
    "schemas": {"cdc", "decoders", "sinks", "pgcdc", "confluent_kafka", "pyspark", "psycopg"},
    "cdc": {"sinks", "pgcdc", "pyspark", "delta"},
    "sinks": {"cdc", "decoders", "pgcdc"},
    "pgcdc": {"pyspark", "delta"},
}


def _by_name(call: ast.Call) -> str | None:
    """The module an ``importlib.import_module("…")`` or ``__import__("…")`` call names, if written literally."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, by its full name (relative imports resolved), wherever it is written."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(ROOT).parent.parts if path.is_relative_to(ROOT) else ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: len(package) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and (named := _by_name(node)):
            yield named


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package: str) -> None:
    offences = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files(package)
        for name in set(_imports(path))
        if name.split(".")[0] in FORBIDDEN[package]
    )
    assert not offences, offences


def test_every_product_package_has_rules() -> None:
    assert set(FORBIDDEN) == set(PRODUCT)
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests", "bench"} == set(PRODUCT)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports."""
    modules = {_module_name(path): path for package in PRODUCT for path in _files(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set(_imports(path))
        submodules = {i for i in imported if _is_module(i)}  # compiled ones (cdc._native) included
        targets = {i for i in imported if i in modules and i != name}
        # Importing pkg.mod runs pkg's __init__ first, as Python does for every submodule: that edge to the
        # package is implied (sinks/_api importing sinks.errors is no cycle through sinks/__init__), not counted.
        graph[name] = {t for t in targets if not any(other.startswith(t + ".") for other in submodules)}
    return graph


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of the checkout (a Python file, a Cython one, a package)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.with_suffix(".pyx").is_file() or path.is_dir()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_product_imports_have_no_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_importing_the_capture_service_does_not_load_pyspark() -> None:
    code = (
        "import sys, pgcdc_common, cdc, pgcdc.cli, decoders, schemas, sinks\n"
        "print(sorted(m for m in sys.modules if m.startswith(('pyspark', 'py4j'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_an_import_is_seen_wherever_it_hides(tmp_path: Path) -> None:
    """The checker above must be able to fail, on each way of writing an import."""
    for text, module in (
        ("import pyspark.sql\n", "pyspark.sql"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cdc._capture import Capture\n", "cdc._capture"),
        ("def f():\n    import sinks._supervisor\n", "sinks._supervisor"),
        ("from cdc import _capture\n", "cdc._capture"),
        ("import importlib\nimportlib.import_module('sinks._progress')\n", "sinks._progress"),
        ("from importlib import import_module\nimport_module('cdc')\n", "cdc"),
        ("__import__('pgcdc.cli')\n", "pgcdc.cli"),
    ):
        (tmp_path / "bad.py").write_text(text)
        assert module in set(_imports(tmp_path / "bad.py")), text


def _reaches_the_coordinator(path: Path) -> bool:
    return bool({"cdc._capture", "cdc.runner"} & set(_imports(path)))


def test_only_the_cli_imports_the_capture_coordinator() -> None:
    """The phases (snapshot, re-snapshot, stream, batch writer) are given what they need; none reaches back into
    the coordinator that runs them. cdc.runner carries it to the application layer, where only the CLI runs it."""
    own = (ROOT / "pgcdc" / "cli.py", ROOT / "cdc" / "_capture.py", ROOT / "cdc" / "runner.py")
    offences = sorted(
        str(path.relative_to(ROOT))
        for package in (*PRODUCT, "bench")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in own and _reaches_the_coordinator(path)
    )
    assert not offences, offences


# --- public faces ---------------------------------------------------------------------------------------------
# A package's modules named with a leading underscore are its own. Every other package, the benchmarks and the dev
# tool use its public modules: each package's __init__, pgcdc_common's modules, cdc.config, cdc.kafka,
# cdc.metrics, cdc.service, cdc.runner (the CLI's alone, above), cdc.encoding, sinks.config, sinks.progress,
# sinks.app and sinks.plugins; a private name of a public module (from cdc.service import _x) is a crossing too.
# There is no allow-list. Tests are left out on purpose: a unit test imports the private module whose logic it
# isolates.


def _private_imports(path: Path, owner: str) -> list[str]:
    """The private modules of packages other than ``owner`` that ``path`` imports."""
    found = set()
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] in PRODUCT and parts[0] != owner:
            private = next((i for i, part in enumerate(parts[1:], 1) if _is_private(part)), None)
            if private is not None:
                found.add(".".join(parts[: private + 1]))
    return sorted(found)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_package_imports_another_packages_private_modules() -> None:
    owners = {package: _files(package) for package in PRODUCT}
    owners["bench"] = sorted((ROOT / "bench").rglob("*.py"))
    owners["pgcdc_dev"] = sorted((ROOT / "tools" / "pgcdc-dev" / "pgcdc_dev").rglob("*.py"))
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for owner, paths in owners.items()
        for path in paths
        for name in _private_imports(path, owner)
    ]
    assert not offences, offences


def test_a_private_import_is_seen(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("from cdc import _kafka\nfrom sinks._config import SinkSettings\n")
    assert _private_imports(tmp_path / "bad.py", "pgcdc") == ["cdc._kafka", "sinks._config"]
    assert _private_imports(tmp_path / "bad.py", "sinks") == ["cdc._kafka"]
    (tmp_path / "name.py").write_text("from cdc.service import _hidden\n")
    assert _private_imports(tmp_path / "name.py", "pgcdc") == ["cdc.service._hidden"]
    (tmp_path / "ok.py").write_text("from cdc import __version__\nfrom cdc.kafka import OffsetStore\n")
    assert _private_imports(tmp_path / "ok.py", "pgcdc") == []


# --- the development tooling ----------------------------------------------------------------------------------

DEV = ROOT / "tools" / "pgcdc-dev"


def _top_level_imports(paths: list[Path]) -> dict[str, set[str]]:
    return {str(path.relative_to(ROOT)): {name.split(".")[0] for name in _imports(path)} for path in paths}


def test_tests_and_bench_share_the_dev_package_and_never_import_each_other() -> None:
    """Local services, service discovery and the bench harness live in pgcdc_dev, which both use."""
    tests = _top_level_imports(sorted((ROOT / "tests").rglob("*.py")) + sorted((DEV / "tests").rglob("*.py")))
    bench = _top_level_imports(sorted((ROOT / "bench").rglob("*.py")))
    dev = _top_level_imports(sorted((DEV / "pgcdc_dev").rglob("*.py")))
    offences = [f"{f} imports bench" for f, names in tests.items() if "bench" in names]
    offences += [f"{f} imports tests" for f, names in {**bench, **dev}.items() if "tests" in names]
    offences += [f"{f} imports bench (the harness finds scenarios by name)" for f, n in dev.items() if "bench" in n]
    assert not offences, offences


def _changed(node: ast.AST) -> ast.expr | None:
    """What ``node`` changes in place, if it is a list method call or an assignment."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value if node.func.attr in ("insert", "append", "extend", "remove") else None
    if isinstance(node, ast.Assign | ast.AugAssign):
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        return target.value if isinstance(target, ast.Subscript) else target
    return None


def _path_edits(path: Path) -> list[int]:
    """Lines where ``sys.path`` is changed: ``sys.path.insert/append/extend/remove`` or an assignment to it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call | ast.Assign | ast.AugAssign)
        and (changed := _changed(node)) is not None
        and ast.unparse(changed) == "sys.path"
    ]


def test_nothing_edits_sys_path() -> None:
    roots = [ROOT / p for p in (*PRODUCT, "tests", "bench")] + [DEV]
    offences = [f"{path.relative_to(ROOT)}:{n}" for r in roots for path in r.rglob("*.py") for n in _path_edits(path)]
    assert not offences, offences


def test_a_sys_path_edit_is_seen(tmp_path: Path) -> None:
    for text in ("import sys\nsys.path.insert(0, 'x')\n", "import sys\nsys.path += ['x']\n", "sys.path[:0] = ['x']\n"):
        (tmp_path / "bad.py").write_text(text)
        assert _path_edits(tmp_path / "bad.py"), text
    (tmp_path / "ok.py").write_text("import sys\nsys.path_importer_cache.pop('x', None)\nitems.append(1)\n")
    assert not _path_edits(tmp_path / "ok.py")
