"""Seeded, batch-independent token sampling: temperature, top-k, top-p.

Every row of a decode batch is sampled from its own `torch.Generator`, with one uniform draw per
token, so a sequence's tokens depend only on its own seed and logits, never on which other
sequences share the batch (continuous batching == one-at-a-time decoding).

The distribution a token is drawn from is the *filtered* one, and the logprob we report is taken
from that same distribution (what an importance ratio against the behaviour policy needs):

    z      = logits / temperature                                  [N, V]
    top-k: z_j = -inf unless z_j >= (k-th largest z)                (k = 0: off; ties at the k-th kept)
    top-p: sort p = softmax(z) descending, keep the smallest prefix whose mass reaches top_p
           (the first token is always kept), z_j = -inf elsewhere   (top_p = 1: off)
    logp   = log_softmax(z)                                         (renormalised over kept tokens)
    token  = inverse CDF of exp(logp) in vocabulary order at u ~ U[0, 1) from the row's generator
    logprob(token) = logp[token]

At temperature 1 with top_k = 0 and top_p = 1 this is exactly log_softmax(logits), i.e. what the
trainer's `token_logprobs` computes. temperature = 0 means greedy: the sampled distribution is a point
mass on the argmax, so the reported logprob is 0.0 (use temperature 1 for RL rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature: 0 = greedy; > 0 scales logits. top_p in (0, 1]; top_k >= 0 (0 = off).
    max_new_tokens: generation budget for this request (finish_reason "length" when hit).
    stop_token_ids: generation stops after emitting one of these (finish_reason "stop_token").
    stop_strings: generation stops once the decoded output contains one (finish_reason "stop_string");
        the tokens are kept as generated (never cut inside a token).
    seed: seeds this request's generator; None = drawn from the engine's seed sequence.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row temperature / top-k / top-p filtering.

    logits [N, V] fp32; temperature [N] (> 0); top_k [N] int (0 = off); top_p [N] (1 = off).
    Returns z [N, V] fp32 with -inf on removed tokens (rows independent of each other).
    """
    z = logits.float() / temperature[:, None]
    V = z.shape[-1]
    need_k = top_k > 0
    need_p = top_p < 1
    if bool(need_k.any()) or bool(need_p.any()):
        sorted_z, order = torch.sort(z, dim=-1, descending=True)  # [N, V]
        ranks = torch.arange(V, device=z.device)[None, :]
        remove_sorted = torch.zeros_like(sorted_z, dtype=torch.bool)
        if bool(need_k.any()):
            k = torch.where(need_k, top_k.clamp(max=V), torch.full_like(top_k, V))
            kth = sorted_z.gather(-1, (k - 1)[:, None])  # [N, 1]
            remove_sorted |= sorted_z < kth  # ties with the k-th value are kept
        if bool(need_p.any()):
            zk = sorted_z.masked_fill(remove_sorted, float("-inf"))
            p = torch.softmax(zk, dim=-1)
            mass_before = torch.cumsum(p, dim=-1) - p  # probability mass strictly above this rank
            remove_p = (mass_before >= top_p[:, None]) & (ranks > 0)
            remove_sorted |= remove_p & need_p[:, None]
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, float("-inf"))
    return z


def sampling_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """log-probs [N, V] of the filtered distribution each row is drawn from (module docstring); greedy rows
    are taken at temperature 1 (their reported logprob is 0.0, set by the caller). logits [N, V]."""
    logits = logits.float()
    if all(p.top_k == 0 and p.top_p == 1 and p.temperature in (0, 1) for p in params):
        return torch.log_softmax(logits, dim=-1)  # nothing to filter, temperature 1
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    return torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [N, V]; params / generators: one per row.

    uniforms: float64 [N], the rows' next U[0, 1) draws if the caller took them from the generators
    already (`UniformStream` draws them in blocks: the same numbers, fewer calls); None = one draw per
    row here. Returns (tokens LongTensor [N], logprobs fp32 [N]) - logprobs under the filtered distribution
    each token was drawn from (0.0 for greedy rows), see the module docstring.
    """
    N = logits.shape[0]
    assert len(params) == N == len(generators), "one SamplingParams and one generator per row"
    logits = logits.float()
    logp = sampling_logprobs(logits, params)  # [N, V]
    # One uniform per row from the row's own generator: independent of batch composition.
    u = uniforms if uniforms is not None else \
        torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cdf = torch.cumsum(logp.double().exp(), dim=-1)  # [N, V], vocabulary order
    target = (u * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    if any(p.temperature == 0 for p in params):
        greedy = torch.tensor([p.temperature == 0 for p in params])
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
        lp = torch.where(greedy, torch.zeros_like(lp), lp)
    return tokens, lp


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded deterministically (one per request)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


class UniformStream:
    """A request's U[0, 1) draws from its generator, taken in blocks of `block` (one call per block instead
    of one per token). torch's CPU generator yields the same numbers either way (rand(n) == n successive
    rand(()) draws), so the sampled tokens do not change."""

    def __init__(self, generator: torch.Generator, block: int = 64) -> None:
        self.generator, self.block = generator, block
        self._buf: list[float] = []
        self._i = 0

    def next(self) -> float:
        if self._i == len(self._buf):
            self._buf = torch.rand(self.block, generator=self.generator, dtype=torch.float64).tolist()
            self._i = 0
        self._i += 1
        return self._buf[self._i - 1]
