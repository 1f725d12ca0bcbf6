"""`odyssey train CONFIG [k=v ...]`: train (or resume) a policy with the RL loop (docs/training.md).

    odyssey train configs/tiny.yaml
    odyssey train configs/tiny.yaml learner.steps=40 model.init_from=$PWD/runs/tiny/warmup
    ray job submit --working-dir . -- odyssey train configs/tiny.yaml logging.run_dir=$PWD/runs/tiny

Watch it with `tensorboard --logdir <run_dir>/tensorboard`; `odyssey report <run_dir>` draws the plots.
Joins the Ray cluster of RAY_ADDRESS (as `ray job submit` sets it) or starts an embedded one. With
`orchestrator.resume: true` (the default) the same command continues from the latest complete checkpoint
in `logging.run_dir` and says so. Exit codes: 0 done, 1 the run stopped (the message says how to resume),
2 a bad config or placement, 130 interrupted.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="odyssey train",
        description="Train a policy with agentic RL: rollout workers and a learner on Ray, async with "
        "bounded staleness (orchestrator.max_staleness), checkpoints every orchestrator.checkpoint_every "
        "steps; the same command resumes a run from its latest checkpoint.",
        epilog="watch a run: every step's metrics go to RUN_DIR/metrics.jsonl and to TensorBoard: "
        "`tensorboard --logdir RUN_DIR/tensorboard` (then open http://localhost:6006; on a remote machine "
        "`ssh -L 6006:localhost:6006 HOST` first). Sampled rollouts as text: RUN_DIR/samples_text.jsonl and "
        "TensorBoard's Text tab. Plots and a report.md, also while the run goes on or after a crash: "
        "`odyssey report RUN_DIR`. RUN_DIR is logging.run_dir. Docs: docs/training.md.",
    )
    p.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. learner.steps=10"
    )
    return p


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    console, err = Console(), Console(stderr=True)
    from rl.rollout.cli import load_run_config
    from rl.train.loop import Trainer, TrainingStopped, resume_hint

    cfg = load_run_config("odyssey train", args.config, args.overrides, err)
    if cfg is None:
        return 2
    trainer = Trainer(cfg, config_path=args.config, console=console)
    try:
        summary = trainer.run()
    except ValueError as e:  # placement, or a run dir that must not be resumed
        err.print(f"odyssey train: {e}", highlight=False, markup=False)
        return 2
    except TrainingStopped as e:
        err.print(f"odyssey train: {e}", highlight=False, markup=False)
        return 1
    except KeyboardInterrupt:
        err.print(
            f"odyssey train: interrupted; {resume_hint(cfg, args.config)}", highlight=False, markup=False
        )
        return 130
    except Exception as e:
        import ray.exceptions

        if not isinstance(e, ray.exceptions.OutOfMemoryError):
            raise
        err.print(  # Ray's memory monitor killed an actor: say so in one line, not a traceback
            "odyssey train: Ray killed an actor because this node ran out of memory "
            f"({str(e).splitlines()[0]}). "
            "Free memory or lower rollout.num_workers, rollout.concurrent_episodes or "
            f"learner.micro_batch_tokens; then {resume_hint(cfg, args.config)}",
            highlight=False,
            markup=False,
        )
        return 1
    final = summary.get("final", {})
    last = ", ".join(
        f"{name} {final[key]:.3f}" for name, key in (("success", "success"), ("reward", "reward/total"))
        if isinstance(final.get(key), (int, float))
    )
    console.print(
        f"odyssey train: done, {summary['steps']} steps in {summary['run_dir']} "
        f"(last training batch: {last or 'no scored episodes'}); "
        f"metrics: {summary['run_dir']}/metrics.jsonl",
        highlight=False,
    )
    evals = summary.get("evals") or []
    if len(evals) >= 2:
        console.print(before_after_table(evals[0], evals[-1], cfg))
    return 0


def before_after_table(first: dict, last: dict, cfg) -> Table:
    """Held-out success of the first and the last evaluation of the run (eval.jsonl), side by side."""
    k = cfg.orchestrator.eval_pass_k
    t = Table(
        title=f"held-out {cfg.env.id} tasks: step {first['step']} vs step {last['step']}", header_style="bold"
    )
    for col in ("metric", f"step {first['step']}", f"step {last['step']}"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    rows = [
        (f"success (T={cfg.rollout.temperature:g})", "success"),
        (f"pass@{k}", f"pass@{k}"),
        ("greedy success", "greedy"),
        ("episodes (sampled + greedy)", "episodes"),
        ("infra errors", "infra_errors"),
    ]
    for name, key in rows:
        t.add_row(
            name,
            *(
                f"{e.get(key):.3f}" if isinstance(e.get(key), float) else str(e.get(key))
                for e in (first, last)
            ),
        )
    return t
