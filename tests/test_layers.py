"""The package's layers point one way, read from the source (every import counted, including those inside
functions): commands on top, then the stages and the tools (each its own room, meeting the others only
through the files in formats/), then the shared layers every room may use."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mmtok"
TOP = ("cli", "commands")  # argument parsing and printing: may import anything
STAGES = ("scan", "plan", "encode", "audio", "sft", "merge")  # each makes one kind of output
TOOLS = ("tools", "bench")  # read outputs, write no dataset
SHARED = ("formats", "codecs", "media")  # files, codecs and media rules: what the rooms share
ROOT_MODULES = ("documents", "errors", "extras", "fsutil", "launch", "progress", "ranks", "text", "vocab")
ROOMS = STAGES + TOOLS
MAX_ROOT_MODULES = 10


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
    """The room or layer of a module: its first package under mmtok, or the module itself at the root."""
    return module.split(".")[1] if module.count(".") else "mmtok"


def _offenders(graph, importers, forbidden) -> dict[str, list[str]]:
    found = {m: sorted(t for t in ts if forbidden(_layer(m), _layer(t)))
             for m, ts in graph.items() if _layer(m) in importers}
    return {m: t for m, t in found.items() if t}


def test_every_package_and_root_module_has_a_layer():
    known = set(TOP + STAGES + TOOLS + SHARED + ROOT_MODULES + ("__init__", "__main__", "data"))
    entries = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__")}
    assert entries <= known, f"classify these in tests/test_layers.py: {sorted(entries - known)}"


def test_the_package_root_keeps_only_a_few_shared_rules():
    modules = [p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__", "cli")]
    assert len(modules) <= MAX_ROOT_MODULES, sorted(modules)


def test_only_the_cli_imports_commands():
    assert not _offenders(import_graph(), set(STAGES + TOOLS + SHARED + ROOT_MODULES + ("mmtok",)),
                          lambda _, target: target == "commands")


def test_no_stage_or_tool_imports_another():
    assert not _offenders(import_graph(), set(ROOMS), lambda room, target: target in ROOMS and target != room)


def test_shared_layers_import_no_stage_or_tool():
    shared = set(SHARED + ROOT_MODULES + ("mmtok",))
    assert not _offenders(import_graph(), shared, lambda _, target: target in ROOMS + TOP)


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


PROGRESS_MODULE = "mmtok.progress"  # the progress bars draw on stderr; every other line is a command's


def _terminal_writes(path: Path) -> list[str]:
    """'line N: print(...)' / 'line N: sys.stderr' for each print call and each use of sys.stdout/sys.stderr."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"line {node.lineno}: print(...)")
        elif (isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr")
              and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            found.append(f"line {node.lineno}: sys.{node.attr}")
    return found


def test_only_commands_print_library_code_returns_what_it_did():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if _layer(module) in TOP or module in ("mmtok.cli", PROGRESS_MODULE):
            continue
        if found := _terminal_writes(path):
            offenders[module] = found
    assert not offenders, f"return these to the command, which prints them (mmtok/commands/report.py): {offenders}"
