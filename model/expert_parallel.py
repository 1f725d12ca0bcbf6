"""Expert parallelism (EP) for `model.moe.LatentMoE`: the routed experts split across the ranks of a process
group, tokens exchanged with all-to-all, dropless (no capacity factor: every (token, expert) pair runs).

    shard_experts(module, group)     # every LatentMoE in `module`: experts [r*E/N, (r+1)*E/N) on rank r

Layout. With N ranks in `group` and E = n_routed_experts (N must divide E), rank r holds the E/N experts
[r*E/N, (r+1)*E/N): `w_gate_up` [E, 2I, L] and `w_down_experts` [E, L, I] become DTensors sharded on dim 0
(`Shard(0)`) over a 1-D device mesh of `group`, so a rank stores 1/N of the expert weights (their gradients
and AdamW moments follow), while state-dict gathering (`torch.distributed.checkpoint.state_dict`, full
state dict) and the grad-norm reduction see the whole [E, ...] tensors. Everything else of the layer (router,
W_down, W_up, latent RMSNorm, shared experts) stays as it was: replicated (DDP) or FSDP-sharded by the caller.

One MoE forward on rank r (T_r tokens, latent z [T_r, L], routing topk_idx [T_r, k], weights p [T_r, k]):

1. sort the T_r*k (token, expert) pairs by expert; since rank j's experts are contiguous, the sorted pairs are
   grouped by destination rank: send_j = #pairs whose expert lives on rank j;
2. exchange the per-expert counts (all_to_all of an [E] int64 vector in N equal parts of E/N): rank r learns
   c[s, e] = #pairs source s sends to its local expert e;
3. all_to_all the gathered latent rows z[tok] with input splits send_j and output splits sum_e c[s, e];
4. reorder the received rows expert-major (stable: source order kept within an expert) and run each local
   expert E_e(x) = W2_e situ_glu(W1_e x, W3_e x) on its segment (one matmul pair per non-empty expert);
5. undo the reorder and all_to_all the results back (the reverse splits);
6. out[t] = sum over t's pairs of p * E_e(z_t) (index_add on the source rank), then the layer goes on with
   W_up . RMSNorm(out) exactly as `LatentMoE.forward`.

Autograd: `_AllToAll` is an autograd Function whose backward is the all_to_all with the splits swapped, so
gradients flow back to the source ranks' z (and through it to W_down and the earlier layers) and p (the
router); the expert weights get their gradient on the owning rank only, summed over every rank's tokens.
(`torch.distributed.nn.functional.all_to_all_single` does the same and works on gloo in torch 2.13, but is
deprecated there in favour of the functional collectives, so the 15-line Function lives here.)
`mean_grads=True` divides the local experts' gradients by N: the learner's data-parallel convention, where
DDP and FSDP average the replicated parameters' gradients over ranks (each rank backpropagates N x its share
of the loss), so every parameter ends with the gradient of the whole minibatch loss.

Collectives: every rank of `group` must run the same sequence of MoE forwards (and backwards): three
all_to_all per layer forward (counts, rows, results), two per backward. A rank without tokens still takes part
(zero-row splits), and its local experts still get a (zero) gradient, so AdamW treats every shard alike.

Routing is untouched: routing replay (R3) forces topk_idx on the source rank before dispatch; the balancing
statistics and expert-load counts are recorded per rank on its own tokens and all-reduced over the data-
parallel process group in `LatentMoE.update_bias` (every rank then sets the identical router bias b).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from model.activations import situ_glu_gu


def _rows_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single of the rows of x [sum(in_splits), ...] -> [sum(out_splits), ...], without ever
    handing the backend an empty chunk: an empty split travels as one zero row, dropped on arrival (both sides
    know the true splits). A rank without tokens, or an expert block nobody routed to, gives empty splits,
    and a 2-rank learner step with them once died of heap corruption on gloo ("free(): invalid next size")."""
    pad_in, pad_out = [max(n, 1) for n in in_splits], [max(n, 1) for n in out_splits]
    if pad_in != in_splits:
        pad = x.new_zeros(1, *x.shape[1:])
        x = torch.cat([c if n else pad for c, n in zip(x.split(in_splits), in_splits)])
    out = x.new_empty(sum(pad_out), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), pad_out, pad_in, group=group)
    if pad_out == out_splits:
        return out
    kept = [c for c, n in zip(out.split(pad_out), out_splits) if n]
    return torch.cat(kept) if kept else out[:0]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with variable splits; backward: the same exchange with splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _rows_all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _rows_all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single: x [sum(in_splits), ...] -> [sum(out_splits), ...]; rows
    in_splits[j] go to rank j, out_splits[j] arrive from rank j (in rank order)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def local_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor,
                  counts: Sequence[int]) -> torch.Tensor:
    """Run expert e on its segment of x: w_gate_up [E_l, 2I, L], w_down [E_l, L, I], x [R, L] sorted by
    expert with counts[e] rows each (sum = R) -> [R, L]. Every weight gets a gradient (zero for experts
    without rows), also when R = 0, so the shards of all ranks take the same optimizer path."""
    if x.shape[0] == 0:  # keep x and the weights in the graph: the backward still runs its collectives
        return x.new_zeros(0, w_down.shape[1]) + 0.0 * (x.sum() + w_gate_up.sum() + w_down.sum())
    w_gu, w_d = w_gate_up.unbind(0), w_down.unbind(0)
    parts = [situ_glu_gu(seg @ w_gu[e].t()) @ w_d[e].t() for e, seg in enumerate(x.split(list(counts)))
             if seg.shape[0]]
    return torch.cat(parts)


