"""`reasoning-gym/<dataset>`: any reasoning-gym dataset as a single- or multi-turn text env.

    env:
      id: reasoning-gym/chain_sum            # any name in reasoning_gym.factory.DATASETS
      kwargs: {config: {min_terms: 2, max_terms: 3}}

reasoning-gym (https://github.com/open-thought/reasoning-gym, the optional extra `envs`) generates its
problems procedurally, so nothing is downloaded. Task `seed` is entry 0 of
`create_dataset(<dataset>, **config, seed=seed, size=1)`: the entry's `question` is the user message.
The model answers in `<answer>...</answer>` tags (reasoning-gym's default system prompt says so); the
episode's outcome is the dataset's own `score_answer(extract_answer(text), entry)` (a number in [0, 1];
0.0 when the text holds no answer tags). With `env.dataset` the rows are entries instead: the prompt
column is the question, the answer column the answer and a `metadata` column, when present, the entry's
metadata (what `score_answer` reads for some datasets).

Scoring runs in a child process with a wall-clock limit (envs/child_process.py): some scorers evaluate
the model's expression, and a crafted answer must not stall the worker. Past `score_timeout_s` the
answer scores 0.0 (`info["score_timed_out"]`). So does an answer that makes `score_answer` raise, return
something outside [0, 1] or kill its process, when the entry's own answer scores normally
(`info["score_failed"]`); if that fails too, the scorer or the row is broken: the env's failure (an infra
error). The answer is extracted in linear time (`extract_answer`). Multi turn (`multi_turn: true`): a
wrong answer gets `feedback` and another try, as in dataset-qa. `oracle_actions()` answers with the
entry's own answer, so `odyssey warmup` can teach a fresh policy the answer format before RL.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from envs.child_process import ChildProcessDied, call_in_child
from envs.dataset import DatasetRow
from envs.dataset_qa import DEFAULT_FEEDBACK
from envs.text_env import TextEnv, TextReply
from envs.verifiers import last_tagged

NAMESPACE = "reasoning-gym"
_RESERVED = ("seed", "size")  # set per task by the adapter


def _rg() -> Any:
    try:
        import reasoning_gym  # noqa: F401  (registers the datasets)
        from reasoning_gym import factory
    except ImportError as e:
        raise ImportError(
            f"{NAMESPACE}/<dataset> envs need the reasoning-gym package: pip install 'odyssey-rl[envs]' ({e})"
        ) from e
    return factory


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers (what `reasoning-gym/<name>` accepts)."""
    return sorted(_rg().DATASETS)


def default_instructions() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"].strip()


@dataclass(frozen=True)
class ReasoningGymTask:
    """entry: reasoning-gym's {question, answer, metadata}."""

    task_id: str
    prompt: str | list[dict[str, str]]
    entry: dict[str, Any] = field(hash=False, compare=False)


@functools.lru_cache(maxsize=32)
def _scorer(name: str, config_json: str) -> Any:
    from reasoning_gym import create_dataset

    return create_dataset(name, **json.loads(config_json), seed=0, size=1)


def _score_in_child(name: str, config_json: str, answer: str | None, entry: dict[str, Any]) -> Any:
    """Runs in the child process: the dataset's own score_answer."""
    return _scorer(name, config_json).score_answer(answer, entry)


def extract_answer(text: str) -> str | None:
    """reasoning-gym's `extract_answer(text)` (the last `<answer>...</answer>`, stripped; None without one) in
    linear time: its regex takes quadratic time on a text of many opening tags and no closing one."""
    tagged = last_tagged(text, "answer")
    return None if tagged is None else tagged.strip()


