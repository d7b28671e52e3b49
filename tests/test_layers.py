"""The package's layers point one way, read from the source (every import counted, including those inside
functions): commands on top, then the stages and the tools (each its own room, meeting the others only
through the files in formats/), then the shared layers every room may use."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mmtok"
TOP = ("cli", "commands")  # argument parsing and printing: may import anything
STAGES = ("scan", "curate", "plan", "encode", "audio", "sft", "merge")  # each makes one kind of output
TOOLS = ("tools", "bench")  # read outputs, write no dataset
SHARED = ("formats", "codecs", "media")  # files, codecs and media rules: what the rooms share
ROOT_MODULES = ("documents", "errors", "extras", "fsutil", "launch", "progress", "ranks", "text", "vocab", "workers")
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


# -- stages meet through formats/, and write files through fsutil -----------------------------------
FILE_OWNERS = {"merged.json": "formats/merged.py", "interleave.json": "formats/interleave.py",
               "manifest.json": "formats/manifest.py", "plan.json": "formats/plan.py",
               "dropped": "formats/shar.py", "parts": "formats/partdir.py"}
PATH_WORDS = ("dropped", "parts")  # also ordinary words (counter prefixes, chat keys): flagged in paths only
DURABILITY_CALLS = ("replace", "rename", "fsync", "fdatasync")


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text("utf-8"))


def _docstrings(tree: ast.AST) -> set[int]:
    bodies = (n.body for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                                  ast.AsyncFunctionDef)))
    return {id(body[0].value) for body in bodies if body and isinstance(body[0], ast.Expr)}


def _path_operands(tree: ast.AST) -> set[int]:
    """The nodes a path is built from: the operands of `/` and the arguments of Path(...) and joinpath(...)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found.update((id(node.left), id(node.right)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "Path", "joinpath", "join"):
            found.update(id(arg) for arg in node.args)
    return found


def test_each_file_between_stages_is_named_only_by_its_formats_owner():
    found = []
    for module, tree in _sources():
        docstrings, paths = _docstrings(tree), _path_operands(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and node.value in FILE_OWNERS) or id(node) in docstrings:
                continue
            if module != FILE_OWNERS[node.value] and (node.value not in PATH_WORDS or id(node) in paths):
                found.append(f"{module}:{node.lineno}: {node.value!r} (use {FILE_OWNERS[node.value]})")
    assert not found, "\n".join(found)


def _durability_call(node: ast.AST) -> str | None:
    """`os.replace/rename/fsync/fdatasync(...)`, or a one-argument `.replace(target)` / `.rename(target)` (Path's;
    str.replace takes two arguments, dataclasses.replace keywords)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr not in DURABILITY_CALLS:
        return None
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "os":
        return f"os.{node.func.attr}"
    if node.func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords:
        return f".{node.func.attr}"
    return None


def test_only_fsutil_renames_or_syncs_files():
    found = [f"{module}:{node.lineno}: {call}" for module, tree in _sources() if module != "fsutil.py"
             for node in ast.walk(tree) if (call := _durability_call(node))]
    assert not found, "use mmtok.fsutil (atomic_writer, publish_file, sync):\n" + "\n".join(found)


TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SELF_CONTAINED = ("mmtok", "tests", "benchmarks", "docs", "plans", "manifests", ".ci", "README.md", "pyproject.toml")
OUTSIDE_DOCUMENTS = ("DESIGN" + ".md", "STYLE" + ".md")  # spelled in two pieces so this file does not cite them


def test_no_test_file_imports_another_test_file():
    """Tests share helpers through conftest.py fixtures and helper modules (encodekit, chatkit, ...), so any
    test file runs, moves or is renamed on its own."""
    found = {}
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found.update({f"{path.name}:{node.lineno}": n for n in names if n.split(".")[0].startswith("test_")})
    assert not found, f"move what these share into a helper module or a conftest.py fixture: {found}"


def test_the_repository_cites_no_document_outside_it():
    """The code and docs explain themselves: a rule is stated where it applies or on a page under docs/."""
    files = [p for entry in SELF_CONTAINED for p in ([REPO / entry] if (REPO / entry).is_file()
                                                        else sorted((REPO / entry).rglob("*")))
             if p.is_file() and b"\0" not in p.read_bytes()[:8192]]  # text files only
    cited = [f"{p.relative_to(REPO)}:{n}" for p in files
             for n, line in enumerate(p.read_text("utf-8", errors="replace").splitlines(), 1)
             if any(name in line for name in OUTSIDE_DOCUMENTS)]
    assert not cited, f"state the rule in the repository instead of citing it: {cited}"


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