class ExpertParallel:
    """The EP dispatcher of one LatentMoE (`LatentMoE.expert_parallel`): group, this rank's expert range, and
    `dispatch`, the drop-in for `LatentMoE.dispatch` (module docstring, steps 1-6)."""

    def __init__(self, group, n_experts: int, mean_grads: bool = True) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(f"expert parallelism over {self.size} ranks needs n_routed_experts divisible by "
                             f"{self.size}, got {n_experts}; pick a rank count that divides it")
        self.n_experts, self.n_local = n_experts, n_experts // self.size
        self.first = self.rank * self.n_local  # this rank holds experts [first, first + n_local)
        self.grad_scale = 1.0 / self.size if mean_grads else 1.0

    def dispatch(self, moe: nn.Module, z: torch.Tensor, topk_idx: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """sum_{i in T} p_i E_i(z) with the experts on their owning ranks. z [T, L], topk_idx [T, k] int64
        (global expert ids), weights [T, k] -> [T, L] (dtype of z). Collective over `group`."""
        T, k = topk_idx.shape
        N, E, El = self.size, self.n_experts, self.n_local
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert, hence by owning rank
        tok = order // k
        counts = torch.bincount(flat, minlength=E).to(torch.int64)  # [E]
        recv = torch.empty_like(counts)  # recv[s*El + e]: pairs source s sends to local expert e
        dist.all_to_all_single(recv, counts, group=self.group)
        send_splits = counts.view(N, El).sum(1).tolist()
        recv_ce = recv.view(N, El)
        recv_splits = recv_ce.sum(1).tolist()
        x = all_to_all(z.index_select(0, tok), recv_splits, send_splits, self.group)  # [R, L], source-major
        # expert-major order of the received rows (stable: source order within an expert)
        expert_of_row = torch.arange(El, device=x.device).repeat(N).repeat_interleave(recv_ce.reshape(-1))
        perm = expert_of_row.argsort(stable=True)
        w_gu, w_d = (self._local(w, z.dtype) for w in (moe.w_gate_up, moe.w_down_experts))
        y = local_experts(w_gu, w_d, x.index_select(0, perm), recv_ce.sum(0).tolist())
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        y = all_to_all(y.index_select(0, inv), send_splits, recv_splits, self.group)  # [T*k, L] as sorted
        p_sorted = weights.reshape(-1)[order].to(z.dtype).unsqueeze(-1)
        return z.new_zeros(T, z.shape[-1]).index_add(0, tok, y * p_sorted)

    def _local(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's [E/N, ...] block of an expert weight (a DTensor's local shard), gradient scaled by
        `grad_scale`, cast to the compute dtype (bf16 under FSDP mixed precision)."""
        local = w.to_local() if isinstance(w, DTensor) else w[self.first:self.first + self.n_local]
        if self.grad_scale != 1.0:
            local = _ScaleGrad.apply(local, self.grad_scale)
        return local.to(dtype)


def expert_mesh(group, device: torch.device) -> DeviceMesh:
    """The 1-D device mesh of `group` that the expert weights' DTensors live on."""
    return DeviceMesh.from_group(group, device.type)


def shard_experts(module: nn.Module, group=None, mesh: DeviceMesh | None = None,
                  mean_grads: bool = True) -> list[nn.Module]:
    """Expert parallelism for every LatentMoE in `module`, over the ranks of `group` (None: a new group of all
    ranks, so the token exchanges never queue behind DDP's or FSDP's own collectives). mesh: the 1-D device
    mesh of the same ranks the expert DTensors live on (None: one over `group`). Must be called on every rank
    with identical weights; rank r keeps experts [r*E/N, (r+1)*E/N) of rank 0's weights (the DTensors are
    scattered from rank 0). Returns the LatentMoE layers. mean_grads: module docstring."""
    from model.moe import LatentMoE

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("expert parallelism needs an initialised torch.distributed process group "
                         "(rl/learner/group.py starts one per learner rank)")
    moes = [m for m in module.modules() if isinstance(m, LatentMoE)]
    if not moes:
        raise ValueError(f"{type(module).__name__} has no LatentMoE layer: expert parallelism shards routed "
                         "experts; use learner.sharding=none or fsdp for a dense model")
    group = dist.new_group(list(range(dist.get_world_size()))) if group is None else group
    for moe in moes:
        if moe.expert_parallel is not None:
            raise ValueError("the module's experts are already sharded (shard_experts ran); "
                             "build a fresh one")
        ep = ExpertParallel(group, moe.n_experts, mean_grads)
        if mesh is not None and mesh.size() != ep.size:
            raise ValueError(f"the experts' mesh has {mesh.size()} ranks but the expert-parallel group "
                             f"{ep.size}; pass a mesh of the group's ranks")
        on = mesh if mesh is not None else expert_mesh(group, moe.w_gate_up.device)
        for name in ("w_gate_up", "w_down_experts"):
            w = getattr(moe, name)
            sharded = distribute_tensor(w.detach(), on, [Shard(0)])
            setattr(moe, name, nn.Parameter(sharded, requires_grad=w.requires_grad))
        moe.expert_parallel = ep
    return moes


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The expert weights `shard_experts` sharded (DTensors): what FSDP and DDP must leave alone."""
    from model.moe import LatentMoE

    return [w for m in module.modules() if isinstance(m, LatentMoE) and m.expert_parallel is not None
            for w in (m.w_gate_up, m.w_down_experts)]


__all__ = ["ExpertParallel", "all_to_all", "expert_mesh", "expert_parameters", "local_experts",
           "shard_experts"]
