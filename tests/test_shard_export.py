"""Weight sync from an FSDP2-sharded learner, bucket by bucket (rl/learner/shard_export.py).

- Oracle (gloo, 2 and 4 spawned ranks): the concatenation of the buckets equals `full_state_dict(policy)`
  (torch's distributed-checkpoint gather) and the weights before sharding, key for key, in order, bit for bit,
  for Odyssey's tiny policy (tied and untied LM head, random router biases); with a bf16 cast it equals the
  cast of those. Every rank yields once per bucket; only rank 0 gets tensors; no bucket exceeds its cap
  unless it is a single larger tensor.
- Memory (the same ranks): the peak RSS rank 0 adds while streaming a 64 MiB model in 8 MiB buckets stays
  within one bucket plus two of its largest tensor plus 4 MiB, while `full_state_dict` adds the whole model.
  glibc's mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_) so a freed tensor leaves RSS at once and the
  high-water mark (reset through /proc/self/clear_refs) is what was live at the peak.
- Sync (real Ray cluster): a 2-rank FSDP LearnerGroup after one step streams its weights to a RolloutWorker's
  TorchEngine; the engine's log-probs equal the learner's (<= 1e-4) and the bf16/fp32 weights equal the full
  gather. Bad manifests are refused before anything is loaded.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rl.learner.shard_export import iter_weight_buckets, plan_buckets
from tests.dist_backend import GPUS_PER_RANK, init_rank, require_ranks

BUCKET = 1 << 20  # 1 MiB buckets on the tiny policy (15 MB fp32): ~15 buckets, some tensors larger than one
MiB = 1 << 20
MEM_LAYERS, MEM_WIDTH, MEM_BUCKET = 16, 1024, 8 * MiB  # 16 x 4 MiB fp32 layers, 8 MiB buckets
MEM_MARGIN = 4 * MiB  # allocator and gloo buffers beyond one bucket + two largest tensors


def _hwm_bytes() -> int:
    """Peak resident set size of this process since the last reset (VmHWM)."""
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _tiny_policy(tie: bool):
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM

    torch.manual_seed(0)
    policy = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", tie_word_embeddings=tie))
    with torch.no_grad():
        for name, b in policy.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return policy


def _bf16_cast(name: str, t: torch.Tensor):
    return None if (not t.is_floating_point() or name.endswith("e_score_correction_bias")) else torch.bfloat16


class _Stack(nn.Module):
    """The memory test's model: MEM_LAYERS square fp32 linears, each an FSDP unit, and a small root norm."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(MEM_WIDTH, MEM_WIDTH, bias=False) for _ in range(MEM_LAYERS))
        self.norm = nn.LayerNorm(MEM_WIDTH)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    device = init_rank(rank, world, init)
    try:
        from rl.learner.forward import TrainModule
        from rl.learner.fsdp import full_state_dict, shard_train_module

        result: dict = {}
        for tie in (False, True):
            policy = _tiny_policy(tie)
            before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            policy.to(device)
            shard_train_module(TrainModule(policy), device, "float32", "float32")
            full = full_state_dict(policy)
            buckets = list(iter_weight_buckets(policy, BUCKET))
            cast = list(iter_weight_buckets(policy, BUCKET, cast=_bf16_cast))
            counts = [None] * world
            dist.all_gather_object(counts, (len(buckets), len(cast), sum(len(b) for b in buckets + cast)))
            if rank == 0:
                result[tie] = {"before": before, "full": full, "buckets": buckets, "cast": cast,
                               "counts": counts}
        # memory: a 64 MiB model in 8 MiB buckets, then the full gather, each from a reset high-water mark
        torch.manual_seed(1)
        stack = _Stack().to(device)
        shard_train_module(stack, device, "float32", "float32")
        peaks = {}
        for how in ("buckets", "full"):
            dist.barrier()
            base = _rss_bytes()
            _reset_hwm()
            if how == "buckets":
                held = 0
                for bucket in iter_weight_buckets(stack, MEM_BUCKET):
                    held = max(held, sum(t.numel() * t.element_size() for t in bucket.values()))
                    del bucket
                peaks["held"] = held
            else:
                sd = full_state_dict(stack)
                del sd
            peaks[how] = _hwm_bytes() - base
        allp = [None] * world
        dist.all_gather_object(allp, peaks)
        if rank == 0:
            result["memory"] = allp
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def spawned(request, tmp_path_factory):
    world = request.param
    require_ranks(world)
    tmp = tmp_path_factory.mktemp(f"export{world}")
    out, init = str(tmp / "rank0.pt"), str(tmp / "rendezvous")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)  # the children inherit it (module docstring)
    try:
        mp.start_processes(_rank, args=(world, init, out), nprocs=world, start_method="spawn")
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    return world, torch.load(out)


def _names(buckets):
    return [k for b in buckets for k in b]


