"""Env registry: built-ins, user registrations and plugins discovered through entry points.

    import envs
    env = envs.make("arith", difficulty=1)                 # or envs.make("odyssey/Arith-v0")
    envs.register("my-env", "my_pkg.env:MyEnv")           # or a class / factory callable
    envs.list_envs()                                       # [EnvEntry(id, gym_id, source, status, ...)]

Plugins: any installed distribution declaring

    [project.entry-points."odyssey.envs"]
    word-count = "odyssey_example_env.env:WordCountEnv"

is found through `importlib.metadata` when this module is imported (on first use of `envs.make`,
`envs.list_envs`, ...; or on `discover()`). Every env is also registered with gymnasium as
`odyssey/<CamelName>-v0` (id "word-count" -> "odyssey/WordCount-v0"), so
`gymnasium.make("odyssey/WordCount-v0")` works once `envs.registry` is imported (`import envs` alone is
lazy and imports nothing); `gymnasium.make("envs.registry:odyssey/WordCount-v0")` imports it itself.

Namespaced ids `namespace/name` resolve through NAMESPACES to an adapter's factory with `name` bound:
`reasoning-gym/<dataset>` (envs/adapters/reasoning_gym.py) and `skyrl/<env>` (envs/adapters/skyrl.py),
from the optional extra `envs`. They are checked against the names the package knows (close matches
suggested), listed once per namespace by `odyssey envs list`, and not registered with gymnasium.

Failures never hide other envs: a plugin whose import fails is warned about by name, listed as
"broken" (with the error) by `list_envs()` / `odyssey envs list`, and `make()` of it raises an error
naming the plugin, its distribution and the import error. Two sources claiming one id is an error:
`register()` raises; a discovered plugin that collides is listed as broken with both sources named.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.metadata
import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium

from envs.dotted import DottedNameError, is_well_formed, resolve_name

ENTRY_POINT_GROUP = "odyssey.envs"
GYM_NAMESPACE = "odyssey"

BUILTINS: dict[str, str] = {
    "arith": "envs.arith:ArithEnv",
    "code-repair": "envs.code_repair:CodeRepairEnv",
    "long-docs": "envs.long_docs:LongDocsEnv",
    "vision-arith": "envs.vision_arith:VisionArithEnv",
    "dataset-qa": "envs.dataset_qa:DatasetQAEnv",
    "agent": "envs.agent_env:AgentEnv",
}

#: id prefix -> (factory taking the name after the slash first, function listing the accepted names)
NAMESPACES: dict[str, tuple[str, str]] = {
    "reasoning-gym": (
        "envs.adapters.reasoning_gym:ReasoningGymEnv",
        "envs.adapters.reasoning_gym:dataset_names",
    ),
    "skyrl": ("envs.adapters.skyrl:SkyRLEnv", "envs.adapters.skyrl:env_names"),
}

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
_ID_RE = re.compile(rf"{_NAME}(/{_NAME})?")  # "arith", or "namespace/name" ("reasoning-gym/chain_sum")


class EnvRegistrationError(ValueError):
    """An env id or entry point cannot be registered (duplicate id, bad id or entry point)."""


class EnvNotFoundError(KeyError):
    """No env with this id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class EnvLoadError(ImportError):
    """The env is registered but its entry point cannot be imported (a broken plugin)."""


@dataclass
class EnvEntry:
    """One registered env. status: "ok" (imported), "not loaded" (not imported yet), "broken"."""

    id: str
    gym_id: str
    source: str  # "builtin" | "user" | "plugin <distribution>"
    entry_point: str
    status: str = "not loaded"
    error: str | None = None
    factory: Callable[..., Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("id", "gym_id", "source", "entry_point", "status", "error")}


_ENTRIES: dict[str, EnvEntry] = {}
_REJECTED: list[EnvEntry] = []  # discovered plugins that lost an id collision (shown as broken)


def gym_id_for(env_id: str) -> str:
    """`odyssey/<CamelName>-v0` for an Odyssey env id ("code-repair" -> "odyssey/CodeRepair-v0")."""
    name = "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_./]", env_id) if part)
    return f"{GYM_NAMESPACE}/{name}-v0"


def _entry_point_str(entry_point: str | Callable[..., Any]) -> str:
    if isinstance(entry_point, str):
        if not is_well_formed(entry_point):
            raise EnvRegistrationError(
                f"entry point {entry_point!r} must look like 'package.module:ClassName' "
                "(or pass the class itself)"
            )
        return entry_point
    if callable(entry_point):
        qualname = getattr(entry_point, "__qualname__", repr(entry_point))
        return f"{getattr(entry_point, '__module__', '?')}:{qualname}"
    raise EnvRegistrationError(
        f"entry point must be 'module:attr' or a callable, got {type(entry_point).__name__}"
    )


