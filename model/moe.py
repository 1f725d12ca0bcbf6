"""Stable LatentMoE: sigmoid router with a balancing bias, latent SiTU-GLU experts, routing replay.

    y = sum_j shared_j(x) + W_up . RMSNorm( sum_{i in T} p_i . E_i(W_down x) )        (DESIGN.md)

x [T, D] full width. Router (on full-width x, fp32):
    s = sigmoid(W_r x)                 [T, n]
    T = topk(s + b, k)                 b: per-expert bias buffer (balancing), zero at init
    p_i = rsf . s_i / sum_{l in T} s_l (renormalised over the chosen k from the *unbiased* s; rsf =
                                        routed_scaling_factor), so b moves the choice, never the weight.
Routed experts E_i(z) = W2_i situ_glu(W1_i z, W3_i z) run in the latent dim L = moe_latent_dim,
with stacked weights w_gate_up [n, 2I, L] (gate rows first, vLLM's w13 layout) and w_down_experts
[n, L, I] (vLLM's w2 layout). Shared experts are full-width SiTU-GLU MLPs (model.ffn.DenseFFN).

Dispatch: flatten the T*k (token, expert) pairs, sort by expert, gather the latent rows once, run
one [c_e, L] x [L, 2I] and one [c_e, I] x [I, L] matmul per non-empty expert on its contiguous
segment, scale by p and index_add back into [T, L]. There is no loop over tokens. When the experts' loads
are close enough (padding to the largest count costs <= 2x rows), the segments go into one zero-padded
[n, max count, L] block instead and all experts run as two batched matmuls (far fewer, larger ops).
A small batch without autograd (decoding: at most 4 pairs per expert on average) takes `forward_small`:
one matmul for every projection of x, then fused CPU kernels for routing and experts (model/fused_cpu.cpp,
same math; only the chosen experts' weights are read).
`dense_reference_forward` is the slow oracle: every expert on every token, masked by p.

Routing replay (R3): `replay_experts` [T, k] forces T (any integer dtype); p is still computed from
the current s over the forced set, so W_r gets gradient. Balancing statistics always use the
router's own free choice topk(s + b) (that is what b controls); load metrics count the experts
that actually ran. Balancing: see model/balancing.py; observability: model/expert_load.py.

Which forwards are counted: every forward while `record_statistics` is True (the default). A trainer that
runs extra forwards (no-grad passes, activation-checkpoint recomputation) turns recording off around them
with `statistics_recording(model, False)`, so exactly one forward per token feeds the balancer and the
expert-load statistics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from model import fused_cpu
from model.activations import situ_glu, situ_glu_gu
from model.balancing import (
    BALANCING_METHODS,
    QuantileStats,
    SignStats,
    aux_balance_loss,
)
from model.expert_load import ExpertLoadTracker
from model.ffn import DenseFFN
from model.fused_weights import ConcatWeight
from model.norm import RMSNorm

# Up to this many (token, expert) pairs per expert on average, the no-autograd fp32 CPU path runs the
# experts in one fused call that reads each chosen expert's weights in place (gemv per pair); above it, one
# matmul pair per expert segment reuses the weights better.
_FUSED_PAIRS_PER_EXPERT = 4
# `dispatch` runs all experts as two batched matmuls over an [n, max count, L] block when the padding costs at
# most this factor in rows (balanced routing: ~1.2x); otherwise one matmul pair per expert segment.
_PADDED_WASTE = 2.0


def latent_expert(w_gate_up: torch.Tensor, w_down: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """W2 situ_glu(W1 z, W3 z) with w_gate_up [2I, L] (gate rows first), w_down [L, I]: z [c, L] -> [c, L]."""
    g, u = (z @ w_gate_up.t()).chunk(2, dim=-1)
    return situ_glu(g, u) @ w_down.t()


class Router(nn.Module):
    """Sigmoid top-k router. weight [n, D] (parameter), e_score_correction_bias b [n] fp32 (persistent
    buffer: saved in the state dict, never trained by the optimizer; DeepSeek-V3 / vLLM name).
    """

    def __init__(self, hidden_size: int, n_experts: int, k: int, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.n_experts, self.k, self.routed_scaling_factor = n_experts, k, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse: bool = True):
        """Keep b in fp32 under model.to(bf16): a bf16 bias (8-bit mantissa) would blur the routing."""
        super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """s = sigmoid(W_r x): x [T, D] -> [T, n] fp32."""
        return torch.sigmoid(x.float() @ self.weight.float().t())

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Free choice topk(s + b): [T, n] -> [T, k] int64."""
        return (scores.detach() + self.e_score_correction_bias.float()).topk(self.k, dim=-1).indices

    def weights(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """p = rsf * s_T / sum s_T over the chosen set: [T, n], [T, k] -> [T, k] fp32 (differentiable)."""
        s = scores.gather(1, topk_idx)
        return s / s.sum(dim=-1, keepdim=True) * self.routed_scaling_factor

    def forward(
        self, x: torch.Tensor, replay_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (scores [T, n] fp32, topk_idx [T, k] int64, weights [T, k] fp32)."""
        s = self.scores(x)
        idx = self.select(s) if replay_experts is None else self._check_replay(replay_experts, x.shape[0])
        return s, idx, self.weights(s, idx)

    def _check_replay(self, replay: torch.Tensor, T: int) -> torch.Tensor:
        if replay.shape != (T, self.k):
            raise ValueError(
                f"replay_experts must have shape [T, k] = [{T}, {self.k}] for this MoE layer, got "
                f"{tuple(replay.shape)}; the model forward takes [T, n_moe_layers, k]"
            )
        if replay.dtype.is_floating_point or replay.dtype == torch.bool:
            raise ValueError(f"replay_experts must be an integer tensor of expert ids, got {replay.dtype}")
        idx = replay.to(device=self.weight.device, dtype=torch.int64)
        if T and (int(idx.min()) < 0 or int(idx.max()) >= self.n_experts):
            raise ValueError(
                f"replay_experts holds expert ids in [{int(idx.min())}, {int(idx.max())}], outside "
                f"[0, {self.n_experts}); were they recorded with a different n_routed_experts?"
            )
        if self.k > 1 and T:
            srt = idx.sort(dim=-1).values
            if bool((srt[:, 1:] == srt[:, :-1]).any()):
                raise ValueError("replay_experts repeats an expert within a token's k choices; "
                                 "make them distinct")
        return idx


class LatentMoE(nn.Module):
    """Stable LatentMoE FFN. forward(x [T, D], replay_experts [T, k] | None) -> (y [T, D], topk_idx [T, k]).

    After each forward `self.aux_loss` is the scalar load-balancing loss (balancing == "aux_loss")
    or None. `update_bias()` applies the pending bias update (call after the optimizer step; no-op
    in eval, for "aux_loss" and "none") and closes the observability step. `load_metrics()` -> dict.
    """

    def __init__(self, config, layer_idx: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        D = config.hidden_size
        n = config.n_routed_experts
        k = config.num_experts_per_tok
        L = config.moe_latent_dim
        I = config.moe_intermediate_size
        self.balancing = getattr(config, "balancing", "quantile")
        if self.balancing not in BALANCING_METHODS:
            raise ValueError(f"balancing={self.balancing!r} is not one of {BALANCING_METHODS}; "
                             "fix the model config")
        if n < 1 or not 1 <= k <= n:
            raise ValueError(
                f"LatentMoE needs n_routed_experts >= 1 and 1 <= num_experts_per_tok <= n_routed_experts, "
                f"got n={n}, k={k}"
            )
        if self.balancing in ("quantile", "bias_sign") and k == n:
            raise ValueError(
                f"balancing={self.balancing!r} needs num_experts_per_tok < n_routed_experts (k = n = {n}): "
                "with every expert chosen there is nothing to balance; set balancing='none'"
            )
        self.n_experts, self.k, self.latent_dim, self.expert_dim = n, k, L, I
        self.bias_update_speed = float(getattr(config, "bias_update_speed", 1e-3))
        self.aux_loss_coef = float(getattr(config, "aux_loss_coef", 1e-2))
        self.quantile_exact_max_tokens = int(getattr(config, "quantile_exact_max_tokens", 65536))
        self.quantile_hist_bins = int(getattr(config, "quantile_hist_bins", 1024))
        self.init_std = float(getattr(config, "initializer_range", 0.02))

        self.router = Router(D, n, k, float(getattr(config, "routed_scaling_factor", 1.0)))
        self.latent_down = nn.Linear(D, L, bias=False)  # W_down
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * I, L))  # [n, 2I, L]: gate rows [:I], up rows [I:]
        self.w_down_experts = nn.Parameter(torch.empty(n, L, I))  # [n, L, I]
        self.latent_norm = RMSNorm(L, eps=getattr(config, "rms_norm_eps", 1e-6))
        self.latent_up = nn.Linear(L, D, bias=False)  # W_up
        n_shared = int(getattr(config, "n_shared_experts", 0) or 0)
        shared_I = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        if n_shared and shared_I < 1:
            raise ValueError("n_shared_experts > 0 needs shared_expert_intermediate_size >= 1")
        self.shared_experts = nn.ModuleList(DenseFFN(config, shared_I) for _ in range(n_shared))

        self.aux_loss: torch.Tensor | None = None
        self.record_statistics = True  # off: forwards feed neither the balancer nor the load tracker
        self.process_group = None  # data-parallel group for the balancing all-reduces (None = default)
        self.expert_parallel = None  # model/expert_parallel.py: runs the experts sharded across ranks
        self._quantile = QuantileStats(k)
        self._sign = SignStats(n)
        self.load_tracker = ExpertLoadTracker(n, k, int(config.moe_load_window))
        self._small_in_weight = ConcatWeight()  # [W_r; W_down; shared W_gate; W_up ...]: `forward_small`
        self._small_out_weight = ConcatWeight(dim=1)  # [W_up | shared W_down ...]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for every matrix (as HF _init_weights does for Linear); b = 0."""
        for w in (self.router.weight, self.latent_down.weight, self.w_gate_up, self.w_down_experts,
                  self.latent_up.weight):
            w.normal_(0.0, self.init_std)
        for lin in self.shared_experts.modules():
            if isinstance(lin, nn.Linear):
                lin.weight.normal_(0.0, self.init_std)
        self.router.e_score_correction_bias.zero_()

    @property
    def bias(self) -> torch.Tensor:
        """The balancing bias b [n] (the router's e_score_correction_bias buffer)."""
        return self.router.e_score_correction_bias

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """E_e(z) = W2_e situ_glu(W1_e z, W3_e z): z [c, L] -> [c, L]."""
        return latent_expert(self.w_gate_up[e], self.w_down_experts[e], z)

    def dispatch(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_{i in T} p_i E_i(z) by sorting (token, expert) pairs by expert.

        z [T, L], topk_idx [T, k] int64, weights [T, k] -> [T, L] (dtype of z).
        """
        T, k = topk_idx.shape
        out = z.new_zeros(T, self.latent_dim)
        if T == 0:
            return out + 0.0 * z.sum()
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)  # [T*k] pairs grouped by expert
        tok = order // k  # token of each sorted pair
        counts_t = torch.bincount(flat, minlength=self.n_experts)
        counts = counts_t.tolist()
        zs = z.index_select(0, tok)  # [T*k, L]
        p_sorted = weights.reshape(-1)[order].to(z.dtype).unsqueeze(-1)
        n, cap = self.n_experts, max(counts)
        if n * cap <= _PADDED_WASTE * T * k:
            # every expert at once: the sorted pairs in an [n, cap, L] block (zero rows pad each expert to the
            # largest count), two batched matmuls against the stacked weights, then the real rows back
            sorted_e = flat[order]
            slot = torch.arange(T * k, device=z.device) - (counts_t.cumsum(0) - counts_t)[sorted_e]
            dest = sorted_e * cap + slot  # row of each sorted pair in the padded block
            zp = z.new_zeros(n * cap, self.latent_dim).index_copy(0, dest, zs).view(n, cap, -1)
            a = situ_glu_gu(torch.bmm(zp, self.w_gate_up.transpose(1, 2)).view(n * cap, -1))
            y = torch.bmm(a.view(n, cap, -1), self.w_down_experts.transpose(1, 2)).view(n * cap, -1)
            return out.index_add(0, tok, y.index_select(0, dest) * p_sorted)
        # split (not slicing): its backward concatenates the segment grads once, whereas every slice's
        # backward would materialise a full-size [T*k, L] zero tensor
        # and unbind (not w[e]): one stacking backward instead of a full-size [n, ...] grad per expert
        w_gu, w_d = self.w_gate_up.unbind(0), self.w_down_experts.unbind(0)
        parts = [situ_glu_gu(seg @ w_gu[e].t()) @ w_d[e].t()  # latent_expert, with the fused activation
                 for e, seg in enumerate(zs.split(counts)) if seg.shape[0]]
        return out.index_add(0, tok, torch.cat(parts) * p_sorted)

    def forward(
        self, x: torch.Tensor, replay_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (or [..., D]), replay_experts [T, k] | None -> (y [T, D], topk_idx [T, k] int64)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if replay_experts is not None:
            replay_experts = replay_experts.reshape(-1, replay_experts.shape[-1])
        small = self.forward_small(x2, replay_experts) if self.expert_parallel is None else None
        if small is not None:
            y, idx = small
            return y.reshape(*lead, y.shape[-1]), idx.reshape(*lead, self.k)
        scores, idx, p = self.router(x2, replay_experts)
        self._observe(scores, idx, p)
        z = self.latent_down(x2)
        ep = self.expert_parallel  # None, or the experts on their owning ranks (model/expert_parallel.py)
        routed = self.dispatch(z, idx, p) if ep is None else ep.dispatch(self, z, idx, p)
        y = self.latent_up(self.latent_norm(routed))
        for shared in self.shared_experts:
            y = y + shared(x2)
        return y.reshape(*lead, y.shape[-1]), idx.reshape(*lead, self.k)

    def forward_small(
        self, x: torch.Tensor, replay_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`forward` for a few tokens without autograd on fp32 CPU (decoding) in three calls: ONE matmul for
        the router, W_down and the shared experts' gate/up projections (their weights concatenated), ONE
        kernel for routing, the chosen experts (reading only their weights), the latent RMSNorm and the
        shared experts' SiTU-GLU (model/fused_cpu.cpp `moe_small`), ONE matmul for W_up and the shared W_down.
        Same math as `forward`, same `_observe`. Returns None (the caller runs `forward`'s own path) unless it
        applies: x [T, D] with 0 < T*k <= 4 pairs per expert."""
        T = x.shape[0]
        if not 0 < T * self.k <= _FUSED_PAIRS_PER_EXPERT * self.n_experts:
            return None
        kernels = fused_cpu.applies(x, self.router.weight, self.w_gate_up, self.w_down_experts)
        if kernels is None or not all(isinstance(s, DenseFFN) for s in self.shared_experts):
            return None
        shared = list(self.shared_experts)
        w_in = self._small_in_weight(self.router.weight, self.latent_down.weight,
                                     *[w for s in shared for w in (s.gate_proj.weight, s.up_proj.weight)])
        proj = x @ w_in  # [T, n + L + sum of 2 I_shared]
        forced = torch.empty(0, dtype=torch.long) if replay_experts is None else \
            self.router._check_replay(replay_experts, T).contiguous()
        out, scores, idx, p = kernels.moe_small(
            proj, self.router.e_score_correction_bias, forced, self.k, self.router.routed_scaling_factor,
            self.w_gate_up, self.w_down_experts, self.latent_norm.weight, self.latent_norm.eps,
            [s.gate_proj.weight.shape[0] for s in shared])
        self._observe(scores, idx, p)
        # out = [RMSNorm(routed latent) | shared activations ...]: W_up and the shared W_down in one matmul
        y = out @ self._small_out_weight(self.latent_up.weight, *[s.down_proj.weight for s in shared])
        return y, idx

    def _observe(self, scores: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> None:
        """Aux loss, then (while `record_statistics`) balancing statistics (training forwards only) and load
        observability."""
        self.aux_loss = None
        if self.balancing == "aux_loss":
            self.aux_loss = aux_balance_loss(scores, idx, self.n_experts, self.aux_loss_coef)
        if not self.record_statistics:
            return
        if self.training:
            if self.balancing == "quantile":
                self._quantile.add(scores, self.bias)
            elif self.balancing == "bias_sign":
                self._sign.add(self.router.select(scores))
        self.load_tracker.record(idx, p)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Apply the step's balancing update to b (train mode, quantile / bias_sign) and close the
        observability step. The new b affects routing from the next forward on, i.e. the next step.
        """
        if dist.is_available() and dist.is_initialized():  # every data-parallel rank logs the whole step
            self.load_tracker.all_reduce(self.process_group)
        self.load_tracker.close_step()
        if not self.training:
            return
        self._quantile.process_group = self._sign.process_group = self.process_group
        new = None
        if self.balancing == "quantile":
            new = self._quantile.solve(self.n_experts, self.quantile_exact_max_tokens,
                                       self.quantile_hist_bins, device=self.bias.device)
        elif self.balancing == "bias_sign":
            new = self._sign.solve(self.bias, self.bias_update_speed)
        if new is not None:
            self.bias.copy_(new.to(self.bias.dtype))

    def load_metrics(self) -> dict[str, float | int | list[int]]:
        """This layer's expert-load metrics of the most recent step (see model/expert_load.py)."""
        return self.load_tracker.metrics()

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, experts={self.n_experts}, top_k={self.k}, "
                f"latent={self.latent_dim}, "
                f"expert_dim={self.expert_dim}, balancing={self.balancing}")


def dense_reference_forward(
    moe: LatentMoE, x: torch.Tensor, replay_experts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow oracle for LatentMoE.forward: every expert runs on every token, masked by the [T, n]
    weight matrix (zero outside the chosen k). Same routing; no statistics are recorded.
    """
    x2 = x.reshape(-1, x.shape[-1])
    scores, idx, p = moe.router(x2, replay_experts)
    W = torch.zeros_like(scores).scatter(1, idx, p)  # [T, n]
    z = moe.latent_down(x2)
    h = torch.zeros(x2.shape[0], moe.latent_dim, dtype=z.dtype, device=z.device)
    for e, (w_gu, w_d) in enumerate(zip(moe.w_gate_up.unbind(0), moe.w_down_experts.unbind(0))):
        h = h + W[:, e:e + 1].to(z.dtype) * latent_expert(w_gu, w_d, z)
    y = moe.latent_up(moe.latent_norm(h))
    for shared in moe.shared_experts:
        y = y + shared(x2)
    return y.reshape(*x.shape[:-1], y.shape[-1]), idx.reshape(*x.shape[:-1], moe.k)


@contextmanager
def statistics_recording(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Set `record_statistics` of every LatentMoE in `model` to `enabled` inside the block, then restore it.

    A trainer wraps no-grad forwards and the backward (where activation checkpointing recomputes the
    forward) in `statistics_recording(model, False)`, so only the one forward with gradients records."""
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    before = [m.record_statistics for m in moes]
    for m in moes:
        m.record_statistics = enabled
    try:
        yield
    finally:
        for m, b in zip(moes, before):
            m.record_statistics = b


def aggregate_load_metrics(per_layer: dict[int, dict], prefix: str = "moe") -> dict[str, float | list]:
    """Flatten {layer_idx: LatentMoE.load_metrics()} into one logging dict.

    Keys: f"{prefix}/layer{l}/{metric}" for every scalar metric and the per-expert list, plus
    summaries over layers: {prefix}/max_mean_load_max, {prefix}/max_mean_load_mean, {prefix}/load_cv_mean,
    {prefix}/n_dead_experts (sum), {prefix}/load_entropy_min, {prefix}/weight_entropy_mean.
    """
    out: dict[str, float | list] = {}
    per_layer = {l: m for l, m in per_layer.items() if m}
    for l, m in per_layer.items():
        for key, v in m.items():
            out[f"{prefix}/layer{l}/{key}"] = v
    if per_layer:
        ms = list(per_layer.values())
        out[f"{prefix}/max_mean_load_max"] = max(m["max_mean_load"] for m in ms)
        out[f"{prefix}/max_mean_load_mean"] = sum(m["max_mean_load"] for m in ms) / len(ms)
        out[f"{prefix}/load_cv_mean"] = sum(m["load_cv"] for m in ms) / len(ms)
        out[f"{prefix}/n_dead_experts"] = float(sum(m["n_dead_experts"] for m in ms))
        out[f"{prefix}/load_entropy_min"] = min(m["load_entropy"] for m in ms)
        out[f"{prefix}/weight_entropy_mean"] = sum(m["weight_entropy"] for m in ms) / len(ms)
    return out


__all__ = [
    "Router",
    "LatentMoE",
    "latent_expert",
    "dense_reference_forward",
    "aggregate_load_metrics",
    "statistics_recording",
]
