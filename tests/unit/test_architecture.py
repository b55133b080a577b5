"""The architecture rules: layer order, pure packages, size budget, README names every module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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


def test_planning_loads_no_torch() -> None:
    # ``import autopar`` and the cost model load neither torch nor pulp; the search, plans and
    # exports run without torch: it loads only where a model is built, profiled or run.
    heavy = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pulp'))"
    code = ("import sys, autopar, autopar.costing; autopar.FRAMEWORKS; autopar.Cluster; "
            f"autopar.Estimate; print({heavy}); "
            "import autopar.search.planner, autopar.exporters, autopar.report, autopar.cli; "
            f"print([m for m in {heavy} if m.startswith('torch')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "[]"], out  # neither at first; no torch to plan


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_module_size_budget() -> None:
    too_long = [
        f"{f.relative_to(ROOT)} ({n} lines)"
        for f in sorted(ROOT.rglob("*.py"))
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(too_long)


def test_function_size_budget() -> None:
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}::{node.name} ({n} lines)")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(too_long)


# Layers that point one way: a module may import its own layer and the ones before it, and the
# runtime never imports the search (it receives Plans; planning belongs to the command line).
LAYERS = ("base", "models", "graph", "cost_model", "plan", "search", "runtime", "cli")
# Top-level modules and the layer each belongs to (packages are their own layer). The package
# itself (``import autopar``) re-exports profile / estimate / plan: the search's layer.
MODULE_LAYERS = {
    "config": "base", "errors": "base", "export_rules": "base", "json_data": "base", "lazy": "base",
    "schedules": "base", "stdio": "base", "timelimit": "base", "toml_text": "base",
    "units": "base", "tp_layout": "plan",
    "costing": "plan", "exporters": "plan", "export_base": "plan", "export_megatron": "plan",
    "plan": "plan", "plan_read": "plan", "plotting": "plan", "report": "plan",
    "__init__": "search", "sweep": "search",
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "autopar":
        return None
    name = parts[1] if len(parts) > 1 else "__init__"
    return name if name in LAYERS else MODULE_LAYERS.get(name)


def _autopar_imports(path: Path) -> set[str]:
    """Every autopar module ``path`` imports: at import time, inside functions, and under
    ``if TYPE_CHECKING:`` (an annotation naming a later layer is a back edge too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "autopar" or n.startswith("autopar.")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("autopar", *parts))


def test_every_module_has_a_layer() -> None:
    orphans = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
               if _layer(_module_name(p)) is None]
    assert not orphans, f"modules outside the layer map (add them to MODULE_LAYERS): {orphans}"


def _back_edges(imports: dict[str, set[str]]) -> set[tuple[str, str]]:
    edges = set()
    for module, names in imports.items():
        own = _layer(module)
        for name in names:
            other = _layer(name)
            if own is None or other is None:
                continue
            later = LAYERS.index(other) > LAYERS.index(own)
            if later or (own == "runtime" and other == "search"):
                edges.add((module, name))
    return edges


def test_layers_point_one_way() -> None:
    imports = {_module_name(p): _autopar_imports(p) for p in sorted(ROOT.rglob("*.py"))}
    back_edges = _back_edges(imports)
    assert not back_edges, (
        "imports against the layer order base <- models <- graph <- cost_model <- plan <- search "
        f"<- runtime <- cli (and runtime never imports search): {sorted(back_edges)}")


def test_a_back_edge_fails_the_check() -> None:
    planted = {
        "autopar.cost_model.memory": {"autopar.plan"},
        "autopar.runtime.apply": {"autopar.search.planner"},
        "autopar.graph.profiler": {"autopar.models"},
    }
    assert _back_edges(planted) == {("autopar.cost_model.memory", "autopar.plan"),
                                    ("autopar.runtime.apply", "autopar.search.planner")}


# README's architecture section names every module and package of autopar/ by its path, and
# only paths that exist.
README = ROOT.parent / "README.md"
README_PATH = re.compile(r"`(autopar/[A-Za-z0-9_./]*)`")


def _architecture_section(readme: str) -> str:
    start = readme.index("\n## Architecture\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:] if end == -1 else readme[start:end]


def _tree_paths(root: Path) -> set[str]:
    """``autopar/`` and every package (``autopar/x/``) and module (``__init__.py`` aside)."""
    paths = {"autopar/"}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).as_posix()
        paths.add(rel.removesuffix("__init__.py") if path.name == "__init__.py" else rel)
    return paths


def _section_problems(section: str, root: Path) -> tuple[list[str], list[str]]:
    """(tree paths the section does not name, paths it names that do not exist)."""
    named = set(README_PATH.findall(section))
    unnamed = sorted(_tree_paths(root) - named)
    missing = sorted(p for p in named if not (root.parent / p).exists())
    return unnamed, missing


def test_readme_architecture_names_every_module() -> None:
    unnamed, missing = _section_problems(_architecture_section(README.read_text()), ROOT)
    assert not unnamed, f"README's Architecture section does not name: {unnamed}"
    assert not missing, f"README's Architecture section names paths that do not exist: {missing}"


def test_readme_architecture_check_can_fail() -> None:
    section = _architecture_section(README.read_text())
    dropped = section.replace("`autopar/units.py`", "units")
    planted = section + "\n- `autopar/cost_model/nowhere.py`: gone\n"
    assert _section_problems(dropped, ROOT) == (["autopar/units.py"], [])
    assert _section_problems(planted, ROOT) == ([], ["autopar/cost_model/nowhere.py"])
