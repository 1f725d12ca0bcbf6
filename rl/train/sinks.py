"""Where each step's metrics record goes: `metrics.jsonl` always, TensorBoard and W&B when configured.

    sinks = MetricSinks(run_dir, cfg.logging)
    sinks.open(first_step)               # TensorBoard / W&B (a resumed run hides the steps it redoes)
    sinks.write(record)                  # the same flat record (metrics.step_record) to every sink
    sinks.write_samples(step, rows)      # decoded rollouts: samples_text.jsonl + a TensorBoard table
    sinks.close()

Every sink gets exactly the keys and values of the JSONL line (null values are left out of TensorBoard and
W&B, which have no "unknown"). TensorBoard event files go to `<run_dir>/tensorboard/` (open them with
`tensorboard --logdir <run_dir>/tensorboard`); the step of a scalar is the record's `step`. W&B runs only
when `logging.wandb_project` is set, and then `wandb` must be installed (a clear error otherwise).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rl.train.metrics import MetricsLog

TENSORBOARD_DIR = "tensorboard"
SAMPLES_TEXT_FILE = "samples_text.jsonl"


def _after_existing_event_files(log_dir: Path) -> None:
    """Wait (at most a second) until a new event file sorts after every existing one. TensorBoard reads a
    run's files in name order, `events.out.tfevents.<unix seconds>.<host>.<pid>.<writer counter>`: within
    one second the counter decides, as text ("10" < "9"), and a resume file read before the file it purges
    would purge nothing."""
    seconds = []
    for f in log_dir.glob("events.out.tfevents.*"):
        part = f.name.split(".")[3]
        if part.isdigit():
            seconds.append(int(part))
    if seconds:
        wait = max(seconds) + 1 - time.time()
        if wait > 0:
            time.sleep(wait)


class TensorBoardSink:
    """Scalars (one per numeric key of the record) and a markdown text table of sampled rollouts."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides the events of steps >= purge_step that the crashed run wrote
        if purge_step is not None:
            _after_existing_event_files(Path(log_dir))
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("samples", samples_markdown(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """W&B: `wandb.init(project=...)`, then one `log(record, step=step)` per record and a Table of samples."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                f"logging.wandb_project is set ({project!r}) but the `wandb` package is not installed; "
                "`pip install wandb`, or set logging.wandb_project=null to log to TensorBoard and JSONL only"
            ) from e
        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(run_dir), config=config, resume="allow",
                              name=run_dir.name)

    def write(self, record: dict[str, Any]) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        self.run.log(values, step=int(record["step"]))

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        cols = list(rows[0]) if rows else ["step"]
        table = self.wandb.Table(columns=cols, data=[[json.dumps(r[c]) if isinstance(r[c], (list, dict))
                                                       else r[c] for c in cols] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricSinks:
    """The JSONL log (rl.train.metrics.MetricsLog, the record of truth) plus the optional sinks of
    `logging` (tensorboard: bool, wandb_project: str | None), started by `open`."""

    def __init__(self, run_dir: str | Path, logging_cfg: Any, config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.jsonl = MetricsLog(self.run_dir)
        self.logging_cfg, self.config = logging_cfg, config or {}
        self.extra: list[TensorBoardSink | WandbSink] = []

    def open(self, first_step: int) -> None:
        """Start TensorBoard / W&B; `first_step` is the step of the next record (> 1 when resuming)."""
        self.close()
        if self.logging_cfg.tensorboard:
            purge = first_step if first_step > 1 else None
            self.extra.append(TensorBoardSink(self.run_dir / TENSORBOARD_DIR, purge_step=purge))
        if self.logging_cfg.wandb_project:
            self.extra.append(WandbSink(self.logging_cfg.wandb_project, self.run_dir, self.config))

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.append(record)
        for sink in self.extra:
            sink.write(record)

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with open(self.run_dir / SAMPLES_TEXT_FILE, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        for sink in self.extra:
            sink.write_samples(step, rows)

    def close(self) -> None:
        for sink in self.extra:
            sink.close()
        self.extra = []


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table (TensorBoard renders it) of sampled rollouts: sample, rewards, turns, text."""
    lines = ["| sample | reward | outcome | turns | tool calls | conversation |", "|---|---|---|---|---|---|"]
    for r in rows:
        text = str(r.get("text", "")).replace("|", "\\|").replace("\n", "<br>")
        lines.append(
            f"| {r.get('sample')} | {r.get('reward')} | {r.get('outcome')} | {r.get('turns')} | "
            f"{r.get('tool_calls')} | {text} |"
        )
    return "\n".join(lines)