class ReasoningGymEnv(TextEnv):
    """reasoning-gym dataset `dataset` with `config` (its config dataclass's fields but seed/size).
    Args: multi_turn, instructions (system message; default: reasoning-gym's), feedback, score_timeout_s,
    and the ToolEnv arguments."""

    default_max_turns = 1

    def __init__(
        self,
        dataset: str,
        config: dict[str, Any] | None = None,
        multi_turn: bool = False,
        instructions: str | None = None,
        feedback: str = DEFAULT_FEEDBACK,
        score_timeout_s: float = 30.0,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
    ) -> None:
        super().__init__(max_turns=max_turns, sandbox_pool=sandbox_pool, tools_in_prompt=tools_in_prompt)
        factory = _rg()
        if dataset not in factory.DATASETS:
            close = difflib.get_close_matches(dataset, list(factory.DATASETS), n=3)
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}"
                + (f"; did you mean {', '.join(repr(c) for c in close)}?" if close else "")
                + f" ({len(factory.DATASETS)} datasets: `python -c 'import reasoning_gym.factory as f; "
                "print(sorted(f.DATASETS))'`)"
            )
        self.config = dict(config or {})
        fields = [f.name for f in dataclasses.fields(factory.DATASETS[dataset][1]) if f.name not in _RESERVED]
        bad = [k for k in self.config if k not in fields]
        if bad:
            raise ValueError(
                f"reasoning-gym/{dataset}: unknown config field(s) {bad} (accepted: {', '.join(fields)}; "
                "seed and size are set per task)"
            )
        try:
            self._config_json = json.dumps(self.config, sort_keys=True)
        except TypeError as e:
            raise ValueError(f"reasoning-gym/{dataset}: config must be plain YAML values ({e})") from None
        factory.create_dataset(dataset, **self.config, seed=0, size=1)  # the dataset's own config checks
        self.dataset, self.env_id = dataset, f"{NAMESPACE}/{dataset}"
        self.multi_turn = bool(multi_turn)
        self.instructions = instructions if instructions is not None else default_instructions()
        self.feedback = str(feedback)
        if score_timeout_s <= 0:
            raise ValueError(f"score_timeout_s must be > 0, got {score_timeout_s}")
        self.score_timeout_s = float(score_timeout_s)

    def generate_task(self, seed: int, options: dict[str, Any]) -> ReasoningGymTask:
        from reasoning_gym import create_dataset

        entry = create_dataset(self.dataset, **self.config, seed=int(seed), size=1)[0]
        return ReasoningGymTask(f"{self.env_id}/{seed}", entry["question"], dict(entry))

    def task_from_row(self, row: DatasetRow) -> ReasoningGymTask:
        prompt = row.prompt
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        entry = {"question": question, "answer": row.answer, "metadata": row.columns.get("metadata") or {}}
        return ReasoningGymTask(f"{self.env_id}/row-{row.index}", prompt, entry)

    def oracle_actions(self) -> list[str]:
        """The scripted perfect policy for the current task: the entry's own answer in answer tags (what the
        SFT warm-up imitates; a dataset without a stored answer has no oracle)."""
        answer = self.task.entry.get("answer")
        if answer is None:
            raise ValueError(
                f"{self.env_id}: this entry has no stored answer, so there is no oracle to imitate"
            )
        return [f"<answer>{answer}</answer>"]

    async def _score(self, answer: str | None) -> tuple[float, bool]:
        """(score_answer's score of `answer`, timed out) from the child; raises when scoring fails."""
        score, timed_out = await call_in_child(
            _score_in_child,
            self.dataset,
            self._config_json,
            answer,
            self.task.entry,
            timeout_s=self.score_timeout_s,
        )
        if timed_out:
            return 0.0, True
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
            raise ValueError(f"{self.env_id}: score_answer returned {str(score)[:100]}, outside [0, 1]")
        return float(score), False

    async def respond(self, text: str) -> TextReply:
        answer = extract_answer(text)
        info: dict[str, Any] = {"answer": answer}
        try:
            score, timed_out = await self._score(answer)
        except Exception as e:
            # score_answer raised, returned garbage or killed its process. The entry's own answer tells
            # whose fault that is: if it scores normally, this answer broke the scorer (a failed check, as
            # the threat model wants: no text escapes scoring); if not, the dataset or the scorer is broken.
            try:
                await self._score(self.task.entry.get("answer"))
            except Exception:
                if isinstance(e, ChildProcessDied):
                    raise RuntimeError(f"{self.env_id}: scoring failed: {e}") from e
                raise
            score, timed_out = 0.0, False
            info["score_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        if timed_out:
            info["score_timed_out"] = True
        if score >= 1.0 or not self.multi_turn or self.turn >= self.max_turns:
            return TextReply([], score, done=True, info=info)
        return TextReply([{"role": "user", "content": self.feedback}], score, done=False, info=info)
