"""Inference engines for rollouts: the `InferenceEngine` protocol and `TorchEngine`, its reference.

An engine turns `GenerationRequest`s into `GenerationResult`s:

    request: prompt_ids (the tokens to append: a whole prompt, or on a later turn of the same
             conversation only the new observation tokens), SamplingParams, optional Session, and the
             images among those tokens: (offset of the image block's <|image_start|> in prompt_ids,
             model.image.PreparedImage), as `model.tokenizer.encode_chat_images` returns them
    result:  token_ids [n_new], logprobs [n_new] (of the distribution actually sampled from, see
             rl/rollout/sampling.py), routed experts of every fed token (R3):
             prompt_routed_experts [n_prompt, n_moe_layers, k] and routed_experts [n_new, n_moe_layers, k],
             finish_reason "stop_token" | "stop_string" | "length", and the Session to continue from.

Sessions (multi-turn continuation): the Session returned with a result holds the model cache of the
whole conversation so far (prompt + generated tokens, the last generated token included), so the
next turn's request carries only the new tokens and nothing is re-run. A session's cache is tied to
the weights it was computed with (`Session.weight_version`).

Weight updates (`update_weights`, between decode steps) never let a cache computed with old weights
be reused: a session continued after an update, and a sequence still decoding when the update lands
(a partial rollout), are re-prefilled from their token history (`Session.token_ids`) with the new
weights before their next token is sampled. Every sampled token records the version of the weights
whose logits it was drawn from (`GenerationResult.token_versions`); recorded routing and log-probs
of earlier tokens stay those of the weights that produced them.

TorchEngine: OdysseyForCausalLM (or any HF causal LM through model.hf_policy.HFPolicy, whose KV cache has
one row per sequence and pads only inside a batched decode step) in fp32 (CPU or GPU), no padding anywhere:
- prefill is packed (cu_seqlens) and chunked: at most `prefill_chunk_size` tokens per forward, with
  logits only at the positions that are sampled from, so a 100K-token observation never builds a
  [T, T] or [T, vocab] tensor (the model's packed forward is causal per sequence, so chunked
  prefill over the cache equals one pass: tested);
- decode is batched and continuous: each step feeds one token per running sequence
  (input_ids [N], cu_seqlens = 0..N, cache rows = sequences), sequences join after their prefill
  and leave when finished (OdysseyCache.concat / .select);
- a sequence that stops is fed its last token once more ("flush") before leaving, so its cache
  holds every token and the routed experts of every generated token are recorded;
- sampling draws from a per-request torch.Generator: tokens do not depend on batch composition;
- images (TorchEngine only; VllmEngine refuses them): each image's patch embeddings are written over its
  <|image_pad|> tokens in the prefill (`model.vision.ImagePatches`, windowed when a chunk boundary cuts
  an image); a session keeps its images with its token history, so a re-prefill after a weight update
  sees them again.

Concurrency: many episodes share one batched engine through `await engine.agenerate(request)`; a
single asyncio serving task gathers pending requests and steps them with the running ones in a
worker thread (the event loop stays free for sandbox I/O). `generate(requests)` is the blocking
twin for scripts and tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from rl.rollout.sampling import (
    SamplingParams,
    UniformStream,
    make_generator,
    sample_tokens,
    sampling_logprobs,
)

FinishReason = Literal["stop_token", "stop_string", "length"]


@dataclass
class Session:
    """Engine-side state of one conversation: the cache row holding every token fed so far.

    cache: model cache with one row (None until the first request). num_tokens: tokens it holds.
    token_ids: those tokens, in order (to rebuild the cache after a weight update).
    next_logits [V]: next-token logits after the last fed token (lets a request with no new tokens
    continue). weight_version: the weights the cache was computed with.
    """

    cache: Any = None
    num_tokens: int = 0
    next_logits: torch.Tensor | None = None
    weight_version: int = 0
    busy: bool = False
    token_ids: list[int] = field(default_factory=list)
    images: list[tuple[int, Any]] = field(default_factory=list)  # (position in token_ids, PreparedImage)


@dataclass
class GenerationRequest:
    """prompt_ids: tokens to append before generating (whole prompt, or only the new tokens when
    continuing `session`). sampling: decoding parameters. session: None starts a new conversation.
    forced_ids: teacher forcing (TorchEngine): instead of sampling, the engine appends these tokens as the
    turn's output and returns them with their log-probs under the distribution `sampling` describes and
    their routed experts, as if it had sampled them (a scripted policy scored by the real model).
    images: (offset in prompt_ids of an image block's <|image_start|> token, model.image.PreparedImage) for
    each image among the prompt tokens; the block must be model.vision.image_token_ids(*image.grid)."""

    prompt_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session: Session | None = None
    request_id: str | None = None
    forced_ids: Sequence[int] = ()
    images: Sequence[tuple[int, Any]] = ()


@dataclass
class GenerationResult:
    request_id: str | None
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_routed_experts: np.ndarray | None  # uint16 [n_prompt, n_moe_layers, k]
    routed_experts: np.ndarray | None  # uint16 [n_new, n_moe_layers, k]
    session: Session
    weight_version: int
    prompt_len: int = 0
    token_versions: list[int] = field(default_factory=list)  # [n_new] weights version of each sampled token


@runtime_checkable
class InferenceEngine(Protocol):
    """What the agent loop and the rollout worker need from an engine (TorchEngine, vLLM plugin)."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]: ...

    async def agenerate(self, request: GenerationRequest) -> GenerationResult: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def release(self, session: Session) -> None: ...

    @property
    def weight_version(self) -> int: ...


def stop_reason(
    tokens: list[int],
    params: SamplingParams,
    detokenize: Callable[[list[int]], str] | None,
    budget: int | None = None,
) -> FinishReason | None:
    """Why generation stops after the last of `tokens` (the tokens generated so far), or None to go on.
    In this order: a stop token id ("stop_token"); a stop string in the decoded tail ("stop_string"; the
    tail is the last longest-stop-string + 4 tokens, so a string split across tokens is found); the
    budget, `params.max_new_tokens` unless `budget` is given ("length"). Every engine applies these rules."""
    if tokens[-1] in params.stop_token_ids:
        return "stop_token"
    if params.stop_strings:
        longest = max(len(x) for x in params.stop_strings)
        tail = detokenize(tokens[-(longest + 4) :])
        if any(x in tail for x in params.stop_strings):
            return "stop_string"
    if len(tokens) >= (params.max_new_tokens if budget is None else budget):
        return "length"
    return None


class _Seq:
    """One request in flight."""

    __slots__ = (
        "req",
        "params",
        "gen",
        "uniforms",
        "session",
        "todo",
        "pos",
        "cache",
        "prompt_routed",
        "tokens",
        "logprobs",
        "routed",
        "finish",
        "flushing",
        "last_logits",
        "future",
        "versions",
        "n_hist",
        "cache_version",
        "n_forced",
        "forced_logits",
        "images",
        "patches",
    )

    def __init__(self, req: GenerationRequest, seed: int, new_session: Session):
        self.req = req
        self.params = req.sampling
        self.gen = make_generator(seed)
        self.uniforms = UniformStream(self.gen)
        self.session = req.session if req.session is not None else new_session
        self.n_forced = len(req.forced_ids)  # teacher-forced output, prefilled after the prompt
        self.todo = list(map(int, req.prompt_ids)) + list(map(int, req.forced_ids))
        self.images = [(int(o), img) for o, img in req.images]  # (position in todo, PreparedImage)
        self.patches = None  # ImagePatches over todo positions, built at the first prefill
        self.pos = 0  # tokens of `todo` already prefilled
        # logits that score the forced tokens: the session's next-token logits when there is no prompt,
        # then the prefill's at each forced position but the last (filled by _prefill)
        self.forced_logits: dict[int, torch.Tensor] = {}
        if self.n_forced and not req.prompt_ids and self.session.next_logits is not None:
            self.forced_logits[-1] = self.session.next_logits
        self.cache = self.session.cache
        self.prompt_routed: list[np.ndarray] = []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routed: list[np.ndarray] = []  # one [1, L, k] row per decode step (views of the step's array)
        self.finish: FinishReason | None = None
        self.flushing = False
        self.last_logits: torch.Tensor | None = self.session.next_logits if not self.todo else None
        self.future: asyncio.Future | None = None
        self.versions: list[int] = []  # weights version of each sampled token
        self.n_hist = 0  # leading tokens of `todo` re-fed from the session's history (stale cache)
        self.cache_version = self.session.weight_version  # weights the sequence's cache was computed with


def _cat_routing(parts: list[np.ndarray], skip: int = 0) -> np.ndarray | None:
    """Concatenated routing rows, without the first `skip` (history re-fed after a weight update)."""
    if not parts:
        return None
    return np.concatenate(parts, 0)[skip:].astype(np.uint16)


class TorchEngine:
    """Reference engine on `OdysseyForCausalLM` (see the module docstring).

    model: an OdysseyForCausalLM (put in eval mode here). detokenize: ids -> text, needed only for
    stop strings. max_batch_size: most sequences decoded together. prefill_chunk_size: most tokens per
    prefill forward. seed: base of the seeds drawn for requests that give none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        detokenize: Callable[[list[int]], str] | None = None,
        max_batch_size: int = 64,
        prefill_chunk_size: int = 2048,
        seed: int = 0,
        weight_version: int = 0,
    ):
        if max_batch_size < 1 or prefill_chunk_size < 1:
            raise ValueError("max_batch_size and prefill_chunk_size must be >= 1")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.config = model.config
        self.detokenize = detokenize
        self.max_batch_size = max_batch_size
        self.prefill_chunk_size = prefill_chunk_size
        self._seed_seq = itertools.count()
        self._base_seed = seed
        self._version = weight_version
        self._lock = threading.Lock()  # one forward at a time; weight updates wait for the step
        self._moe = len(getattr(model, "moe_layer_indices", []) or []) > 0
        # async serving state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[_Seq] = []
        self._running: list[_Seq] = []
        self._joining: list[_Seq] = []  # taken from _pending by the step now running in the thread
        self._batch_cache: Any = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # the decode step's own thread: never the loop's default executor, which other code (agents) may fill
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.stats = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "forwards": 0,
            "forward_s": 0.0,
            "requests": 0,
            "max_batch": 0,
        }

    # ------------------------------------------------------------------ public API
    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights between decode steps (later steps use them). The keys must match the
        model's state_dict exactly; nothing is loaded otherwise. Caches computed with the old weights
        (open sessions, sequences mid-decode) are rebuilt from their tokens before they are used again."""
        expected = set(self.model.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(
                f"update_weights: state_dict does not match the model: missing={missing[:5]} "
                f"unexpected={unexpected[:5]} (pass model.state_dict() of the same config)"
            )
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
            self._version = int(version)

    def update_weights_stream(self, names: Sequence[str], buckets: Iterable[Mapping[str, torch.Tensor]],
                              version: int) -> None:
        """`update_weights` bucket by bucket (a sharded learner's sync, rl/learner/shard_export.py): `names`,
        every key the buckets will hold, must be exactly the model's (checked before anything is loaded);
        each bucket is loaded with load_state_dict(strict=False) and dropped before the next is read. The lock
        is held throughout, so no decode step sees half the new weights (rl/rollout/weight_stream.py)."""
        from rl.rollout.weight_stream import check_weight_names, checked_buckets

        check_weight_names(names, self.model.state_dict().keys())
        with self._lock, torch.no_grad():
            for bucket in checked_buckets(names, buckets):
                self.model.load_state_dict(bucket, strict=False)
                del bucket
            self._version = int(version)

    def release(self, session: Session) -> None:
        """Drop a conversation's cache (the agent loop calls this when an episode ends)."""
        session.cache = None
        session.next_logits = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking: run `requests` to completion with continuous batching; results in request order."""
        seqs: list[_Seq] = []
        try:
            seqs += (self._new_seq(r) for r in requests)
            pending, running, cache = list(seqs), [], None
            while pending or running:
                free = self.max_batch_size - len(running)
                joining, pending = pending[:free], pending[free:]
                running, cache, _ = self._step(running, cache, joining)
        except BaseException:  # a bad request or a failed step: no session stays marked busy
            for s in seqs:
                s.session.busy = False
            raise
        return [self._result(s) for s in seqs]

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Awaitable single request; concurrent callers are decoded together in one batch."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            if self._running or self._joining or self._pending:
                raise RuntimeError("TorchEngine is serving requests on another event loop")
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._serve())
        seq = self._new_seq(request)
        seq.future = loop.create_future()
        self._pending.append(seq)
        self._wake.set()
        return await seq.future

    async def aclose(self) -> None:
        """Stop the serving task; requests still in flight fail with RuntimeError("engine closed")."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._task = None
        for s in self._running + self._joining + self._pending:
            s.session.busy = False
            if s.future is not None and not s.future.done():
                s.future.set_exception(RuntimeError("TorchEngine closed while this request was in flight"))
        self._running, self._joining, self._pending, self._batch_cache = [], [], [], None

    # ------------------------------------------------------------------ serving loop
    async def _serve(self) -> None:
        assert self._wake is not None
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch-engine")
        loop = asyncio.get_running_loop()
        while True:
            if not self._running and not self._pending:
                self._wake.clear()
                await self._wake.wait()
            free = self.max_batch_size - len(self._running)
            joining, self._pending = self._pending[:free], self._pending[free:]
            self._joining = joining
            try:
                running, cache, finished = await loop.run_in_executor(
                    self._executor, self._step, self._running, self._batch_cache, joining
                )
            except Exception as err:  # fail every request in flight, keep serving new ones
                for s in self._running + joining:
                    if s.future is not None and not s.future.done():
                        s.future.set_exception(err)
                    s.session.busy = False
                self._running, self._joining, self._batch_cache = [], [], None
                continue
            self._running, self._joining, self._batch_cache = running, [], cache
            for s in finished:
                if s.future is not None and not s.future.done():
                    s.future.set_result(self._result(s))

    # ------------------------------------------------------------------ core
    def _new_seq(self, req: GenerationRequest) -> _Seq:
        if req.session is not None and req.session.busy:
            raise RuntimeError("this session already has a request in flight; await it before continuing")
        if not req.prompt_ids and (req.session is None or req.session.next_logits is None):
            raise ValueError(
                "GenerationRequest.prompt_ids is empty and there is no session to continue: "
                "give at least one prompt token"
            )
        if req.sampling.stop_strings and self.detokenize is None:
            raise ValueError(
                "stop_strings need a detokenizer: TorchEngine(model, detokenize=tokenizer.decode)"
            )
        if req.images:
            self._check_images(req)
        seed = req.sampling.seed
        if seed is None:
            seed = hash((self._base_seed, next(self._seed_seq))) & 0x7FFFFFFF
        seq = _Seq(req, seed, Session(weight_version=self._version))
        seq.session.busy = True
        self.stats["requests"] += 1
        return seq

    def _check_images(self, req: GenerationRequest) -> None:
        """Images need a vision model, and each must sit on its own image block inside prompt_ids."""
        from model.vision import image_token_ids

        p = getattr(self.config, "vision_patch_size", 0)
        if not p:
            raise ValueError("GenerationRequest.images given but the model is text-only "
                             "(vision_patch_size=0); use a model preset with vision settings")
        prompt = list(map(int, req.prompt_ids))
        prev = 0
        for j, (o, img) in enumerate(req.images):
            grid = getattr(img, "grid", None)
            pixels = getattr(img, "pixels", None)
            if grid is None or pixels is None:
                raise ValueError(f"GenerationRequest.images[{j}] must be (offset, PreparedImage) as "
                                 "model.tokenizer.encode_chat_images returns it")
            block = image_token_ids(*grid)
            if not (prev <= int(o) and prompt[int(o):int(o) + len(block)] == block):
                raise ValueError(f"GenerationRequest.images[{j}] at offset {o}: prompt_ids there are not the "
                                 f"image block of its {grid[0]}x{grid[1]} grid (or it overlaps the previous "
                                 "image); "
                                 "take prompt_ids and images from one encode_chat_images / "
                                 "encode_continuation_images call")
            if tuple(pixels.shape) != (3, grid[0] * p, grid[1] * p):
                raise ValueError(f"GenerationRequest.images[{j}] has pixels {tuple(pixels.shape)}, not "
                                 f"[3, {grid[0] * p}, {grid[1] * p}] for the model's patch size {p}: prepare "
                                 "images with the model's vision_patch_size and vision_max_pixels")
            prev = int(o) + len(block)

    def _patches(self, s: _Seq) -> Any:
        """ImagePatches of `s` over its todo positions (None without images), built once."""
        if not s.images:
            return None
        if s.patches is None:
            from model.vision import ImagePatches

            s.patches = ImagePatches.from_images([img.pixels for _, img in s.images],
                                                 [o for o, _ in s.images], self.config.vision_patch_size)
        return s.patches

    def _result(self, s: _Seq) -> GenerationResult:
        s.session.busy = False
        return GenerationResult(
            request_id=s.req.request_id,
            token_ids=list(s.tokens),
            logprobs=list(s.logprobs),
            finish_reason=s.finish or "length",
            prompt_routed_experts=_cat_routing(s.prompt_routed, skip=s.n_hist),
            routed_experts=_cat_routing(s.routed),
            session=s.session,
            weight_version=self._version,
            prompt_len=len(s.todo) - s.n_hist,
            token_versions=list(s.versions),
        )

    def _forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache: Any, logit_index: torch.Tensor | None,
        images: Any = None,
    ) -> tuple[torch.Tensor, np.ndarray | None, Any]:
        """One packed forward on the model's device. logit_index None = every position (a decode step).
        images: ImagePatches over input_ids positions (prefill) or None.
        Returns (logits [len(logit_index), V] fp32 on CPU, routed experts [T, L, k] as a numpy array | None,
        cache on the model's device)."""
        t0 = time.perf_counter()
        dev = self.device
        logits, routed, cache = _packed_forward(
            self.model, input_ids.to(dev), cu_seqlens.to(dev), cache,
            logit_index.to(dev) if logit_index is not None else None, self._moe,
            images.to(dev) if images is not None else None,
        )
        self.stats["forwards"] += 1
        self.stats["forward_s"] += time.perf_counter() - t0
        return logits.cpu(), (routed.cpu().numpy() if routed is not None else None), cache

    def _step(
        self, running: list[_Seq], cache: Any, joining: list[_Seq]
    ) -> tuple[list[_Seq], Any, list[_Seq]]:
        """Prefill `joining`, then one decode step over everyone. Returns (running, batch cache, finished)."""
        finished: list[_Seq] = []
        with self._lock, torch.inference_mode():
            for s in joining:  # a session continued after a weight update: re-feed its whole history
                if s.cache is not None and s.cache_version != self._version:
                    self._refeed_history(s)
            if running and any(s.cache_version != self._version for s in running):
                cache = self._rebuild_running(running, cache)
            if joining:
                self._prefill(joining)
                for s in joining:
                    s.cache_version = self._version
                firsts = [s for s in joining if s.params.max_new_tokens > 0 and not s.n_forced]
                for s in joining:
                    if s.n_forced:  # teacher-forced: scored in the prefill, nothing to sample
                        self._take_forced(s)
                        self._leave(s, s.cache, s.last_logits)
                        finished.append(s)
                    elif s.params.max_new_tokens == 0:  # prefill only
                        s.finish = "length"
                        self._leave(s, s.cache, s.last_logits)
                        finished.append(s)
                if firsts:
                    self._sample(firsts, torch.stack([s.last_logits for s in firsts]))
                    cache = _concat(
                        [cache] + [s.cache for s in firsts] if running else [s.cache for s in firsts]
                    )
                    running = running + firsts
                    for s in firsts:
                        s.cache = None
            if not running:
                return [], None, finished
            self.stats["max_batch"] = max(self.stats["max_batch"], len(running))
            # decode: feed each sequence's last sampled token
            n = len(running)
            ids = torch.tensor([s.tokens[-1] for s in running], dtype=torch.long)
            cu = torch.arange(n + 1, dtype=torch.int32)
            logits, routed, cache = self._forward(ids, cu, cache, None)
            self.stats["decode_tokens"] += n
            sampling = []
            fed_last = [s.flushing for s in running]  # this step fed the stopping token: the flush is done
            for i, s in enumerate(running):
                if routed is not None:
                    s.routed.append(routed[i : i + 1])
                if not s.flushing:
                    sampling.append(i)
            if sampling:
                self._sample([running[i] for i in sampling], logits[sampling])
            keep = []
            for i, s in enumerate(running):
                if fed_last[i]:
                    assert routed is None or len(s.routed) == len(s.tokens)
                    self._leave(s, _select(cache, [i]), logits[i])
                    finished.append(s)
                else:
                    keep.append(i)
            if len(keep) < n:
                cache = _select(cache, keep) if keep else None
                running = [running[i] for i in keep]
        return running, cache, finished

    def _take_forced(self, s: _Seq) -> None:
        """Move the prefilled forced tokens of `s` from its prompt to its output: their log-probs under the
        request's sampling distribution (rl/rollout/sampling.py, as if sampled), their routed experts, and
        the finish reason the stop rules give for them (the budget being the forced length)."""
        n, m = s.n_forced, len(s.todo) - s.n_forced
        forced = s.todo[m:]
        rows = torch.stack([s.forced_logits[i] for i in range(m - 1, m + n - 1)])  # row j scores token j
        p = s.params
        lp = sampling_logprobs(rows, [p] * n).gather(-1, torch.tensor(forced)[:, None]).squeeze(-1)
        if p.temperature == 0:  # greedy reports 0.0, as sample_tokens does
            lp = torch.zeros_like(lp)
        s.todo, s.tokens, s.logprobs = s.todo[:m], forced, lp.tolist()
        s.versions = [self._version] * n
        if s.prompt_routed:
            routed = np.concatenate(s.prompt_routed, 0)
            s.prompt_routed, s.routed = [routed[: len(routed) - n]], [routed[len(routed) - n :]]
        s.finish = stop_reason(forced, p, self.detokenize, budget=n)
        s.forced_logits = {}

    def _leave(self, s: _Seq, cache_row: Any, next_logits: torch.Tensor | None) -> None:
        sess = s.session
        sess.cache = cache_row
        sess.num_tokens += len(s.todo) + len(s.tokens)
        sess.images += [(len(sess.token_ids) + o, img) for o, img in s.images]
        sess.token_ids += s.todo + s.tokens
        sess.next_logits = next_logits
        sess.weight_version = self._version

    def _refeed_history(self, s: _Seq) -> None:
        """`s` continues a session whose cache predates the current weights: drop the cache and prefill
        the session's tokens + the new ones instead (routing and prompt_len count only the new ones)."""
        sess = s.session
        s.n_hist = len(sess.token_ids)
        s.images = list(sess.images) + [(s.n_hist + o, img) for o, img in s.images]
        s.patches = None
        s.todo = list(sess.token_ids) + s.todo
        s.cache, s.last_logits = None, None
        sess.cache, sess.next_logits, sess.token_ids, sess.num_tokens = None, None, [], 0
        sess.images = []

    def _rebuild_running(self, running: list[_Seq], cache: Any) -> Any:
        """Batch cache with the rows of sequences decoded under older weights recomputed from their tokens
        (session history + this request's prompt + generated tokens but the last, which the next decode
        step feeds). Fresh rows are kept as they are."""
        stale = [i for i, s in enumerate(running) if s.cache_version != self._version]
        probes = []
        for i in stale:
            s = running[i]
            hist = list(s.session.token_ids) + s.todo + s.tokens[:-1]
            n_sess = len(s.session.token_ids)
            images = list(s.session.images) + [(n_sess + o, img) for o, img in s.images]
            probe = _Seq(GenerationRequest(hist, images=images), 0, Session(weight_version=self._version))
            probes.append(probe)
        self._prefill(probes)
        rebuilt = dict(zip(stale, (p.cache for p in probes)))
        rows = [rebuilt[i] if i in rebuilt else _select(cache, [i]) for i in range(len(running))]
        for s in running:
            s.cache_version = self._version
        return _concat(rows)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        u = torch.tensor([s.uniforms.next() for s in seqs], dtype=torch.float64)
        tokens, lps = sample_tokens(logits, [s.params for s in seqs], [s.gen for s in seqs], uniforms=u)
        for s, t, lp in zip(seqs, tokens.tolist(), lps.tolist()):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(self._version)
            s.finish = stop_reason(s.tokens, s.params, self.detokenize)
            if s.finish is not None:
                s.flushing = True

    def _prefill(self, seqs: list[_Seq]) -> None:
        """Packed, chunked prefill: each forward holds at most prefill_chunk_size tokens in total."""
        for s in seqs:
            if s.cache is None and s.todo:
                s.cache = _empty_cache(self.model, 1)
        active = [s for s in seqs if s.pos < len(s.todo)]
        while active:
            budget, parts = self.prefill_chunk_size, []
            for s in active:
                if budget == 0:
                    break
                n = min(len(s.todo) - s.pos, budget)
                parts.append((s, n))
                budget -= n
            ids = torch.tensor([t for s, n in parts for t in s.todo[s.pos : s.pos + n]], dtype=torch.long)
            lens = torch.tensor([n for _, n in parts])
            cu = torch.zeros(len(parts) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(lens, 0)
            done = [i for i, (s, n) in enumerate(parts) if s.pos + n == len(s.todo)]
            index = [int(cu[i + 1]) - 1 for i in done]
            wanted = []  # (seq, todo position) whose logits score a forced token
            for i, (s, n) in enumerate(parts):
                first = len(s.todo) - s.n_forced - 1  # the last prompt token's logits score forced token 0
                for q in range(max(s.pos, first), min(s.pos + n, len(s.todo) - 1)) if s.n_forced else ():
                    wanted.append((s, q))
                    index.append(int(cu[i]) + q - s.pos)
            logit_index = torch.tensor(index, dtype=torch.long)
            cache = _concat([s.cache for s, _ in parts]) if len(parts) > 1 else parts[0][0].cache
            windows = [(self._patches(s), s.pos, n, int(cu[i])) for i, (s, n) in enumerate(parts)]
            windows = [(p.window(a, a + n), o) for p, a, n, o in windows if p is not None]
            images = None
            if windows:
                from model.vision import ImagePatches

                images = ImagePatches.concat([w for w, _ in windows], [o for _, o in windows])
            logits, routed, cache = self._forward(ids, cu, cache, logit_index, images)
            for j, (s, q) in enumerate(wanted):
                s.forced_logits[q] = logits[len(done) + j]
            self.stats["prefill_tokens"] += int(lens.sum())
            for i, (s, n) in enumerate(parts):
                s.cache = _select(cache, [i]) if len(parts) > 1 else cache
                if routed is not None:
                    s.prompt_routed.append(routed[int(cu[i]) : int(cu[i + 1])])
                s.pos += n
            for j, i in enumerate(done):
                parts[i][0].last_logits = logits[j]
            active = [s for s in active if s.pos < len(s.todo)]


# ---------------------------------------------------------------------- model adapters
def _empty_cache(model: torch.nn.Module, n: int) -> Any:
    if hasattr(model, "empty_cache"):  # model.hf_policy.HFPolicy: its own KV rows
        return model.empty_cache(n)
    from model.cache import OdysseyCache

    p = next(model.parameters())
    return OdysseyCache.empty(model.config, n, device=p.device, dtype=p.dtype)


def _concat(caches: list[Any]) -> Any:
    if len(caches) == 1:
        return caches[0]
    return type(caches[0]).concat(caches)  # OdysseyCache | HFPackedCache


def _select(cache: Any, indices: list[int]) -> Any:
    return cache.select(indices)


def _packed_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache: Any,
    logit_index: torch.Tensor | None,
    moe: bool,
    images: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Packed forward returning logits only at `logit_index` (positions in input_ids; None = all): [len, V]
    fp32.

    Runs the backbone (`model.model`: hidden [T, D]) and applies the LM head to the selected rows only,
    so a prefill chunk never builds [T, vocab]. images: ImagePatches over input_ids positions, or None.
    Returns (logits, routed [T, n_moe, k] | None, new cache).
    """
    if hasattr(model, "packed_logits"):  # model.hf_policy.HFPolicy (an HF MoE records its routes)
        if moe:
            return model.packed_logits_routed(input_ids, cu_seqlens, cache, logit_index)
        logits, cache = model.packed_logits(input_ids, cu_seqlens, cache, logit_index)
        return logits, None, cache
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(model, "head_logits"):  # not an OdysseyForCausalLM: full forward
        kw = {"images": images} if images is not None else {}
        out = model(input_ids, cu_seqlens=cu_seqlens, cache=cache, return_routed_experts=moe, **kw)
        logits = out.logits if logit_index is None else out.logits[logit_index]
        return logits.float(), (out.routed_experts if moe else None), out.cache
    h, new_layers, routed, _ = backbone(input_ids, cu_seqlens, cache, None, moe, images)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    logits = model.head_logits(h if logit_index is None else h[logit_index]).float()
    return logits, routed, cache.advanced(new_layers, lens)
