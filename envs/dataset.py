"""Tasks from a file of rows: a jsonl or parquet file read with `datasets`, split into train and eval rows.

    data = TaskDataset.load("examples/data/arith_qa.jsonl", eval_size=0.25, seed=0)
    data.n_rows("train"), data.n_rows("eval")      # a deterministic split of the file's rows
    row = data.task_row("train", 17)               # the 18th training task: a DatasetRow
    row.prompt, row.answer, row.columns            # "What is 3+4?", "7", every column of the row

A row is a task like a generated seed: the training loop draws task index i of a split, `task_row` maps
it to a row, and the env builds its task from the row (`ToolEnv.task_from_row`) instead of from a seed.

Split (fixed by `seed`): the row numbers are permuted with `default_rng(seed)`; the first `n_eval` of the
permutation are the eval rows, the rest the train rows (each kept in file order). `eval_size` < 1 is a
fraction of the rows (rounded, at least one row when it is > 0), `eval_size` >= 1 a count of rows.

Order: train task i is row `train[perm_e[i mod n_train]]` with `e = i // n_train` (the epoch) and
`perm_e = default_rng([seed, e]).permutation(n_train)`: every epoch visits each train row once, in a
seeded order that differs between epochs. Eval task i is `eval[i mod n_eval]` (file order, no shuffle),
so an evaluation always sees the same rows.

Rows are checked when the file loads, each problem naming the row and column: the prompt column must
hold a string or a list of {role, content} messages; every value must be JSON-serialisable (a
trajectory stores its row with it); the answer column, when an env needs one, is checked by that env.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SPLITS = ("train", "eval")


class DatasetError(ValueError):
    """A dataset file that cannot give tasks: unreadable, wrong format, or rows that do not fit."""


@dataclass(frozen=True)
class DatasetRow:
    """One row of the file. index: its row number in the file (0-based); columns: every column as read;
    prompt_field / answer_field: which columns hold the prompt and the ground truth."""

    index: int
    columns: dict[str, Any] = field(hash=False, compare=False)
    prompt_field: str = "prompt"
    answer_field: str = "answer"

    @property
    def prompt(self) -> str | list[dict[str, str]]:
        """The prompt: a string (the user message) or a list of chat messages."""
        return self.columns[self.prompt_field]

    @property
    def answer(self) -> Any:
        """The ground truth, or None when the row has no answer column."""
        return self.columns.get(self.answer_field)

    def require_answer(self, who: str) -> Any:
        """The ground truth; DatasetError naming the row and the column when it is missing."""
        value = self.columns.get(self.answer_field)
        if value is None:
            raise DatasetError(
                f"{who}: dataset row {self.index} has no ground truth in column {self.answer_field!r} "
                f"(columns: {', '.join(self.columns)}); set env.dataset.answer_field to the column that "
                "holds it"
            )
        return value

    def messages(self, system: str | None = None) -> list[dict[str, str]]:
        """The prompt as chat messages: a string prompt becomes [system, user]; a message list is kept,
        with `system` put first when it has no system message of its own."""
        p = self.prompt
        if isinstance(p, str):
            return ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": p}
            ]
        msgs = [dict(m) for m in p]
        if system and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system})
        return msgs

    def to_dict(self) -> dict[str, Any]:
        """JSON form (stored with a trajectory as metadata["dataset_row"], and in checkpoints)."""
        return {
            "index": self.index,
            "columns": self.columns,
            "prompt_field": self.prompt_field,
            "answer_field": self.answer_field,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DatasetRow:
        return cls(int(d["index"]), dict(d["columns"]), d.get("prompt_field", "prompt"),
                   d.get("answer_field", "answer"))


def as_row(row: DatasetRow | Mapping[str, Any]) -> DatasetRow:
    """A DatasetRow as is, or a plain mapping of columns (`env.reset(options={"row": {"prompt": ...}})`;
    index -1: not from a file)."""
    if isinstance(row, DatasetRow):
        return row
    if isinstance(row, Mapping):
        return DatasetRow(-1, dict(row))
    raise TypeError(f"options['row'] must be a DatasetRow or a mapping of columns, got {type(row).__name__}")


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], ...]:
    """Every row of `path` (cached by path, modification time and size: a changed file is read again)."""
    import datasets

    datasets.disable_progress_bars()
    kind = SUFFIXES[Path(path).suffix.lower()]
    try:
        ds = (datasets.Dataset.from_json if kind == "json" else datasets.Dataset.from_parquet)(
            path, keep_in_memory=True
        )
    except Exception as e:  # pyarrow / datasets parse errors: keep their text, name the file and format
        msg = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
        raise DatasetError(f"cannot read {path} as {kind}: {type(e).__name__}: {msg}") from e
    return tuple(_bytes_as_base64(r) for r in ds.to_list())


def _bytes_as_base64(value: Any) -> Any:
    """`value` with every bytes object (a parquet binary cell, e.g. the "bytes" of an HF datasets image
    column) as {"base64": <its base64 text>}, so a row stays JSON (`envs.dataset_qa.row_image` reads it)."""
    if isinstance(value, (bytes, bytearray)):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {k: _bytes_as_base64(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bytes_as_base64(v) for v in value]
    return value


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl (or .json lines) or .parquet file, read with `datasets`. DatasetError on a
    missing file, an unsupported suffix or a file `datasets` cannot parse."""
    p = Path(path).expanduser()
    if p.suffix.lower() not in SUFFIXES:
        raise DatasetError(
            f"dataset {str(path)!r}: unsupported file type {p.suffix or '(none)'!r}; use .jsonl or .parquet"
        )
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise DatasetError(f"dataset {str(path)!r} {what}; give the path of a .jsonl or .parquet file")
    st = p.stat()
    return list(_read(str(p.resolve()), st.st_mtime_ns, st.st_size))


