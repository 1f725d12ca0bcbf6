"""TRL's `GRPOTrainer` on the arith prompts of a `tiny` run: the peer of bench/train.py's RL tokens/s row.

    from bench.trl_grpo import trl_tokens_per_s
    row = trl_tokens_per_s(cfg, steps=4, threads=2)   # cfg: the RunConfig `odyssey train` ran

What matches our run (configs/tiny.yaml): the prompts are the rendered first prompts (system + tool schemas +
user task, generation prompt) of the same train tasks in the same order (`rl.rollout.tasks.task_stream`, task
i of step k = our task k * tasks_per_step + i), `num_generations` = learner.group_size, completions per step =
rollout.episodes, `max_completion_length` = rollout.max_new_tokens, the same temperature / top-p / top-k, the
same stop tokens (END_OF_TURN, EOS), learner.lr, clip_eps_low / clip_eps_high, grad_clip, kl_coef (0: no
reference model), one optimizer step per batch. The model is `bench.vs_llama.llama_like`: a dense
`LlamaForCausalLM` with tiny's hidden size, layers, heads and vocab and the MLP width that gives tiny's active
parameter count; fp32 on the CPU, HF `generate` (no vLLM), our tokenizer (model/tokenizer.py) as the
processing class.

What differs, by TRL's design: one turn per episode (TRL runs no tool in this setup; our episodes run up to
rollout.max_turns turns with the calculator), and TRL tokenizes the rendered prompt text as a whole (our
rollout encodes message contents separately, so its prompt ids differ by a few tokens).

Reward: the arith outcome check, cheap and the same rule as `envs.arith.ArithEnv.answer`: 1.0 when the
completion's first `answer` tool call carries the task's value (within 1e-6), else 0.0.

Tokens per step: TRL's own count, `state.num_input_tokens_seen` after the step minus before it = prompt tokens
+ completion tokens (up to and including the stop token) of the step's completions. Seconds per step: the
time between consecutive `on_step_end` callbacks, the first step (start-up, first generation) excluded.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from typing import Any

import torch


def arith_prompts(cfg: Any, n_tasks: int) -> list[dict[str, Any]]:
    """Rows {"prompt": rendered text, "answer": float} of the first `n_tasks` train tasks of `cfg`."""
    import envs
    from model.tokenizer import load_tokenizer, render_chat
    from rl.rollout.tasks import task_stream

    tok = load_tokenizer()
    env = envs.make(cfg.env.id, **{**cfg.env.kwargs, "use_sandbox": False})
    stream = task_stream(cfg, "train")
    rows = []
    for i in range(n_tasks):
        task = stream.task(i)
        messages, _ = env.reset(seed=task.seed, options=task.reset_options())
        text = render_chat(tok, messages, env.tool_schemas(), add_generation_prompt=True)
        rows.append({"prompt": text, "answer": float(env.task.answer)})
    return rows


def answer_reward(completions: list[str], answer: list[float], **_: Any) -> list[float]:
    """1.0 when the completion's first `answer` call has the task's value, else 0.0 (envs/arith.py's rule)."""
    from envs.tool_call import ToolCall, parse_tool_calls

    out = []
    for text, want in zip(completions, answer, strict=True):
        calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall) and c.name == "answer"]
        value = calls[0].arguments.get("value") if calls else None
        ok = isinstance(value, (int, float)) and math.isclose(float(value), want, rel_tol=0, abs_tol=1e-6)
        out.append(1.0 if ok else 0.0)
    return out


def ascii_letters(text: str) -> float:
    """The share of ASCII letters in `text`: a reward with signal for a random-weight policy, so every group
    of a throughput run trains (our learner drops a group whose rewards tie, as DAPO does; TRL trains it)."""
    return sum(c.isascii() and c.isalpha() for c in text) / max(1, len(text))


def ascii_share(traj: Any) -> float:
    """`ascii_letters` of an episode's last assistant turn (our reward signature: `rewards=[{name:
    'bench.trl_grpo:ascii_share'}]`)."""
    from rewards.text import completion_text

    return ascii_letters(completion_text(traj))


def ascii_share_reward(completions: list[str], **_: Any) -> list[float]:
    """`ascii_letters` in TRL's reward signature."""
    return [ascii_letters(c) for c in completions]


