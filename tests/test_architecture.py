"""The house rules (docs/architecture.md): every import between the repo's packages points down.

    rl -> envs, rewards, sandbox, model        envs -> sandbox        rewards -> envs' leaf modules only
    model -> nothing in the repo               sandbox -> nothing in the repo

Checked on the source (every `import`, module level or inside a function), so a lazy import cannot
hide an upward arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "sandbox", "envs", "rewards", "rl")
# package -> module prefixes of other packages it may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "model": (),
    "sandbox": (),
    "envs": ("sandbox",),
    "rewards": ("envs.trajectory", "envs.dotted", "envs.threads"),  # leaves: record, resolver, own threads
    "rl": ("envs", "rewards", "sandbox", "model"),
}
# what rewards/ may import: they import nothing in the repo
LEAVES = ("envs.trajectory", "envs.dotted", "envs.threads")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down(package):
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in PACKAGES and top != package and not _allowed(module, ALLOWED[package]):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    may = ALLOWED[package] or "nothing in the repo"
    assert not bad, f"{package}/ may import only {may}:\n" + "\n".join(bad)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_in_the_repo(leaf):
    path = REPO / (leaf.replace(".", "/") + ".py")
    repo_imports = [m for _, m in _imports(path) if m.split(".")[0] in PACKAGES]
    assert repo_imports == [], f"{leaf} must stay a leaf, imports {repo_imports}"
