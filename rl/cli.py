"""`odyssey` - the command-line entry point.

Each command group lives with the code it drives; this file only dispatches:

    odyssey config show FILE [k=v ...]        -> rl.config.cli_main
    odyssey model params --preset NAME        -> model.count.cli_main
    odyssey sandbox build|ls|gc ...           -> sandbox.image.cli_main
    odyssey envs list                         -> envs.registry.cli_main
    odyssey rollout CONFIG --episodes N       -> rl.rollout.cli.cli_main
    odyssey warmup CONFIG --out DIR           -> rl.warmup.cli_main
    odyssey train CONFIG [k=v ...]            -> rl.train.cli.cli_main
    odyssey eval CONFIG --checkpoint DIR      -> rl.train.eval.cli_main
    odyssey report RUN_DIR                    -> rl.train.report.cli_main
    odyssey plan --preset k3 [...]            -> rl.plan.cli.cli_main

Imports are lazy so `odyssey --help` answers instantly and one broken group cannot break the others.
Every run command (RUN_COMMANDS) first reaps the sandbox containers of dead owners on this host
(`sandbox.reaper.reap_quietly`), so leases of a SIGKILLed run never outlive the next run.
"""

from __future__ import annotations

import importlib
import sys

#: group -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "rollout": ("rl.rollout.cli", "cli_main", "run agent episodes in sandboxes; store scored trajectories"),
    "warmup": ("rl.warmup", "cli_main", "SFT warm-up on an env's oracle episodes: warmup CONFIG --out DIR"),
    "train": (
        "rl.train.cli",
        "cli_main",
        "RL training on Ray (resumes from the latest checkpoint): train CONFIG",
    ),
    "eval": ("rl.train.eval", "cli_main", "held-out evaluation: eval CONFIG --checkpoint DIR --episodes N"),
    "report": ("rl.train.report", "cli_main", "plots and report.md of a training run: report RUN_DIR"),
    "config": ("rl.config", "cli_main", "show a resolved run config: config show FILE [k=v ...]"),
    "plan": ("rl.plan.cli", "cli_main", "GPUs, per-rank memory and step time of a run: plan --preset k3"),
    "model": ("model.count", "cli_main", "model tools: model params --preset tiny|small|k3 [--json]"),
    "sandbox": ("sandbox.image", "cli_main", "sandbox image and containers: sandbox build|ls|gc"),
    "envs": ("envs.registry", "cli_main", "environments: envs list"),
}


#: commands that start a run (and may lease sandboxes): each first reaps the leftovers of dead runs
RUN_COMMANDS = ("rollout", "warmup", "train")


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: odyssey <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `odyssey <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    group, rest = argv[0], argv[1:]
    if group not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(group, COMMANDS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"odyssey: unknown command '{group}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    if group in RUN_COMMANDS:
        from sandbox.reaper import reap_quietly

        reap_quietly()
    module_name, func_name, _ = COMMANDS[group]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
