"""Training metrics: one flat record per learner step, appended to `<run_dir>/metrics.jsonl`, and a live line.

`step_record` is the one place a record is made. Keys (all flat; values numbers, `null` when unknown):

    step, policy_version, wall_s                       learner step done, weights version now, run time
    success, reward/<key>, reward/total                means over the batch's trainable episodes
    episodes, groups, tokens, generated_tokens         what the learner trained on
    masked/infra, masked/reward_error                  members excluded from their groups (never scored 0)
    dropped/stale, discarded/zero_variance             stale members; DAPO groups drawn but not trained
    infra_retries, worker_restarts                     since the previous record
    staleness/mean, staleness/max                      learner version - oldest token version, over the batch
    length/mean, length/max, turns/mean, turns/max     generated tokens and assistant turns per episode
    tool_calls, tool_errors, infra/<env|sandbox|engine>  tool calls and their errors; infra failures by source
    learner/<key>, moe/<key>                           everything Learner.step returned, plain keys under
                                                       learner/ (loss, grad_norm, tokens; learner/kl,
                                                       learner/entropy, learner/routing_agreement/layer<l>,
                                                       learner/replay_changed, moe/layer<l>/max_mean_load,
                                                       ... as the learner names them; docs/training.md)
    time/<phase>_s                                     seconds: rollout (waiting for the batch), learner,
                                                       weight_sync, eval, step (all of it); episodes and
                                                       reward: worker-seconds playing / scoring the batch
    throughput/rollout_tokens_per_s                    the batch's generated tokens / time/step_s
    stage                                              index into `stages` (rl/train/stages.py; 0 without)
    eval/<...>                                         held-out evaluation on steps that ran one (eval.py)

rl/train/sinks.py writes each record to the JSONL and to TensorBoard / W&B; `odyssey report`
(rl/train/report.py) plots it. `MetricsLog.keep_first` drops the lines a resumed run redoes (they move to
`metrics.superseded.jsonl`, nothing is deleted).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.rollout.tasks import Sample
from rl.trajectory import Trajectory

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"


def _num(v: Any) -> float | int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def batch_stats(batch: Sequence[tuple[Sample, Trajectory]], learner_version: int) -> dict[str, Any]:
    """Rewards by component, success, counts, tokens and staleness of the batch handed to the learner."""
    from rewards.compose import infra_error_of, is_trainable
    from rl.train.buffer import staleness

    trajs = [t for _, t in batch]
    valid = [t for t in trajs if is_trainable(t)]
    sums: dict[str, float] = {}
    for t in valid:
        for k, v in t.rewards.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    stale = [staleness(t, learner_version) for t in trajs]
    out: dict[str, Any] = {
        "success": sum(float(t.outcome or 0.0) for t in valid) / len(valid) if valid else None,
        **{f"reward/{k}": v / len(valid) for k, v in sorted(sums.items())},
        "episodes": len(trajs),
        "groups": len({s.task.key for s, _ in batch}),
        "tokens": sum(t.n_tokens for t in trajs),
        "generated_tokens": sum(t.n_generated for t in trajs),
        "masked/infra": sum(infra_error_of(t) is not None for t in trajs),
        "masked/reward_error": sum(bool(t.reward_error) and infra_error_of(t) is None for t in trajs),
        "staleness/mean": sum(stale) / len(stale) if stale else None,
        "staleness/max": max(stale) if stale else None,
    }
    gen = [t.n_generated for t in trajs]
    turns = [int(t.metadata.get("n_turns", t.n_assistant_turns)) for t in trajs]
    out.update(
        {
            "length/mean": sum(gen) / len(gen) if gen else None,
            "length/max": max(gen) if gen else None,
            "turns/mean": sum(turns) / len(turns) if turns else None,
            "turns/max": max(turns) if turns else None,
            "tool_calls": sum(len(i.get("tool_calls") or []) for t in trajs for i in t.step_infos),
            "tool_errors": sum(len(i.get("tool_errors") or []) for t in trajs for i in t.step_infos),
        }
    )
    for source in ("env", "sandbox", "engine"):
        out[f"infra/{source}"] = sum(
            infra_error_of(t) is not None and t.metadata.get("infra_source") == source for t in trajs
        )
    # worker-seconds of this batch's episodes (they overlap across workers and with the learner when async)
    out["time/episodes_s"] = sum(float(t.metadata.get("wall_s", 0.0)) for t in trajs)
    out["time/reward_s"] = sum(float(t.metadata.get("reward_s", 0.0)) for t in trajs)
    return out


SAMPLE_TEXT_CHARS = 16_000  # per logged rollout: long-context conversations keep their head and tail


def _clip(text: str, limit: int = SAMPLE_TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def sample_rows(batch: Sequence[tuple[Sample, Trajectory]], n: int) -> list[dict[str, Any]]:
    """`n` rollouts of the batch as text (TRL's log_completions): the best and the worst by total reward
    first, then the rest in sample order. Each row: sample key, rewards, outcome, turns, tool calls (call and
    result), tool errors, and the decoded conversation (`metadata["messages"]`, "[role] content" per message;
    longer than SAMPLE_TEXT_CHARS, its middle is cut)."""
    if n <= 0 or not batch:
        return []
    items = sorted(batch, key=lambda st: st[0].order)
    by_reward = sorted(items, key=lambda st: float(st[1].rewards.get("total", float("-inf"))))
    picked: list[tuple[Sample, Trajectory]] = []
    for st in [by_reward[-1], by_reward[0], *items]:
        if len(picked) < n and all(st[0].key != p[0].key for p in picked):
            picked.append(st)
    rows = []
    for s, t in picked:
        messages = t.metadata.get("messages") or []
        lines = [f"[{m.get('role')}] {m.get('content')}" for m in messages if isinstance(m, dict)]
        text = _clip("\n".join(lines))
        calls = [
            {"call": str(c)[:200], "result": str(r)[:200]}
            for info in t.step_infos
            for c, r in zip(info.get("tool_calls") or [], info.get("tool_results") or [])
        ]
        errors = [str(e)[:200] for info in t.step_infos for e in info.get("tool_errors") or []]
        rows.append(
            {
                "sample": s.key,
                "reward": _num(t.rewards.get("total")),
                "rewards": {k: _num(v) for k, v in t.rewards.items()},
                "outcome": _num(t.outcome),
                "turns": int(t.metadata.get("n_turns", t.n_assistant_turns)),
                "tool_calls": calls,
                "tool_errors": errors,
                "infra_error": t.infra_error,
                "text": text,
            }
        )
    return rows


def step_record(
    *,
    step: int,
    policy_version: int,
    wall_s: float,
    batch: dict[str, Any],
    learner: dict[str, Any],
    timings: dict[str, float],
    counters: dict[str, int],
    evaluation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The flat metrics record of one learner step (keys in the module docstring)."""
    rec: dict[str, Any] = {
        "step": int(step),
        "policy_version": int(policy_version),
        "wall_s": round(wall_s, 3),
    }
    rec.update({k: _num(v) for k, v in batch.items()})
    rec.update({k: _num(v) for k, v in counters.items()})
    rec.update({(k if "/" in k else f"learner/{k}"): _num(v) for k, v in sorted(learner.items())})
    rec.update({f"time/{k}_s": round(float(v), 4) for k, v in timings.items()})
    if evaluation:
        rec.update({f"eval/{k}": _num(v) for k, v in evaluation.items()})
    return rec


class MetricsLog:
    """Append-only JSONL of step records (one line each, flushed and fsync'ed)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            import os

            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]

    def line_count(self) -> int:
        return len(self.read())

    def keep_first(self, n: int) -> int:
        """Keep the first `n` records; move the rest to metrics.superseded.jsonl. Returns how many moved."""
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()] if self.path.exists() else []
        extra = lines[n:]
        if extra:
            with open(self.path.with_name(SUPERSEDED_FILE), "a") as f:
                f.write("\n".join(extra) + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in lines[:n]))
        tmp.replace(self.path)
        return len(extra)


class ProgressLine:
    """The live status line: step, reward, success, loss, seconds per step and ETA. A `rich` live line on a
    terminal; plain lines every `log_every` steps otherwise (job logs)."""

    def __init__(self, total_steps: int, console: Console, log_every: int = 1):
        self.total, self.console, self.log_every = total_steps, console, max(1, log_every)
        self._live = None
        self._t0 = time.perf_counter()
        self._done_at_start: int | None = None
        if console.is_terminal:
            from rich.live import Live

            self._live = Live("", console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> ProgressLine:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def text(self, rec: dict[str, Any]) -> str:
        step = rec["step"]
        if self._done_at_start is None:
            self._done_at_start = step - 1
        done = step - self._done_at_start
        per_step = (time.perf_counter() - self._t0) / max(1, done)
        eta = per_step * (self.total - step)

        def f(key: str, fmt: str) -> str:
            v = rec.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        return (
            f"step {step}/{self.total}  reward {f('reward/total', '+.3f')}  success {f('success', '.3f')}  "
            f"loss {f('learner/loss', '+.4f')}  staleness {f('staleness/mean', '.2f')}  "
            f"{per_step:.1f} s/step  ETA {eta / 60:.1f} min"
        )

    def update(self, rec: dict[str, Any]) -> None:
        line = self.text(rec)
        if self._live is not None:
            self._live.update(line)
        elif rec["step"] % self.log_every == 0 or rec["step"] == self.total:
            self.console.print(f"odyssey train: {line}", highlight=False, markup=False, soft_wrap=True)

    def note(self, message: str) -> None:
        self.console.print(f"odyssey train: {message}", highlight=False, markup=False, soft_wrap=True)
