"""tests/ mirrors gpuwatch/ (tests/README.md): only whole-system tests at the top, and the tests start their
daemons with the test harness (gpuwatch.testing), never with the bench; measurements live in gpuwatch/bench."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# What belongs to no package folder: the entry point, config and the daemon as a whole, install, the dashboards,
# the README and the docs, and the layering itself.
WHOLE_SYSTEM = {
    "test_alert_rules.py",
    "test_architecture.py",
    "test_cli.py",
    "test_config.py",
    "test_doc_references.py",
    "test_errors.py",
    "test_first_run.py",
    "test_gpu_missing.py",
    "test_grafana_dashboard.py",
    "test_install.py",
    "test_layout.py",
    "test_readme.py",
    "test_sampling_thread.py",
}


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_only_whole_system_tests_are_at_the_top_of_tests() -> None:
    at_the_top = {path.name for path in TESTS.glob("test_*.py")}
    assert sorted(at_the_top - WHOLE_SYSTEM) == [], "a package's tests go in tests/<package>/ (tests/README.md)"


def test_no_file_in_tests_but_the_benchs_own_tests_imports_gpuwatch_bench() -> None:
    offenders = {
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*.py")
        if path.parent != TESTS / "bench"
        and any(name == "gpuwatch.bench" or name.startswith("gpuwatch.bench.") for name in imported_modules(path))
    }
    assert sorted(offenders) == [], "start daemons with gpuwatch.testing; a measurement goes in gpuwatch/bench"
