"""What `odyssey rollout` shows: a live progress display while workers run, then the summary table.

The progress display is a rich progress bar on a terminal, and plain periodic log lines otherwise
(e.g. in `ray job logs`, where a live display would not render).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rl.rollout.worker import WorkerReport


class RolloutProgress:
    """update(done, generated_tokens, infra_errors) from the polling loop; use as a context manager."""

    def __init__(self, total: int, console: Console, log_every_s: float = 10.0):
        self.total, self.console, self.log_every_s = total, console, log_every_s
        self.t0 = time.perf_counter()
        self._last_log = 0.0
        self._last_done = -1
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]rollout"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("episodes  {task.fields[tps]:>7.1f} tok/s  {task.fields[infra]} sandbox failures"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task("rollout", total=total, tps=0.0, infra=0)

    def __enter__(self) -> RolloutProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, done: int, generated_tokens: int, infra_errors: int) -> None:
        elapsed = time.perf_counter() - self.t0
        tps = generated_tokens / elapsed if elapsed > 0 else 0.0
        if self._bar is not None:
            self._bar.update(self._task, completed=done, tps=tps, infra=infra_errors)
            return
        now = time.perf_counter()
        if done != self._last_done and (now - self._last_log >= self.log_every_s or done == self.total):
            self.console.print(
                f"rollout: {done}/{self.total} episodes, {tps:.1f} tok/s, "
                f"{infra_errors} sandbox failures, {elapsed:.0f} s",
                highlight=False,
            )
            self._last_log, self._last_done = now, done


def summary_table(report: WorkerReport, title: str = "rollout summary") -> Table:
    """Reward per component, turns, tokens, tool errors, sandbox failures, tokens/s."""
    n = max(report.episodes, 1)
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("episodes", f"{report.episodes} ({report.workers} workers)")
    t.add_row("success rate", f"{report.successes / n:.3f}")
    for k, v in report.reward_means().items():
        t.add_row(f"reward {k}", f"{v:+.4f}")
    if not report.rewards.sums:
        t.add_row("reward", "(no scored episodes)")
    t.add_row("turns / episode", f"{report.turns / n:.2f}")
    t.add_row("tokens (total / generated)", f"{report.tokens} / {report.generated_tokens}")
    t.add_row("tokens / episode", f"{report.tokens / n:.1f}")
    t.add_row("tool calls", str(report.tool_calls))
    t.add_row("tool errors", str(report.tool_errors))
    t.add_row("sandbox / infra failures", str(report.infra_errors))
    if report.infra_retries:
        t.add_row("infra failures re-run", str(report.infra_retries))
    t.add_row("reward errors", str(report.reward_errors))
    t.add_row("terminated / truncated", f"{report.terminated} / {report.truncated}")
    t.add_row("turn ends", ", ".join(f"{k} {v}" for k, v in sorted(report.finish_reasons.items())) or "-")
    t.add_row("generated tokens / s", f"{report.tokens_per_s:.1f}")
    t.add_row("wall time", f"{report.wall_s:.1f} s")
    return t


def report_from_dict(d: dict[str, Any]) -> WorkerReport:
    """Inverse of WorkerReport.to_dict (drops the derived fields)."""
    from rewards.compose import RewardMetrics

    fields = WorkerReport.__dataclass_fields__
    kw = {k: v for k, v in d.items() if k in fields}
    kw["rewards"] = RewardMetrics(**kw.get("rewards", {}))
    return WorkerReport(**kw)


def report_from_store(store_dir: str | Path, run: WorkerReport) -> WorkerReport:
    """The summary of what the store holds (episodes of dead workers included), with the timing fields
    (wall_s, engine_forward_s) and worker count of the run's merged report `run`."""
    from rl.trajectory import TrajectoryStore

    out = WorkerReport(
        workers=run.workers,
        wall_s=run.wall_s,
        engine_forward_s=run.engine_forward_s,
        infra_retries=run.infra_retries,
    )
    if Path(store_dir).exists():
        for t in TrajectoryStore(store_dir):
            out.add(t)
    return out
