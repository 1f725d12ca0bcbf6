"""`skyrl/<env>`: a SkyRL-gym `BaseTextEnv` (gsm8k, gsm8k_multi_turn, aime, text2sql, search, ...) as an
Odyssey env, its tasks from dataset rows.

    env:
      id: skyrl/gsm8k
      dataset: {path: examples/data/gsm8k_skyrl.jsonl}     # rows in SkyRL's format
      kwargs: {env_config: {}}                              # SkyRL's env_config (an OmegaConf mapping)

SkyRL-gym (https://github.com/NovaSky-AI/SkyRL, the optional extra `envs`) builds one env per task from a
dataset row: `skyrl_gym.make(<env>, env_config=..., extras=row)`, where the row holds what the env reads
(gsm8k: `reward_spec: {ground_truth}`; aime: `reward_model: {ground_truth}`) and the prompt column the
chat messages. The episode is SkyRL's: `init(prompt)` gives the first messages, and each turn's whole
text goes to `step(text)`, whose observations, reward and `done` become the gymnasium step (each
step's reward is `info["env_reward"]`, the last one, when done, the outcome). The `env_reward` reward
(rewards/env_reward.py) credits every step's reward to its turn, as SkyRL's own trainers do.

SkyRL's `step` is synchronous: it runs in a thread, and one that takes longer than `step_timeout_s`
ends the episode as the env's failure (an infra error), as does an exception from SkyRL's code (a row
without the fields the env asserts on, for instance).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from envs.dataset import DatasetRow
from envs.text_env import TextEnv, TextReply
from envs.threads import run_in_own_thread

NAMESPACE = "skyrl"


def _skyrl() -> Any:
    try:
        import skyrl_gym
    except ImportError as e:
        raise ImportError(
            f"{NAMESPACE}/<env> envs need the skyrl-gym package: pip install 'odyssey-rl[envs]' ({e})"
        ) from e
    return skyrl_gym


def env_names() -> list[str]:
    """Every env id SkyRL-gym registers (what `skyrl/<env>` accepts)."""
    return sorted(_skyrl().registry)


@dataclass
class SkyRLTask:
    """One row: prompt (chat messages), extras (the row: SkyRL's `extras`), env: the SkyRL env for it."""

    task_id: str
    prompt: list[dict[str, str]]
    extras: dict[str, Any] = field(repr=False)
    env: Any = field(default=None, repr=False)


class SkyRLEnv(TextEnv):
    """SkyRL-gym env `env` with `env_config`. Args: step_timeout_s, and the ToolEnv arguments."""

    default_max_turns = 1
    rows_only = True

    def __init__(
        self,
        env: str,
        env_config: dict[str, Any] | None = None,
        step_timeout_s: float = 300.0,
        *,
        max_turns: int | None = None,
        sandbox_pool: Any | None = None,
        tools_in_prompt: bool = True,
    ) -> None:
        super().__init__(max_turns=max_turns, sandbox_pool=sandbox_pool, tools_in_prompt=tools_in_prompt)
        names = env_names()
        if env not in names:
            close = difflib.get_close_matches(env, names, n=1)
            raise ValueError(
                f"unknown SkyRL-gym env {env!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" (registered: {', '.join(names)})"
            )
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        from omegaconf import OmegaConf

        self.skyrl_id, self.env_id = env, f"{NAMESPACE}/{env}"
        self.env_config = OmegaConf.create(dict(env_config or {}))
        self.step_timeout_s = float(step_timeout_s)

    def generate_task(self, seed: int, options: dict[str, Any]) -> SkyRLTask:
        raise ValueError(
            f"{self.env_id} takes its tasks from dataset rows (SkyRL's `extras`): set env.dataset to a "
            ".jsonl or .parquet file in SkyRL's format (a prompt column of chat messages plus what the env "
            "reads)"
        )

    def task_from_row(self, row: DatasetRow) -> SkyRLTask:
        extras = dict(row.columns)
        skyrl_env = _skyrl().make(self.skyrl_id, env_config=self.env_config, extras=extras)
        prompt = row.messages() if isinstance(row.prompt, str) else [dict(m) for m in row.prompt]
        first, _ = skyrl_env.init(prompt)
        return SkyRLTask(f"{self.env_id}/row-{row.index}", [dict(m) for m in first], extras, skyrl_env)

    def first_messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.task.prompt]  # SkyRL's init() result, as SkyRL's trainers send it

    async def respond(self, text: str) -> TextReply:
        try:
            out = await run_in_own_thread(
                self.task.env.step, text, timeout_s=self.step_timeout_s, what="env-step"
            )
        except TimeoutError:
            raise TimeoutError(
                f"{self.env_id}: step took longer than step_timeout_s={self.step_timeout_s:g}"
            ) from None
        done = bool(out["done"])
        info = {"skyrl_metadata": out.get("metadata") or {}}
        if out.get("postprocessed_action") is not None:
            info["postprocessed_action"] = out["postprocessed_action"]
        if done:
            info["skyrl_metrics"] = self.task.env.get_metrics()
        observations = [{"role": m["role"], "content": str(m["content"])} for m in out["observations"] or []]
        return TextReply(observations, float(out["reward"]), done=done, info=info)

    async def aclose(self) -> None:
        await super().aclose()
        self._close_skyrl()

    def close(self) -> None:
        super().close()
        self._close_skyrl()

    def _close_skyrl(self) -> None:
        task = self.task
        if isinstance(task, SkyRLTask) and task.env is not None:
            task.env.close()
            task.env = None
