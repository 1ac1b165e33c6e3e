"""The vramledger package's module graph: no import cycle, and every module imports on its own.

A cycle (a command module importing cli.py, which imports it back) works only while the order
of first imports happens to suit it; a lazy import inside a function closes a cycle as surely as
one at the top, so both kinds count here. Runs against the importable `vramledger`, as the other
tests of this folder.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vramledger

PACKAGE_DIR = Path(vramledger.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__")


def package_imports(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its file (top level or inside a
    function): `from vramledger import a, b`, `from vramledger.a import x`, `import vramledger.a`,
    `from . import a` and `from .a import x`."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text(), filename=f"{module}.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "vramledger" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] == "vramledger":
                parts = node.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
            elif node.level == 1:
                found.update([node.module.split(".")[0]] if node.module
                             else [a.name for a in node.names])
    return found - {module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # absent: unseen; 1: on the current path; 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_lazy_cycle_and_passes_a_chain():
    assert find_cycle({"cli": {"_snapshot_cli"}, "_snapshot_cli": {"cli"}}) == [
        "_snapshot_cli", "cli", "_snapshot_cli"]
    assert find_cycle({"cli": {"_guard_cli"}, "_guard_cli": {"_plan"},
                       "_plan": {"_snapshot_cli"}, "_snapshot_cli": {"cli"}}) == [
        "_guard_cli", "_plan", "_snapshot_cli", "cli", "_guard_cli"]
    assert find_cycle({"cli": {"_cli_shared", "_snapshot_cli"},
                       "_snapshot_cli": {"_cli_shared"}, "_cli_shared": {"_snapshot"}}) is None


def test_the_package_has_no_import_cycle():
    assert "cli" in MODULES and "_cli_shared" in MODULES, MODULES
    # __init__ is left out: importing any submodule runs it first, so an edge to it is no cycle
    # of the submodules' own; its imports of submodules are edges like any other.
    graph = {m: package_imports(m) - {"__init__"} for m in MODULES}
    graph["__init__"] = package_imports("__init__")
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_command_module_is_imported_by_the_shared_helpers():
    commands = {"cli", "_snapshot_cli", "_guard_cli", "_run_cli", "_plan", "_report"}
    assert not package_imports("_cli_shared") & commands


def test_one_restricted_snapshot_unpickler():
    """Only _snapshot.py defines an Unpickler (it refuses every class); the others use it."""
    definers = []
    for module in MODULES:
        tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(base).endswith("Unpickler") for base in node.bases):
                definers.append(f"{module}.{node.name}")
    assert definers == ["_snapshot.PlainUnpickler"], definers


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    # __main__ runs the command when imported: it is imported alone by `python -m vramledger`.
    args = (["-m", "vramledger", "--version"] if module == "__main__"
            else ["-c", f"import vramledger.{module}"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
