"""Time to reward against TRL: SmolLM2-135M-Instruct trained by our loop and by TRL's `GRPOTrainer`, both
scored by our held-out harness -> bench/results/trl_time_to_reward.json.

    .venv/bin/python bench/trl_time_to_reward.py [--steps 40] [--eval-every 10] [--eval-episodes 64]
                     [--order trl-first|odyssey-first] [--variant grpo_pretrained|grpo_pretrained_lora|...]
                     [--odyssey-run DIR] [--trl-threads N]
    .venv/bin/python bench/trl_time_to_reward.py --smoke      # TRL only: 2 steps, 4 eval episodes

The cell is bench/learning.py's `smollm2-arith` family, variant `grpo_pretrained` (full fine-tuning) or
`grpo_pretrained_lora` (LoRA rank 16, alpha 32 on every projection, lr 5e-4; `grpo_pretrained_lora_half_lr`
at 2.5e-4; on both sides: ours injects peft's LoRA layers, TRL gets the same `peft.LoraConfig` as
`peft_config`; TRL's policies are saved merged)
(configs/smollm2_arith_qa.yaml: dataset-qa on examples/arith_words/arith_words.jsonl, 64 rows held out,
math-verify, GRPO groups of 8, 32 episodes a step, 128 new tokens, T = 1). The results file holds the latest
race in full and every race's summary in "runs". With --order trl-first the TRL side runs in a child process
(this bench again with --trl-only --results OUT/trl_side.json), so its memory is gone before ours trains.

Ours: bench/learning.py's `run` trains the cell (`odyssey train`, Ray, async with the config's
max_staleness) and evaluates every --eval-every steps in training; `--odyssey-run DIR` records a finished run
of the same cell instead (learning.run's `adopt`: its config.yaml must be this cell's).

TRL: `trl.GRPOTrainer` (HF generate, fp32, CPU, one process with --trl-threads torch threads, default every
core it may run on) trains the same converted checkpoint (`model.hf_path`) on
  - the same prompts: the train tasks of `rl.rollout.tasks.task_stream(cfg, "train")` in stream order (task i
    of step k = our task k * tasks_per_step + i), rendered as our env renders them (the env's system
    instructions + the user question through the checkpoint's chat template, generation prompt), passed as
    plain text; TRL tokenizes that text, and the bench checks the ids equal our rollout's
    (`prompt_ids_equal`);
  - the same reward: the env's verifier (`DatasetQAEnv.verifier`, math-verify in a child process) on the
    completion text decoded as our agent loop decodes it (the final stop token dropped, special tokens kept);
  - the settings of the "fairness" dict in the results (group size, completions per step, sampling, lr and its
    warm-up, AdamW betas, clip range, grad clip, beta = kl_coef = 0, one optimizer step per generation batch:
    micro-batches of one group, gradient accumulation over the batch, TRL's "dapo" loss = our token_mean).
It saves the policy (`save_pretrained` of model + tokenizer) every --eval-every steps and at the end, with
the wall seconds since `on_train_begin`; after training, `rl.train.eval.evaluate_checkpoint` plays each saved
policy (and, as step 0, the converted checkpoint itself) on the same held-out tasks with the same sampling
seeds as our in-training evaluations.

Wall clock ("train_wall_s"): seconds since training started, evaluation excluded. TRL: minus the time spent
saving checkpoints. Ours: metrics.jsonl's wall_s minus the eval.jsonl wall_s of every evaluation up to that
step (the step-0 one included; during an evaluation, training episodes already in flight may keep
generating, so ours is a slight over-subtraction at most the evaluations' length).

Time to reward: target = TRL's held-out success (T = 1) at its last step; for each side, the first evaluated
step whose success >= target, and its train_wall_s. ratio_trl_over_ours = TRL's seconds / ours (> 1: we get
there sooner); None when ours never reaches it. Both train --steps by default; time to reward is wall
seconds, so `--odyssey-steps N` (and `--odyssey-eval-every M`) lets ours, the faster trainer per step, keep
training in the time TRL's steps take; "odyssey_success_by_trl_final_wall_s" is ours' last evaluated success
at or before TRL's last training second (the "ends no lower" check). `--trl-record RESULTS` reuses the TRL
side (curve included) of an earlier race of the same variant, seed, steps and eval interval, as measured
then (recorded as trl_adopted_from).

Tokens (both sides alike): prompt + completion tokens (stop token included) of a step's completions, counted
two ways: "all" (every group: what TRL trains, tied groups with zero advantage) and "trained" (groups whose
rewards are not all equal: what our learner trains; it drops all-tie groups). Ours: metrics `tokens` (all) and
`learner/tokens` + `learner/trained_trajectories` (trained: the learner's inputs are each sequence minus its
last token). TRL: from the reward calls (prompt ids + completion ids per completion); TRL's own
`num_input_tokens_seen` is checked against "all". Rates: tokens / train_wall_s over the whole run, and over
steps 2..N (tokens of steps 2..N / (t_N - t_1)).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import io
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "trl_time_to_reward.json"
SMOKE_RESULTS = RESULTS.with_name("trl_time_to_reward_smoke.json")  # --smoke writes here, never over a race
FAMILY, VARIANT = "smollm2-arith", "grpo_pretrained"
#: bench/learning.py variants of the cell the race can run on both sides (full fine-tuning, LoRA)
RACE_VARIANTS = ("grpo_pretrained", "grpo_pretrained_lora", "grpo_pretrained_lora_half_lr")
#: our learner.loss_agg -> TRL's loss_type with the same token weights (rl/learner/losses.py)
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}


# ---------------------------------------------- pure helpers (tests/test_bench_trl_time_to_reward.py)


def tied(rewards: list[float]) -> bool:
    """Whether a group's rewards are all equal (ours drops the group; TRL trains it, advantage 0)."""
    return max(rewards) == min(rewards)


