"""The declared minimum, Python 3.9 (``python_requires`` in setup.py), is true of the code.

mypy 2 checks against Python 3.10 at the oldest (``python_version`` in
pyproject.toml), so it catches what 3.11 added (``BaseException.add_note``,
``typing.Self``) but not what 3.10 added. These tests cover the rest: every
Python file of the repository byte-compiles with a Python 3.9 interpreter
when one is at hand (new syntax: ``match``, parenthesised context managers),
and no file calls what 3.10 added to functions 3.9 has (``zip(strict=)``,
``dataclass(slots=)``, ...). ruff's FA102 (pyproject.toml) catches ``X | Y``
in annotations that 3.9 would evaluate.
"""
import ast
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["torchpipe", "torchpipe_balancing", "examples", "benchmarks", "tests", "docs"]


def python_files() -> List[Path]:
    files = [ROOT / "setup.py"]
    for folder in FOLDERS:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if "_build" not in p.parts)
    return files


def python39() -> Optional[str]:
    """A Python 3.9 interpreter: $TORCHPIPE_PYTHON39, python3.9 on the PATH, or one of pyenv's."""
    candidates = [os.environ.get("TORCHPIPE_PYTHON39", ""), shutil.which("python3.9") or ""]
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", "3.9*", "bin", "python3.9")))
    for candidate in filter(None, candidates):
        try:
            found = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 9))"],
                capture_output=True, text=True, timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if found.returncode == 0 and found.stdout.strip() == "True":
            return candidate
    return None


COMPILE_ALL = """
import sys
failures = []
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as file:
        source = file.read()
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as error:
        failures.append(f"{path}:{error.lineno}: {error.msg}")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_every_file_byte_compiles_with_python_3_9() -> None:
    """setup.py said Python >= 3.9 while the code needed 3.10 and 3.11; 3.9 must at least parse every file."""
    interpreter = python39()
    if interpreter is None:
        pytest.skip("no Python 3.9 interpreter found (set TORCHPIPE_PYTHON39 to point at one)")
    result = subprocess.run(
        [interpreter, "-c", COMPILE_ALL, *map(str, python_files())], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"Python 3.9 cannot compile:\n{result.stdout}{result.stderr}"


#: Keyword arguments that Python 3.10 added to functions Python 3.9 already has.
KEYWORDS_SINCE_3_10 = {
    "zip": {"strict"},
    "dataclass": {"slots", "kw_only", "match_args"},
    "bisect": {"key"},
    "bisect_left": {"key"},
    "bisect_right": {"key"},
    "insort": {"key"},
    "insort_left": {"key"},
    "insort_right": {"key"},
}
#: Names that Python 3.10 added (as module attributes, builtins or methods).
NAMES_SINCE_3_10 = {"pairwise", "bit_count", "aiter", "anext", "TypeGuard", "ParamSpec", "Concatenate", "TypeAlias"}


def _callee(call: ast.Call) -> str:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return ""


def uses_of_python_3_10(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            added = KEYWORDS_SINCE_3_10.get(_callee(node), set())
            if any(k.arg in added for k in node.keywords):
                yield node
        if isinstance(node, ast.Attribute) and node.attr in NAMES_SINCE_3_10:
            yield node
        if isinstance(node, ast.Name) and node.id in NAMES_SINCE_3_10:
            yield node
        if isinstance(node, ast.ImportFrom) and node.module in ("typing", "itertools"):
            if any(alias.name in NAMES_SINCE_3_10 for alias in node.names):
                yield node


def test_no_file_calls_what_python_3_10_added() -> None:
    """``zip(strict=True)`` in parallel/collate.py raised TypeError on Python 3.9, which setup.py claimed."""
    found = []
    for path in python_files():
        if path == Path(__file__).resolve():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in uses_of_python_3_10(tree):
            found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {ast.dump(node)[:80]}")
    assert not found, "Python 3.10 features in code that must run on 3.9:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for() -> None:
    source = "zip(a, b, strict=True)\nimport itertools\nitertools.pairwise(x)\n@dataclass(slots=True)\nclass A: ..."
    assert len(list(uses_of_python_3_10(ast.parse(source)))) == 3


def test_declared_minimum_is_3_9() -> None:
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert 'python_requires=">=3.9"' in setup
    assert sys.version_info >= (3, 9)
