"""The layering rule: cost_model/ and search/ never import torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "autopar"
PURE_PACKAGES = ("cost_model", "search")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_do_not_import_torch_distributed(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under autopar/{package}"
    offenders = [
        f"{f.relative_to(ROOT)}: {name}"
        for f in files
        for name in sorted(_imports(f))
        if name == "torch.distributed"
        or name.startswith("torch.distributed.")
        or name == "torch.distributed"
    ]
    assert not offenders, "torch.distributed imported in a pure package:\n" + "\n".join(offenders)


def test_module_size_budget() -> None:
    too_long = [
        f"{f.relative_to(ROOT)} ({n} lines)"
        for f in sorted(ROOT.rglob("*.py"))
        if (n := len(f.read_text().splitlines())) > 600
    ]
    assert not too_long, "modules over the 600-line hard limit: " + ", ".join(too_long)
