"""Every project import in bench/ and examples/ resolves, including the ones inside functions.

Bench scripts import lazily (a section's heavy dependencies load only when it runs), so a module moved or a
name renamed in rl/, model/, envs/... breaks a bench only when someone next runs that section
(bench/smollm2_tasks.py once imported `init_ray` from rl.rollout.cli after it had moved to
rl.rollout.fleet). This walks each file's syntax tree, and for every `from <project module> import name`
anywhere in it checks that the module imports and has the name.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("rl", "model", "envs", "sandbox", "rewards", "bench")
FILES = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("examples/**/*.py")])


def project_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from <project module> import name` in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PROJECT:
                out += [(node.lineno, node.module, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] in PROJECT]
    return out


def test_the_walk_finds_function_local_imports():
    found = project_imports(ROOT / "bench" / "smollm2_tasks.py")
    assert any(mod == "rl.rollout.fleet" and name == "init_ray" for _, mod, name in found)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_project_import_resolves(path):
    missing = []
    for line, module, name in project_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: import {module}: {e}")
            continue
        if name and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module} has no {name!r}")
    assert not missing, "\n".join(missing)
