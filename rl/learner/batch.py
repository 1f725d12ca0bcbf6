"""From scored trajectories to training samples: validation, selection, advantages.

    batch = prepare_batch(trajectories, facts, cfg.learner, max_tokens=cfg.rollout.max_tokens)
    batch.samples   # one Sample per trajectory trained on; batch.metrics: counts and reward statistics

A trajectory of T tokens gives the model L = T - 1 inputs (its last token predicts nothing). Input j predicts
token j + 1, so the scored positions are the j with loss_mask[j + 1] == 1 (tokens the policy generated), and
every per-token quantity (rollout log-prob, advantage, reward, later old/ref log-probs and values) lives on
those M positions.

Bad input is refused with a message that names the trajectory (`selection.describe`): an empty batch, a
tokenizer fingerprint that differs from the learner's, token ids outside the vocabulary, a generated first
token, a generated token without a rollout log-prob, routed experts missing (with routing replay on) or of the
wrong shape or range, images for a text-only model, image spans whose tokens are not their image block, and
image bytes that do not decode to their recorded patch grid.

Images: each sample carries its images decoded once (pixels uint8 [3, h·p, w·p] with the position of their
<|image_start|> token); `packing.collate` turns a micro-batch's images into the model's `ImagePatches`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from model.image import ImageError, decode_prepared
from rewards.placement import token_rewards
from rl.learner.advantages import turn_returns
from rl.learner.estimators import estimator
from rl.learner.selection import baseline_reward, describe, select
from rl.trajectory import Trajectory, check_image_tokens


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know about the policy: vocabulary, MoE layout, tokenizer fingerprint."""

    vocab_size: int
    n_moe_layers: int
    n_experts: int
    top_k: int
    tokenizer: str | None  # fingerprint (model.tokenizer.tokenizer_fingerprint); None = not checked
    vision_patch_size: int = 0  # the model's patch size p; 0 = text-only (trajectories with images refused)


@dataclass
class Sample:
    """One trajectory prepared for the loss. L = T - 1 model inputs, m scored positions.

    index: position in the step's batch; name: how errors name it; group: its baseline group (or None).
    input_ids int64 [L]; scored int64 [m]: inputs j whose next token is generated; targets int64 [m] = tokens
    at scored + 1; rollout_logp float32 [m]; replay uint16 [L, n_moe, k] | None: the experts the rollout used
    on each input (axis order = model.moe_layer_indices); advantages float64 [m] (gae: after the first pass);
    rewards float64 [m]: per-token rewards (gae). Filled by the learner's first pass: old_logp, ref_logp,
    old_values, returns (float64 [m]). images: (start, pixels uint8 [3, h·p, w·p]) per image span, start = the
    index of its <|image_start|> token in input_ids. segment_starts int64 [s]: inputs where the context
    restarts inside the sample (an agent that rewrote its history, `metadata["segment_starts"]`): the
    forward treats each segment as its own sequence.
    """

    index: int
    name: str
    group: object
    input_ids: np.ndarray
    scored: np.ndarray
    targets: np.ndarray
    rollout_logp: np.ndarray
    replay: np.ndarray | None
    advantages: np.ndarray | None = None
    rewards: np.ndarray | None = None
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None
    old_values: np.ndarray | None = None
    returns: np.ndarray | None = None
    images: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    segment_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def n_tokens(self) -> int:
        """L, the model inputs of this sample (its packing length)."""
        return int(self.input_ids.shape[0])

    @property
    def n_scored(self) -> int:
        return int(self.scored.shape[0])


@dataclass
class PreparedBatch:
    """samples: the trained ones; extra_tokens / extra_episodes: scored tokens / episodes the loss normalisers
    count beyond the samples' (learner.equal_groups_in_normaliser: the dropped all-equal groups; else 0)."""

    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)
    extra_tokens: int = 0
    extra_episodes: int = 0


def check_tokenizer(traj: Trajectory, index: int, facts: ModelFacts) -> None:
    """Raise ValueError naming `traj` when its recorded tokenizer fingerprint is not the learner's. A
    trajectory without a fingerprint (recorded before fingerprints existed) passes."""
    fp = traj.metadata.get("tokenizer")
    if facts.tokenizer is not None and fp is not None and fp != facts.tokenizer:
        raise ValueError(
            f"{describe(traj, index)}: tokenizer mismatch: it was rolled out with tokenizer {fp!r} but the "
            f"learner's is {facts.tokenizer!r}; its token ids mean other text to this model. Roll out with "
            "the policy's tokenizer (model.tokenizer.policy_tokenizer: an HF checkpoint's own when it ships "
            "one, else model/assets/tokenizer)"
        )