def check_rows(rows: Sequence[dict[str, Any]], prompt_field: str, path: str = "dataset") -> None:
    """DatasetError listing (up to 5) rows whose prompt is missing or malformed, or whose values JSON cannot
    store."""
    problems: list[str] = []
    if not rows:
        raise DatasetError(f"{path}: the file holds no rows")
    for i, row in enumerate(rows):
        p = row.get(prompt_field)
        if p is None:
            problems.append(
                f"row {i}: no prompt in column {prompt_field!r} (columns: {', '.join(row)}); "
                "set env.dataset.prompt_field to the column that holds it"
            )
        elif not isinstance(p, str) and not _is_messages(p):
            problems.append(
                f"row {i}: column {prompt_field!r} must hold a string or a list of {{role, content}} "
                f"messages, got {type(p).__name__}"
            )
        try:
            json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as e:
            bad = [k for k, v in row.items() if not _json_ok(v)]
            problems.append(
                f"row {i}: column(s) {bad} cannot be stored as JSON ({e}); a trajectory stores its row, so "
                "convert them to strings or numbers, or drop them"
            )
        if len(problems) >= 5:
            problems.append("(further rows not checked)")
            break
    if problems:
        raise DatasetError(f"{path}: " + "; ".join(problems))


def _is_messages(p: Any) -> bool:
    return (
        isinstance(p, list)
        and bool(p)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in p
        )
    )


def _json_ok(v: Any) -> bool:
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def split_rows(n: int, eval_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train row numbers, eval row numbers), each sorted; see the module docstring."""
    if eval_size < 0:
        raise DatasetError(f"eval_size must be >= 0, got {eval_size}")
    if eval_size >= 1:
        if eval_size != int(eval_size):
            raise DatasetError(
                f"eval_size {eval_size:g} is >= 1, so it counts rows and must be a whole number; "
                "use a fraction below 1 (e.g. 0.1) or a count (e.g. 50)"
            )
        n_eval = int(eval_size)
    else:
        n_eval = max(1, round(eval_size * n)) if eval_size > 0 else 0
    if n_eval >= n:
        raise DatasetError(
            f"eval_size {eval_size:g} holds out {n_eval} of the {n} rows and leaves none to train on; "
            "lower env.dataset.eval_size"
        )
    perm = np.random.default_rng(int(seed)).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


@dataclass
class TaskDataset:
    """Rows of one file with their train/eval split; `task_row(split, i)` is task i of a split."""

    path: str
    rows: list[dict[str, Any]]
    train: np.ndarray
    eval: np.ndarray
    seed: int = 0
    prompt_field: str = "prompt"
    answer_field: str = "answer"

    @classmethod
    def load(
        cls,
        path: str | Path,
        eval_size: float = 0.1,
        seed: int = 0,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
    ) -> TaskDataset:
        """Read, check and split `path`. DatasetError names the file and every problem."""
        rows = read_rows(path)
        check_rows(rows, prompt_field, str(path))
        train, held_out = split_rows(len(rows), eval_size, seed)
        return cls(str(path), rows, train, held_out, int(seed), prompt_field, answer_field)

    @property
    def columns(self) -> list[str]:
        """Column names (of the first row; jsonl rows may differ)."""
        return list(self.rows[0])

    def n_rows(self, split: str) -> int:
        return len(self._split(split))

    def _split(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.train if split == "train" else self.eval

    def row_number(self, split: str, task_index: int) -> int:
        """The file row of task `task_index` of `split` (see the module docstring for the order)."""
        rows = self._split(split)
        if len(rows) == 0:
            raise DatasetError(
                f"{self.path}: the {split} split is empty; set env.dataset.eval_size > 0 to hold out "
                "eval rows"
            )
        if task_index < 0:
            raise ValueError(f"task index must be >= 0, got {task_index}")
        if split == "eval":
            return int(rows[task_index % len(rows)])
        epoch, pos = divmod(int(task_index), len(rows))
        return int(rows[_epoch_order(self.seed, epoch, len(rows))[pos]])

    def row(self, number: int) -> DatasetRow:
        """File row `number` as a DatasetRow."""
        return DatasetRow(int(number), dict(self.rows[number]), self.prompt_field, self.answer_field)

    def task_row(self, split: str, task_index: int) -> DatasetRow:
        return self.row(self.row_number(split, task_index))


@functools.lru_cache(maxsize=16)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n)
