"""SFT warm-up: teach a fresh policy the agent format from an env's scripted oracle before RL.

    odyssey warmup configs/tiny.yaml --out runs/tiny/warmup            # ~1 min on CPU (tiny preset)
    odyssey rollout configs/tiny.yaml --episodes 32 model.init_from=runs/tiny/warmup

A freshly initialised policy never emits a well-formed tool call, so GRPO sees no reward signal. The
warm-up imitates `env.oracle_actions()` on token-faithful transcripts, the exact token sequences the
agent loop (rl/rollout/agent_loop.py) produces when the policy plays those actions:

    ids  = encode_chat(reset messages, tools=env.tool_schemas(), generation prompt)   mask 0
    per oracle action a:
        ids += encode(a) + [END_OF_TURN]                                              mask 1
        obs  = env.step(a)                        (the real env, really stepped)
        ids += encode_continuation(obs, generation prompt)                            mask 0

Images (a vision env such as vision-arith): the codec has the model's vision settings (`vision_codec`), each
transcript keeps (offset of <|image_start|>, pixels) per image of its prompt and observations, and the
packed batch feeds them to the forward as `ImagePatches` (the shared prefix ends before the first image).

The env is built as a rollout worker builds it (`tools_in_prompt=False`, `max_turns=rollout.max_turns`),
except that an env whose constructor takes `use_sandbox` runs its tools in-process (`use_sandbox=False`):
arith's calculator prints the same text either way, so the transcripts equal a sandboxed rollout's and
the warm-up needs no Docker. By the chat-format invariant (model/tokenizer.py) the transcript equals
rendering the whole conversation at once; tests/test_warmup.py checks it against `run_episode`.

Loss (mean over the B transcripts' assistant tokens, next-token prediction within each transcript):

    L = - sum_{t : m[t+1] = 1} log p(x[t+1] | x[<=t]) / sum_t m[t+1]

Batches are packed without padding (input_ids [T] + cu_seqlens int32 [B+1]). Every transcript of an env
starts with the same system prompt and tool schemas (~330 of the ~420 tokens of an arith transcript),
so that shared prefix is run once per step without gradients and its cache row is duplicated for the
B suffixes (`OdysseyCache.select`): the logits are the same as a full forward (the model's cache
contract), the gradient just does not flow into the prefix's own activations. The LM head runs only
at the scored positions, so no [T, vocab] tensor is built. AdamW; the learning rate (config `warmup.lr`)
follows transformers' `get_cosine_with_min_lr_schedule_with_warmup_lr_rate`: linear warm-up over
`warmup.warmup_steps`, then cosine decay to `warmup.lr_min_ratio * lr` at the last step.

The checkpoint (save_pretrained, fp32) gets `warmup.json` with the recipe (config sections the warm-up
reads + its hyper-parameters): re-running with the same recipe is a no-op, a different one retrains.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import inspect
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rl.config import WarmupSection
from rl.rollout.agent_loop import ChatCodec, run_episode

RECIPE_FILE = "warmup.json"
RECIPE_VERSION = 2  # 2: the learning-rate schedule is transformers' (the cosine starts one step later)
#: episode seeds of the warm-up data start here, far from rollout seeds (rollout.seed * 1_000_003 + i)
DATA_SEED_BASE = 1 << 40
_DEFAULTS = WarmupSection.model_fields  # the config's `warmup:` defaults are the only ones


@dataclass(frozen=True)
class WarmupParams:
    """Hyper-parameters. Defaults: tuned on the tiny preset and arith difficulties 0-1 (docs/warmup.md).
    The run config's `warmup:` section sets the first five (`WarmupParams.from_config`)."""

    steps: int = _DEFAULTS["steps"].default
    batch_size: int = _DEFAULTS["batch_size"].default  # transcripts per step
    lr: float = _DEFAULTS["lr"].default  # peak learning rate
    warmup_steps: int = _DEFAULTS["warmup_steps"].default  # linear lr warm-up, then cosine decay
    lr_min_ratio: float = _DEFAULTS["lr_min_ratio"].default  # to lr_min_ratio * lr at the last step
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    share_prefix: bool = True  # run the common prompt prefix once per step (no grad), see module doc
    log_every: int = 25

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm-up {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"warm-up lr must be > 0, got {self.lr}")

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> WarmupParams:
        """The params of RunConfig `cfg`'s `warmup:` section (steps, batch_size, lr, warmup_steps,
        lr_min_ratio), plus `overrides` of the others."""
        return cls(**cfg.warmup.model_dump(), **overrides)