def check_segments(traj: Trajectory, name: str) -> None:
    """`metadata["segment_starts"]` (token positions where the context restarts) must be increasing
    positions in (0, T), each the start of a prompt turn: no generated token is predicted across one."""
    starts = traj.metadata.get("segment_starts") or []
    prompts = {s.start for s in traj.turns if s.role == "prompt"}
    ok = all(isinstance(b, int) and 0 < b < traj.n_tokens and b in prompts for b in starts)
    if not ok or sorted(set(starts)) != list(starts):
        raise ValueError(
            f"{name}: metadata['segment_starts'] = {starts!r} must be increasing token positions inside the "
            "trajectory, each the start of a 'prompt' turn (where the agent's new context begins)"
        )


def check_trajectory(traj: Trajectory, index: int, facts: ModelFacts, need_routing: bool) -> None:
    """Raise ValueError naming `traj` when the learner cannot train on it (see the module docstring)."""
    check_tokenizer(traj, index, facts)
    name = describe(traj, index)
    T = traj.n_tokens
    check_segments(traj, name)
    if T and (int(traj.tokens.max()) >= facts.vocab_size or int(traj.tokens.min()) < 0):
        raise ValueError(
            f"{name}: token ids span [{int(traj.tokens.min())}, {int(traj.tokens.max())}] but the model's "
            f"vocab_size is {facts.vocab_size}; was it rolled out with another tokenizer or model?"
        )
    if T and traj.loss_mask[0]:
        raise ValueError(
            f"{name}: its first token is marked generated (loss_mask[0] = 1), but nothing "
            "precedes it to predict it from; the prompt must come first"
        )
    gen = np.flatnonzero(traj.loss_mask)
    bad = gen[~np.isfinite(traj.rollout_logprobs[gen])]
    if bad.size:
        raise ValueError(
            f"{name}: {bad.size} generated token(s) have no rollout log-prob (first at token {int(bad[0])}: "
            f"{traj.rollout_logprobs[bad[0]]}); the engine must record the log-prob of every sampled token "
            "(off-policy correction compares it with the learner's)"
        )
    if traj.image_spans:
        if facts.vision_patch_size == 0:
            raise ValueError(
                f"{name}: holds {len(traj.image_spans)} image(s) but the model is text-only "
                "(vision_patch_size=0); train it with a model preset that has vision settings"
            )
        try:
            check_image_tokens(traj)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    re = traj.routed_experts
    if re is None:
        if need_routing:
            raise ValueError(
                f"{name}: has no routed_experts but learner.routing_replay is on; roll out with an engine "
                "that records routing, or set learner.routing_replay=false"
            )
        return
    want = (T, facts.n_moe_layers, facts.top_k)
    if re.shape != want:
        raise ValueError(
            f"{name}: routed_experts has shape {re.shape}, expected [T, n_moe_layers, k] = {list(want)} for "
            "this model; it was rolled out with a model of another MoE layout"
        )
    if re.size and int(re.max()) >= facts.n_experts:
        raise ValueError(
            f"{name}: routed_experts holds expert id {int(re.max())} but the model has {facts.n_experts} "
            "routed experts; it was rolled out with another model"
        )


def _turn_of_tokens(traj: Trajectory, positions: np.ndarray) -> np.ndarray:
    """Index of the assistant turn holding each token position (every generated token is in one)."""
    spans = traj.assistant_spans()
    starts = np.array([s.start for s in spans])
    return np.searchsorted(starts, positions, side="right") - 1


def decode_images(traj: Trajectory, index: int, patch_size: int) -> list[tuple[int, torch.Tensor]]:
    """(start, pixels uint8 [3, h·p, w·p]) of each image span, decoded from the stored PNG and checked against
    its content address and recorded grid; ValueError naming the trajectory otherwise."""
    out, cache = [], {}
    for sp in traj.image_spans:
        if sp.sha256 not in cache:
            try:
                cache[sp.sha256] = decode_prepared(traj.images[sp.sha256], patch_size, (sp.grid_h, sp.grid_w),
                                                   sp.sha256)
            except ImageError as e:
                raise ValueError(f"{describe(traj, index)}: image {sp.sha256[:16]}...: {e}") from None
        out.append((sp.start, cache[sp.sha256]))
    return out


