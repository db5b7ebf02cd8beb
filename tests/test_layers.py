"""The package's shape: imports point one way (core <- models <- service <- cli), with no cycle.

Every module's imports are read from its source (AST), those inside functions included, so a
deferred import cannot hide a cycle. Imports inside functions are allowed only where they keep
torch out of ``padim --help`` / ``padim health`` or load an optional extra, and each says so in
a comment.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Folder -> the package it is installed as (setup.py's ROOTS).
FOLDERS = {"core": "padim.core", "models": "padim.models", "service": "padim.service", "cli": "padim"}
#: Lower layers first; a module may import its own layer and those before it.
LAYERS = ("padim.core", "padim.models", "padim.service", "padim")


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [p for p in rest if p != "__init__"]
    return ".".join([FOLDERS[folder], *parts])


def modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


MODULES = modules()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports(name: str) -> list[tuple[str, ast.stmt, bool]]:
    """``(imported padim module, node, inside a function)`` for every import of a padim module in ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if is_package(name) else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child, in_function) for a in child.names if a.name.split(".")[0] == "padim")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                if base.split(".")[0] != "padim":
                    continue
                for alias in child.names:  # `from padim.models import fit`: the submodule, when it is one
                    sub = f"{base}.{alias.name}"
                    found.append((sub if sub in MODULES else base, child, in_function))
            visit(child, nested)

    visit(tree, False)
    return [(target, node, inside) for target, node, inside in found if target in MODULES and target != name]


def layer(name: str) -> int:
    """The index in :data:`LAYERS` of the package ``name`` is in (the command line: whatever is outside the rest)."""
    inside = [i for i, prefix in enumerate(LAYERS[:-1]) if name == prefix or name.startswith(prefix + ".")]
    return inside[0] if inside else len(LAYERS) - 1


GRAPH = {name: sorted({target for target, _, _ in imports(name)}) for name in MODULES}


def test_every_source_file_is_a_module_of_the_package():
    assert "padim.models.fit.in_progress" in MODULES and "padim.commands.train" in MODULES
    assert len(MODULES) > 60


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_from_a_higher_layer(name):
    higher = [t for t in GRAPH[name] if layer(t) > layer(name)]
    assert not higher, f"{name} ({LAYERS[layer(name)]}) imports {higher} from a higher layer"


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, or with a self-loop."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_cycle_between_modules():
    assert strongly_connected(GRAPH) == []


def room(name: str) -> str:
    """A module's room: the subpackage of ``padim.models`` or ``padim.service`` it is in, or itself."""
    parts = name.split(".")
    if parts[:2] in (["padim", "models"], ["padim", "service"]) and len(parts) > 3:
        return ".".join(parts[:3])
    return name


def test_no_cycle_between_the_rooms():
    rooms: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    assert strongly_connected({k: sorted(v) for k, v in rooms.items()}) == []


#: The rooms of :mod:`padim.models`, lower first: a module imports its own room and those before it (a top-level
#: module is a room of one). docs/layout.md says the same in words.
MODEL_ROOMS = (
    "padim.models.choices",
    "padim.models.families",
    "padim.models.errors",
    "padim.models.options",
    "padim.models.devices",
    "padim.models.data",
    "padim.models.config",
    "padim.models.features",
    "padim.models.scoring",
    "padim.models.scorer",
    "padim.models.fit",
    "padim.models.deploy",
    "padim.models.evaluation",
    "padim.models.repository",
    "padim.models.api",
    "padim.models",
)
#: The rooms of :mod:`padim.service`, lower first, as those of models.
SERVICE_ROOMS = (
    "padim.service.settings",
    "padim.service.metrics",
    "padim.service.monitor",
    "padim.service.edge",
    "padim.service.record",
    "padim.service.device",
    "padim.service.updates",
    "padim.service.state",
    "padim.service.lines",
    "padim.service.routes",
    "padim.service.app",
    "padim.service.processes",
    "padim.service.server",
    "padim.service",
)
#: Each layer with rooms: its rooms in order, and how many modules may stand at its top.
HOUSES = {"padim.models": (MODEL_ROOMS, 10), "padim.service": (SERVICE_ROOMS, 12)}


def members(house: str) -> list[str]:
    return sorted(n for n in MODULES if n == house or n.startswith(house + "."))


ROOMS = [(house, n) for house in HOUSES for n in members(house) if n.count(".") == 2 and is_package(n)]


@pytest.mark.parametrize("house", HOUSES)
def test_each_house_reads_as_a_table_of_contents(house):
    """At most about ten (models) or twelve (service) modules at the top, every module in a room of the list."""
    rooms, most = HOUSES[house]
    top = [n for n in members(house) if n.count(".") == 2 and not is_package(n)]
    assert len(top) <= most, f"{len(top)} modules at the top of {house}: {top}"
    assert sorted({room(n) for n in members(house)}) == sorted(rooms)


@pytest.mark.parametrize("name", [n for house in HOUSES for n in members(house)])
def test_the_rooms_import_down(name):
    rooms = HOUSES[".".join(name.split(".")[:2])][0]
    mine = rooms.index(room(name))
    upward = [t for t in GRAPH[name] if room(t) in rooms and rooms.index(room(t)) > mine]
    assert not upward, f"{name} ({room(name)}) imports {upward} from a room above it (tests/test_layers.py)"


