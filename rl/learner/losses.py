"""Policy-gradient losses of the GRPO/PPO family, per scored token, and how they are aggregated.

Per scored token t of episode i (pi = learner now, pi_old = learner at the start of the policy step,
A = advantage, r_t = exp(log pi(y_t) - log pi_old(y_t)), eps_l / eps_h = clip_eps_low / clip_eps_high):

    ppo_clip   l_t = -min(r_t A_t, clip(r_t, 1 - eps_l, 1 + eps_h) A_t)     (clip-higher: eps_h > eps_l)
    gspo       s_i = exp(mean_{t in i} (log pi(y_t) - log pi_old(y_t)))      (length-normalised)
               l_t = -min(s_i A_t, clip(s_i, 1 - eps_l, 1 + eps_h) A_t)       (gradient through s_i)
    cispo      l_t = -sg(min(r_t, 1 + eps_h)) A_t log pi(y_t)                 (sg = stop-gradient)

Each is multiplied by the off-policy weight w_t (rl/learner/off_policy.py), then the KL penalty to the frozen
reference is added per token, with x_t = log pi_ref(y_t) - log pi(y_t):

    k1 = -x_t        k2 = x_t^2 / 2        k3 = exp(x_t) - x_t - 1   (TRL's, unbiased and >= 0)

    L = sum_t c_t (w_t l_t + kl_coef k_t)  -  entropy_coef * sum_t H_t / N  +  value_coef * sum_t v_t / N

with N the scored tokens of the minibatch and c_t the aggregation weight (`aggregation_weights`, over the
minibatch's E episodes with n_i scored tokens each). With learner.equal_groups_in_normaliser, N and E also
count the all-equal groups dropped from the batch (TRL trains them at advantage 0: their policy terms are 0,
their tokens and episodes count; rl/learner/sharding.py `plan_step` shares them out over minibatches):

    token_mean            c_t = 1 / N
    seq_mean_token_mean   c_t = 1 / (E n_i)
    seq_mean_token_sum    c_t = 1 / (E C)      C = rollout.max_tokens (Dr.GRPO's constant normaliser)

Because every c_t is fixed for the whole minibatch, summing L over micro-batches and data-parallel ranks
gives exactly the minibatch loss (gradient accumulation is exact).

Value loss (PPO, clipped): v_t^clip = V_old + clip(V_t - V_old, -value_clip, value_clip),
v_t = max((V_t - R_t)^2, (v_t^clip - R_t)^2) / 2.

TRL 1.16's `GRPOTrainer._compute_loss` is the oracle (tests/test_learner_losses.py): ppo_clip = its grpo /
bnpo / dapo / dr_grpo loss types (by loss_agg), gspo = importance_sampling_level="sequence", cispo = its
cispo with epsilon_high = 1 + clip_eps_high; kl k3 = its beta term; entropy = its entropy bonus.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PolicyLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def ppo_clip(logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high, *, sequence=False):
    """PPO-clip per token (module docstring); sequence=True: gspo's length-normalised sequence ratio."""
    A = advantages
    log_ratio = logp - old_logp
    if sequence:
        per_seq = log_ratio.new_zeros(seq_tokens.numel()).index_add(0, seq, log_ratio)
        log_ratio = (per_seq / seq_tokens.clamp(min=1).to(logp.dtype))[seq]
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = -torch.min(ratio * A, clipped_ratio * A)
    clipped = ((ratio < 1.0 - clip_eps_low) & (A < 0)) | ((ratio > 1.0 + clip_eps_high) & (A > 0))
    return loss, clipped.detach()


def gspo(logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high):
    """GSPO: PPO-clip on the episode's length-normalised ratio s_i (module docstring)."""
    return ppo_clip(logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high, sequence=True)


def cispo(logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high):
    """CISPO: the capped, stopped IS weight times A log pi (module docstring)."""
    ratio = (logp - old_logp).exp()
    cap = 1.0 + clip_eps_high
    weight = ratio.clamp(max=cap).detach()
    return -weight * advantages * logp, ((ratio > cap) & (advantages > 0)).detach()