@pytest.mark.parametrize("tie", [False, True])
def test_buckets_concatenate_to_the_full_state_dict(spawned, tie):
    world, result = spawned
    r = result[tie]
    full, before, buckets = r["full"], r["before"], r["buckets"]
    assert _names(buckets) == list(full) == list(before)  # the unsharded names, in state-dict order
    assert len(set(_names(buckets))) == len(full)  # no name twice
    for k, v in full.items():
        got = next(b[k] for b in buckets if k in b)
        assert got.device.type == "cpu" and got.dtype == v.dtype and torch.equal(got, v), k
        assert torch.equal(got, before[k]), k
    assert any(k.endswith("e_score_correction_bias") for k in full)
    tied = torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    assert tied == tie
    for b in buckets:  # the cap holds, except for a single larger tensor
        nbytes = sum(t.numel() * t.element_size() for t in b.values())
        assert nbytes <= BUCKET or len(b) == 1, (list(b), nbytes)
    assert len(buckets) > 4 and any(len(b) > 1 for b in buckets)
    # every rank yields once per bucket; only rank 0 got tensors
    n, n_cast = len(buckets), len(r["cast"])
    assert r["counts"][0] == (n, n_cast, 2 * len(full))
    assert all(c == (n, n_cast, 0) for c in r["counts"][1:]), r["counts"]
    # with a cast: the cast of the full state dict, router biases kept fp32
    for k, v in full.items():
        got = next(b[k] for b in r["cast"] if k in b)
        want = v if _bf16_cast(k, v) is None else v.to(torch.bfloat16)
        assert got.dtype == want.dtype and torch.equal(got, want), k
    print(f"\n{world} ranks, tie={tie}: {len(full)} tensors in {n} buckets (bf16: {n_cast})")


def test_streaming_peak_memory_is_one_bucket_not_the_model(spawned):
    world, result = spawned
    model = MEM_LAYERS * MEM_WIDTH * MEM_WIDTH * 4
    largest = MEM_WIDTH * MEM_WIDTH * 4
    bound = MEM_BUCKET + 2 * largest + MEM_MARGIN
    for rank, p in enumerate(result["memory"]):
        print(f"\n{world} ranks, rank {rank}: streamed peak +{p['buckets'] / MiB:.1f} MiB (largest bucket "
              f"held {p['held'] / MiB:.1f} MiB), full gather +{p['full'] / MiB:.1f} MiB; model "
              f"{model / MiB:.0f} MiB")
        assert p["buckets"] <= bound, (rank, p)
    r0 = result["memory"][0]
    assert r0["held"] == MEM_BUCKET  # 2 layers a bucket
    assert r0["full"] >= 0.9 * model  # the measure sees the whole model when it is gathered


def test_plan_buckets_cuts_consecutive_runs_and_refuses_a_bad_size():
    sizes = [("a", 3), ("b", 3), ("c", 5), ("d", 1), ("e", 9), ("f", 2)]
    assert plan_buckets(sizes, 6) == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert plan_buckets(sizes, 100) == [["a", "b", "c", "d", "e", "f"]]
    assert plan_buckets([], 6) == []
    with pytest.raises(ValueError, match="bucket_bytes=0: a weight bucket needs a positive size"):
        plan_buckets(sizes, 0)


def test_unsharded_module_streams_copies_not_views():
    """Without a process group (an unsharded learner) the one process gets every bucket; the tensors are
    copies, so a later optimizer step does not change what was sent."""
    lin = nn.Linear(4, 3)
    got = {k: v for b in iter_weight_buckets(lin, 16) for k, v in b.items()}
    assert list(got) == ["weight", "bias"] and torch.equal(got["weight"], lin.weight)
    with torch.no_grad():
        lin.weight.add_(1.0)
    assert not torch.equal(got["weight"], lin.weight)


PARITY_TOL = 1e-4  # fp32: the engine's sampled-token log-probs against the learner's weights


class _DictOnlyEngine:
    """An engine without update_weights_stream (e.g. a scripted wrapper): it gets the buckets assembled."""

    def __init__(self) -> None:
        self.got: dict | None = None
        self.weight_version = 0

    def update_weights(self, state_dict, version: int) -> None:
        self.got, self.weight_version = dict(state_dict), version