# --------------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Transcript:
    """One oracle episode as the agent loop tokenises it.

    tokens int32 [T]; loss_mask uint8 [T]: 1 on assistant tokens (the oracle's turns and the END_OF_TURN
    closing each, the last one included); task_id; n_turns: assistant turns; success: env's score;
    images: (index in tokens of the block's <|image_start|>, pixels uint8 [3, h·p, w·p]) per image in the
    prompt or a tool observation, in order (prepared by the codec exactly as the agent loop prepares them).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    task_id: str
    n_turns: int
    success: float
    images: tuple[tuple[int, torch.Tensor], ...] = ()


def vision_codec(tokenizer: Any, model: Any) -> ChatCodec:
    """The agent loop's codec with `model`'s vision settings (patch size 0: text-only), as a worker builds
    it."""
    c = model.config
    return ChatCodec(tokenizer, int(getattr(c, "vision_patch_size", 0) or 0),
                     int(getattr(c, "vision_max_pixels", 0) or 0))


def make_warmup_env(env_id: str, env_kwargs: dict[str, Any]) -> Any:
    """The env as a rollout worker makes it (tool schemas go to the chat template), tools in-process.

    env_kwargs: `envs.make` kwargs (e.g. RunConfig env.kwargs + max_turns). `use_sandbox=False` is passed
    when the env's constructor takes it; otherwise the env runs as configured (a sandbox env then needs
    Docker, like its rollouts)."""
    import envs

    kwargs = dict(env_kwargs)
    kwargs.setdefault("tools_in_prompt", False)
    env = envs.make(env_id, **kwargs)
    if getattr(env, "uses_sandbox", False) and "use_sandbox" in inspect.signature(type(env)).parameters:
        env.close()
        env = envs.make(env_id, **{**kwargs, "use_sandbox": False})
    if not callable(getattr(env, "oracle_actions", None)):
        env.close()
        raise ValueError(
            f"env {env_id!r} has no oracle_actions(): the SFT warm-up imitates a scripted policy; "
            "implement oracle_actions() on the env (docs/envs.md) or skip the warm-up"
        )
    return env


def oracle_transcript(env: Any, codec: ChatCodec, seed: int) -> Transcript:
    """Play `env.oracle_actions()` for task `seed` and tokenise it exactly as `run_episode` would.

    Raises ValueError if the oracle does not solve the task (the data would teach a failing policy)."""
    try:
        messages, info = env.reset(seed=seed)
        actions = list(env.oracle_actions())
        enc = codec.encode_prompt(messages, env.tool_schemas())
        ids = list(enc.ids)
        images = [(int(o), im.pixels) for o, im in enc.images]
        mask = [0] * len(ids)
        success, n_turns = None, 0
        for action in actions:
            turn = codec.turn_ids(action) + [codec.eot_id]
            ids += turn
            mask += [1] * len(turn)
            n_turns += 1
            obs, reward, terminated, truncated, step_info = env.step(action)
            if terminated or truncated:
                success = step_info.get("success", reward if terminated else None)
                break
            enc = codec.encode_observation(obs)
            obs_ids = list(enc.ids)
            images += [(len(ids) + int(o), im.pixels) for o, im in enc.images]
            ids += obs_ids
            mask += [0] * len(obs_ids)
    finally:
        env.close()  # returns the lease / private event loop even when the env or oracle raises
    if success is None or float(success) < 1.0:
        raise ValueError(
            f"oracle of env {getattr(env, 'env_id', env)!r} did not solve task {info.get('task_id')!r} "
            f"(seed {seed}, success {success}, {n_turns} of {len(actions)} actions played): check the env's "
            "oracle_actions() and max_turns"
        )
    return Transcript(
        tokens=np.asarray(ids, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.uint8),
        task_id=str(info.get("task_id")),
        n_turns=n_turns,
        success=float(success),
        images=tuple(images),
    )


@dataclass
class PackedBatch:
    """B transcripts packed for one SFT step, split at their common prefix.

    prefix int64 [P] (P >= 1; no assistant token in it or right after it), suffix int64 [S] (the B
    suffixes packed), cu_seqlens int32 [B+1] over `suffix`, score_pos int64 [M] (positions in the full
    per-transcript view, see `positions`), targets int64 [M]: the tokens predicted at those positions.
    When P == 0 (share_prefix off) the suffixes are the whole transcripts. images: the patches of every
    transcript's images, token_index into `suffix` (None without images; the prefix never holds one).
    """

    prefix: torch.Tensor
    suffix: torch.Tensor
    cu_seqlens: torch.Tensor
    score_pos: torch.Tensor
    targets: torch.Tensor
    images: Any = None


def common_prefix_len(seqs: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> int:
    """Length P of the shared prefix: the longest common prefix, cut so that no scored target lies in it.

    Position t predicts token t+1, and the last prefix position is not run with gradients, so the prefix
    must end before the token preceding the first assistant token: P = min(LCP, first_assistant - 1)."""
    lcp = min(len(s) for s in seqs)
    first = seqs[0]
    for s in seqs[1:]:
        diff = np.nonzero(s[:lcp] != first[:lcp])[0]
        if diff.size:
            lcp = int(diff[0])
    first_scored = min(int(np.argmax(m)) if m.any() else len(m) for m in masks)
    return max(0, min(lcp, first_scored - 1))


def pack_batch(
    transcripts: Sequence[Transcript], share_prefix: bool = True, patch_size: int = 0
) -> PackedBatch:
    """Pack transcripts for `sft_loss`: shared prefix (if any), packed suffixes, scored positions.

    In the suffix stream, suffix token j of transcript b sits at cu[b] + j; the hidden state there scores
    the next token of the same transcript when that token is an assistant token. The shared prefix ends
    before the first image of any transcript (equal image tokens may stand for different pixels), and
    images need the model's `patch_size`."""
    seqs = [t.tokens.astype(np.int64) for t in transcripts]
    masks = [t.loss_mask for t in transcripts]
    P = common_prefix_len(seqs, masks) if share_prefix and len(seqs) > 1 else 0
    first_image = min((s for t in transcripts for s, _ in t.images), default=None)
    if first_image is not None:
        P = min(P, int(first_image))
    lens = [len(s) - P for s in seqs]
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    cu[1:] = np.cumsum(lens)
    pos, tgt = [], []
    for b, (s, m) in enumerate(zip(seqs, masks)):
        t = np.nonzero(m[P + 1 :])[0]  # suffix positions j whose next token (P + j + 1) is scored
        pos.append(cu[b] + t)
        tgt.append(s[P + 1 + t])
    images = None
    if first_image is not None:
        if patch_size < 1:
            raise ValueError("transcripts hold images: pass the model's patch size (pack_batch(..., "
                             "patch_size=config.vision_patch_size)); a text-only model cannot learn them")
        from model.vision import ImagePatches

        starts = [int(cu[b]) + s - P for b, t in enumerate(transcripts) for s, _ in t.images]
        pixels = [px for t in transcripts for _, px in t.images]
        images = ImagePatches.from_images(pixels, starts, patch_size)
    return PackedBatch(
        prefix=torch.from_numpy(seqs[0][:P].copy()),
        suffix=torch.from_numpy(np.concatenate([s[P:] for s in seqs])),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        score_pos=torch.from_numpy(np.concatenate(pos)),
        targets=torch.from_numpy(np.concatenate(tgt)),
        images=images,
    )


