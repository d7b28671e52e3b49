"""The package's layers point one way (STYLE.md): read from the source, every import counted,
including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mmtok"
STAGES = ("scan", "plan", "encode", "audio", "pack", "sft", "merge", "bench", "inspect", "demo", "commands", "cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """mmtok module -> the mmtok modules it imports (a package import counts as its __init__)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                               for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "mmtok"


def test_only_the_cli_imports_commands():
    offenders = {m: sorted(t for t in ts if _layer(t) == "commands")
                 for m, ts in import_graph().items() if _layer(m) not in ("commands", "cli")}
    assert not {m: t for m, t in offenders.items() if t}


def test_formats_and_codecs_import_no_stage():
    graph = import_graph()
    offenders = {m: sorted(t for t in ts if _layer(t) in STAGES)
                 for m, ts in graph.items() if _layer(m) in ("formats", "codecs")}
    assert not {m: t for m, t in offenders.items() if t}


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path + [node, target]
            if target not in state and (cycle := visit(target, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            raise AssertionError("import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))
