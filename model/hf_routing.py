"""Routing replay (R3) and expert-load metrics for Hugging Face MoE policies (model.hf_policy.HFPolicy).

An HF MoE block calls its router once per forward on the flattened tokens x [T, D] and gets back
(router_logits [T, n], weights [T, k], idx [T, k]); the block then runs experts idx[t] mixed by weights[t]
(plus shared experts, untouched here). `HFRouting` puts a forward hook on every router of the model, in
decoder-layer order (`layer_indices`, the axis order of `Trajectory.routed_experts`), which, inside a
`scope`:

- records the router's own free choice idx [T, k] per MoE layer (TorchEngine rollouts: prompt and generated
  tokens alike; the learner with routing replay off: its routing agreement with the rollout);
- replays: replaces idx by the forced experts R [T, k] of that layer and the weights by the architecture's
  own formula evaluated on the *current* router logits at R (so the router keeps its gradient and the
  replayed forward with R = the free choice is the free forward, bit for bit):

      softmax_topk  (qwen3_moe, qwen3_next, olmoe: norm_topk_prob; qwen3_5_moe, mixtral: always)
                    p = softmax(logits, fp32)[R];  p /= sum(p)  if normalised;  cast to the logits' dtype
                    (mixtral keeps fp32)
      sigmoid_group (kimi_linear, deepseek_v3, glm4_moe: DeepSeek-style, grouped top-k with a selection
                    bias, which moves the choice only)
                    s = sigmoid(logits)[R];  s /= (sum(s) + 1e-20) if norm_topk_prob;  s *= rsf
      topk_softmax  (gpt_oss) p = softmax(logits[R])  in the logits' dtype

  and, per layer, counts the tokens whose free top-k *set* equals the replayed set (routing agreement);
- tracks expert load (model/expert_load.py `ExpertLoadTracker`, one per MoE layer): the experts that actually
  ran (replayed or free) and their weights, in the forwards the learner computes gradients with.

A scope is a context variable, so the hooks are inert outside it (HF's own `generate`, the packing probe).
Activation checkpointing recomputes a layer in the backward: `recompute_scope` gives that recomputation the
same replayed experts, with no recording or counting (HFPolicy's checkpointing context_fn opens it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from model.expert_load import ExpertLoadTracker


def softmax_topk_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor, *,
                         always_norm: bool = False, cast: bool = True) -> torch.Tensor:
    """Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE / OLMoE / Mixtral: softmax over all n experts (fp32), the chosen k
    gathered, renormalised over them when `norm_topk_prob` (or always_norm), cast back to the logits' dtype
    unless cast=False (Mixtral). logits [T, n], idx [T, k] -> [T, k]."""
    p = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
    if always_norm or getattr(router, "norm_topk_prob", False):
        p = p / p.sum(dim=-1, keepdim=True)
    return p.to(logits.dtype) if cast else p


def sigmoid_group_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Kimi Linear / DeepSeek-V3 / GLM-4-MoE: sigmoid scores of the chosen experts (the selection bias and the
    group mask only choose), renormalised (+1e-20) when norm_topk_prob, times routed_scaling_factor.
    logits [T, n] fp32, idx [T, k] -> [T, k]."""
    s = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    return s * router.routed_scaling_factor


