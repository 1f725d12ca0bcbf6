"""The house rules (docs/architecture.md): every import between the repo's packages points down.

    rl -> envs, rewards, sandbox, model        envs -> sandbox        rewards -> envs' leaf modules only
    model -> nothing in the repo               sandbox -> nothing in the repo

and inside rl/: trajectory, policy, config -> learner | rollout -> train, warmup -> cli, with no import cycle
(the config checks may look names up in the registries, which import nothing of rl but the policy factory).

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


# ------------------------------------------------------------------------------------------ inside rl/
# Layers inside rl/, lowest first: a module may import its own unit and lower layers only. learner and
# rollout share a layer and do not import each other (one policy factory, rl/policy.py, serves both).
RL_LAYERS: dict[str, int] = {
    "rl.trajectory": 0, "rl.policy": 0, "rl.config": 0, "rl.placement": 0, "rl.weight_buckets": 0,
    "rl.learner": 1, "rl.rollout": 1,
    "rl.train": 2, "rl.warmup": 2, "rl.plan": 2,
    "rl.cli": 3,
}
# The registries the config checks look names up in (each imports nothing of rl at load time but rl.policy)
REGISTRIES = ("rl.learner.estimators", "rl.learner.losses", "rl.rollout.engines", "rl.train.group_filters")


def _rl_modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "rl").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _rl_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the rl modules it imports (`from a import b` counts a.b when that is a module)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != "rl":
                    continue
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != name:
                    graph.setdefault(name, set()).add(t)
    return graph


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_rl_layers_point_down():
    modules = _rl_modules()
    assert {_unit(m) for m in modules} - {"rl"} <= set(RL_LAYERS), "give every rl/ unit a layer"
    bad = []
    for m, targets in _rl_imports(modules).items():
        for t in targets:
            a, b = _unit(m), _unit(t)
            if a == b or b == "rl" or (a == "rl.config" and t in REGISTRIES):
                continue
            if RL_LAYERS[b] >= RL_LAYERS[a]:
                bad.append(f"{m} imports {t} ({a} is layer {RL_LAYERS[a]}, {b} layer {RL_LAYERS[b]})")
    rule = "imports inside rl/ must point down (config -> learner/rollout -> train -> cli)"
    assert not bad, rule + ":\n" + "\n".join(bad)


def test_rl_has_no_import_cycle():
    graph = _rl_imports(_rl_modules())
    seen: set[str] = set()

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in seen:
            return None
        seen.add(m)
        for t in sorted(graph.get(m, ())):
            found = cycle_from(t, [*path, m])
            if found:
                return found
        return None

    for m in sorted(graph):
        found = cycle_from(m, [])
        assert found is None, "import cycle: " + " -> ".join(found)


@pytest.mark.parametrize("registry", REGISTRIES)
def test_registries_import_only_the_policy_factory_from_rl(registry):
    modules = _rl_modules()
    tree = ast.parse(modules[registry].read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    at_load = {n.module if isinstance(n, ast.ImportFrom) else a.name for n in top
               for a in (n.names if isinstance(n, ast.Import) else [None])}
    assert {m for m in at_load if m and m.split(".")[0] in PACKAGES} <= {"rl.policy"}, at_load