@pytest.mark.parametrize("house, package", ROOMS, ids=[p for _, p in ROOMS])
def test_each_room_opens_with_what_it_holds_and_may_import(house, package):
    """Its docstring names each of its modules and, after "May import:", every room of its house it imports."""
    rooms = HOUSES[house][0]
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert "May import:" in doc, f"{package}: no 'May import:' in its docstring"
    said = set(re.findall(rf":mod:`({re.escape(house)}\.\w+)`", doc.split("May import:", 1)[1]))
    inside = members(house)
    used = {room(t) for n in inside if room(n) == package for t in GRAPH[n] if t in inside and room(t) != package}
    assert used <= said, f"{package} imports {sorted(used - said)}, which its docstring does not name"
    assert all(rooms.index(r) < rooms.index(package) for r in said), f"{package} names a room above it"
    modules = [n.rpartition(".")[2] for n in inside if n.rpartition(".")[0] == package]
    left_out = [m for m in modules if f"``{m}``" not in doc and f":mod:`.{m}`" not in doc]
    assert left_out == [], f"{package}: its docstring leaves modules out: {left_out}"


def test_layers_are_told_apart():
    assert [
        layer(n)
        for n in (
            "padim.core.statistics",
            "padim.models.fit.in_progress",
            "padim.service.state",
            "padim.commands.train",
            "padim.cli",
            "padim",
        )
    ] == [0, 1, 2, 3, 3, 3]


def test_the_cycle_checker_finds_a_cycle():
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert strongly_connected({"a": ["b"], "b": []}) == []


def function_imports() -> list[tuple[str, int, str]]:
    """``(module, line, source line)`` of every import inside a function, of any package."""
    found = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        found.append((name, inner.lineno, lines, inner))
    return found


def _in_import(line: str) -> bool:
    """A line of an import statement, one of several lines of a parenthesised one included."""
    return line.startswith(("import ", "from ")) or line == ")" or (line.endswith(",") and " " not in line.rstrip(","))


def says_why(lines: list[str], lineno: int) -> bool:
    """A comment on a line of the import's block of imports, or on the line just above the block."""
    above = lineno - 1
    while above >= 0 and (not lines[above].strip() or _in_import(lines[above].strip())):
        if "#" in lines[above]:
            return True
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def test_imports_inside_functions_say_why_and_never_dodge_a_cycle():
    unexplained, library = [], []
    for name, lineno, lines, node in function_imports():
        if not says_why(lines, lineno):
            unexplained.append(f"{MODULES[name].relative_to(ROOT)}:{lineno}")
        if (
            layer(name) < layer("padim")
            and isinstance(node, ast.ImportFrom)
            and (node.level or (node.module or "").startswith("padim"))
        ):
            library.append(f"{MODULES[name].relative_to(ROOT)}:{lineno}")
    assert not unexplained, f"imports inside functions without a comment saying why: {unexplained}"
    assert not library, f"the library imports its own modules inside functions: {library}"


def environment_reads_on_import(source: str) -> list[int]:
    """Lines of ``source`` that read the environment (``os.environ``, ``os.getenv``) in code that runs on import: the
    module's body, class bodies, decorators and default values; not a function's body."""
    found: list[int] = []

    def reads(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            return node.attr in {"environ", "environb", "getenv", "getenvb"}
        return isinstance(node, ast.Name) and node.id in {"environ", "getenv"}

    def visit(node: ast.AST, on_import: bool) -> None:
        if on_import and reads(node):
            found.append(node.lineno)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for part in [*getattr(node, "decorator_list", []), node.args, getattr(node, "returns", None)]:
                if part is not None:
                    visit(part, on_import)
            for statement in node.body if isinstance(node.body, list) else [node.body]:
                visit(statement, False)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, on_import)

    visit(ast.parse(source), True)
    return found


def test_no_module_reads_the_environment_when_imported():
    """Settings are read when a command or the service starts, never on import: an import cannot be given another
    environment later, and what it read stays in every process forked after it (tests/cli_zygote.py imports padim
    once and forks the suite's command lines and servers from it; the service's supervisor forks its children)."""
    reads = {
        f"{path.relative_to(ROOT)}:{line}"
        for path in MODULES.values()
        for line in environment_reads_on_import(path.read_text())
    }
    assert not reads, f"read on import: {sorted(reads)}"


def test_the_environment_checker_finds_reads_on_import():
    source = """
import os
from os import environ
A = os.environ.get("X")
class B:
    c = os.getenv("Y")
def d(e=environ["Z"]):
    return os.environ.get("RUN_TIME")
@decorate(os.environ)
def f():
    g = lambda h=os.getenv("W"): os.environ
"""
    assert environment_reads_on_import(source) == [4, 6, 7, 9]


#: Classes that may run past 250 lines: declarations, which a split would scatter (a table of settings, of metrics).
DECLARATIONS = {"padim.service.settings.ServiceSettings", "padim.service.metrics.Metrics"}


def test_no_long_pieces_but_declarations():
    """No class over 250 lines but the declarations; at most three functions over 60 lines besides theirs."""
    long_classes, long_functions = [], []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and lines > 250 and f"{name}.{node.name}" not in DECLARATIONS:
                long_classes.append((f"{name}.{node.name}", lines))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > 60:
                declaring = node.name == "__init__" and any(c.rpartition(".")[0] == name for c in DECLARATIONS)
                if not declaring:  # a declaration's __init__ (Metrics: one metric a few lines) is the declaration
                    long_functions.append((f"{name}.{node.name}", lines))
    assert long_classes == [], long_classes
    assert len(long_functions) <= 3, sorted(long_functions, key=lambda f: -f[1])
