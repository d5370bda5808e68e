"""The house stays readable: the package's imports form layers (no module imports, through others, one that
imports it, type-only imports included), no library file grows past 500 lines, the docstrings and docs describe
the code rather than its history (no "session"), and every ``[Note: ...]`` cited is defined once."""
import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

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


# The text a reader of the library meets: the packages' sources and everything under docs/.
TEXT_ROOTS = ["torchpipe", "torchpipe_balancing", "docs"]
SKIPPED_DIRS = {"__pycache__", "_build"}
#: Phrases in which "session" means something other than a stretch of the project's history (a torchrun session,
#: say), exactly as written; none occurs yet.
SESSION_ALLOWED: Tuple[str, ...] = ()


def text_files() -> Iterator[Tuple[Path, str]]:
    """Every text file under :data:`TEXT_ROOTS` (pictures and build outputs left out), with its text."""
    for root in TEXT_ROOTS:
        for path in sorted((ROOT / root).rglob("*")):
            if not path.is_file() or SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
                continue
            raw = path.read_bytes()
            if b"\0" in raw:
                continue
            yield path, raw.decode("utf-8")


def sessions(text: str, allowed: Tuple[str, ...] = SESSION_ALLOWED) -> List[Tuple[int, str]]:
    """The lines (number, text) of ``text`` that say "session" other than inside an allowed phrase."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        rest = line.lower()
        for phrase in allowed:
            rest = rest.replace(phrase.lower(), "")
        if "session" in rest:
            found.append((number, line.strip()))
    return found


def test_no_docstring_or_doc_says_session() -> None:
    # Docs say what the code does now; which sitting of work changed it, and what it measured then, is git's.
    found = [f"{path.relative_to(ROOT)}:{number}: {line}" for path, text in text_files()
             for number, line in sessions(text)]
    assert not found, ("describe the code as it is (figures live in benchmarks/RESULTS.md, history in git), or add "
                       "a phrase where the word means something else to SESSION_ALLOWED:\n" + "\n".join(found))


def test_the_session_check_finds_a_diary() -> None:
    assert sessions("a line\nwhich it was until the twentieth Session") == [
        (2, "which it was until the twentieth Session")]
    assert sessions("a torchrun session ends", allowed=("torchrun session",)) == []


NOTE = re.compile(r"\[Note:\s+([^\]]+?)\s*\]")
# A definition opens a paragraph of a docstring, or a comment block (``#:`` documents an attribute, and cites):
# the note first on its line, followed by its text or nothing, not by the punctuation of a sentence that cites it.
DEFINITION = re.compile(r'^\s*(?P<comment>#(?!:)\s*)?(?:r?"""\s*)?\[Note: (?P<name>[^\]]+)\](?=\s|$)')


def note_definitions(text: str) -> List[str]:
    """The names of the notes ``text`` (Python source) defines, in order."""
    names = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        found = DEFINITION.match(line)
        if not found:
            continue
        before = lines[number - 1].strip() if number else ""
        opens = before in ("", '"""', 'r"""') or '"""' in line.split("[Note:")[0]
        if opens or (found.group("comment") and not before.startswith("#")):
            names.append(found.group("name"))
    return names


def note_citations(text: str) -> List[str]:
    """The names of every ``[Note: ...]`` in ``text``, definitions included, a name broken over lines (of a
    comment, a docstring or Markdown) joined again."""
    joined = re.sub(r"[ \t]*\n[ \t]*(?:#:?[ \t]*)?", " ", text)
    return [" ".join(m.group(1).split()) for m in NOTE.finditer(joined) if m.group(1) != "..."]


def test_every_note_cited_is_defined_once() -> None:
    defined: Dict[str, List[str]] = {}
    cited: Dict[str, Set[str]] = {}
    for path, text in text_files():
        where = str(path.relative_to(ROOT))
        if path.suffix == ".py":
            for name in note_definitions(text):
                defined.setdefault(name, []).append(where)
        for name in note_citations(text):
            cited.setdefault(name, set()).add(where)
    twice = {name: places for name, places in defined.items() if len(places) > 1}
    assert not twice, f"notes defined more than once (give each its own name): {twice}"
    missing = {name: sorted(places) for name, places in cited.items() if name not in defined}
    assert not missing, f"notes cited but defined nowhere (cite a defined name, or define it): {missing}"


def test_the_note_check_tells_definitions_from_citations() -> None:
    source = ('"""One line.\n\n[Note: a b] The note itself, citing [Note: c].\n"""\n'
              "# [Note: d]\n# Its text, then see [Note:\n# a b]).\n"
              "#: [Note: e] a citation, in lower case\n    [Note: f]). The end of a citation\n")
    assert note_definitions(source) == ["a b", "d"]
    assert note_citations(source) == ["a b", "c", "d", "a b", "e", "f"]
