"""The packages' import rules: data flows one way, and the capture service never loads Spark."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> top-level modules it must never import
FORBIDDEN = {
    "decoders": {"cdc", "schemas", "sinks", "confluent_kafka", "pyspark", "fastavro"},
    "schemas": {"cdc", "sinks", "confluent_kafka", "pyspark", "psycopg"},
    "cdc": {"sinks", "pyspark", "delta"},
    "sinks": {"cdc", "decoders"},
}
# The deliberate crossings, all lazy (inside a function): the `cdc` front door hands `cdc sinks …` to
# sinks.cli; sinks.cli asks the capture's public face (cdc.source_tables) what the source holds; and the
# capture's dashboard and `cdc status` read the sinks' progress (sinks/_progress.py, which never loads Spark).
ALLOWED = {("cdc/cli.py", "sinks"), ("sinks/cli.py", "cdc"), ("cdc/_observe.py", "sinks")}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_upstream(package: str) -> None:
    offences = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / package).rglob("*.py")
        for name in _imported_modules(path) & FORBIDDEN[package]
        if (str(path.relative_to(ROOT)), name) not in ALLOWED
    }
    assert not offences, sorted(offences)


def test_importing_the_capture_service_does_not_load_pyspark() -> None:
    code = (
        "import sys, cdc, cdc.cli, decoders, schemas, sinks\n"
        "print(sorted(m for m in sys.modules if m.startswith(('pyspark', 'py4j'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_forbidden_import_is_detected(tmp_path: Path) -> None:
    """The checker above must be able to fail."""
    bad = tmp_path / "bad.py"
    bad.write_text("import pyspark.sql\nfrom cdc.errors import CDCError\nfrom . import sibling\n")
    assert _imported_modules(bad) == {"pyspark", "cdc"}


def _full_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, by its full name (relative imports resolved within ``cdc``), wherever
    the import sits: at the top, inside a function or under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*path.relative_to(ROOT).parent.parts, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_only_the_cli_imports_the_capture_coordinator() -> None:
    """The phases (snapshot, re-snapshot, stream, batch writer) are given what they need; none reaches back into
    the coordinator that runs them, so the capture's imports have no cycle."""
    offences = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "cdc").rglob("*.py")
        if path.name != "cli.py" and "cdc._capture" in _full_imports(path)
    )
    assert not offences, offences


def test_the_coordinator_import_is_seen_wherever_it_hides(tmp_path: Path) -> None:
    """The checker above must be able to fail, on each way of writing the import."""
    for text in (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cdc._capture import Capture\n",
        "def f():\n    import cdc._capture\n",
        "from cdc import _capture\n",
    ):
        (tmp_path / "bad.py").write_text(text)
        assert "cdc._capture" in _full_imports(tmp_path / "bad.py"), text