def to_sample(traj: Trajectory, index: int, group: object = None, patch_size: int = 0) -> Sample:
    """The training view of one validated trajectory (see Sample); patch_size: the model's (images)."""
    tokens = traj.tokens.astype(np.int64)
    scored = np.flatnonzero(traj.loss_mask[1:]).astype(np.int64)
    replay = traj.routed_experts[:-1] if traj.routed_experts is not None else None
    return Sample(
        index=index,
        name=describe(traj, index),
        group=group,
        input_ids=tokens[:-1],
        scored=scored,
        targets=tokens[scored + 1],
        rollout_logp=traj.rollout_logprobs[scored + 1].astype(np.float32),
        replay=replay,
        images=decode_images(traj, index, patch_size) if traj.image_spans else [],
        segment_starts=np.asarray(traj.metadata.get("segment_starts") or [], dtype=np.int64),
    )


def episode_token_rewards(traj: Trajectory, scored: np.ndarray) -> np.ndarray:
    """`rewards.placement.token_rewards` on the scored positions, float64 [m]. Reward placed on a token that
    is not scored (a turn without a generated token) moves to the last scored token, so the sum stays
    rewards["total"]."""
    r = token_rewards(traj).astype(np.float64)
    out = r[scored + 1].copy()
    out[-1] += float(r.sum() - out.sum())
    return out


def prepare_batch(trajs: Sequence[Trajectory], facts: ModelFacts, lcfg) -> PreparedBatch:
    """Validate, select (rl.learner.selection) and compute advantages. `lcfg`: the run's LearnerSection.
    GAE samples get per-token rewards here; their advantages need values (the learner's first pass)."""
    if not trajs:
        raise ValueError("Learner.step got an empty batch: pass at least one scored trajectory")
    est = estimator(lcfg.advantage)
    grouped = est.grouped
    sel = select(
        trajs,
        grouped=grouped,
        group_size=lcfg.group_size,
        turn_credit=lcfg.turn_credit,
        overlong_filter=lcfg.overlong_filter,
        successes_only=est.successes_only,
    )
    for i, t in enumerate(trajs):  # excluded ones too: a wrong tokenizer is never silent
        check_tokenizer(t, i, facts)
    for i in sel.kept:
        check_trajectory(trajs[i], i, facts, lcfg.routing_replay and facts.n_moe_layers > 0)
    group_of = {i: g for g, idx in sel.groups.items() for i in idx}
    samples = [to_sample(trajs[i], i, group_of.get(i), facts.vision_patch_size) for i in sel.kept]
    episode_adv: dict[int, float] = {}
    if grouped and sel.groups:
        members = [i for idx in sel.groups.values() for i in idx]
        groups = [group_of[i] for i in members]
        adv = est.compute([baseline_reward(trajs[i], lcfg.turn_credit) for i in members], groups, lcfg)
        episode_adv = dict(zip(members, adv.tolist()))
    for s in samples:
        t = trajs[s.index]
        if grouped:
            a = np.full(s.n_scored, episode_adv[s.index], dtype=np.float64)
            if lcfg.turn_credit and t.turn_rewards and est.turn_credit:
                G = turn_returns(t.turn_rewards, lcfg.gamma).numpy()
                a += G[_turn_of_tokens(t, s.scored + 1)]
            s.advantages = a
        else:
            s.rewards = episode_token_rewards(t, s.scored)
    kept_rewards = [trajs[s.index].rewards["total"] for s in samples]
    metrics = {f"learner/{k}": float(v) for k, v in sel.counts.items()}
    equal_tokens = sum(int(np.count_nonzero(trajs[i].loss_mask[1:])) for i in sel.equal)  # as to_sample
    metrics["learner/equal_group_tokens"] = float(equal_tokens)
    metrics.update(
        {
            "learner/trajectories": float(len(trajs)),
            "learner/trained_trajectories": float(len(samples)),
            "learner/groups": float(len(sel.groups)),
            "learner/reward_mean": float(np.mean(kept_rewards)) if kept_rewards else 0.0,
        }
    )
    if grouped and samples:
        a = np.concatenate([s.advantages for s in samples])
        metrics.update(
            {"learner/advantage_mean": float(a.mean()), "learner/advantage_abs_max": float(np.abs(a).max())}
        )
    if not lcfg.equal_groups_in_normaliser:
        return PreparedBatch(samples=samples, metrics=metrics)
    return PreparedBatch(samples, metrics, extra_tokens=equal_tokens, extra_episodes=len(sel.equal))


__all__ = [
    "ModelFacts",
    "Sample",
    "PreparedBatch",
    "prepare_batch",
    "check_tokenizer",
    "check_trajectory",
    "to_sample",
    "decode_images",
    "episode_token_rewards",
]