def sft_loss(model: Any, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean NLL of the scored targets (formula in the module docstring) + MoE aux loss when configured.

    Returns (loss scalar, {"nll", "acc": greedy next-token accuracy on scored tokens, "tokens": M})."""
    backbone = model.model
    cache = None
    if batch.prefix.numel():
        from model.cache import OdysseyCache

        p = next(model.parameters())
        with torch.no_grad():
            empty = OdysseyCache.empty(model.config, 1, device=p.device, dtype=p.dtype)
            cu1 = torch.tensor([0, batch.prefix.numel()], dtype=torch.int32, device=p.device)
            _, layers, _, _ = backbone(batch.prefix.to(p.device), cu1, empty, None, False)
            cache = empty.advanced(layers, [batch.prefix.numel()])
        cache = cache.select([0] * (batch.cu_seqlens.numel() - 1))
    dev = next(model.parameters()).device
    h, _, _, aux = backbone(batch.suffix.to(dev), batch.cu_seqlens.to(dev), cache, None, False, batch.images)
    logits = model.lm_head(h[batch.score_pos.to(dev)]).float()  # [M, V]
    targets = batch.targets.to(dev)
    nll = F.cross_entropy(logits, targets)
    loss = nll + aux if aux is not None else nll
    with torch.no_grad():
        acc = (logits.argmax(-1) == targets).float().mean()
    return loss, {"nll": float(nll.detach()), "acc": float(acc), "tokens": int(targets.numel())}


# --------------------------------------------------------------------------------------------------- recipe
def _env_args(cfg: Any) -> tuple[str, dict[str, Any]]:
    """(env id, envs.make kwargs) exactly as `WorkerSettings.from_config` builds them."""
    from rl.rollout.worker import WorkerSettings

    s = WorkerSettings.from_config(cfg)
    return s.env_id, s.env_kwargs


def recipe(cfg: Any, params: WarmupParams) -> dict[str, Any]:
    """Everything the warm-up's result depends on (compared to skip a re-run)."""
    env_id, env_kwargs = _env_args(cfg)
    return {
        "version": RECIPE_VERSION,
        "model": cfg.model.model_dump(mode="json"),
        "env_id": env_id,
        "env_kwargs": env_kwargs,
        "init_seed": cfg.learner.seed,
        "data_seed": cfg.rollout.seed,
        "params": dataclasses.asdict(params),
    }


def recipe_digest(r: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True, default=str).encode()).hexdigest()[:16]


