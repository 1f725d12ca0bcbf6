"""Task identity and sample seeds: what an episode solves, and which draw of the policy plays it.

    tasks = TaskStream(base_seed=cfg.rollout.seed, split="train")
    task = tasks.task(17)                      # Task(split="train", index=17, seed=34 + ...)
    group = tasks.samples(task, group_size=4)  # 4 Samples of the same task: one GRPO group

A `Task` is one problem: `env.reset(seed=task.seed, options=task.options)` regenerates it anywhere.
Its identity is `(split, index)`; `Task.key` ("train/17") is the GRPO group id (never the env's own
`task_id`: a small generator such as arith difficulty 0 has only 100 distinct problems, so different
tasks can share content and must still form separate groups).

A `Sample` is one episode of a task: `Sample.index` in `[0, group_size)` and its own sampling `seed`,
so the `group_size` samples of a task draw different completions of the same problem. `attempt`
counts re-runs after an infrastructure failure (same seeds: the re-run replays the same draw).

Held-out tasks are disjoint from training tasks by construction: training task seeds are even,
evaluation task seeds odd (`task_seed`). Note that disjoint seeds are disjoint problems only when the
generator's problem space is large; arith difficulty 0 (one-digit a+b) has 100 problems, so its
held-out seeds measure generalisation over fresh draws, not over unseen sums.

Dataset tasks (`env.dataset`, envs/dataset.py): a row is a task like a seed. `task_stream(cfg, split)`
gives a stream whose task i is row `dataset.row_number(split, i)` of the file's train or eval rows
(disjoint by the dataset's split; train rows in a seeded order per epoch): the task carries the row
(`Task.row`, passed to the env as `reset(options={"row": row})`) and its row number as the reset option
"row", so its key reads "train/17@row=42". Groups, samples and seeds work as for generated tasks: a
GRPO group is `group_size` samples of one row. The driver reads the file; the rows travel with the
tasks, so workers on other nodes need no access to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from envs.dataset import DatasetRow, TaskDataset

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")


def task_seed(base_seed: int, split: str, index: int) -> int:
    """The env seed of task `index` of `split`: even for "train", odd for "eval" (disjoint sets)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if index < 0:
        raise ValueError(f"task index must be >= 0, got {index}")
    return 2 * (int(base_seed) * 1_000_003 + int(index)) + SPLITS.index(split)


def sample_seed(task: Task, index: int) -> int:
    """Sampling seed of sample `index` of `task` (31-bit; independent of the task seed's stream)."""
    words = [SPLITS.index(task.split), task.seed & 0xFFFFFFFF, task.seed >> 32, int(index)]
    return int(np.random.SeedSequence(words).generate_state(1)[0]) & 0x7FFFFFFF


