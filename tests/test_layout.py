"""The packages' import direction: each top-level package imports only the packages below it.

kernels < engine < serving < {draft_service, target_service, coordinator} < deployment < bench < specserve (the CLI).
``specserve.v1``, the generated gRPC API, sits below everything and imports nothing of the project.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = "specserve.v1"
SERVICES_BELOW = {"serving", "engine", "kernels", API}
ALLOWED: dict[str, set[str]] = {
    API: set(),
    "kernels": set(),
    "engine": {"kernels"},
    "serving": {"engine", "kernels", API},
    "draft_service": SERVICES_BELOW,
    "target_service": SERVICES_BELOW,
    "coordinator": SERVICES_BELOW,
    "deployment": SERVICES_BELOW,
    "bench": SERVICES_BELOW | {"deployment", "coordinator", "draft_service", "target_service"},
}
PROJECT = set(ALLOWED) | {"specserve"}


def _package_of(module: str) -> str | None:
    """The project package a dotted module name belongs to (``specserve.v1`` is its own), else None."""
    if module == API or module.startswith(API + "."):
        return API
    top = module.split(".")[0]
    return top if top in PROJECT else None


def _imports(path: Path) -> set[str]:
    """Every project package the file imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {package for name in names if (package := _package_of(name))}
    return found


def _files_of(package: str) -> list[Path]:
    if package == API:
        return sorted((ROOT / "specserve" / "v1").glob("*.py"))
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_downward(package: str) -> None:
    files = _files_of(package)
    assert files, f"no sources for {package}"
    wrong = {str(path.relative_to(ROOT)): sorted(bad) for path in files
             if (bad := _imports(path) - ALLOWED[package] - {package})}
    assert not wrong, f"{package} imports packages above it or beside it: {wrong}"


def test_every_project_package_has_a_place_in_the_order() -> None:
    tops = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert tops == PROJECT - {API}