def existing_recipe(out_dir: str | Path) -> dict[str, Any] | None:
    """The recipe stored with a finished warm-up checkpoint in `out_dir`, or None."""
    p = Path(out_dir) / RECIPE_FILE
    if not p.is_file() or not (Path(out_dir) / "config.json").is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------------------------------- train
def lr_schedule(opt: torch.optim.Optimizer, params: WarmupParams) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' cosine-with-min-lr schedule: step i < warmup_steps runs at lr * (i + 1) / warmup_steps,
    then cosine decay reaching lr * lr_min_ratio at the last step (`params.steps - 1`)."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup_lr_rate

    return get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
        opt, params.warmup_steps, params.steps, min_lr_rate=params.lr_min_ratio
    )


def build_model(cfg: Any) -> Any:
    """The policy to warm up, in fp32 train mode: `model.init_from` when set, else the preset initialised
    with `learner.seed` (the same weights a rollout worker would build)."""
    from rl.config import is_hf_policy
    from rl.policy import PolicySpec, build_policy

    if is_hf_policy(cfg.model):
        raise ValueError(f"the SFT warm-up runs on Odyssey's model only (its packed prefix cache); "
                         f"{cfg.model.checkpoint} is a Hugging Face checkpoint: fine-tune it with its own "
                         "tools (e.g. TRL's SFTTrainer) and pass the result as model.hf_path")
    return build_policy(PolicySpec.from_config(cfg).replace(dtype="float32"), train=True)


@dataclass
class WarmupResult:
    """What `train` returns: the model (eval mode), per-log-line history, final metrics, wall time."""

    model: Any
    history: list[dict[str, float]]
    final_nll: float
    final_acc: float
    wall_s: float
    transcript_tokens: int  # mean tokens per transcript
    n_tasks: int  # distinct task ids seen