def trl_tokens_per_s(cfg: Any, steps: int, threads: int, model_dir: str | None = None,
                     signal: bool = False, gradient_checkpointing: bool = False) -> dict[str, Any]:
    """Run `steps` GRPOTrainer steps on CPU with `threads` torch threads -> tokens/s over steps 2..steps and
    over the whole run (all steps' tokens / seconds from `trainer.train()` to the end of the last step).
    model_dir: an HF checkpoint to train (the same-model comparison); None = `llama_like` of cfg's preset.
    signal: add `ascii_share_reward` to the answer check (so a random policy's groups do not tie).
    gradient_checkpointing: TRL's `GRPOConfig` turns it on by default; off here unless asked, as our
    learner runs with learner.activation_checkpointing=false (the same recomputation on both sides)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.vs_llama import llama_like
    from model.config import OdysseyConfig
    from model.tokenizer import load_tokenizer, stop_token_ids

    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first step is excluded from the rate), got {steps}")
    ro, lc = cfg.rollout, cfg.learner
    if ro.episodes % lc.group_size:
        raise ValueError(f"rollout.episodes ({ro.episodes}) must be a multiple of group_size {lc.group_size}")
    tasks_per_step = ro.episodes // lc.group_size
    rows = arith_prompts(cfg, tasks_per_step * steps)
    tok = load_tokenizer()
    longest = max(len(tok(text=r["prompt"])["input_ids"]) for r in rows)
    model, active = llama_like(OdysseyConfig.from_preset(cfg.model.preset), longest + ro.max_new_tokens)
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.generation_config.eos_token_id = stop_token_ids(tok)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[tuple[float, int]] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            self.marks.append((time.perf_counter(), int(state.num_input_tokens_seen)))

    clock = StepClock()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            args = GRPOConfig(
                output_dir=out_dir,
                use_cpu=True,
                bf16=False,
                fp16=False,
                report_to="none",
                save_strategy="no",
                logging_steps=1,
                disable_tqdm=True,
                max_steps=steps,
                per_device_train_batch_size=ro.episodes,
                gradient_accumulation_steps=1,
                num_generations=lc.group_size,
                max_completion_length=ro.max_new_tokens,
                temperature=ro.temperature,
                top_p=ro.top_p,
                top_k=ro.top_k,
                shuffle_dataset=False,
                learning_rate=lc.lr,
                lr_scheduler_type="constant",
                warmup_steps=0,
                max_grad_norm=lc.grad_clip,
                beta=lc.kl_coef,
                epsilon=lc.clip_eps_low,
                epsilon_high=lc.clip_eps_high,
                num_iterations=1,
                seed=lc.seed,
                dataloader_num_workers=0,
                gradient_checkpointing=gradient_checkpointing,
            )
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=[answer_reward, ascii_share_reward] if signal else answer_reward,
                args=args,
                train_dataset=Dataset.from_list(rows),
                processing_class=tok,
                callbacks=[clock],
            )
            t0 = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - t0
            rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    finally:
        torch.set_num_threads(before)
    if len(clock.marks) != steps:
        raise RuntimeError(f"TRL ran {len(clock.marks)} steps, expected {steps}")
    (t_first, n_first), (t_last, n_last) = clock.marks[0], clock.marks[-1]
    per_step = [b[1] - a[1] for a, b in zip(clock.marks, clock.marks[1:])]
    return {
        "trainer": "trl.GRPOTrainer (HF generate, CPU, fp32)",
        "model": f"{type(model).__name__} ({model_dir or 'bench.vs_llama.llama_like'})",
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "odyssey_active_parameters": active,
        "torch_threads": threads,
        "steps": steps,
        "completions_per_step": ro.episodes,
        "num_generations": lc.group_size,
        "max_completion_length": ro.max_new_tokens,
        "seconds_per_step": (t_last - t_first) / (steps - 1),
        "tokens_per_step": statistics.mean(per_step),
        "tokens_per_s": (n_last - n_first) / (t_last - t_first),
        "tokens_per_s_whole_run": n_last / (t_last - t0),
        "first_step_tokens": n_first,
        "gradient_checkpointing": gradient_checkpointing,
        "mean_reward": statistics.mean(rewards) if rewards else None,
        "rewards": "answer check + ascii share" if signal else "answer check",
        "wall_s_with_startup": wall,
    }
