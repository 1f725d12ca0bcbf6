"""Multi-turn tool calling against TRL: RL tokens/s of `odyssey train` and of TRL's own tool loop
(`trl.GRPOTrainer(tools=..., environment_factory=...)`) on SmolLM2-135M-Instruct with the same calculator
tools -> bench/results/trl_tools_race.json (issue 44, item 5b: ours >= 1.5x TRL).

    .venv/bin/python bench/trl_tools_race.py [--steps 4] [--episodes 32] [--order trl-first|odyssey-first]
                     [--trl-threads 2] [--trl-micro-batch 2] [--seed 0]
    .venv/bin/python bench/trl_tools_race.py --smoke   # TRL only, a tiny random model with SmolLM2's
                                                         # tokenizer, 2 steps of 8 episodes, 8 new tokens

The task: configs/smollm2_arith_tools.yaml (the `arith` env at difficulty 0, tools calc(expression) and
answer(value), three worked episodes as earlier turns, GRPO groups of 8, 32 episodes a step, up to 4 turns of
128 new tokens, T = 1, lr 1e-5) with these overrides on BOTH sides:
  - model.hf_path: a derived checkpoint directory (`derive_checkpoint`): the converted SmolLM2 weights
    (symlinked) and tokenizer, with TRL's own `qwen2_5_chat_template` as its chat template. SmolLM2's own
    template is not one `trl.chat_template_utils.add_response_schema` knows, so `GRPOTrainer(tools=...)`
    refuses it ("Unrecognized chat template, failed to add response schema"); the Qwen2.5 template is
    ChatML on the same <|im_start|>/<|im_end|> tokens SmolLM2 has, and it renders the tool list itself, so
  - env.kwargs.tools_in_prompt: false (the template lists the tools from the env's JSON schemas, both sides);
  - rewards: outcome only (1.0 when the episode's first answer call has the task's value, else 0.0);
  - orchestrator.eval_every: 0 (no held-out evaluation: this is a throughput race), checkpoint_every 0.

TRL side: `GRPOTrainer` with
  - the same prompts: each train task of `rl.rollout.tasks.task_stream(cfg, "train")` in stream order (task i
    of step k = our task k * tasks_per_step + i) as the env's reset messages (system instructions, the three
    demonstrations, the question), passed as a conversation; TRL renders it with the tools. The rendered ids
    are checked equal to our rollout's (`ChatCodec.render_prompt`) for every task: trl.prompt_ids_equal;
  - the same tools: `tools=[calc]` and, for the per-episode state answer needs, `environment_factory` (one
    `ArithEpisode` per rollout, TRL's API for tools bound to an episode) providing `answer`. Both run OUR env
    code in-process: each TRL tool call is played as one tool call of an `arith` env (use_sandbox=False: the
    same evaluator our Docker sandbox runs, envs/sandbox_scripts/calc.py) and returns the env's tool message,
    so results and error texts are ours. Each tool is a callable dict holding our env's JSON schema
    (`SchemaTool`): transformers renders a dict tool as that schema verbatim, so the prompt lists exactly the
    schemas ours lists (its schema from a Python signature would lack "additionalProperties": false);
  - the same reward: the outcome of the episode's first answer call (`ArithEpisode.outcome`);
  - budgets (`trl_budgets`): per generation max_new_tokens = rollout.max_new_tokens (generation_kwargs),
    max_tool_calling_iterations = rollout.max_turns - 1 (one generation + that many post-tool generations =
    max_turns turns), max_completion_length = rollout.max_tokens - the longest prompt (ours caps the whole
    trajectory at max_tokens);
  - the learner settings of bench/trl_time_to_reward.py's `trl_config` (group size, generation batch =
    rollout.episodes, T / top-p / top-k, lr and warm-up, AdamW betas, clip range, grad clip, beta = kl_coef
    = 0, loss_agg token_mean = TRL's "dapo", one optimizer step per generation batch, gradient checkpointing
    off), micro-batches of --trl-micro-batch completions accumulated over the batch;
  - torch threads: --trl-threads (default 2: the whole machine, as ours runs 2 rollout workers + a learner).
Ours: `odyssey train` (rl.train.loop.Trainer: embedded Ray, 2 TorchEngine rollout workers with Docker
sandboxes, a learner actor, async with max_staleness 1) on the same config.

Tokens (counted alike): each trajectory's whole token sequence as its learner receives it = prompt + every
generated turn + every tool result with its template markup. Ours: metrics.jsonl `tokens` (sum of trajectory
lengths; "all") and `learner/tokens` + `learner/trained_trajectories` ("trained": our learner drops groups
whose rewards all tie). TRL: prompt ids + completion ids per completion (TRL's completion ids hold the tool
results), from the reward call ("all"; "trained": its groups whose rewards do not all tie, though TRL trains
those too at advantage 0); TRL's own `num_input_tokens_seen` counts no tool-result tokens, so "all" minus it
is the step's tool-result tokens (reported). Rates: tokens / wall seconds since training started (ours:
metrics wall_s, from the first draw after the actors are up; TRL: from `on_train_begin`) over the whole run,
and over steps 2..N (bench/trl_time_to_reward.py's `rates`).

What differs by design ("differences" in the results): see DIFFERENCES.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trl_time_to_reward import (  # noqa: E402
    check_mappable,
    check_one_batch_per_step,
    group_tokens,
    learner_fairness,
    machine_record,
    peft_config,
    rates,
    read_run,
    train_trl_in_child,
    trl_config,
)

RESULTS = ROOT / "bench" / "results" / "trl_tools_race.json"
CONFIG = "configs/smollm2_arith_tools.yaml"
#: overrides on both sides (module docstring)
SHARED_OVERRIDES = [
    "env.kwargs.tools_in_prompt=false",
    "rewards=[{name: outcome, weight: 1.0}]",
    "orchestrator.eval_every=0",
    "orchestrator.checkpoint_every=0",
]
TARGET = 1.5  # issue 44, item 5b: ours >= 1.5x TRL's RL tokens/s

DIFFERENCES = [
    "tools: ours runs calc in a Docker sandbox (envs/sandbox_scripts/calc.py via docker exec); TRL runs the "
    "same env code in-process (arith env with use_sandbox=False: the same evaluator, no container), so TRL's "
    "tool calls are cheaper",
    "episode end: in ours the first answer call ends the episode; TRL's tool loop has no terminal tool, so "
    "after answer's result TRL generates another turn (if turns and budget remain); its reward is still the "
    "first answer's outcome, and later calls get 'error: the episode is over'",
    "a turn without a tool call: ours answers with a user nudge restating the format and plays on (up to "
    "max_turns); TRL ends the episode there",
    "turn end: ours ends a turn at the first </tool_call> (a stop string) and closes it with <|im_end|>; "
    "TRL's HF generate stops only at <|im_end|> (EOS), so a TRL turn may hold text after </tool_call>",
    "budget: ours caps each turn at max_new_tokens and the whole trajectory at max_tokens; TRL caps each "
    "generation at max_new_tokens (generation_kwargs) and prompt + completion at max_tokens via "
    "max_completion_length = max_tokens - longest prompt",
    "tool-call arguments: ours validates them against the schema (envs/tools.py); TRL parses them with its "
    "response template and calls the tool with them, which then runs our validation (the same error texts)",
    "ours is async (rollouts for step k+1 overlap step k's learner update, max_staleness 1) with 2 rollout "
    "worker processes and a learner process; TRL is sequential, one process",
    "ours drops all-tie groups from the loss; TRL trains them at advantage 0 (see tokens 'all' / 'trained')",
    "ours computes a group's shared prompt once in the learner (shared-prefix packing); TRL forwards every "
    "completion's padded prompt",
    "ours applies truncated IS between rollout and learner log-probs (learner.tis_cap); TRL's HF generate "
    "path has none",
]


# ---------------------------------------------- pure helpers (tests/test_bench_trl_tools_race.py)


def derive_checkpoint(src: str | Path, dst: str | Path, chat_template: str) -> Path:
    """A checkpoint directory `dst` = `src` with `chat_template` as its chat template: weight files
    (*.safetensors, *.bin) symlinked, every other file copied, chat_template.jinja written, and any
    "chat_template" key dropped from tokenizer_config.json (the .jinja file is then the template). `dst` is
    replaced if it exists. ValueError when `src` has no config.json or no tokenizer.json."""
    src, dst = Path(src).expanduser().resolve(), Path(dst)
    for need in ("config.json", "tokenizer.json"):
        if not (src / need).is_file():
            raise ValueError(
                f"{src} has no {need}: give a converted HF checkpoint with its tokenizer "
                "(python -m model.embedded ensure converts the embedded SmolLM2)"
            )
    if dst.exists() or dst.is_symlink():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "chat_template.jinja" or not f.is_file():
            continue
        if f.suffix in (".safetensors", ".bin"):
            (dst / f.name).symlink_to(f)
        elif f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (dst / f.name).write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copy2(f, dst / f.name)
    (dst / "chat_template.jinja").write_text(chat_template)
    return dst


def trl_budgets(max_new_tokens: int, max_turns: int, max_tokens: int, longest_prompt: int) -> dict[str, int]:
    """TRL's budgets for our per-turn / per-episode ones (module docstring): {"max_new_tokens" (per
    generation), "max_tool_calling_iterations" (post-tool generations), "max_completion_length" (everything
    after the prompt)}. ValueError when the longest prompt leaves no room."""
    if min(max_new_tokens, max_turns) < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) and max_turns ({max_turns}) must be >= 1")
    room = max_tokens - longest_prompt
    if room < 1:
        raise ValueError(
            f"the longest prompt has {longest_prompt} tokens, rollout.max_tokens is {max_tokens}: "
            "no room for a completion; raise rollout.max_tokens"
        )
    return {
        "max_new_tokens": max_new_tokens,
        "max_tool_calling_iterations": max_turns - 1,
        "max_completion_length": room,
    }


def episode_shape(completion: list[dict[str, Any]]) -> dict[str, int]:
    """{"turns": assistant messages, "tool_results": tool messages} of one TRL multi-turn completion (its list
    of messages after the prompt)."""
    return {
        "turns": sum(m.get("role") == "assistant" for m in completion),
        "tool_results": sum(m.get("role") == "tool" for m in completion),
    }


class SchemaTool(dict):
    """A tool for TRL that is its JSON schema: a dict (so `apply_chat_template` renders `schema` verbatim, the
    same text as our env's `tool_schemas()`), callable with the call's arguments as keywords ->
    `fn(arguments)`, named `__name__` (TRL's tool lookup key)."""

    def __init__(self, schema: dict[str, Any], fn: Any) -> None:
        super().__init__(copy.deepcopy(schema))
        self.__name__ = schema["function"]["name"]
        self._fn = fn

    def __call__(self, **arguments: Any) -> str:
        return self._fn(arguments)

    def __eq__(self, other: object) -> bool:  # TRL dedups tools with `in`: one per object
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = object.__hash__


class EnvTools:
    """Our `arith` env driven one tool call at a time: `call(name, arguments)` plays
    `<tool_call>{name, arguments}</tool_call>` as one env step and returns the env's tool message text (the
    same text our rollout appends). `reset(task)` starts the task (a rl.rollout.tasks.Task); `outcome` is the
    first answer's success (0.0 before any), `over` whether the episode ended. In-process (use_sandbox=False),
    no turn limit (TRL's own limits apply)."""

    OVER = "error: the episode is over (answer was called)"

    def __init__(self, env_id: str, env_kwargs: dict[str, Any]) -> None:
        import envs

        kwargs = {k: v for k, v in env_kwargs.items() if k not in ("max_turns",)}
        self.env = envs.make(env_id, **{**kwargs, "use_sandbox": False, "max_turns": 10**9})
        self.outcome, self.over = 0.0, True

    def reset(self, task: Any) -> list[dict[str, Any]]:
        messages, _ = self.env.reset(seed=task.seed, options=task.reset_options())
        self.outcome, self.over = 0.0, False
        return messages

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        from envs.tool_call import format_tool_call

        if self.over:
            return self.OVER
        obs, _, terminated, truncated, info = self.env.step(format_tool_call(name, arguments))
        if terminated or truncated:
            self.over = True
            if info.get("success") is not None:
                self.outcome = float(info["success"])
        return "\n".join(str(m.get("content", "")) for m in obs)

    def close(self) -> None:
        self.env.close()


class ArithEpisode:
    """One TRL rollout's environment (`GRPOTrainer(environment_factory=...)`): `reset(task_index=i, ...)`
    starts train task i of `tasks`; its tool `answer` (a `SchemaTool` with our schema, set on the instance)
    plays the call in this episode's env. TRL lists the class's public functions as tools and then reads them
    off the instance, so the instance attribute (our schema) is what it renders and calls."""

    def __init__(
        self, tasks: list[Any], env_id: str, env_kwargs: dict[str, Any], schemas: dict[str, dict[str, Any]]
    ) -> None:
        self._tasks = tasks
        self._env = EnvTools(env_id, env_kwargs)
        self.answer = SchemaTool(schemas["answer"], lambda args: self._env.call("answer", args))

    def reset(self, task_index: int, **_: Any) -> None:
        self._env.reset(self._tasks[int(task_index)])

    def answer(self, value: float) -> str:  # listed by TRL; the instance's SchemaTool shadows it
        """Submit the final result; this ends the episode.

        Args:
            value: the value of the whole expression.
        """
        return self._env.call("answer", {"value": value})

    @property
    def outcome(self) -> float:
        return self._env.outcome


# ---------------------------------------------------------------- config


def race_config(
    model_dir: str, steps: int, episodes: int | None, seed: int, run_dir: Path, extra: list[str]
) -> Any:
    """The RunConfig both sides run: CONFIG + SHARED_OVERRIDES + the derived checkpoint + steps, seed."""
    from rl.config import load_config

    return load_config(
        str(ROOT / CONFIG),
        [
            f"model.hf_path={model_dir}",
            *SHARED_OVERRIDES,
            f"learner.steps={steps}",
            f"rollout.seed={seed}",
            *([f"rollout.episodes={episodes}"] if episodes else []),
            f"logging.run_dir={run_dir}",
            *extra,
        ],
    )


def check_race(cfg: Any) -> None:
    """ValueError naming each setting TRL cannot be given the same value of: bench/trl_time_to_reward.py's
    `check_mappable` on the learner (its one-turn rule aside: TRL's tool loop plays max_turns turns)."""
    check_mappable(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_turns": 1})}))
    if cfg.learner.activation_checkpointing:
        raise ValueError("learner.activation_checkpointing is on: TRL runs gradient_checkpointing=False here")


# ---------------------------------------------------------------- TRL side


def trl_prompts(cfg: Any, tok: Any, n_tasks: int) -> tuple[list[Any], list[dict[str, Any]], dict, int]:
    """(tasks, rows {"prompt": messages, "task_index", "prompt_tokens"}, tool schemas by name, how many rows'
    TRL rendering (apply_chat_template with the schemas) equals our rollout's prompt ids) for the first
    `n_tasks` train tasks."""
    from rl.rollout.agent_loop import ChatCodec
    from rl.rollout.tasks import task_stream

    codec = ChatCodec(tok)
    env = EnvTools(cfg.env.id, cfg.env.kwargs)
    schemas = {s["function"]["name"]: s for s in env.env.tool_schemas()}
    stream = task_stream(cfg, "train")
    tasks, rows, equal = [], [], 0
    for i in range(n_tasks):
        task = stream.task(i)
        messages = env.reset(task)
        ours = codec.render_prompt(messages, list(schemas.values()))
        theirs = tok.apply_chat_template(
            messages,
            tools=list(schemas.values()),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        equal += ours == list(theirs)
        tasks.append(task)
        rows.append({"prompt": messages, "task_index": i, "prompt_tokens": len(theirs)})
    env.close()
    return tasks, rows, schemas, equal


class OutcomeReward:
    """TRL reward function: each rollout's `ArithEpisode.outcome`; logs per call the rewards, the token counts
    (prompt + completion ids, tool results included), turns and tool results per completion."""

    __name__ = "outcome"

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        task_index: list[int],
        environments: list[ArithEpisode],
        trainer_state: Any = None,
        **_: Any,
    ) -> list[float]:
        rewards = [float(e.outcome) for e in environments]
        shapes = [episode_shape(c) for c in completions]
        self.calls.append(
            {
                "step": int(trainer_state.global_step) + 1
                if trainer_state is not None
                else len(self.calls) + 1,
                "task_index": [int(i) for i in task_index],
                "rewards": rewards,
                "tokens": [
                    self.rows[int(i)]["prompt_tokens"] + len(c) for i, c in zip(task_index, completion_ids)
                ],
                "completion_tokens": [len(c) for c in completion_ids],
                "turns": [s["turns"] for s in shapes],
                "tool_results": [s["tool_results"] for s in shapes],
            }
        )
        return rewards


class StepClock:
    """TrainerCallback: wall seconds since `on_train_begin` and TRL's token count at each optimizer step;
    prints a progress line per step from the reward's last call."""

    def __init__(self, reward: OutcomeReward, steps: int) -> None:
        self.reward, self.steps = reward, steps
        self.t0 = 0.0
        self.marks: list[dict[str, Any]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wall = time.perf_counter() - self.t0
        self.marks.append(
            {
                "step": int(state.global_step),
                "wall_s": wall,
                "num_input_tokens_seen": int(state.num_input_tokens_seen),
            }
        )
        call = self.reward.calls[-1] if self.reward.calls else None
        if call:
            print(
                f"  TRL step {state.global_step}/{self.steps}: {wall:.0f} s, {sum(call['tokens'])} tokens, "
                f"reward {statistics.mean(call['rewards']):.3f}, turns {statistics.mean(call['turns']):.2f}, "
                f"tool results {statistics.mean(call['tool_results']):.2f}",
                flush=True,
            )


def make_trl_trainer(cfg: Any, model_dir: str, steps: int, out: Path, micro_batch: int) -> dict[str, Any]:
    """TRL's `GRPOTrainer` on the race config (module docstring), not yet trained -> {"trainer", "reward"
    (OutcomeReward), "clock" (StepClock), "rows", "tasks", "equal" (prompts whose ids equal ours), "budgets",
    "calc_env"}. Every train task of the run is in the dataset, in stream order."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from model.tokenizer import policy_tokenizer

    ro, lc = cfg.rollout, cfg.learner
    tok = copy.deepcopy(policy_tokenizer(model_dir))  # ours is cached: TRL sets a response template on it
    tasks, rows, schemas, equal = trl_prompts(cfg, tok, ro.episodes // lc.group_size * steps)
    longest = max(r["prompt_tokens"] for r in rows)
    budgets = trl_budgets(ro.max_new_tokens, ro.max_turns, ro.max_tokens, longest)
    calc_env = EnvTools(cfg.env.id, cfg.env.kwargs)
    calc_env.reset(tasks[0])  # calc's result does not depend on the task; this episode never ends
    calc = SchemaTool(schemas["calc"], lambda args: calc_env.call("calc", args))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    one_turn = cfg.model_copy(update={"rollout": ro.model_copy(update={"max_turns": 1})})
    args = trl_config(one_turn, str(out / "trainer"), steps, micro_batch)
    args.max_completion_length = budgets["max_completion_length"]
    args.max_tool_calling_iterations = budgets["max_tool_calling_iterations"]
    args.generation_kwargs = {"max_new_tokens": budgets["max_new_tokens"]}
    reward = OutcomeReward(rows)
    clock = type("Clock", (StepClock, TrainerCallback), {})(reward, steps)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(
            [{"prompt": r["prompt"], "task_index": r["task_index"]} for r in rows]
        ),
        processing_class=tok,
        callbacks=[clock],
        tools=[calc],
        environment_factory=lambda: ArithEpisode(tasks, cfg.env.id, cfg.env.kwargs, schemas),
        peft_config=peft_config(cfg.learner.lora),
    )
    return {
        "trainer": trainer,
        "reward": reward,
        "clock": clock,
        "rows": rows,
        "tasks": tasks,
        "equal": equal,
        "budgets": budgets,
        "calc_env": calc_env,
    }


def close_trl(run: dict[str, Any]) -> None:
    """Close the envs of a `make_trl_trainer` run (its calc env and TRL's pool of ArithEpisodes)."""
    for episodes in getattr(run["trainer"], "_environment_pool", {}).values():
        for e in episodes:
            e._env.close()
    run["calc_env"].close()


def train_trl(
    cfg: Any, model_dir: str, steps: int, threads: int, out: Path, micro_batch: int, tiny_model: bool = False
) -> dict[str, Any]:
    """Run TRL's tool loop on the race config (module docstring) -> record with per-step tokens and times."""
    import torch

    ro, lc = cfg.rollout, cfg.learner
    tasks_per_step = ro.episodes // lc.group_size
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = make_trl_trainer(cfg, model_dir, steps, out, micro_batch)
        trainer, reward, clock, rows = run["trainer"], run["reward"], run["clock"], run["rows"]
        budgets, equal = run["budgets"], run["equal"]
        try:
            trainer.train()
        finally:
            close_trl(run)
        log = [h for h in trainer.state.log_history if "loss" in h]
    finally:
        torch.set_num_threads(before)
    check_one_batch_per_step(len(clock.marks), len(reward.calls), steps)
    per_step, seen = [], 0
    for mark, call in zip(clock.marks, reward.calls):
        want = list(range((mark["step"] - 1) * tasks_per_step, mark["step"] * tasks_per_step))
        if call["task_index"][:: lc.group_size] != want or any(
            len(set(call["task_index"][g : g + lc.group_size])) != 1
            for g in range(0, ro.episodes, lc.group_size)
        ):
            raise RuntimeError(
                f"TRL's step {mark['step']} played tasks {call['task_index']}, expected groups of "
                f"{lc.group_size} of {want} (our stream's order)"
            )
        counts = group_tokens(call["rewards"], call["tokens"], lc.group_size)
        trl_seen = mark["num_input_tokens_seen"] - seen
        seen = mark["num_input_tokens_seen"]
        per_step.append(
            {
                "step": mark["step"],
                "wall_s": mark["wall_s"],
                "train_wall_s": mark["wall_s"],
                "tokens_all": counts["all"],
                "tokens_trained": counts["trained"],
                "groups": counts["groups"],
                "tied_groups": counts["tied_groups"],
                "reward_mean": statistics.mean(call["rewards"]),
                "completion_tokens_mean": statistics.mean(call["completion_tokens"]),
                "turns_mean": statistics.mean(call["turns"]),
                "tool_results_mean": statistics.mean(call["tool_results"]),
                "trl_num_input_tokens_seen": trl_seen,
                "tool_result_tokens": counts["all"] - trl_seen,
            }
        )
    del trainer, run
    gc.collect()
    return {
        "trainer": "trl.GRPOTrainer(tools=[calc], environment_factory=ArithEpisode) (HF generate, CPU, fp32)",
        "model_dir": model_dir,
        "tiny_random_model": tiny_model,
        "torch_threads": threads,
        "micro_batch": micro_batch,
        "gradient_accumulation_steps": ro.episodes // micro_batch,
        "budgets": budgets,
        "prompts": len(rows),
        "prompt_ids_equal": equal,
        "prompt_tokens": sorted({r["prompt_tokens"] for r in rows}),
        "steps": per_step,
        "loss_log": [
            {
                k: h.get(k)
                for k in (
                    "step",
                    "loss",
                    "reward",
                    "grad_norm",
                    "learning_rate",
                    "tools/call_frequency",
                    "tools/failure_frequency",
                )
            }
            for h in log
        ],
        "tool_tokens_never_negative": all(s["tool_result_tokens"] >= 0 for s in per_step),
    }


# ---------------------------------------------------------------- our side


def train_ours(cfg: Any) -> dict[str, Any]:
    """`odyssey train` of `cfg` (rl.train.loop.Trainer, as bench/learning.py's `run` starts it; progress on
    stdout) -> record with per-step tokens and times (bench/trl_time_to_reward.py's `read_run`)."""
    from rich.console import Console

    from rl.train.loop import Trainer

    run_dir = Path(cfg.logging.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    Trainer(cfg, console=Console(file=sys.stdout, force_terminal=False)).run()
    return record_ours(cfg, time.perf_counter() - t0)


def record_ours(cfg: Any, wall: float) -> dict[str, Any]:
    """The record of our finished run in `cfg`'s run dir (metrics.jsonl), `wall` seconds with startup."""
    from rl.placement import torch_threads

    run_dir = Path(cfg.logging.run_dir)
    if not (run_dir / "eval.jsonl").exists():  # eval_every 0: no evaluations, an empty record of them
        (run_dir / "eval.jsonl").write_text("")
    rec = read_run(run_dir, cfg.orchestrator.eval_pass_k)
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    extra = {int(m["step"]): m for m in metrics if "step" in m and "tokens" in m}
    for s in rec["steps"]:
        m = extra[s["step"]]
        s.update(
            {
                "turns_mean": m.get("turns/mean"),
                "length_mean": m.get("length/mean"),
                "generated_tokens": m.get("generated_tokens"),
                "tool_calls": m.get("tool_calls"),
                "rollout_s": m.get("time/rollout_s"),
                "learner_s": m.get("time/learner_s"),
            }
        )
    o = cfg.orchestrator
    return {
        "trainer": "odyssey train (Ray, async, TorchEngine rollout workers, Docker sandboxes, a learner)",
        "run_dir": str(run_dir),
        "torch_threads": {
            "per_rollout_worker": torch_threads(o.rollout_resources),
            "rollout_workers": cfg.rollout.num_workers,
            "learner": torch_threads(o.learner_resources),
        },
        "max_staleness": o.max_staleness,
        "wall_s_with_startup": round(wall, 1),
        "steps": rec["steps"],
    }


# ---------------------------------------------------------------- report


def fairness(cfg: Any, trl_threads: int, micro: int, budgets: dict[str, int] | None) -> dict[str, Any]:
    """Every setting held equal (ours: config key; TRL: GRPOConfig field / trainer argument)."""
    ro, lc = cfg.rollout, cfg.learner
    return {
        "model": f"{cfg.model.hf_path} (model.hf_path, fp32): SmolLM2-135M-Instruct weights + tokenizer, "
        "chat template = trl.chat_template_utils.qwen2_5_chat_template; the same directory on both sides",
        "prompts": "task_stream(cfg, 'train') in order: env system instructions + 3 demonstrations + "
        "question, tools rendered by the template from the env's JSON schemas (ids checked equal: "
        "trl.prompt_ids_equal)",
        "tools": "calc(expression), answer(value): our arith env's code on both (ours: calc in Docker; TRL: "
        "in-process)",
        "reward": "outcome only: 1.0 when the first answer call has the task's value (tol 1e-6), else 0.0",
        "group_size = num_generations": lc.group_size,
        "episodes = generation batch": ro.episodes,
        "max_turns -> max_tool_calling_iterations": [ro.max_turns, ro.max_turns - 1],
        "max_new_tokens (per turn) -> generation_kwargs.max_new_tokens": ro.max_new_tokens,
        "max_tokens (per trajectory) -> max_completion_length": [
            ro.max_tokens,
            budgets and budgets["max_completion_length"],
        ],
        "temperature / top_p / top_k": [ro.temperature, ro.top_p, ro.top_k],
        **learner_fairness(lc),
        "torch_threads": f"TRL {trl_threads} in one process (micro-batches of {micro}); ours 1 per rollout "
        f"worker x {ro.num_workers} + 1 for the learner, on the same {os.cpu_count()} cores",
        "device / dtype": "CPU, fp32 on both",
    }


def side_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "steps": len(steps),
        "train_wall_s": steps[-1]["train_wall_s"] if steps else None,
        "reward_mean": statistics.mean(s["reward_mean"] for s in steps if s.get("reward_mean") is not None)
        if steps
        else None,
        "tied_groups": sum(s["tied_groups"] for s in steps),
        "groups": sum(s["groups"] for s in steps),
        **rates(steps),
    }


def compare(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """ours / TRL for each rate of `side_summary`, and whether each reaches TARGET. "conservative": our
    trained tokens against every token TRL trained (its tied groups included)."""
    out: dict[str, Any] = {}
    for kind in ("all", "trained"):
        for span in ("", "_steps_2_to_n"):
            key = f"tokens_{kind}_per_s{span}"
            a, b = ours.get(key), trl.get(key)
            out[f"ratio_ours_over_trl_{key}"] = a / b if a and b else None
    for span in ("", "_steps_2_to_n"):
        a, b = ours.get(f"tokens_trained_per_s{span}"), trl.get(f"tokens_all_per_s{span}")
        out[f"ratio_conservative{span}"] = a / b if a and b else None
    out["target"] = f"ours >= {TARGET}x TRL's RL tokens/s"
    out["target_met"] = {k: v >= TARGET for k, v in out.items() if k.startswith("ratio_") and v is not None}
    return out


def tiny_checkpoint(tok_dir: Path, dst: Path) -> str:
    """A small random LlamaForCausalLM (2 layers, hidden 64) saved at `dst` with the tokenizer of `tok_dir`:
    the smoke run's policy (it trains and plays the loop; it does not learn the task)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    if dst.exists():
        shutil.rmtree(dst)
    LlamaForCausalLM(config).save_pretrained(dst)
    tok.save_pretrained(dst)
    return str(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=None, help="rollout.episodes (default: the config's 32)")
    ap.add_argument("--seed", type=int, default=0, help="rollout.seed (task stream and sampling seeds)")
    ap.add_argument("--order", choices=("trl-first", "odyssey-first"), default="trl-first")
    ap.add_argument("--trl-only", action="store_true", help="run the TRL side only")
    ap.add_argument("--trl-threads", type=int, default=2)
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=2,
        help="completions per TRL forward/backward (this machine's memory; the loss is the same)",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override on both sides (e.g. rollout.max_new_tokens=64)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="TRL only on a tiny random model with SmolLM2's tokenizer: 2 steps of 8 episodes, 8 new "
        "tokens a turn; the results file says smoke: true",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_trl_tools_race")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the steps 2..N rate needs two steps)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from trl.chat_template_utils import qwen2_5_chat_template

    from model.embedded import resolve_hf_path

    source = resolve_hf_path("smollm2-135m-instruct")
    model_dir = str(derive_checkpoint(source, args.out / "smollm2_qwen25_template", qwen2_5_chat_template))
    trl_model = model_dir
    if args.smoke:
        args.steps, args.episodes, args.trl_only = 2, args.episodes or 8, True
        args.override = ["rollout.max_new_tokens=8", *args.override]
        trl_model = tiny_checkpoint(Path(model_dir), args.out / "tiny_random")
    cfg = race_config(model_dir, args.steps, args.episodes, args.seed, args.out / "odyssey", args.override)
    check_race(cfg)
    if cfg.rollout.episodes % args.trl_micro_batch:
        ap.error(
            f"--trl-micro-batch {args.trl_micro_batch} must divide rollout.episodes {cfg.rollout.episodes}"
        )
    load0 = list(os.getloadavg())
    t_all = time.perf_counter()
    order = ["trl", "odyssey"] if args.order == "trl-first" else ["odyssey", "trl"]
    if args.trl_only:
        order = ["trl"]
    sides: dict[str, Any] = {"trl": None, "odyssey": None}

    def write(complete: bool) -> dict[str, Any]:
        """The results file with the sides run so far (after each side: a later failure keeps the first)."""
        trl, ours = sides["trl"], sides["odyssey"]
        summary: dict[str, Any] = {s: side_summary(sides[s]["steps"]) for s in ("trl", "odyssey") if sides[s]}
        if trl is not None and ours is not None:
            summary.update(compare(summary["odyssey"], summary["trl"]))
        result = {
            "bench": "trl_tools_race",
            "smoke": bool(args.smoke),
            "complete": complete,
            "config": CONFIG,
            "overrides": [*SHARED_OVERRIDES, *args.override],
            "steps": args.steps,
            "episodes_per_step": cfg.rollout.episodes,
            "seed": args.seed,
            "order": order,
            "summary": summary,
            "fairness": fairness(cfg, args.trl_threads, args.trl_micro_batch, trl and trl.get("budgets")),
            "tokens_counted": "per trajectory: prompt + every generated turn + every tool result with its "
            "template markup, the sequence its learner receives (ours: metrics tokens / learner tokens; TRL: "
            "prompt ids + completion ids from the reward call)",
            "differences": DIFFERENCES,
            "trl": trl,
            "odyssey": ours,
            "machine": machine_record(load0, t_all),
        }
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return summary

    for n, side in enumerate(order):
        if side == "trl":
            print(
                f"TRL: {args.steps} steps x {cfg.rollout.episodes} episodes on {args.trl_threads} torch "
                "thread(s)",
                flush=True,
            )
            if n < len(order) - 1:  # ours follows: TRL in a child process, so its memory is gone by then
                sides["trl"] = train_trl_in_child(Path(__file__), sys.argv[1:], args.out / "trl_side.json")
            else:
                sides["trl"] = train_trl(
                    cfg,
                    trl_model,
                    args.steps,
                    args.trl_threads,
                    args.out / "trl",
                    args.trl_micro_batch,
                    tiny_model=args.smoke,
                )
        else:
            print(f"ours: odyssey train, {args.steps} steps x {cfg.rollout.episodes} episodes", flush=True)
            sides["odyssey"] = train_ours(cfg)
        summary = write(complete=n == len(order) - 1)
    trl, ours = sides["trl"], sides["odyssey"]
    assert trl is not None
    t = summary["trl"]
    print(
        f"TRL: {t['tokens_all']} tokens in {t['train_wall_s']:.0f} s = {t['tokens_all_per_s']:.1f} tokens/s "
        f"(steps 2..N {t['tokens_all_per_s_steps_2_to_n']:.1f}); prompt ids equal "
        f"{trl['prompt_ids_equal']}/{trl['prompts']}"
    )
    if ours is not None:
        o = summary["odyssey"]
        print(
            f"ours: {o['tokens_all']} tokens in {o['train_wall_s']:.0f} s = {o['tokens_all_per_s']:.1f} "
            f"tokens/s "
            f"(steps 2..N {o['tokens_all_per_s_steps_2_to_n']:.1f})"
        )
        for key in ("tokens_all_per_s", "tokens_all_per_s_steps_2_to_n", "tokens_trained_per_s_steps_2_to_n"):
            print(f"ours / TRL ({key}): {summary['ratio_ours_over_trl_' + key]}")
        print(
            f"conservative (our trained / TRL all, steps 2..N): {summary['ratio_conservative_steps_2_to_n']}"
        )
    print(f"wrote {args.results}" + (" (smoke run)" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
