"""The house stays readable (issue 35): the package's imports form layers (no module imports, through others,
one that imports it, type-only imports included), and no library file grows past 500 lines."""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["torchpipe", "torchpipe_balancing"]
MOST_LINES = 500


def modules() -> Dict[str, Path]:
    found: Dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The package's modules that ``name`` imports anywhere in its text (under TYPE_CHECKING, in functions)."""
    found: Set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle of ``graph``, as the modules along it (the first repeated at the end); None if none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_imports_in_layers_without_a_circle() -> None:
    known = modules()
    # A package's __init__ gathers what its modules define: its own imports of them go down, not round.
    graph = {name: {t for t in imports(name, path, known) if not (path.name == "__init__.py" and
                                                                 t.startswith(name + "."))}
             for name, path in known.items()}
    found = circle(graph)
    assert found is None, "an import circle: " + " -> ".join(found or [])


def test_the_structure_check_finds_a_circle() -> None:
    # The check itself can fail: a type-only import back up a chain is a circle.
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_no_library_file_is_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MOST_LINES}
    assert not long, f"split these by job (at most {MOST_LINES} lines a file): {long}"