def train(
    cfg: Any,
    params: WarmupParams | None = None,
    log: Callable[[str], None] | None = print,
    model: Any = None,
) -> WarmupResult:
    """Run the SFT warm-up for `cfg` (a RunConfig; params default to its `warmup:` section). The data stream
    is deterministic: step i uses the oracle transcripts of episode seeds
    DATA_SEED_BASE + rollout.seed * 1_000_003 + i * B + b."""
    params = params or WarmupParams.from_config(cfg)
    from model.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(cfg.learner.seed)
    env_id, env_kwargs = _env_args(cfg)
    env = make_warmup_env(env_id, env_kwargs)
    model = build_model(cfg) if model is None else model.float().train()
    codec = vision_codec(load_tokenizer(), model)
    patch_size = int(getattr(model.config, "vision_patch_size", 0) or 0)
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(
        model.parameters(), lr=params.lr, betas=params.betas, weight_decay=params.weight_decay
    )
    sched = lr_schedule(opt, params)
    base = DATA_SEED_BASE + int(cfg.rollout.seed) * 1_000_003
    history: list[dict[str, float]] = []
    tasks: set[str] = set()
    n_tok, n_tr = 0, 0
    run_nll, run_acc, run_n = 0.0, 0.0, 0
    for step in range(params.steps):
        batch_tr = [
            oracle_transcript(env, codec, base + step * params.batch_size + b)
            for b in range(params.batch_size)
        ]
        for t in batch_tr:
            tasks.add(t.task_id)
            n_tok += len(t.tokens)
            n_tr += 1
            if int(t.tokens.max()) >= vocab:
                raise ValueError(f"token id {int(t.tokens.max())} >= model vocab_size {vocab}")
        batch = pack_batch(batch_tr, params.share_prefix, patch_size)
        lr = sched.get_last_lr()[0]  # this step's
        loss, m = sft_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), params.grad_clip))
        opt.step()
        sched.step()
        if hasattr(model, "update_router_biases"):
            model.update_router_biases()
        run_nll, run_acc, run_n = run_nll + m["nll"], run_acc + m["acc"], run_n + 1
        if (step + 1) % params.log_every == 0 or step + 1 == params.steps:
            rec = {
                "step": step + 1,
                "nll": run_nll / run_n,
                "acc": run_acc / run_n,
                "grad_norm": gnorm,
                "lr": lr,
                "elapsed_s": time.perf_counter() - t0,
            }
            history.append(rec)
            run_nll, run_acc, run_n = 0.0, 0.0, 0
            if log is not None:
                log(
                    f"warmup step {rec['step']:>4}/{params.steps}  nll {rec['nll']:.4f}  "
                    f"acc {rec['acc']:.3f}  |g| {gnorm:.2f}  lr {rec['lr']:.2e}  {rec['elapsed_s']:.1f} s"
                )
    model.eval()
    return WarmupResult(
        model=model,
        history=history,
        final_nll=history[-1]["nll"],
        final_acc=history[-1]["acc"],
        wall_s=time.perf_counter() - t0,
        transcript_tokens=n_tok // max(1, n_tr),
        n_tasks=len(tasks),
    )


