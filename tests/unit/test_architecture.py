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


# Layers that point one way: a module may import its own layer and the ones before it.
LAYERS = ("models", "graph", "cost_model", "plan", "search", "runtime", "cli")
# Known back edges, each to be removed (issue: one home per rule); no new one may appear.
KNOWN_BACK_EDGES = {
    ("runtime/run.py", "autopar.search.planner"),  # plan_from_config: a Plan from a config
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "autopar" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _runtime_imports(path: Path) -> set[str]:
    """Modules imported at run time (imports under ``if TYPE_CHECKING:`` are annotations only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            typing_only.update(id(child) for child in ast.walk(node))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layers_point_one_way() -> None:
    back_edges = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        own = _layer("autopar." + ".".join(rel.with_suffix("").parts))
        if own is None:
            continue
        for name in _runtime_imports(path):
            other = _layer(name)
            later = other is not None and LAYERS.index(other) > LAYERS.index(own)
            if later or (own == "runtime" and other == "search"):
                back_edges.add((rel.as_posix(), name))
    assert back_edges <= KNOWN_BACK_EDGES, (
        "imports against the layer order models <- graph <- cost_model <- plan <- search <- "
        f"runtime <- cli: {sorted(back_edges - KNOWN_BACK_EDGES)}")
