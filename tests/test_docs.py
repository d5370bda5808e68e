"""Every code example of README.md and docs/*.md runs as written.

The ```python blocks of a page run in order in one namespace, like the cells
of a notebook, on the CPU (CUDA is hidden from them), in a scratch folder
(examples may write files). ```pycon blocks are doctests, run in the same
namespace. Other fences (```text, ```console) are not run: use them for
output, shell commands and signatures.

A block that fails only because of a known bug outside the docs can be listed
in ``KNOWN_FAILURES`` (strict: the test fails once the bug is fixed). The
blocks of a page that needs an optional package (``REQUIRES``) are skipped
when it is not installed.
"""
import doctest
import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RUN = ("python", "pycon")

#: (page name, line of the opening fence) -> why the block fails for now.
KNOWN_FAILURES: Dict[Any, str] = {}

#: page name -> the optional package its code needs (an extra of setup.py).
REQUIRES: Dict[str, str] = {"language_models.md": "transformers"}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class Block(NamedTuple):
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str


def blocks(page: Path) -> List[Block]:
    """The fenced code blocks of a Markdown page, with the language of each fence."""
    found: List[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    opening = re.compile(r"^(`{3,}|~{3,})\s*([\w{}-]*)")
    index = 0
    while index < len(lines):
        match = opening.match(lines[index])
        if not match:
            index += 1
            continue
        fence, language = match.group(1), match.group(2)
        start = index
        index += 1
        body: List[str] = []
        while index < len(lines) and not lines[index].startswith(fence):
            body.append(lines[index])
            index += 1
        index += 1
        found.append(Block(page, start + 1, language, "\n".join(body) + "\n"))
    return found


def runnable() -> Iterator[Any]:
    for page in PAGES:
        for block in blocks(page):
            if block.language not in RUN:
                continue
            marks = []
            reason = KNOWN_FAILURES.get((page.name, block.line))
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            package = REQUIRES.get(page.name)
            if package is not None and not _installed(package):
                marks.append(pytest.mark.skip(reason=f"{page.name} needs {package} (pip install -e '.[{package}]')"))
            yield pytest.param(block, id=f"{page.relative_to(ROOT)}:{block.line}", marks=marks)


_namespaces: Dict[Path, Dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def cpu_scratch_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    folder = tmp_path_factory.mktemp("docs")
    previous = os.getcwd()
    os.chdir(folder)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setattr(torch.cuda, "device_count", lambda: 0)
        try:
            yield
        finally:
            os.chdir(previous)
            torch.set_num_threads(threads)
            _namespaces.clear()


@pytest.mark.parametrize("block", list(runnable()))
def test_code_block_runs(block: Block) -> None:
    namespace = _namespaces.setdefault(block.page, {"__name__": f"docs:{block.page.name}"})
    # Line numbers of tracebacks point into the page.
    source = "\n" * block.line + block.code
    if block.language == "python":
        exec(compile(source, str(block.page), "exec"), namespace)
        return
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.code, namespace, f"{block.page.name}:{block.line}", str(block.page), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output: List[str] = []
    runner.run(test, out=output.append, clear_globs=False)
    # DocTest runs on a copy of the namespace: what the block defined is the page's, as for ```python blocks.
    namespace.update(test.globs)
    assert runner.failures == 0, "".join(output)


def test_every_page_is_checked() -> None:
    """Each page's blocks are found, and no ```python block is hidden behind another spelling."""
    assert any(b.language == "python" for b in blocks(ROOT / "README.md"))
    for page in PAGES:
        for block in blocks(page):
            assert block.language.lower() not in ("py", "python3", "ipython"), (
                f"{page.name}:{block.line}: write ```python (run by tests/test_docs.py), or ```text if it is not code"
            )