def _gym_register(entry: EnvEntry) -> None:
    if entry.gym_id in gymnasium.registry:
        del gymnasium.registry[entry.gym_id]
    gymnasium.register(id=entry.gym_id, entry_point=functools.partial(make, entry.id))


def _add(env_id: str, entry_point: str | Callable[..., Any], source: str, overwrite: bool) -> EnvEntry:
    if not isinstance(env_id, str) or not _ID_RE.fullmatch(env_id):
        raise EnvRegistrationError(
            f"env id {env_id!r} must start with a letter or digit and contain only letters, digits, "
            "'-', '_' or '.'"
        )
    ep = _entry_point_str(entry_point)
    gym_id = gym_id_for(env_id)
    old = _ENTRIES.get(env_id)
    if old is not None and not overwrite:
        raise EnvRegistrationError(
            f"env id '{env_id}' is already registered by {old.source} ({old.entry_point}); "
            f"choose another id for {ep}, or pass overwrite=True to replace it"
        )
    clash = next((e for e in _ENTRIES.values() if e.gym_id == gym_id and e.id != env_id), None)
    if clash is not None:
        raise EnvRegistrationError(
            f"env id '{env_id}' maps to gymnasium id '{gym_id}', "
            f"already used by '{clash.id}' ({clash.source}); "
            "choose an id that differs by more than '-', '_' or '.'"
        )
    entry = EnvEntry(
        env_id, gym_id, source, ep, factory=None if isinstance(entry_point, str) else entry_point
    )
    if entry.factory is not None:
        entry.status = "ok"
    _ENTRIES[env_id] = entry
    _gym_register(entry)
    return entry


def register(env_id: str, entry_point: str | Callable[..., Any], *, overwrite: bool = False) -> EnvEntry:
    """Register an env under `env_id`. `entry_point` is 'module:Class' (imported lazily) or a class/factory.

    Raises `EnvRegistrationError` when `env_id` is taken (unless `overwrite=True`) or malformed.
    """
    return _add(env_id, entry_point, "user", overwrite)


def unregister(env_id: str) -> None:
    """Remove an env (and its gymnasium registration)."""
    entry = _ENTRIES.pop(env_id, None)
    if entry is None:
        raise EnvNotFoundError(f"no env '{env_id}' to unregister")
    gymnasium.registry.pop(entry.gym_id, None)


def discover() -> list[EnvEntry]:
    """(Re)scan the `odyssey.envs` entry point group; returns the plugin entries now registered.

    Plugin entries from an earlier scan are replaced, so a plugin installed or removed since is
    picked up. Nothing is imported here; `list_envs()` / `make()` import lazily.
    """
    for env_id in [k for k, e in _ENTRIES.items() if e.source.startswith("plugin")]:
        unregister(env_id)
    _REJECTED.clear()
    found: list[EnvEntry] = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        source = f"plugin {dist}"
        try:
            found.append(_add(ep.name, ep.value, source, overwrite=False))
        except EnvRegistrationError as err:
            rejected = EnvEntry(
                ep.name, gym_id_for(ep.name), source, ep.value, status="broken", error=str(err)
            )
            _REJECTED.append(rejected)
            warnings.warn(
                f"odyssey env plugin '{ep.name}' from {dist} was not registered: {err}", stacklevel=2
            )
    return found


def _load(entry: EnvEntry) -> Callable[..., Any]:
    if entry.factory is not None:
        return entry.factory
    try:
        obj = resolve_name(entry.entry_point, what="entry point")
    except DottedNameError as err:
        entry.status, entry.error = "broken", err.problem
        message = (
            f"env '{entry.id}' ({entry.source}) failed to import its entry point {entry.entry_point}: "
            f"{entry.error}"
        )
        raise EnvLoadError(message) from err
    entry.factory, entry.status, entry.error = obj, "ok", None
    return obj


def list_envs(load: bool = True) -> list[EnvEntry]:
    """Every registered env, sorted by id, plus rejected plugins (status "broken").

    With `load=True` each entry point is imported, so broken plugins show as "broken" (and warn).
    """
    if load:
        for entry in _ENTRIES.values():
            if entry.factory is None and entry.status != "broken":
                try:
                    _load(entry)
                except EnvLoadError as err:
                    warnings.warn(str(err), stacklevel=2)
    return sorted([*_ENTRIES.values(), *_REJECTED], key=lambda e: (e.id, e.status != "ok"))


def list_namespaces() -> list[EnvEntry]:
    """One entry "namespace/<name>" per adapter namespace: status "ok" with the number of names it knows in
    `error`'s place (None), or "broken" with the import error (its package is not installed)."""
    out = []
    for ns, (factory_ep, names_ep) in NAMESPACES.items():
        entry = EnvEntry(f"{ns}/<name>", "-", f"adapter {ns}", factory_ep)  # not gymnasium-registered
        try:
            n = len(resolve_name(names_ep, what="name list")())
            entry.status = f"ok ({n} names)"
        except (ImportError, DottedNameError) as err:
            entry.status, entry.error = "broken", str(err)
        out.append(entry)
    return out