@pytest.mark.ray
def test_sync_from_a_two_rank_fsdp_learner_streams_buckets_to_the_engine(ray_session):
    """A 2-rank FSDP LearnerGroup (tiny preset) after one step: `weights_ref` is a WeightBuckets manifest of
    several buckets; a RolloutWorker loads it bucket by bucket into its TorchEngine, whose log-probs then
    equal the learner's (the full gather's weights) within PARITY_TOL; the buckets equal the full gather
    exactly."""
    import asyncio

    import ray

    from rl.config import load_config
    from rl.learner.group import LearnerGroup
    from rl.learner.learner import master_policy
    from rl.policy import PolicySpec, build_policy
    from rl.rollout.engine import GenerationRequest, TorchEngine
    from rl.rollout.sampling import SamplingParams
    from rl.rollout.worker import RolloutWorker, WorkerSettings
    from rl.weight_buckets import WeightBuckets
    from tests.learner_fixtures import ragged_batch

    cfg = load_config("configs/tiny.yaml", ["learner.sharding=fsdp", "learner.num_ranks=2",
                                            "learner.routing_replay=false", "learner.lr=1e-3"])
    require_ranks(2)
    group = LearnerGroup(cfg, torch_threads=1, num_gpus=GPUS_PER_RANK)
    try:
        init = group.state_dict()
        group.step(ragged_batch(seed=11, routed=False))
        ref = group.weights_ref(bucket_bytes=BUCKET)
        manifest = ray.get(ref)
        full = group.state_dict()  # the full gather (full_state_dict), the oracle
    finally:
        group.shutdown()
    assert isinstance(manifest, WeightBuckets) and len(manifest.refs) > 4
    assert manifest.names == list(full)
    streamed = {k: v for b in manifest.stream() for k, v in b.items()}
    assert all(torch.equal(streamed[k], v) for k, v in full.items())
    assert manifest.nbytes == sum(v.numel() * v.element_size() for v in full.values())
    assert max(float((full[k] - init[k]).abs().max()) for k in full) > 1e-4  # the step moved the weights

    engine = TorchEngine(build_policy(PolicySpec.from_config(cfg)))
    worker = RolloutWorker(WorkerSettings.from_config(cfg), engine=engine)
    assert asyncio.run(worker.update_weights([ref], 1)) == 1
    learner = master_policy(cfg).eval()
    learner.load_state_dict(full)
    reqs = [GenerationRequest(list(range(20 + i, 30 + i)), SamplingParams(max_new_tokens=8, seed=i))
            for i in range(3)]
    worst = 0.0
    for req, res in zip(reqs, engine.generate(reqs)):
        ids = torch.tensor(list(req.prompt_ids) + res.token_ids)
        with torch.no_grad():
            want = learner.token_logprobs(ids[:-1], ids[1:])[len(req.prompt_ids) - 1:]
        worst = max(worst, float((torch.tensor(res.logprobs) - want).abs().max()))
        assert res.token_versions == [1] * len(res.token_ids)
    print(f"\nTorchEngine after a bucketed sync ({len(manifest.refs)} buckets): log-prob max|diff| "
          f"{worst:.2e}")
    assert worst <= PARITY_TOL

    # an engine without update_weights_stream gets the same weights assembled into one state dict
    plain = RolloutWorker(WorkerSettings.from_config(cfg), engine=_DictOnlyEngine())
    assert asyncio.run(plain.update_weights([ref], 2)) == 2
    assert list(plain.engine.got) == list(full)
    assert all(torch.equal(plain.engine.got[k], v) for k, v in full.items())

    # bad streams are refused naming the problem; a refused manifest loads nothing
    names, buckets = manifest.names, list(manifest.stream())
    with pytest.raises(ValueError, match=r"missing=\['lm_head.weight'\]"):
        engine.update_weights_stream([n for n in names if n != "lm_head.weight"], iter(buckets), 3)
    with pytest.raises(ValueError, match="names listed twice"):
        engine.update_weights_stream(names + names[:1], iter(buckets), 3)
    with pytest.raises(ValueError, match=r"ended with 1 of the manifest's names not loaded"):
        engine.update_weights_stream(names, iter([*buckets[:-1], dict(list(buckets[-1].items())[:-1])]), 3)
    with pytest.raises(ValueError, match="already loaded"):
        engine.update_weights_stream(names, iter([buckets[0], *buckets]), 3)
    assert engine.weight_version == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_loads_a_bucket_stream(tmp_path):
    """VllmEngine (in process) loads new weights streamed in 1 MiB buckets through vLLM's reload iterator:
    its log-probs then equal the new trainer model's (<= 1e-4, the vLLM parity tolerance); a bad manifest is
    refused before anything is loaded."""
    from model.tokenizer import load_tokenizer
    from rl.rollout.engine import GenerationRequest
    from rl.rollout.sampling import SamplingParams
    from tests.vllm_helpers import prompt, require_vllm, save_policy, trainer_view

    require_vllm()
    from rl.rollout.vllm_engine import VllmEngine

    save_policy("tiny", tmp_path / "old", seed=0)
    new = save_policy("tiny", tmp_path / "new", seed=7, bias_std=0.5)
    tok = load_tokenizer()
    eng = VllmEngine(str(tmp_path / "old"), detokenize=lambda ids: tok.decode(ids, skip_special_tokens=False),
                     max_model_len=512, max_num_seqs=4)
    try:
        names = list(new.state_dict())
        with pytest.raises(ValueError, match=r"missing=\['lm_head.weight'\]"):
            eng.update_weights_stream([n for n in names if n != "lm_head.weight"],
                                      iter_weight_buckets(new, BUCKET), 1)
        assert eng.weight_version == 0
        eng.update_weights_stream(names, iter_weight_buckets(new, BUCKET), 1)
        p = prompt(5, 40)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
        res = eng.generate([GenerationRequest(p, sp)])[0]
        lp, _ = trainer_view(new, p + res.token_ids, len(p))
        err = float((lp - torch.tensor(res.logprobs)).abs().max())
        print(f"\nVllmEngine after a bucketed sync: log-prob max|diff| {err:.2e}")
        assert res.weight_version == 1 and err <= PARITY_TOL
    finally:
        eng.shutdown()
