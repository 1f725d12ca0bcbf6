"""`dataset-qa`: questions from a dataset's rows, the answer checked by a verifier. No tools, no sandbox.

    env:
      id: dataset-qa
      dataset: {path: examples/data/arith_qa.jsonl, prompt_field: prompt, answer_field: answer}
      kwargs: {verifier: math-verify, multi_turn: false}

A task is one row (`env.dataset`, envs/dataset.py): the prompt column is the user message (or the
conversation, for a list of chat messages), the answer column the ground truth. The model answers in
plain text; `verifier` (envs/verifiers.py: `math-verify`, `exact-match` or `pkg.module:fn`) scores the
turn's text against the ground truth, and that score is the episode's outcome (`traj.outcome`, what the
`outcome` reward reads).

- single turn (`multi_turn: false`, the default): the first turn is the answer; the episode ends there.
- multi turn (`multi_turn: true`): a wrong answer gets `feedback` as a user message and another try,
  until the verifier scores 1.0 or the last of `rollout.max_turns` tries is scored (its score is the
  outcome).

Images (`image_field: <column>`): the column holds the row's image in the HF datasets convention, a path
string or a mapping {"bytes": encoded bytes | None, "path": str | None} (bytes win; a relative path is
read from the working directory). A parquet file's binary bytes arrive as {"base64": ...} (envs/dataset.py
keeps every row JSON), which is read the same way. The user message becomes [image part, text part].
The image is checked when the task is built (`envs.tool_result.sanitize_image`: at most
`MAX_IMAGE_BYTES`, the pixel limit read from the header, an allowed mode, fully decodable) and re-encoded
as an RGB PNG; a bad one is a DatasetError naming the row, the column and the problem. A row without a
value there is a text-only task.

A verifier past `verifier_timeout_s` scores the answer 0.0 (`info["verifier_timed_out"]`), and so does an
answer that makes a built-in verifier fail (`info["verifier_failed"]`, envs/verifiers.py "Failures"): any
text the model writes gets a score. A custom verifier that raises is the env's own failure (an infra
error: not scored).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

from envs.dataset import DatasetError, DatasetRow, TaskDataset
from envs.spaces import ChatMessages
from envs.text_env import TextEnv, TextReply
from envs.verifiers import DEFAULT_TIMEOUT_S, make_verifier


def row_image(value: Any, where: str) -> bytes:
    """The checked RGB PNG of an image cell in the HF datasets convention (a path, or {"bytes", "path"})."""
    from envs.tool_result import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ToolImageError, sanitize_image

    data, path = None, None
    if isinstance(value, str):
        path = value
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):
        data, path = value.get("bytes"), value.get("path")
    else:
        raise DatasetError(f"{where}: an image must be a path or {{'bytes': ..., 'path': ...}} (the HF "
                           f"datasets image convention), got {type(value).__name__}")
    if data is None:
        if not isinstance(path, str) or not path:
            raise DatasetError(f"{where}: the image has neither bytes nor a path")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise DatasetError(f"{where}: cannot read image file {path!r}: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("base64"), str):  # bytes read from a parquet file
        try:
            data = base64.b64decode(data["base64"], validate=True)
        except ValueError as e:
            raise DatasetError(f"{where}: the image's base64 bytes do not decode ({e})") from None
    if not isinstance(data, (bytes, bytearray)):
        raise DatasetError(f"{where}: image bytes must be bytes, got {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise DatasetError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return sanitize_image(bytes(data), MAX_IMAGE_PIXELS)[0]
    except ToolImageError as e:
        raise DatasetError(f"{where}: {e}") from None


DEFAULT_INSTRUCTIONS = "Solve the problem. Put your final answer within \\boxed{}."
DEFAULT_FEEDBACK = "That is not correct. Try again."


@dataclass(frozen=True)
class QATask:
    """One row's question. prompt: a string or chat messages; answer: the ground truth; columns: the row."""

    task_id: str
    prompt: str | list[dict[str, Any]]
    answer: Any
    columns: dict[str, Any] = field(hash=False, compare=False)


class DatasetQAEnv(TextEnv):
    """Rows of `env.dataset` as questions. Args: verifier ("math-verify" | "exact-match" | "pkg.module:fn"),
    multi_turn (retry with feedback until correct or max_turns), instructions (the system message),
    feedback (the user message after a wrong answer, multi turn), verifier_timeout_s, image_field (the
    column holding each row's image, see the module docstring; None: text only), and the ToolEnv
    arguments (max_turns, sandbox_pool, tools_in_prompt)."""

    env_id = "dataset-qa"
    default_max_turns = 1
    rows_only = True

    def __init__(
        self,
        verifier: str = "math-verify",
        multi_turn: bool = False,
        instructions: str = DEFAULT_INSTRUCTIONS,
        feedback: str = DEFAULT_FEEDBACK,
        verifier_timeout_s: float = DEFAULT_TIMEOUT_S,
        image_field: str | None = None,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
    ) -> None:
        super().__init__(max_turns=max_turns, sandbox_pool=sandbox_pool, tools_in_prompt=tools_in_prompt)
        if verifier_timeout_s <= 0:
            raise ValueError(f"verifier_timeout_s must be > 0, got {verifier_timeout_s}")
        self.verifier = make_verifier(verifier, verifier_timeout_s)
        self.multi_turn = bool(multi_turn)
        self.instructions = str(instructions)
        self.feedback = str(feedback)
        self.image_field = image_field
        if image_field is not None:
            self.observation_space = ChatMessages(images=True)

    @classmethod
    def dataset_problems(cls, data: TaskDataset | None) -> list[str]:
        out = super().dataset_problems(data)
        if data is not None:
            missing = [i for i, r in enumerate(data.rows) if r.get(data.answer_field) is None]
            if missing:
                out.append(
                    f"dataset-qa needs a ground truth in column {data.answer_field!r}, missing in "
                    f"{len(missing)} rows (first: row {missing[0]}, columns "
                    f"{', '.join(data.rows[missing[0]])}); set env.dataset.answer_field to the column that "
                    "holds it"
                )
        return out

    def generate_task(self, seed: int, options: dict[str, Any]) -> QATask:
        raise ValueError(
            "dataset-qa takes its tasks from dataset rows: set env.dataset to a .jsonl or .parquet file "
            "(or call reset(options={'row': {...}}) with a row)"
        )

    def task_from_row(self, row: DatasetRow) -> QATask:
        answer = row.require_answer("dataset-qa")
        value = row.columns.get(self.image_field) if self.image_field is not None else None
        if value is None:
            return QATask(f"row-{row.index}", row.prompt, answer, row.columns)
        png = row_image(value, f"dataset row {row.index}, column {self.image_field!r}")
        messages = row.messages()
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise DatasetError(f"dataset row {row.index}: the prompt has no user message to put the image in")
        m = messages[users[0]]
        m["content"] = [{"type": "image", "image": png}, {"type": "text", "text": m["content"]}]
        columns = {**row.columns, self.image_field: {"sha256": hashlib.sha256(png).hexdigest()}}
        return QATask(f"row-{row.index}", messages, answer, columns)

    async def respond(self, text: str) -> TextReply:
        result = await self.verifier.averify(text, self.task.answer, self.task.columns)
        info: dict[str, Any] = {"verifier_timed_out": True} if result.timed_out else {}
        if result.failed is not None:
            info["verifier_failed"] = result.failed
        if result.score >= 1.0 or not self.multi_turn or self.turn >= self.max_turns:
            return TextReply([], result.score, done=True, info=info)
        return TextReply([{"role": "user", "content": self.feedback}], result.score, done=False, info=info)