def group_tokens(rewards: list[float], tokens: list[int], group_size: int) -> dict[str, int]:
    """{"all", "trained"} token counts of one step: completions in groups of `group_size` consecutive entries
    (TRL's order: each prompt's generations together); tokens[i] = prompt + completion tokens of completion i.
    "trained": only groups whose rewards are not all equal. Also the group counts."""
    if len(rewards) != len(tokens) or len(rewards) % group_size:
        raise ValueError(
            f"{len(rewards)} rewards / {len(tokens)} token counts: not whole groups of {group_size}"
        )
    out = {"all": 0, "trained": 0, "groups": 0, "tied_groups": 0}
    for g in range(0, len(rewards), group_size):
        n = sum(tokens[g : g + group_size])
        out["all"] += n
        out["groups"] += 1
        if tied(rewards[g : g + group_size]):
            out["tied_groups"] += 1
        else:
            out["trained"] += n
    return out


def first_reaching(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point of `curve` (ordered by step) with success >= target, or None."""
    for p in curve:
        if p["success"] is not None and p["success"] >= target:
            return p
    return None


def rates(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens per second from per-step records {"step", "train_wall_s", "tokens_all", "tokens_trained"}
    (train_wall_s: at the end of the step, since training started): over the whole run (sum / t_N) and over
    steps 2..N (tokens of steps 2..N / (t_N - t_1)); None where undefined."""
    if not steps:
        return {}
    steps = sorted(steps, key=lambda s: s["step"])
    t_n, t_1 = steps[-1]["train_wall_s"], steps[0]["train_wall_s"]
    out: dict[str, Any] = {}
    for kind in ("all", "trained"):
        total = sum(s[f"tokens_{kind}"] for s in steps)
        later = total - steps[0][f"tokens_{kind}"]
        out[f"tokens_{kind}"] = total
        out[f"tokens_{kind}_per_s"] = total / t_n if t_n > 0 else None
        out[f"tokens_{kind}_per_s_steps_2_to_n"] = (
            later / (t_n - t_1) if len(steps) > 1 and t_n > t_1 else None
        )
    return out


def eval_excluded_walls(metrics: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[int, float]:
    """Our run's {step: wall_s minus the wall_s of every evaluation at a step <= it} (the step-0 evaluation
    runs inside the timed loop before step 1; an evaluation at step k is inside step k's wall_s)."""
    out = {}
    for m in metrics:
        if "step" in m and "wall_s" in m:
            spent = sum(float(e.get("wall_s", 0.0)) for e in evals if e["step"] <= m["step"])
            out[int(m["step"])] = float(m["wall_s"]) - spent
    return out


# ---------------------------------------------------------------- config of the cell


def cell_config(
    steps: int, eval_every: int, eval_episodes: int | None, seed: int, extra: list[str],
    variant: str = VARIANT,
) -> Any:
    """The RunConfig of bench/learning.py's cell (FAMILY, variant, seed) as its `run` builds it, + extra."""
    from bench.learning import FAMILIES, VARIANTS
    from rl.config import load_config

    fam = FAMILIES[FAMILY]
    base = load_config(str(ROOT / fam.config), [])
    n = eval_episodes if eval_episodes is not None else base.orchestrator.eval_episodes
    return load_config(str(ROOT / fam.config), [
        f"learner.steps={steps}", f"rollout.seed={seed}", f"orchestrator.eval_every={eval_every or steps}",
        f"orchestrator.eval_episodes={n}", "orchestrator.checkpoint_every=0",
        *VARIANTS[variant], *fam.overrides, *extra,
    ])  # fmt: skip


def check_mappable(cfg: Any) -> None:
    """ValueError naming each learner setting TRL's GRPOTrainer cannot be given the same value of."""
    lc = cfg.learner
    problems = [
        f"learner.{k} is {getattr(lc, k)!r}, TRL's GRPOTrainer here runs {want!r}"
        for k, want in (("advantage", "grpo"), ("policy_loss", "ppo_clip"), ("ppo_epochs", 1),
                        ("num_minibatches", 1), ("entropy_coef", 0.0), ("negative_advantage_weight", 1.0),
                        ("turn_credit", False), ("num_ranks", 1))
        if getattr(lc, k) != want
    ]  # fmt: skip
    if lc.loss_agg not in LOSS_TYPES:
        problems.append(
            f"learner.loss_agg {lc.loss_agg!r} has no TRL loss_type with the same weights "
            f"(mappable: {', '.join(LOSS_TYPES)})"
        )
    if lc.lora is not None and not cfg.model.hf_path:
        problems.append("learner.lora on Odyssey's own model: TRL's side needs a Hugging Face checkpoint")
    if cfg.rollout.max_turns != 1:
        problems.append(f"rollout.max_turns is {cfg.rollout.max_turns}: TRL plays one turn per completion")
    if cfg.rollout.episodes % lc.group_size:
        problems.append(
            f"rollout.episodes ({cfg.rollout.episodes}) is not a multiple of group_size {lc.group_size}"
        )
    if problems:
        raise ValueError("this config cannot be run the same way by TRL:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------- TRL side


def qa_prompts(cfg: Any, tok: Any, n_tasks: int) -> tuple[list[dict[str, Any]], int]:
    """Rows {"prompt": rendered text, "task_index", "answer", "columns", "prompt_tokens", "task"} of the first
    `n_tasks` train tasks of `cfg`, rendered as our rollout renders them, and how many of them TRL's
    tokenization of the text (`tok(text=...)`) gives exactly our rollout's prompt ids."""
    import envs
    from model.tokenizer import render_chat
    from rl.rollout.agent_loop import ChatCodec
    from rl.rollout.tasks import task_stream

    codec = ChatCodec(tok)
    env = envs.make(cfg.env.id, **{**cfg.env.kwargs, "max_turns": cfg.rollout.max_turns})
    stream = task_stream(cfg, "train")
    rows, equal = [], 0
    for i in range(n_tasks):
        task = stream.task(i)
        messages, _ = env.reset(seed=task.seed, options=task.reset_options())
        tools = env.tool_schemas()
        text = render_chat(tok, messages, tools, add_generation_prompt=True)
        ours = codec.render_prompt(messages, tools)
        theirs = tok(text=text)["input_ids"]
        equal += ours == list(theirs)
        rows.append({"prompt": text, "task_index": i, "answer": env.task.answer, "columns": env.task.columns,
                     "prompt_tokens": len(theirs), "task": task.key})  # fmt: skip
    env.close()
    return rows, equal


class VerifierReward:
    """TRL reward function: the env's verifier score of each completion (our `outcome`), logging per call
    the rewards and the prompt + completion token counts of the generation batch."""

    __name__ = "outcome"

    def __init__(self, cfg: Any, rows: list[dict[str, Any]], stop_ids: list[int], tok: Any) -> None:
        import envs

        self.env = envs.make(cfg.env.id, **{**cfg.env.kwargs, "max_turns": 1})
        self.rows, self.stop_ids, self.tok = rows, set(stop_ids), tok
        self.loop = asyncio.new_event_loop()
        self.calls: list[dict[str, Any]] = []

    def text(self, ids: list[int]) -> str:
        """Our agent loop's turn text: the final stop token dropped, special tokens kept."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        task_index: list[int],
        trainer_state: Any = None,
        **_: Any,
    ) -> list[float]:
        rows = [self.rows[int(i)] for i in task_index]
        texts = [self.text(ids) for ids in completion_ids]
        verify = self.env.verifier.averify

        async def score() -> list[Any]:
            return await asyncio.gather(*(verify(t, r["answer"], r["columns"]) for t, r in zip(texts, rows)))

        rewards = [float(r.score) for r in self.loop.run_until_complete(score())]
        self.calls.append({
            "step": int(trainer_state.global_step) + 1 if trainer_state is not None else len(self.calls) + 1,
            "task_index": [int(i) for i in task_index], "rewards": rewards,
            "tokens": [r["prompt_tokens"] + len(c) for r, c in zip(rows, completion_ids)],
            "completion_tokens": [len(c) for c in completion_ids],
        })  # fmt: skip
        return rewards

    def close(self) -> None:
        self.env.close()
        self.loop.close()


def peft_config(lora: Any) -> Any:
    """peft.LoraConfig for TRL's `GRPOTrainer(peft_config=...)` with `learner.lora`'s rank, alpha, target
    modules and dropout (ours injects peft's LoRA layers with the same settings, rl/learner/lora.py), or None
    (full fine-tuning) when `lora` is None."""
    from rl.learner.lora import peft_lora_config

    return None if lora is None else peft_lora_config(lora, task_type="CAUSAL_LM")


def save_policy(model: Any, tok: Any, out_dir: Path) -> None:
    """`save_pretrained` of a TRL policy and its tokenizer into `out_dir` as a plain checkpoint: a peft
    model is merged first (W + (alpha / rank) B A, on a copy: training goes on with the adapters), so the
    evaluation loads it like any other."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def trl_config(cfg: Any, out_dir: str, steps: int, micro_batch: int) -> Any:
    """GRPOConfig with every setting of `cfg` TRL has (module docstring); micro-batches of `micro_batch`
    completions, accumulated over the generation batch of rollout.episodes completions: one optimizer step
    per batch (TRL's "dapo" normaliser is the whole generation batch's token count, so the micro-batch size
    changes memory, not the loss)."""
    from trl import GRPOConfig

    from rl.learner.optim import SCHEDULES

    ro, lc = cfg.rollout, cfg.learner
    if micro_batch < 1 or ro.episodes % micro_batch:
        raise ValueError(f"the TRL micro-batch ({micro_batch}) must divide rollout.episodes ({ro.episodes})")
    accumulate = ro.episodes // micro_batch
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=steps, seed=ro.seed, data_seed=ro.seed,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulate,
        steps_per_generation=accumulate, num_generations=lc.group_size, num_iterations=lc.ppo_epochs,
        max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        shuffle_dataset=False, learning_rate=lc.lr, lr_scheduler_type=SCHEDULES[lc.lr_schedule],
        warmup_steps=lc.warmup_steps, weight_decay=lc.weight_decay, adam_beta1=lc.betas[0],
        adam_beta2=lc.betas[1], max_grad_norm=lc.grad_clip, beta=lc.kl_coef, epsilon=lc.clip_eps_low,
        epsilon_high=lc.clip_eps_high, scale_rewards=lc.scale_rewards, loss_type=LOSS_TYPES[lc.loss_agg],
        mask_truncated_completions=lc.overlong_filter, gradient_checkpointing=False,
        dataloader_num_workers=0,
    )  # fmt: skip


def train_trl(
    cfg: Any, steps: int, eval_every: int, threads: int, out: Path, micro_batch: int | None = None
) -> dict[str, Any]:
    """Run TRL on the cell (module docstring); policies saved under out/step-NNNNNN -> record with
    "checkpoints" [{step, dir, wall_s, train_wall_s, save_s}] and "steps" (per-step tokens and times)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from model.tokenizer import policy_tokenizer, stop_token_ids
    from rl.policy import PolicySpec

    check_mappable(cfg)
    ro, lc = cfg.rollout, cfg.learner
    model_dir = PolicySpec.from_config(cfg).checkpoint
    tok = copy.deepcopy(policy_tokenizer(model_dir))  # ours is cached: TRL may set padding on it
    tasks_per_step = ro.episodes // lc.group_size
    micro = micro_batch or lc.group_size
    rows, equal = qa_prompts(cfg, tok, tasks_per_step * steps)
    reward = VerifierReward(cfg, rows, stop_token_ids(tok), tok)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.generation_config.eos_token_id = stop_token_ids(tok)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.saving = 0.0  # seconds spent saving so far
            self.marks: list[dict[str, Any]] = []
            self.checkpoints: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            wall = time.perf_counter() - self.t0
            step = int(state.global_step)
            self.marks.append({"step": step, "wall_s": wall, "train_wall_s": wall - self.saving,
                               "num_input_tokens_seen": int(state.num_input_tokens_seen)})  # fmt: skip
            if step % eval_every == 0 or step == steps:
                t1 = time.perf_counter()
                d = out / f"step-{step:06d}"
                save_policy(kwargs["model"], tok, d)
                save_s = time.perf_counter() - t1
                self.checkpoints.append({"step": step, "dir": str(d), "wall_s": wall,
                                         "train_wall_s": wall - self.saving, "save_s": save_s})  # fmt: skip
                self.saving += save_s

    clock = Clock()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=trl_config(cfg, str(out / "trainer"), steps, micro),
            train_dataset=Dataset.from_list(
                [{"prompt": r["prompt"], "task_index": r["task_index"]} for r in rows]
            ),
            processing_class=tok,
            callbacks=[clock],
            peft_config=peft_config(lc.lora),
        )
        trainer.train()
        log = [h for h in trainer.state.log_history if "loss" in h]
    finally:
        torch.set_num_threads(before)
        reward.close()
    check_one_batch_per_step(len(clock.marks), len(reward.calls), steps)
    per_step, seen = [], 0
    for mark, call in zip(clock.marks, reward.calls):
        want = [
            r["task_index"] for r in rows[(mark["step"] - 1) * tasks_per_step : mark["step"] * tasks_per_step]
        ]
        got = call["task_index"][:: lc.group_size]
        if got != want or any(len(set(call["task_index"][g : g + lc.group_size])) != 1
                               for g in range(0, ro.episodes, lc.group_size)):  # fmt: skip
            raise RuntimeError(
                f"TRL's step {mark['step']} played tasks {call['task_index']}, expected groups of "
                f"{lc.group_size} of {want} (our stream's order)"
            )
        counts = group_tokens(call["rewards"], call["tokens"], lc.group_size)
        per_step.append({
            "step": mark["step"], "wall_s": mark["wall_s"], "train_wall_s": mark["train_wall_s"],
            "tokens_all": counts["all"], "tokens_trained": counts["trained"], "groups": counts["groups"],
            "tied_groups": counts["tied_groups"], "reward_mean": statistics.mean(call["rewards"]),
            "completion_tokens_mean": statistics.mean(call["completion_tokens"]),
            "trl_num_input_tokens_seen": mark["num_input_tokens_seen"] - seen,
        })  # fmt: skip
        seen = mark["num_input_tokens_seen"]
    del trainer, model
    gc.collect()
    return {
        "trainer": "trl.GRPOTrainer (HF generate, CPU, fp32)",
        "model_dir": model_dir,
        "torch_threads": threads,
        "micro_batch": micro,
        "gradient_accumulation_steps": ro.episodes // micro,
        "prompts": len(rows),
        "prompt_ids_equal": equal,
        "checkpoints": clock.checkpoints,
        "steps": per_step,
        "loss_log": [
            {k: h.get(k) for k in ("step", "loss", "reward", "grad_norm", "learning_rate")} for h in log
        ],
        "tokens_counted_match_trl": all(s["tokens_all"] == s["trl_num_input_tokens_seen"] for s in per_step),
    }


def evaluate_trl(cfg: Any, trl: dict[str, Any], episodes: int, keep: bool) -> list[dict[str, Any]]:
    """Held-out evaluation of the converted checkpoint (step 0) and every TRL checkpoint with our harness ->
    the curve [{step, success, greedy, pass@k, wall_s, train_wall_s, eval_s}]."""
    from rich.console import Console

    from rl.train.eval import evaluate_checkpoint

    k = cfg.orchestrator.eval_pass_k
    points = [{"step": 0, "dir": trl["model_dir"], "wall_s": 0.0, "train_wall_s": 0.0}, *trl["checkpoints"]]
    curve = []
    for p in points:
        t0 = time.perf_counter()
        m = evaluate_checkpoint(cfg, p["dir"], episodes, Console(file=io.StringIO()))
        curve.append({"step": p["step"], "success": m["success"], "greedy": m["greedy"],
                      f"pass@{k}": m[f"pass@{k}"], "episodes": m["episodes"],
                      "infra_errors": m["infra_errors"],
                      "wall_s": p["wall_s"], "train_wall_s": p["train_wall_s"],
                      "eval_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(
            f"  TRL step {p['step']}: held-out success {m['success']:.3f} (greedy {m['greedy']:.3f})",
            flush=True,
        )
        if p["step"] > 0 and not keep:
            shutil.rmtree(p["dir"], ignore_errors=True)
    return curve


# ---------------------------------------------------------------- our side


def adopted_trl(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """--trl-record: a TRL record (trl_record.json, evaluated afterwards from its kept checkpoints) or a
    results file of an earlier race of the same variant and seed, whose TRL side (curve included) is reused
    as it was measured."""
    data = json.loads(path.read_text())
    if "trl" not in data:
        return data
    cell = data["cell"]
    want = {"variant": args.variant, "seed": args.seed, "steps": args.steps, "eval_every": args.eval_every}
    got = {k: cell.get(k) for k in want}
    if got != want or data.get("smoke") or "curve" not in data["trl"]:
        raise SystemExit(f"--trl-record {path}: a race of {got} (smoke {data.get('smoke')}), not this cell "
                         f"{want}; give a results file of the same cell, or a trl_record.json")
    return {**data["trl"], "adopted_from": f"{path} (race finished {data.get('finished_utc')})"}


def ours_overrides(args: argparse.Namespace) -> list[str]:
    """Config overrides ours runs the cell with: --normaliser trl (the default) counts the all-equal groups
    ours drops in the loss normaliser, as TRL's dapo loss counts the zero-advantage groups it trains."""
    return ["learner.equal_groups_in_normaliser=true"] if args.normaliser == "trl" else []


def odyssey_side(cfg: Any, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train (or adopt, --odyssey-run) bench/learning.py's cell, and read its run dir (`read_run`)."""
    from bench.learning import run
    from rl.placement import torch_threads

    rec = run(FAMILY, args.variant, args.seed, args.odyssey_steps, cfg.orchestrator.eval_episodes, out,
              args.odyssey_eval_every, adopt=args.odyssey_run, extra=ours_overrides(args))  # fmt: skip
    run_dir = args.odyssey_run or out / FAMILY / f"{args.variant}_seed{args.seed}"
    o = cfg.orchestrator
    return {
        "trainer": "odyssey train (Ray, async, TorchEngine rollout workers + learner actor)",
        "run_dir": str(run_dir),
        "adopted": args.odyssey_run is not None,
        "torch_threads": {
            "per_rollout_worker": torch_threads(o.rollout_resources),
            "rollout_workers": cfg.rollout.num_workers,
            "learner": torch_threads(o.learner_resources),
        },  # fmt: skip
        "max_staleness": o.max_staleness,
        "wall_s_with_startup": rec["wall_s"],
        **read_run(Path(run_dir), cfg.orchestrator.eval_pass_k),
    }


def read_run(run_dir: Path, k: int) -> dict[str, Any]:
    """A run dir's held-out curve (eval.jsonl) and per-step tokens (metrics.jsonl), with eval-excluded wall
    seconds -> {"curve", "steps"}; k = orchestrator.eval_pass_k."""
    evals = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = eval_excluded_walls(metrics, evals)
    raw = {int(m["step"]): float(m["wall_s"]) for m in metrics if "step" in m and "wall_s" in m}
    curve = [{"step": e["step"], "success": e["success"], "greedy": e["greedy"],
              f"pass@{k}": e.get(f"pass@{k}"),
              "episodes": e["episodes"], "infra_errors": e["infra_errors"], "wall_s": raw.get(e["step"], 0.0),
              "train_wall_s": walls.get(e["step"], 0.0), "eval_s": e.get("wall_s")}
             for e in evals]  # fmt: skip
    steps = [{
        "step": int(m["step"]), "wall_s": float(m["wall_s"]), "train_wall_s": walls[int(m["step"])],
        "tokens_all": int(m["tokens"]),
        "tokens_trained": int(m.get("learner/tokens", 0) + m.get("learner/trained_trajectories", 0)),
        "groups": int(m.get("groups", 0)), "tied_groups": int(m.get("learner/equal_groups", 0)),
        "reward_mean": m.get("reward/total"), "staleness_mean": m.get("staleness/mean"),
    } for m in metrics if "step" in m and "tokens" in m]  # fmt: skip
    return {"curve": curve, "steps": steps}


# ---------------------------------------------------------------- report


def check_one_batch_per_step(optimizer_steps: int, generation_batches: int, steps: int) -> None:
    """RuntimeError unless TRL ran `steps` optimizer steps and as many generation batches (one each)."""
    if optimizer_steps != steps or generation_batches != steps:
        raise RuntimeError(
            f"TRL ran {optimizer_steps} optimizer steps and {generation_batches} generation "
            f"batches, expected {steps} of each (one optimizer step per generation batch)"
        )


def machine_record(load0: list[float], t_all: float) -> dict[str, Any]:
    """The machine a TRL bench ran on: platform, CPUs, load average at start (`load0`) and now, seconds since
    `t_all` (perf_counter), this process's peak RSS."""
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_start": load0,
        "load_average_at_end": list(os.getloadavg()),
        "bench_wall_s": round(time.perf_counter() - t_all, 1),
        "peak_rss_gib_this_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def learner_fairness(lc: Any) -> dict[str, Any]:
    """The learner settings held equal in both TRL benches (ours: `learner.*`; TRL: GRPOConfig field)."""
    return {
        "lr = learning_rate": lc.lr,
        "lr_schedule / warmup_steps": [
            lc.lr_schedule,
            lc.warmup_steps,
            "transformers.get_scheduler stepped once per optimizer step on both (linear warm-up from 0)",
        ],
        "betas = adam_beta1/2": lc.betas,
        "weight_decay": lc.weight_decay,
        "clip_eps_low/high = epsilon/epsilon_high": [lc.clip_eps_low, lc.clip_eps_high],
        "grad_clip = max_grad_norm": lc.grad_clip,
        "kl_coef = beta": lc.kl_coef,
        "scale_rewards": lc.scale_rewards,
        "loss_agg -> loss_type": [lc.loss_agg, LOSS_TYPES[lc.loss_agg]],
        "equal_groups_in_normaliser (ours; TRL's normaliser counts every group it trains)":
            lc.equal_groups_in_normaliser,
        "ppo_epochs = num_iterations": lc.ppo_epochs,
        "optimizer steps per generation batch": 1,
        "overlong_filter = mask_truncated_completions": lc.overlong_filter,
        "learner.seed (ours: model init, LoRA's A)": lc.seed,
        "lora (rank, alpha, target_modules, dropout)": None if lc.lora is None else [
            lc.lora.rank, lc.lora.alpha, list(lc.lora.target_modules), lc.lora.dropout,
            "peft LoRA layers on both (ours: injected into the trunk, rl/learner/lora.py; TRL: peft_config); "
            "the same init law (A Kaiming, B zero), different random draws"],
        "gradient_checkpointing": "off on both (our learner has no activation checkpointing on: "
        f"learner.activation_checkpointing={lc.activation_checkpointing}; TRL gradient_checkpointing=False)",
    }


def fairness(cfg: Any, trl_threads: int) -> dict[str, Any]:
    """Every setting held equal (ours: config key; TRL: GRPOConfig field)."""
    ro, lc = cfg.rollout, cfg.learner
    return {
        "model": f"{cfg.model.hf_path} (model.hf_path, fp32) = the TRL model dir, same weights",
        "prompts": "task_stream(cfg, 'train') in order, env system instructions + question, checkpoint chat "
        "template, generation prompt (prompt ids checked equal: trl.prompt_ids_equal)",
        "reward": f"env verifier {cfg.env.kwargs.get('verifier')} on the turn text (stop token dropped)",
        "held_out_eval": "rl.train.eval samples + summarize: same tasks, same sampling seeds, T = "
        f"{ro.temperature} and greedy, eval_pass_k {cfg.orchestrator.eval_pass_k}",
        "group_size = num_generations": lc.group_size,
        "episodes = generation batch": ro.episodes,
        "max_new_tokens = max_completion_length": ro.max_new_tokens,
        "temperature / top_p / top_k": [ro.temperature, ro.top_p, ro.top_k],
        "rollout.seed = GRPOConfig.seed (--seed: ours' task and sampling seeds, TRL's torch seed)": ro.seed,
        **learner_fairness(lc),
        "torch_threads": f"TRL {trl_threads} in one process; ours 1 per rollout worker and per learner (see "
        "odyssey.torch_threads)",
        "device / dtype": "CPU, fp32 on both",
    }


DIFFERENCES = [
    "ours is async (episodes may lag the learner by orchestrator.max_staleness versions); TRL is on-policy "
    "and sequential",
    "ours drops all-tie groups from the batch; TRL trains them at advantage 0 (policy term 0; with beta 0 "
    "and no entropy bonus nothing else): the same loss when ours counts their tokens in its token mean "
    "(cell.normaliser 'trl', learner.equal_groups_in_normaliser); with 'dapo' ours' normaliser is the kept "
    "groups' tokens only, a larger gradient on steps with many ties",
    "ours applies a truncated IS correction between rollout and learner log-probs (learner.tis_cap); TRL's "
    "HF generate path has none (old log-probs = current ones)",
    "ours generates with TorchEngine in separate worker processes; TRL with HF generate in the trainer "
    "process",
    "ours' wall clock: evaluations subtracted (their wall_s in eval.jsonl), approximately (module docstring)",
]


def side_summary(curve: list[dict[str, Any]], steps: list[dict[str, Any]], target: float | None) -> dict:
    hit = first_reaching(curve, target) if target is not None else None
    return {
        "final_success": curve[-1]["success"] if curve else None,
        "first_reaching_target": hit and {"step": hit["step"], "train_wall_s": hit["train_wall_s"]},
        "train_wall_s": steps[-1]["train_wall_s"] if steps else None,
        "tied_groups": sum(s["tied_groups"] for s in steps),
        "groups": sum(s["groups"] for s in steps),
        **rates(steps),
    }


def train_trl_in_child(script: Path, argv: list[str], results: Path) -> dict[str, Any]:
    """The bench `script` with `argv` (this command's arguments) + `--trl-only --results RESULTS` in a child
    process -> its TRL record; the child's results file stays at `results`. For a TRL side run before ours
    (--order trl-first): run in the bench process, TRL left about 5 GB resident (Python and glibc keep freed
    memory), and Ray's OOM monitor then killed ours' learner on a 24 GB machine (2026-12-07, tools race)."""
    import subprocess

    results.unlink(missing_ok=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(script).resolve()), *argv, "--trl-only", "--results", str(results)]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0 or not results.is_file():
        raise RuntimeError(f"the TRL side failed (exit {done.returncode}): {' '.join(cmd)}")
    return json.loads(results.read_text())["trl"]


def run_record(result: dict[str, Any]) -> dict[str, Any]:
    """One race's cell, order, summary and machine record: what `runs` keeps of every race."""
    keys = ("cell", "order", "smoke", "finished_utc", "summary", "machine", "notes_added_after_run")
    return {k: result[k] for k in keys if k in result}


def earlier_runs(path: Path) -> list[dict[str, Any]]:
    """The `runs` of the results file at `path` (its top-level race for a file written before `runs`
    existed); smoke races are not kept. The file's full record is of the latest race only."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    runs = old.get("runs") or [run_record(old)]
    return [r for r in runs if not r.get("smoke")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, default sys.argv[1:]) -> its arguments, --smoke's settings applied."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-episodes", type=int, default=None, help="default: the config's eval_episodes")
    ap.add_argument(
        "--seed", type=int, default=0, help="rollout.seed (task stream, sampling, held-out tasks)"
    )
    ap.add_argument("--order", choices=("trl-first", "odyssey-first"), default="trl-first")
    ap.add_argument(
        "--variant",
        choices=RACE_VARIANTS,
        default=VARIANT,
        help="bench/learning.py's variant of the cell: full fine-tuning, or LoRA on both sides",
    )
    ap.add_argument(
        "--odyssey-steps",
        type=int,
        default=None,
        help="steps ours trains (default --steps): time to reward is wall seconds, so the faster trainer may "
        "take more steps in the time TRL's --steps take",
    )
    ap.add_argument(
        "--odyssey-eval-every", type=int, default=None, help="our evaluation interval (default --eval-every)"
    )
    ap.add_argument("--odyssey-run", type=Path, help="a finished run of the cell (eval.jsonl, metrics.jsonl)")
    ap.add_argument(
        "--normaliser",
        choices=("trl", "dapo"),
        default="trl",
        help="ours' token-mean normaliser: trl = every group's tokens, the all-equal groups ours drops "
        "included, as TRL's dapo loss counts them (learner.equal_groups_in_normaliser); dapo = the trained "
        "groups' only (ours' default; every race before 2026-12-07 07:00 UTC)",
    )
    ap.add_argument("--trl-only", action="store_true", help="run the TRL side only")
    ap.add_argument(
        "--trl-record",
        type=Path,
        help="OUT/trl_VARIANT_seedS/trl_record.json of a finished TRL training of the same cell: evaluate it "
        "instead of training again (written before every evaluation)",
    )
    ap.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="default: every core this process may run on (ours spreads its rollout workers and learner "
        "over them)",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the TRL side (needs --trl-only: ours runs the cell as is)",
    )
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="completions per TRL forward/backward (default group_size; smaller: less memory, same loss)",
    )
    ap.add_argument(
        "--keep-checkpoints", action="store_true", help="keep TRL's saved policies after evaluation"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="TRL only, 2 steps, eval every 2, 4 eval episodes, 1 eval worker, TRL micro-batch 2; the "
        "results go to bench/results/trl_time_to_reward_smoke.json (smoke: true)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_trl_ttr")
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help=f"results file (default {RESULTS.relative_to(ROOT)}; --smoke: {SMOKE_RESULTS.name} beside it)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_every, args.eval_episodes, args.trl_only = 2, 2, args.eval_episodes or 4, True
        args.override = ["rollout.num_workers=1", *args.override]
        args.trl_micro_batch = args.trl_micro_batch or 2  # this shared machine's 4 GB budget
    if args.override and not args.trl_only:
        ap.error(
            "--override changes the TRL side only: give --trl-only too (or change the cell in "
            "bench/learning.py)"
        )
    args.odyssey_steps = args.odyssey_steps or args.steps
    args.odyssey_eval_every = args.odyssey_eval_every or args.eval_every
    if args.steps < 2 or args.eval_every < 1:
        ap.error("--steps must be >= 2 and --eval-every >= 1")
    args.results = args.results or (SMOKE_RESULTS if args.smoke else RESULTS)
    return args


def main() -> int:
    args = parse_args()
    cfg = cell_config(args.steps, args.eval_every, args.eval_episodes, args.seed,
                      [*ours_overrides(args), *args.override], args.variant)
    check_mappable(cfg)
    threads = args.trl_threads or len(os.sched_getaffinity(0))
    load0 = list(os.getloadavg())
    t_all = time.perf_counter()
    trl = ours = None
    order = ["trl", "odyssey"] if args.order == "trl-first" else ["odyssey", "trl"]
    for side in order:
        if side == "trl":
            trl_dir = args.out / f"trl_{args.variant}_seed{args.seed}"
            if args.trl_record:  # a finished TRL training of this cell (its checkpoints kept beside it)
                trl = adopted_trl(args.trl_record, args)
                print(f"TRL: reusing the training recorded in {args.trl_record}", flush=True)
            elif side != order[-1] and not args.trl_only:  # ours follows: TRL's memory gone by then
                print(f"TRL: {args.steps} steps on {threads} torch thread(s), in a child process", flush=True)
                trl = train_trl_in_child(Path(__file__), sys.argv[1:], args.out / "trl_side.json")
            else:
                print(f"TRL: {args.steps} steps on {threads} torch thread(s)", flush=True)
                trl = train_trl(cfg, args.steps, args.eval_every, threads, trl_dir, args.trl_micro_batch)
                # on disk before the evaluation, so an evaluation failure loses no training (--trl-record)
                (trl_dir / "trl_record.json").write_text(json.dumps(trl, indent=2, default=str) + "\n")
            if "curve" not in trl:
                trl["curve"] = evaluate_trl(cfg, trl, cfg.orchestrator.eval_episodes, args.keep_checkpoints)
        elif not args.trl_only:
            print(
                f"ours: {'adopting ' + str(args.odyssey_run) if args.odyssey_run else 'training'}", flush=True
            )
            ours = odyssey_side(cfg, args, args.out)
    assert trl is not None
    target = trl["curve"][-1]["success"]
    summary = {
        "target_success (TRL's final held-out success)": target,
        # not above TRL's step-0 success: both sides "reach" it at step 0 and the time ratio is undefined
        "target_above_start": target > trl["curve"][0]["success"],
        "trl": side_summary(trl["curve"], trl["steps"], target),
    }
    if ours is not None:
        summary["odyssey"] = side_summary(ours["curve"], ours["steps"], target)
        # "ends no lower": ours' last evaluation at or before TRL's last training second
        by_then = [p for p in ours["curve"] if p["train_wall_s"] <= trl["curve"][-1]["train_wall_s"]]
        summary["odyssey_success_by_trl_final_wall_s"] = by_then[-1]["success"] if by_then else None
        t_trl, t_ours = (summary[s]["first_reaching_target"] for s in ("trl", "odyssey"))
        summary["time_to_reward_ratio_trl_over_ours"] = (
            t_trl["train_wall_s"] / t_ours["train_wall_s"] if t_trl and t_ours and t_ours["train_wall_s"] > 0
            else None)  # fmt: skip
        for kind in ("all", "trained"):
            for span in ("", "_steps_2_to_n"):
                key = f"tokens_{kind}_per_s{span}"
                a, b = summary["odyssey"].get(key), summary["trl"].get(key)
                summary[f"ratio_ours_over_trl_{key}"] = a / b if a and b else None
    result = {
        "bench": "trl_time_to_reward",
        "smoke": bool(args.smoke),
        "cell": {
            "family": FAMILY,
            "variant": args.variant,
            "seed": args.seed,
            "steps": args.steps,
            "eval_every": args.eval_every,
            "odyssey_steps": args.odyssey_steps,
            "odyssey_eval_every": args.odyssey_eval_every,
            "normaliser": args.normaliser,
            "trl_adopted_from": trl.get("adopted_from"),
            "eval_episodes": cfg.orchestrator.eval_episodes,
            "trl_overrides": args.override,
        },  # fmt: skip
        "order": order if not args.trl_only else ["trl"],
        "summary": summary,
        "fairness": fairness(cfg, threads),
        "differences": DIFFERENCES,
        "trl": trl,
        "odyssey": ours,
        "machine": machine_record(load0, t_all),
    }
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = args.results
    result["runs"] = [*earlier_runs(path), run_record(result)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"TRL final held-out success {target:.3f} at {trl['steps'][-1]['train_wall_s']:.0f} s")
    if ours is not None:
        o = summary["odyssey"]
        hit = o["first_reaching_target"]
        print(
            f"ours final {o['final_success']:.3f}; reaches {target:.3f} "
            + (f"at step {hit['step']}, {hit['train_wall_s']:.0f} s" if hit else "never")
        )
        print(f"time-to-reward ratio TRL/ours: {summary['time_to_reward_ratio_trl_over_ours']}")
        for key in ("tokens_all_per_s", "tokens_trained_per_s", "tokens_trained_per_s_steps_2_to_n"):
            print(f"tokens/s ours/TRL ({key}): {summary['ratio_ours_over_trl_' + key]}")
    for r in result["runs"]:
        c, sm = r["cell"], r["summary"]
        print(f"race {c['variant']} seed {c['seed']} {'-then-'.join(r['order'])}: time-to-reward TRL/ours "
              f"{sm.get('time_to_reward_ratio_trl_over_ours')}, tokens_all/s ours/TRL "
              f"{sm.get('ratio_ours_over_trl_tokens_all_per_s')}")
    print(f"wrote {path}" + (" (smoke run)" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
