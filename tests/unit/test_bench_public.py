"""Benchmarks measure the product through its public interfaces: no benchmark imports the tests'
helpers or a private name of the zerolayer package, reads a private attribute of another object,
or replaces an attribute with setattr (a rename inside the engine must not break a benchmark)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("zerolayer",)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(source: str) -> list[str]:
    """What in ``source`` (a benchmark module) reaches past a public interface, as
    "line: what"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "tests":
                found.append(f"{node.lineno}: imports {node.module}")
            elif parts[0] in PRODUCT:
                names = parts + [a.name for a in node.names]
                found += [f"{node.lineno}: imports {node.module}.{n}" for n in names if _private(n)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tests" or (parts[0] in PRODUCT and any(map(_private, parts))):
                    found.append(f"{node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: reads {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_catches_each_kind_of_reach():
    source = (
        "from tests.support.x import y\n"
        "import tests.support\n"
        "from zerolayer.engine.engine import _one_row\n"
        "from zerolayer._private import thing\n"
        "engine._inbox\n"
        "setattr(engine, 'step', f)\n"
        "self._ok\n"
        "from zerolayer.engine.engine import Engine\n"
        "from benchmarks._support.daemon import Daemon\n"
    )
    assert [v.split(":")[0] for v in violations(source)] == ["1", "2", "3", "4", "5", "6"]


def test_no_benchmark_reaches_past_a_public_interface():
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(files) > 15  # the scripts, their scenarios and their support package
    found = {str(f.relative_to(ROOT)): v for f in files if (v := violations(f.read_text()))}
    assert found == {}