@dataclass(frozen=True)
class Task:
    """One problem. split + index: identity (the task cursor counts indices); seed: `env.reset` seed;
    options: `env.reset` options as sorted (key, value) pairs, e.g. (("difficulty", 2),)."""

    split: str
    index: int
    seed: int
    options: tuple[tuple[str, Any], ...] = ()
    row: DatasetRow | None = field(default=None, compare=False, repr=False)  # a dataset task's row

    @property
    def key(self) -> str:
        """The GRPO group id: "<split>/<index>", plus "@name=value" per reset option (the same index at
        two difficulties is two tasks)."""
        return f"{self.split}/{self.index}" + "".join(f"@{k}={v}" for k, v in self.options)

    def reset_options(self) -> dict[str, Any]:
        """`env.reset` options: `options`, with a dataset task's row itself under "row"."""
        return dict(self.options) | ({"row": self.row} if self.row is not None else {})

    def to_dict(self) -> dict[str, Any]:
        d = {"split": self.split, "index": self.index, "seed": self.seed, "options": dict(self.options)}
        return d | ({"row": self.row.to_dict()} if self.row is not None else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        row = DatasetRow.from_dict(d["row"]) if d.get("row") is not None else None
        return cls(
            d["split"], int(d["index"]), int(d["seed"]), tuple(sorted((d.get("options") or {}).items())), row
        )


@dataclass(frozen=True)
class Sample:
    """One episode: sample `index` of `task`, sampled with `seed` (or greedily). attempt: 0 for the first
    run, +1 per re-run after an infrastructure failure."""

    task: Task
    index: int
    seed: int
    greedy: bool = False
    attempt: int = 0

    @property
    def key(self) -> str:
        """Unique id of the sample: "<split>/<task index>/<sample index>" (+ "/greedy")."""
        return f"{self.task.key}/{self.index}" + ("/greedy" if self.greedy else "")

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key: task index, sample index, greedy last (the deterministic batch order)."""
        return (self.task.index, self.index, int(self.greedy))

    def retry(self) -> Sample:
        return replace(self, attempt=self.attempt + 1)

    def metadata(self) -> dict[str, Any]:
        """What a trajectory records about its sample (Trajectory.metadata)."""
        return {
            "sample_key": self.key,
            "group_id": self.task.key,
            "split": self.task.split,
            "task_index": self.task.index,
            "task_seed": self.task.seed,
            "task_options": dict(self.task.options),
            "sample_index": self.index,
            "sample_seed": self.seed,
            "greedy": self.greedy,
            "attempt": self.attempt,
        } | ({"dataset_row": self.task.row.to_dict()} if self.task.row is not None else {})

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task.to_dict(),
            "index": self.index,
            "seed": self.seed,
            "greedy": self.greedy,
            "attempt": self.attempt,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(
            Task.from_dict(d["task"]), int(d["index"]), int(d["seed"]), bool(d["greedy"]), int(d["attempt"])
        )


@dataclass
class TaskStream:
    """The deterministic task sequence of one split: task i has seed `task_seed(base_seed, split, i)` and
    reset options `options` (e.g. {"difficulty": 1}; empty = the env's own settings). With `dataset`,
    task i is also a row of the split (see the module docstring)."""

    base_seed: int = 0
    split: str = "train"
    options: dict[str, Any] = field(default_factory=dict)
    dataset: TaskDataset | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        task_seed(self.base_seed, self.split, 0)  # validates the split

    def task(self, index: int) -> Task:
        options, row = dict(self.options), None
        if self.dataset is not None:
            row = self.dataset.task_row(self.split, int(index))
            options["row"] = row.index
        return Task(
            self.split,
            int(index),
            task_seed(self.base_seed, self.split, index),
            tuple(sorted(options.items())),
            row,
        )

    def samples(self, task: Task, group_size: int, greedy: bool = False) -> list[Sample]:
        """The `group_size` samples of `task` (one greedy sample when greedy: decoding is deterministic)."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        return [Sample(task, j, sample_seed(task, j), greedy) for j in range(1 if greedy else group_size)]

    def first_samples(self, n: int, group_size: int) -> list[Sample]:
        """The first `n` samples of the stream, task by task (`odyssey rollout --episodes n`)."""
        out: list[Sample] = []
        i = 0
        while len(out) < n:
            out += self.samples(self.task(i), group_size)
            i += 1
        return out[:n]


def load_dataset(cfg: Any) -> TaskDataset | None:
    """The run's dataset (`env.dataset` of a RunConfig), read and split; None when the env generates tasks."""
    d = cfg.env.dataset
    if d is None:
        return None
    return TaskDataset.load(d.path, d.eval_size, d.seed, d.prompt_field, d.answer_field)


def task_stream(
    cfg: Any, split: str, options: dict[str, Any] | None = None, dataset: TaskDataset | None = None
) -> TaskStream:
    """The task stream of a RunConfig's split: seeds from rollout.seed, rows from env.dataset (read here
    unless `dataset` is given)."""
    data = dataset if dataset is not None else load_dataset(cfg)
    return TaskStream(cfg.rollout.seed, split, dict(options or {}), data)
