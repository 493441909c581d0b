"""The layering the codebase keeps (README "How the code is laid out"): runtime/ needs nothing of engine/
(the plan types both use live in nextserve/step_plan.py), and model files know nothing of either."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nextserve"


def _imports(path: Path) -> set[str]:
    """Every module a file imports (relative imports resolved against its package), TYPE_CHECKING too."""
    pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            out.add(f"{base}.{node.module}".strip(".") if node.module else base)
    return out


def _in(module: str, *packages: str) -> bool:
    """Whether `module` is one of `packages` or inside one (nextserve.engine_config is not in engine)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_runtime_imports_nothing_of_engine() -> None:
    for f in sorted((PKG / "runtime").glob("*.py")):
        bad = {m for m in _imports(f) if _in(m, "nextserve.engine")}
        assert not bad, (f.name, bad)


def test_model_files_know_nothing_of_engine_runtime_or_server() -> None:
    for f in sorted((PKG / "model").glob("*.py")):
        bad = {m for m in _imports(f) if _in(m, "nextserve.engine", "nextserve.runtime", "nextserve.server")}
        assert not bad, (f.name, bad)
