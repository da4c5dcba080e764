"""docs/architecture.md against the tree and the import-linter contracts it describes.

The page's parts table names every package and every module at the top of gpuwatch/ with its layer; a part
added, removed or moved without the page (or a layer changed in pyproject.toml without it) fails here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gpuwatch"
PAGE = REPO / "docs" / "architecture.md"
# a row of the parts table: | layer | `gpuwatch.part` | what it is |
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`(gpuwatch(?:\.\w+)?)`\s*\|")
# what `python -m gpuwatch` and a package's own metadata are, not parts
NOT_PARTS = {"__init__", "__main__"}


def documented_parts() -> dict[str, int]:
    """Each part the page's table names, with its layer."""
    parts: dict[str, int] = {}
    for line in PAGE.read_text().splitlines():
        match = ROW.match(line)
        if match:
            assert match.group(2) not in parts, f"{match.group(2)} is in the table twice"
            parts[match.group(2)] = int(match.group(1))
    return parts


def parts_in_the_tree() -> set[str]:
    """Every package and every module directly under gpuwatch/."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in NOT_PARTS}
    return {f"gpuwatch.{name}" for name in packages | modules}


def contract_layers() -> dict[str, int]:
    """Each part's layer (1 = top) in the layers contract of pyproject.toml."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers" and not c.get("containers"))
    return {part.strip(): n for n, layer in enumerate(layers, 1) for part in re.split(r"[|:]", layer)}


def test_the_page_names_every_part_and_only_parts_that_exist() -> None:
    documented, present = set(documented_parts()), parts_in_the_tree()
    assert sorted(present - documented) == [], "parts missing from docs/architecture.md"
    assert sorted(documented - present) == [], "docs/architecture.md names parts that do not exist"


def test_the_page_gives_each_part_the_layer_import_linter_holds_it_to() -> None:
    assert documented_parts() == contract_layers()


def test_the_readme_links_the_page() -> None:
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()