# --------------------------------------------------------------------------------------------------- eval
def evaluate(
    model: Any,
    cfg: Any,
    episodes: int,
    temperature: float = 0.0,
    seed: int = 7,
    concurrency: int = 16,
) -> dict[str, Any]:
    """Success rate of `model` on `episodes` fresh tasks, played through the real agent loop on the engine
    rollout.engine names (`rl.rollout.engines.build_engine`; budgets from cfg.rollout; tools in-process like
    the warm-up). Episode seeds are
    seed * 1_000_003 + i (the rollout's scheme), disjoint from the warm-up's data seeds.

    Returns {"success_rate", "episodes", "well_formed": fraction of turns with tool calls and no tool errors,
    "tasks": task ids, "outcomes": per-episode outcome (None for truncated), "wall_s"}."""
    from model.tokenizer import load_tokenizer
    from rl.rollout.engines import build_engine
    from rl.rollout.worker import WorkerSettings

    codec = vision_codec(load_tokenizer(), model)
    settings = dataclasses.replace(WorkerSettings.from_config(cfg), max_batch_size=max(64, concurrency))
    env_id, env_kwargs = settings.env_id, settings.env_kwargs
    ep_cfg = dataclasses.replace(settings.episode, temperature=temperature)
    engine, engine_dir = build_engine(settings, codec.decode, policy=model.eval())  # rollout.engine's kind
    t0 = time.perf_counter()

    async def main() -> list[Any]:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> Any:
            async with sem:
                env = make_warmup_env(env_id, env_kwargs)
                return await run_episode(engine, env, codec, ep_cfg, seed=seed * 1_000_003 + i)

        try:
            return await asyncio.gather(*(one(i) for i in range(episodes)))
        finally:
            await engine.aclose()

    try:
        trajs = asyncio.run(main())
    finally:
        if engine_dir:
            shutil.rmtree(engine_dir, ignore_errors=True)
    infos = [s for t in trajs for s in t.step_infos]
    bad = sum(bool(s.get("tool_errors")) or not s.get("tool_calls") for s in infos)
    return {
        "success_rate": sum(float(t.outcome or 0.0) for t in trajs) / max(1, episodes),
        "episodes": episodes,
        "well_formed": 1.0 - bad / max(1, len(infos)),
        "infra_errors": sum(bool(t.infra_error) for t in trajs),
        "tasks": [t.metadata.get("task_id") for t in trajs],
        "outcomes": [t.outcome for t in trajs],
        "wall_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------------------------------- CLI
def run_warmup(
    cfg: Any,
    out_dir: str | Path,
    params: WarmupParams,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[bool, dict[str, Any]]:
    """Warm up and save to `out_dir` unless it already holds the same recipe's checkpoint.

    Returns (trained, recipe record). A non-empty `out_dir` that is not a warm-up checkpoint is never
    overwritten (ValueError); one from a different recipe is replaced."""
    out = Path(out_dir).expanduser().resolve()
    want = recipe(cfg, params)
    digest = recipe_digest(want)
    have = existing_recipe(out)
    if have is not None and have.get("digest") == digest and not force:
        log(
            f"odyssey warmup: {out} already holds this warm-up (recipe {digest}, {params.steps} steps); "
            "skipping (pass --force to retrain)"
        )
        return False, have
    if out.exists() and any(out.iterdir()) and have is None:
        raise ValueError(
            f"{out} is not empty and holds no warm-up checkpoint ({RECIPE_FILE}); choose a new --out "
            "or remove it"
        )
    if have is not None and have.get("digest") != digest:
        log(f"odyssey warmup: {out} holds a warm-up from another recipe ({have.get('digest')}); retraining")
    env_id, env_kwargs = _env_args(cfg)
    log(
        f"odyssey warmup: {params.steps} steps x {params.batch_size} oracle transcripts of {env_id} "
        f"{env_kwargs}, model {cfg.model.preset}, lr {params.lr:g}, {torch.get_num_threads()} threads"
    )
    res = train(cfg, params, log=log)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    res.model.save_pretrained(tmp)
    record = {
        "digest": digest,
        "recipe": want,
        "final_nll": res.final_nll,
        "final_acc": res.final_acc,
        "wall_s": round(res.wall_s, 2),
        "transcript_tokens": res.transcript_tokens,
        "distinct_tasks": res.n_tasks,
        "history": res.history,
    }
    (tmp / RECIPE_FILE).write_text(json.dumps(record, indent=2, default=str))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(
        f"odyssey warmup: saved {out} (nll {res.final_nll:.4f}, acc {res.final_acc:.3f}, "
        f"{res.wall_s:.1f} s); use it with model.init_from={out}"
    )
    return True, record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="odyssey warmup",
        description="SFT warm-up on the env's oracle transcripts; saves a checkpoint for model.init_from.",
    )
    p.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument("--out", required=True, help="checkpoint directory to write (skipped if up to date)")
    p.add_argument("--steps", default=None, help="shortcut for the override warmup.steps=N")
    p.add_argument("--batch-size", default=None, help="shortcut for the override warmup.batch_size=B")
    p.add_argument("--lr", default=None, help="shortcut for the override warmup.lr=X (peak learning rate)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--eval-episodes",
        type=int,
        default=0,
        help="after training, play N greedy episodes on new tasks and print the success rate",
    )
    p.add_argument("--force", action="store_true", help="retrain even if --out is up to date")
    return p


def cli_main(argv: list[str]) -> int:
    """`odyssey warmup CONFIG --out DIR [k=v ...]`: the hyper-parameters are the config's `warmup:` section
    (`--steps/--batch-size/--lr` are shortcuts for its overrides). Exit 0 ok/skipped, 2 bad config/args."""
    args = _parser().parse_intermixed_args(argv)
    from rl.config import ConfigError, load_config

    shortcuts = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr}
    overrides = list(args.overrides) + [f"warmup.{k}={v}" for k, v in shortcuts.items() if v is not None]
    try:
        cfg = load_config(args.config, overrides)
        params = WarmupParams.from_config(cfg)
    except (ConfigError, ValueError) as e:
        print(f"odyssey warmup: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        trained, record = run_warmup(cfg, args.out, params, force=args.force)
    except ValueError as e:
        print(f"odyssey warmup: {e}", file=sys.stderr)
        return 2
    if args.eval_episodes > 0:
        from model.modeling import OdysseyForCausalLM

        model = OdysseyForCausalLM.from_pretrained(str(Path(args.out).expanduser().resolve()))
        ev = evaluate(model, cfg, args.eval_episodes, temperature=0.0)
        print(
            f"odyssey warmup: greedy success {ev['success_rate']:.3f} on {ev['episodes']} new tasks "
            f"(well-formed turns {ev['well_formed']:.3f}, {ev['wall_s']:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
