"""Every `.md` file a docstring or comment in gpuwatch/ names is in the repository.

A reader sent to a design note that lives elsewhere cannot check the fact; the facts belong in docs/ (or the
comment cites the vendor's page). A name is looked up from the repository root, from docs/ and from the module's
own folder.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gpuwatch"
# a file name ending in .md, with the folders written before it (a docstring may break the path at a "/")
MD_NAME = re.compile(r"[\w./-]*\w\.md\b")


def docstrings_and_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of each docstring (module, class, function) and each comment in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            text = first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            if isinstance(text, str):
                found.append((first.lineno, text))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def named_md_files(text: str) -> list[str]:
    """The `.md` names in `text`; a path broken across lines after a "/" is joined again."""
    return MD_NAME.findall(re.sub(r"/\s*\n\s*(?:#\s*)?", "/", text))


def resolves(name: str, module: Path) -> bool:
    return any((base / name).is_file() for base in (REPO, REPO / "docs", module.parent))


def missing_references(package: Path) -> list[str]:
    """`path:line: name` for each `.md` name in a docstring or comment under `package` that is not a file here."""
    missing = []
    for module in sorted(package.rglob("*.py")):
        for line, text in docstrings_and_comments(module.read_text()):
            for name in named_md_files(text):
                if not resolves(name, module):
                    missing.append(f"{module.relative_to(package.parent)}:{line}: {name}")
    return missing


def test_no_docstring_or_comment_names_a_document_outside_the_repository() -> None:
    assert missing_references(PACKAGE) == []


def test_a_missing_document_is_found_in_a_docstring_and_in_a_comment(tmp_path: Path) -> None:
    """The check itself: it reports a name that is not here, and passes one that is (docs/, or beside the module)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "notes.md").write_text("local notes\n")
    (package / "mod.py").write_text(
        '"""Why: see DESIGN.md and docs/\nmetrics.md and notes.md."""\n\n'
        "X = 1  # ref. shared/reference/dcgm.md §1.2, then architecture.md\n"
        'Y = "README-missing.md"  # a string is not a docstring\n'
    )
    found = [entry.split(": ", 1)[1] for entry in missing_references(package)]
    assert found == ["DESIGN.md", "shared/reference/dcgm.md"]