def _namespaced(env_id: str) -> EnvEntry | None:
    """The entry of "namespace/name" for a namespace in NAMESPACES (None for any other id). Its factory is
    the namespace's factory with `name` bound; EnvLoadError when the adapter's package is not installed,
    EnvNotFoundError when it does not know `name`."""
    ns, sep, name = env_id.partition("/")
    if not sep or ns not in NAMESPACES:
        return None
    factory_ep, names_ep = NAMESPACES[ns]
    entry = EnvEntry(env_id, "-", f"adapter {ns}", factory_ep)  # not gymnasium-registered
    try:
        names = resolve_name(names_ep, what="name list")()
        cls = resolve_name(factory_ep, what="entry point")
    except (ImportError, DottedNameError) as err:
        raise EnvLoadError(f"env '{env_id}' is not available: {err}") from err
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(repr(f'{ns}/{c}') for c in close)}?" if close else ""
        raise EnvNotFoundError(f"no {ns} env '{name}'.{hint} {ns} has {len(names)}: {', '.join(names[:40])}"
                               + (", ..." if len(names) > 40 else ""))
    entry.factory, entry.status = functools.partial(cls, name), "ok"
    return entry


def entry_for(env_id: str) -> EnvEntry:
    """The registered entry of `env_id` (an Odyssey id, its gymnasium id, or "namespace/name"); its factory
    is not imported for plain ids. EnvNotFoundError / EnvLoadError name the problem and the fix."""
    return _resolve_id(env_id)


def _resolve_id(env_id: str) -> EnvEntry:
    entry = _ENTRIES.get(env_id)
    if entry is None:
        entry = next((e for e in _ENTRIES.values() if e.gym_id == env_id), None)
    if entry is None and isinstance(env_id, str):
        entry = _namespaced(env_id)
    if entry is None:
        rejected = [e for e in _REJECTED if e.id == env_id]
        if rejected:
            raise EnvLoadError(f"env '{env_id}' is not available: {rejected[0].error}")
        ids = sorted(_ENTRIES)
        close = difflib.get_close_matches(env_id, ids, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise EnvNotFoundError(
            f"no env '{env_id}'.{hint} Registered: {', '.join(ids)}, and the namespaces "
            f"{', '.join(f'{ns}/<name>' for ns in NAMESPACES)}. Install a plugin package declaring an "
            f"'{ENTRY_POINT_GROUP}' entry point, or call envs.register(id, 'module:Class')"
        )
    return entry


def make(env_id: str, **kwargs: Any) -> Any:
    """A new env instance: `envs.make("arith", difficulty=1, sandbox_pool=pool)`.

    `env_id` is an Odyssey id ("code-repair") or its gymnasium id ("odyssey/CodeRepair-v0").
    """
    entry = _resolve_id(env_id)
    factory = _load(entry)
    env = factory(**kwargs)
    if not isinstance(env, gymnasium.Env):
        raise TypeError(
            f"env '{entry.id}' entry point {entry.entry_point} returned {type(env).__name__}, "
            "not a gymnasium.Env; "
            "point it at a ToolEnv subclass"
        )
    from envs.base import ToolEnv

    if isinstance(env, ToolEnv):
        env.env_id = entry.id
    return env


def _register_builtins() -> None:
    for env_id, ep in BUILTINS.items():
        if env_id not in _ENTRIES:
            _add(env_id, ep, "builtin", overwrite=False)


def cli_main(argv: list[str]) -> int:
    """`odyssey envs list [--json] [--strict]`."""
    parser = argparse.ArgumentParser(prog="odyssey envs", description="Odyssey environments")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="list built-in, registered and plugin envs with their status")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--strict", action="store_true", help="exit 1 when any env is broken")
    args = parser.parse_args(argv)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table shows every failure
        entries = list_envs(load=True) + list_namespaces()
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="Odyssey environments")
        for col in ("id", "gymnasium id", "source", "entry point", "status"):
            table.add_column(col, overflow="fold")
        for e in entries:
            status = (
                f"[green]{escape(e.status)}[/green]"
                if e.status.startswith("ok")
                else f"[red]{e.status}[/red] {escape(e.error or '')}"
            )
            table.add_row(*(escape(x) for x in (e.id, e.gym_id, e.source, e.entry_point)), status)
        Console(width=220).print(table)
    broken = [e for e in entries if e.status == "broken"]
    return 1 if args.strict and broken else 0


_register_builtins()
discover()
