r"""KDA state composition across contiguous shards of one sequence: the building block of context parallelism.

Recurrence (1) of docs/kda.md is affine in the state. Per head, with
A_t = (I - beta_t k_t k_t^T) Diag(alpha_t) [K, K] and b_t = beta_t k_t v_t^T [K, V]:

    S_t = A_t S_{t-1} + b_t    =>    over a shard:  S_out = M S_in + S_local,                        (C)
    M = A_T ... A_1 [K, K],    S_local = the shard's final state from S_in = 0 [K, V].

Because the recurrence acts on each column of S independently, ONE run over the shard from the initial state
[I | 0] with values [0 | v] (K + V columns) gives [M | S_local] (`shard_summary`). The summaries of R shards,
computed in parallel (one per rank), compose by an exclusive scan (`compose`): S_in of shard r is
M_{r-1} S_in_{r-1} + S_local_{r-1}. Each shard can then re-run with its true S_in. Oracle:
tests/test_sequence_chunks.py (`test_kda_shard_composition_equals_whole_sequence`).

Shapes follow `chunk_kda`: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] (B independent rows).
"""

from __future__ import annotations

import torch

from model.kda_reference import naive_recurrent_kda


def shard_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  recurrence=naive_recurrent_kda) -> tuple[torch.Tensor, torch.Tensor]:
    """(M [B, H, K, K], S_local [B, H, K, V]) of one shard, fp32, by one run of `recurrence` (any function
    with naive_recurrent_kda's contract, e.g. model.kda.kda_sequence) over K + V state columns."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, H, K, K)
    S0 = torch.cat([eye, eye.new_zeros(B, H, K, V)], dim=-1)
    v_ext = torch.cat([v.float().new_zeros(B, T, H, K), v.float()], dim=-1)
    _, S = recurrence(torch.zeros_like(k, dtype=torch.float32), k.float(), v_ext, g.float(), beta.float(), S0)
    return S[..., :K], S[..., K:]


def compose(summaries: list[tuple[torch.Tensor, torch.Tensor]], initial_state: torch.Tensor | None = None
            ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Exclusive scan of (C) over shard summaries [(M_r, S_local_r)]: returns (S_in of every shard, the
    final state of the last one). initial_state: S_in of shard 0 [B, H, K, V] (None = zeros)."""
    if not summaries:
        raise ValueError("compose needs at least one shard summary")
    S = torch.zeros_like(summaries[0][1]) if initial_state is None else initial_state.float()
    starts = []
    for M, S_local in summaries:
        starts.append(S)
        S = M @ S + S_local
    return starts, S


__all__ = ["shard_summary", "compose"]