# learner.policy_loss: a built-in name, or "pkg.module:fn" with the same signature as these
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}


def policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss `name` names: a built-in (`POLICY_LOSSES`) or a `pkg.module:fn` of the same signature
    (logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high) -> (loss [M], clipped [M])."""
    from envs.dotted import builtin_or_dotted

    return builtin_or_dotted(name, POLICY_LOSSES, "policy loss",
                             "function (signature: rl.learner.losses.policy_loss_fn)")  # fmt: skip


def policy_loss(
    kind: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq: torch.Tensor,
    seq_tokens: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss l [M] (formulas above) and a bool [M] marking tokens whose ratio was clipped
    (in the direction that stops the gradient). kind: `policy_loss_fn`'s name; logp (with grad), old_logp,
    advantages [M]; seq int64 [M]: episode of each token (0..E-1); seq_tokens int64 [E]: scored tokens per
    episode."""
    fn = policy_loss_fn(kind)
    return fn(logp, old_logp.detach(), advantages, seq, seq_tokens, clip_eps_low, clip_eps_high)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi: [M] (formulas above)."""
    x = ref_logp.detach() - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return x.exp() - x - 1.0
    raise ValueError(f"kl_estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Clipped value loss per token [M] (formula above)."""
    old = old_values.detach()
    clipped = old + (values - old).clamp(-clip, clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)


def aggregation_weights(
    loss_agg: str,
    seq: torch.Tensor,
    seq_tokens: torch.Tensor,
    n_episodes: float,
    n_tokens: float,
    max_tokens: int,
) -> torch.Tensor:
    """c_t [M] float64 (formulas above). n_episodes / n_tokens: the minibatch's (over every micro-batch and
    rank); seq / seq_tokens: this micro-batch's token -> episode map and scored tokens per episode."""
    if loss_agg == "token_mean":
        return torch.full((seq.numel(),), 1.0 / max(n_tokens, 1), dtype=torch.float64)
    if loss_agg == "seq_mean_token_mean":
        return 1.0 / (max(n_episodes, 1) * seq_tokens.double().clamp(min=1.0))[seq]
    if loss_agg == "seq_mean_token_sum":
        return torch.full((seq.numel(),), 1.0 / (max(n_episodes, 1) * max_tokens), dtype=torch.float64)
    raise ValueError(
        f"loss_agg must be 'token_mean', 'seq_mean_token_mean' or 'seq_mean_token_sum', got {loss_agg!r}"
    )


def objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq: torch.Tensor,
    seq_tokens: torch.Tensor,
    agg_weights: torch.Tensor,
    n_tokens: float,
    *,
    policy: str = "ppo_clip",
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    is_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L (module docstring) without the value term, for one micro-batch: every argument is per scored token
    [M] (seq / seq_tokens as in `policy_loss`; agg_weights = `aggregation_weights`; n_tokens = the
    minibatch's scored tokens, the entropy normaliser). Returns (L, parts) with parts = {"policy": the
    aggregated policy term, "kl": per-token KL [M] or None, "clipped": bool [M]} (detached)."""
    pl, clipped = policy_loss(
        policy, logp, old_logp, advantages, seq, seq_tokens, clip_eps_low, clip_eps_high
    )
    per_token = pl if is_weights is None else is_weights * pl
    policy_term = (agg_weights * per_token).sum()
    loss = policy_term
    kl = None
    if ref_logp is not None and kl_coef > 0:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * (agg_weights * kl).sum()
    if entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * entropy.sum() / max(n_tokens, 1)
    parts = {"policy": policy_term.detach(), "kl": None if kl is None else kl.detach(), "clipped": clipped}
    return loss, parts


__all__ = [
    "POLICY_LOSSES",
    "policy_loss_fn",
    "ppo_clip",
    "gspo",
    "cispo",
    "policy_loss",
    "kl_penalty",
    "value_loss",
    "aggregation_weights",
    "objective",
]
