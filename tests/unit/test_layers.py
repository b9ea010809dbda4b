"""The import contract (pyproject.toml [tool.importlinter], CONTRIBUTING.md): the parts import downward only, no
module or package imports its siblings in a cycle, only the CLI imports click and rich, the estimator imports no
torch; and no module imports another module's private names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import memplan

ROOT = Path(memplan.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"


def test_import_linter_contracts_are_kept():
    cli = pytest.importorskip("importlinter.cli")
    if not PYPROJECT.exists():  # an installed copy, not a checkout
        pytest.skip("pyproject.toml not beside the package")
    assert cli.lint_imports(config_filename=str(PYPROJECT), no_cache=True) == 0, \
        "an import breaks the contract: run `lint-imports` for the chain"


def _private_imports():
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memplan"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if names:
                    yield f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {names} from {node.module}"


def test_no_module_imports_another_modules_private_names():
    assert list(_private_imports()) == []


def test_at_most_eight_modules_directly_under_the_package():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 8, top


def test_no_module_is_named_like_a_public_function():
    """A submodule named like a function the package exports would be bound over it once imported."""
    functions = {name for name in memplan.__all__ if name[:1].islower() and name != "__version__"}
    clashes = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.stem in functions]
    clashes += [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_dir() and p.name in functions]
    assert clashes == []