def topk_softmax_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits only, in the logits' dtype.
    [T, n], [T, k] -> [T, k]."""
    return torch.softmax(logits.gather(1, idx), dim=1, dtype=logits.dtype)


WeightFormula = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

#: router class name -> its routing-weight formula (module docstring); each was read off the class's forward
ROUTER_FORMULAS: dict[str, WeightFormula] = {
    "Qwen3MoeTopKRouter": softmax_topk_weights,
    "Qwen3NextTopKRouter": softmax_topk_weights,
    "OlmoeTopKRouter": softmax_topk_weights,
    "Qwen3_5MoeTopKRouter": lambda r, lg, i: softmax_topk_weights(r, lg, i, always_norm=True),
    "MixtralTopKRouter": lambda r, lg, i: softmax_topk_weights(r, lg, i, always_norm=True, cast=False),
    "KimiLinearTopkRouter": sigmoid_group_weights,
    "DeepseekV3TopkRouter": sigmoid_group_weights,
    "Glm4MoeTopkRouter": sigmoid_group_weights,
    "Glm5NextTextTopkRouter": sigmoid_group_weights,
    "GptOssTopKRouter": topk_softmax_weights,
}


@dataclasses.dataclass
class RoutedLayer:
    """One MoE layer of an HF model: its decoder-layer index, router module, weight formula and expert-load
    tracker (`load_tracker`, the attribute the learner checkpoints, as for Odyssey's LatentMoE)."""

    layer_idx: int
    router: nn.Module
    formula: WeightFormula
    load_tracker: ExpertLoadTracker


@dataclasses.dataclass
class _Scope:
    """What the router hooks do inside one forward: replay int64 [T, n_moe, k] | None (forced experts),
    record (per MoE layer, the free idx [t, k] of each router call) | None, track (expert load and replay
    agreement: the learner's forward with gradients only)."""

    replay: torch.Tensor | None = None
    record: list[list[torch.Tensor]] | None = None
    track: bool = False


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("odyssey_hf_routing", default=None)


def find_routed_layers(hf: nn.Module, window: int = 100) -> list[RoutedLayer]:
    """The MoE layers of an HF causal LM (`hf.model.layers[i].mlp` holding a router of ROUTER_FORMULAS), in
    layer order. Empty for a dense model or one whose router class is unknown here."""
    out = []
    for i, layer in enumerate(getattr(getattr(hf, "model", None), "layers", None) or []):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        routers = [m for m in mlp.modules() if type(m).__name__ in ROUTER_FORMULAS]
        if len(routers) > 1:
            raise ValueError(f"layer {i} of {type(hf).__name__} holds {len(routers)} routers; Odyssey's HF "
                             "routing replay supports one router per MoE layer")
        if routers:
            r = routers[0]
            out.append(RoutedLayer(i, r, ROUTER_FORMULAS[type(r).__name__],
                                   ExpertLoadTracker(int(r.num_experts), int(r.top_k), window)))
    if out and len({(int(x.router.num_experts), int(x.router.top_k)) for x in out}) > 1:
        raise ValueError(f"{type(hf).__name__}'s MoE layers differ in (experts, top-k); routing replay needs "
                         "one [T, n_moe_layers, k] layout")
    return out


class HFRouting:
    """Router hooks of one HF MoE model (module docstring). `layer_indices`: decoder layers with a router;
    `n_experts`, `top_k`: their common layout; `layers`: RoutedLayer per MoE layer."""

    def __init__(self, layers: list[RoutedLayer]) -> None:
        if not layers:
            raise ValueError("HFRouting needs at least one MoE layer (find_routed_layers found none)")
        self.layers = layers
        self.layer_indices = [x.layer_idx for x in layers]
        self.n_experts, self.top_k = int(layers[0].router.num_experts), int(layers[0].router.top_k)
        self._agree: torch.Tensor | None = None  # float64 [n_moe] while `agreement` is open
        self._agree_tokens = [0.0]
        self._handles = [x.router.register_forward_hook(self._hook(j)) for j, x in enumerate(layers)]

    def _hook(self, j: int):
        layer = self.layers[j]

        def hook(module: nn.Module, args: tuple, output: tuple):
            scope = _SCOPE.get()
            if scope is None:
                return None
            logits, weights, idx = output
            if scope.record is not None:
                scope.record[j].append(idx.detach())
            if scope.replay is None:
                if scope.track:
                    layer.load_tracker.record(idx, weights)
                return None
            forced = scope.replay[:, j]
            if forced.shape[0] != idx.shape[0]:
                raise ValueError(f"routing replay: layer {layer.layer_idx}'s router sees {idx.shape[0]} "
                                 f"tokens but {forced.shape[0]} replayed rows were given; the replayed "
                                 "experts must cover the packed forward's tokens one for one")
            forced = forced.to(idx.device)
            new = layer.formula(module, logits, forced)
            if scope.track:
                layer.load_tracker.record(forced, new)
                if self._agree is not None:
                    same = (idx.sort(dim=-1).values == forced.sort(dim=-1).values).all(dim=-1)
                    self._agree[j] += float(same.sum())
                    if j == 0:
                        self._agree_tokens[0] += float(idx.shape[0])
            return logits, new, forced

        return hook

    def check_replay(self, replay: torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
        """replay [T, n_moe, k] integer expert ids -> int64 on `device`; a ValueError names what is wrong."""
        want = (T, len(self.layers), self.top_k)
        if tuple(replay.shape) != want:
            raise ValueError(f"replay_experts must have shape [T, n_moe_layers, k] = {list(want)} for this "
                             f"HF MoE, got {tuple(replay.shape)}; were the routes recorded with another "
                             "model?")
        if replay.dtype.is_floating_point or replay.dtype == torch.bool:
            raise ValueError(f"replay_experts must be an integer tensor of expert ids, got {replay.dtype}")
        idx = replay.to(device=device, dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.n_experts):
            raise ValueError(f"replay_experts holds expert ids in [{int(idx.min())}, {int(idx.max())}], "
                             f"outside [0, {self.n_experts}); were they recorded with another model?")
        if self.top_k > 1 and idx.numel():
            srt = idx.sort(dim=-1).values
            if bool((srt[..., 1:] == srt[..., :-1]).any()):
                raise ValueError("replay_experts repeats an expert within a token's k choices; make them "
                                 "distinct")
        return idx

    @contextlib.contextmanager
    def scope(self, replay: torch.Tensor | None = None, record: bool = False,
              track: bool = False) -> Iterator[list[list[torch.Tensor]] | None]:
        """Inside: routers replay `replay` (int64 [T, n_moe, k], checked) if given, record their free choice
        if `record` (the yielded per-layer lists), and track load / agreement if `track`."""
        rec = [[] for _ in self.layers] if record else None
        token = _SCOPE.set(_Scope(replay, rec, track))
        try:
            yield rec
        finally:
            _SCOPE.reset(token)

    @staticmethod
    def stack(record: list[list[torch.Tensor]]) -> torch.Tensor:
        """Per-layer lists of free idx [t_i, k] (one per router call, in token order) -> int64
        [T, n_moe, k]."""
        return torch.stack([torch.cat(calls) for calls in record], dim=1).long()

    @contextlib.contextmanager
    def agreement(self, agree: torch.Tensor, counted: list[float]) -> Iterator[None]:
        """While open, every tracked replayed forward adds, per MoE layer j, the tokens whose free top-k set
        equals the replayed set to agree[j] (float64 [n_moe]), and its token count to counted[0]
        (rl/learner/routing.py `replay_agreement`, for Odyssey's routers)."""
        self._agree, self._agree_tokens = torch.zeros(len(self.layers), dtype=torch.float64), [0.0]
        try:
            yield
        finally:
            agree += self._agree
            counted[0] += self._agree_tokens[0]
            self._agree = None


def recompute_scope() -> contextlib.AbstractContextManager:
    """For activation checkpointing's recomputation: the routing scope of the forward being saved, replaying
    the same experts, recording and tracking nothing (a null context outside any scope)."""
    scope = _SCOPE.get()
    if scope is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        token = _SCOPE.set(_Scope(scope.replay, None, False))
        try:
            yield
        finally:
            _SCOPE.reset(token)

    return recompute()


__all__ = ["HFRouting", "ROUTER_FORMULAS", "RoutedLayer", "find_routed_layers", "recompute_scope",
           "sigmoid_group_weights", "softmax_topk_weights", "topk_softmax_weights"]
