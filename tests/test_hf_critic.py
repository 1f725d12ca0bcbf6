"""The separate critic of an HF policy (`learner.value_model: critic` with `model.hf_path`;
rl/learner/value.py `HFCritic`): a copy of the policy's initial weights with a zero-initialised value head,
run through the policy's own packed forward.

Oracles and tolerances (fp32 CPU, small random checkpoints made here: a 2-layer Llama with an untied head, a
Qwen3 with a tied head, a 2-layer Qwen3-MoE):
- packed == alone: the critic's values of a packed micro-batch equal its head on transformers' own forward of
  each sequence alone, <= 1e-5 (head weights randomised, so the values are not all zero); an MoE critic
  leaves the policy's expert-load trackers untouched;
- shared prefixes: values of a micro-batch with shared prompts (prefix_of) equal the unshared one's, <= 1e-5;
- at build: every value is exactly 0, the trunk's weights are bit-equal to the policy's (own storage), every
  critic weight trains except an untied lm_head; with LoRA adapters on the policy the critic holds the base
  weights without adapters;
- a real learner PPO step (advantage=gae, value_model=critic) on TorchEngine rollouts: finite positive value
  loss, the value head, the critic's trunk and the policy all move;
- learner.activation_checkpointing: the same step (metrics, critic weights <= 1e-5) as without;
- resume: the critic's weights and AdamW state come back bit-exact, and the next step equals an
  uninterrupted learner's;
- learner.sharding=fsdp (2 spawned gloo ranks, marked slow): the same step as one rank (critic weights within
  5e-4 of how far they moved, loss and value loss 1e-5 relative), a sharded checkpoint restores the critic;
- configs/smollm2_arith_qa.yaml with learner.advantage=gae, learner.value_model=critic loads and a learner
  builds from it (a tiny random Llama as model.hf_path; the real SmolLM2 checkpoint validated when present);
- refused with a clear error: learner.critic_preset with an HF policy (config and builder), a critic of the
  other kind of model, images, a trunk that is not an HFPolicy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model.hf_policy import HFPolicy
from rl.config import ConfigError, load_config
from rl.learner.forward import TrainModule
from rl.learner.packing import collate
from rl.learner.prefix_sharing import share_prefixes
from rl.learner.value import Critic, HFCritic, build_value_model
from tests.test_hf_policy import V, make_llama, make_qwen3, make_qwen3_moe
from tests.test_prefix_sharing import _groups

torch.set_num_threads(1)
TOL = 1e-5
GAE_CRITIC = ("learner.advantage=gae", "learner.value_model=critic")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("llama"))


def _randomise_head(critic: HFCritic, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.head.proj.weight.copy_(torch.randn(critic.head.proj.weight.shape, generator=g) * 0.1)
        critic.head.proj.bias.fill_(0.3)


def _cfg(tmp_path, hf_dir: str, *extra: str):
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: arith}\n")
    return load_config(path, [f"model.hf_path={hf_dir}", "learner.group_size=2", "rollout.episodes=4",
                              "learner.lr=1e-3", *GAE_CRITIC, *extra])


def _rollouts(hf_dir: str):
    from rl.rollout.engine import TorchEngine
    from tests.test_hf_policy import _trajectories

    return _trajectories(TorchEngine(HFPolicy.from_pretrained(hf_dir)))


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


# ---- the critic's forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [make_llama, make_qwen3_moe], ids=["llama", "qwen3_moe"])
def test_packed_values_equal_each_sequence_alone(make, tmp_path):
    policy = HFPolicy.from_pretrained(make(tmp_path / "m")).train()
    critic = build_value_model("critic", policy, None, 0)
    assert isinstance(critic, HFCritic)
    _randomise_head(critic)
    g = torch.Generator().manual_seed(1)
    lens = [7, 13, 4, 9]
    ids = torch.randint(10, V, (sum(lens),), generator=g)
    cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32)
    pos = torch.tensor([1, 6, 7, 12, 19, 20, 23, 25, 32])
    got = critic(ids, cu, pos)  # training mode, with gradients: as in the learner
    with torch.no_grad():
        h = torch.cat([critic.trunk.model(input_ids=ids[a:b][None]).last_hidden_state[0]
                       for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        want = critic.head(h[pos])
    assert got.dtype == torch.float32 and got.shape == (len(pos),)
    assert want.abs().max() > 0.1  # the randomised head gives values that can differ
    assert (got.detach() - want).abs().max().item() <= TOL
    for layer in (policy.routing.layers if policy.routing is not None else []):  # the critic's own hooks
        assert layer.load_tracker.state_dict()["tokens"] == 0
    assert critic.moe_layers() == []


@pytest.mark.parametrize("make", [make_llama, make_qwen3], ids=["llama", "qwen3"])
def test_values_with_shared_prefixes_equal_the_unshared(make, tmp_path):
    policy = HFPolicy.from_pretrained(make(tmp_path / "m")).train()
    critic = build_value_model("critic", policy, None, 0)
    _randomise_head(critic)
    samples = _groups(seed=2)
    mb = collate(samples, ())
    sh = share_prefixes(mb, samples)
    assert sh.prefix_of is not None and sh.n_tokens < mb.n_tokens
    module = TrainModule(policy, critic)
    whole, shared = (module(batch, values=True).values.detach() for batch in (mb, sh))
    assert whole.abs().max() > 0.1
    assert (whole - shared).abs().max().item() <= TOL


# ---- at build ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [make_llama, make_qwen3], ids=["llama_untied", "qwen3_tied"])
def test_critic_starts_at_zero_as_a_copy_of_the_policy(make, tmp_path):
    policy = HFPolicy.from_pretrained(make(tmp_path / "m")).train()
    critic = build_value_model("critic", policy, None, 0)
    ids = torch.randint(10, V, (30,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(critic(ids, cu, torch.arange(30)), torch.zeros(30))
    want, got = policy.model.state_dict(), critic.trunk.model.state_dict()
    assert set(want) == set(got)
    for k, v in want.items():
        assert torch.equal(v, got[k]), k
        assert v.data_ptr() != got[k].data_ptr(), k  # a copy: training the critic leaves the policy alone
    tied = critic.trunk.lm_head.weight is critic.trunk.model.get_input_embeddings().weight
    assert tied == (make is make_qwen3)
    frozen = {n for n, p in critic.named_parameters() if not p.requires_grad}
    assert frozen == (set() if tied else {"trunk.lm_head.weight"})


def test_critic_of_a_lora_policy_is_a_full_copy_of_the_base(llama_dir):
    from rl.config import LoraSection
    from rl.learner.lora import apply_lora, has_lora, is_adapter_key

    policy = apply_lora(HFPolicy.from_pretrained(llama_dir),
                        LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"], dropout=0.0))
    with torch.no_grad():  # nonzero adapters: a copy of the merged weights would differ from the base
        for n, p in policy.named_parameters():
            if is_adapter_key(n):
                p.normal_(0, 0.05)
    critic = build_value_model("critic", policy, None, 0)
    assert not has_lora(critic) and has_lora(policy)
    base = HFPolicy.from_pretrained(llama_dir).model.state_dict()
    got = critic.trunk.model.state_dict()
    assert set(base) == set(got) and all(torch.equal(base[k], got[k]) for k in base)
    assert all(p.requires_grad for n, p in critic.trunk.model.named_parameters())


# ---- the learner ------------------------------------------------------------------------------------------


def test_learner_ppo_step_trains_the_critic_and_the_policy(llama_dir, tmp_path):
    from rl.learner import Learner

    learner = Learner(_cfg(tmp_path, llama_dir, "learner.ppo_epochs=2"))
    critic = learner.module.value
    assert isinstance(critic, HFCritic)
    optimised = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert all(id(p) in optimised for p in critic.parameters() if p.requires_grad)
    head0, trunk0 = _flat(critic.head.parameters()), _flat(critic.trunk.model.parameters())
    policy0 = _flat(learner.policy.parameters())
    m = learner.step(_rollouts(llama_dir))
    assert math.isfinite(m["learner/value_loss"]) and m["learner/value_loss"] > 0, m
    assert m["learner/optimizer_steps"] == 2 and math.isfinite(m["loss"])
    # epoch 1 trains the head (the trunk's gradient through a zero head is zero), epoch 2 the trunk too
    assert (_flat(critic.head.parameters()) - head0).abs().max() > 0
    assert (_flat(critic.trunk.model.parameters()) - trunk0).abs().max() > 0
    assert (_flat(learner.policy.parameters()) - policy0).abs().max() > 0


def test_activation_checkpointing_gives_the_same_critic_step(llama_dir, tmp_path):
    """learner.activation_checkpointing recomputes the critic's layers too (HFPolicy's checkpointing, which
    keeps the packed boundaries): the same metrics and critic weights as without (<= 1e-5)."""
    from rl.learner import Learner

    trajs = _rollouts(llama_dir)
    out = []
    for ckpt in (False, True):
        learner = Learner(_cfg(tmp_path, llama_dir, "learner.ppo_epochs=2",
                               f"learner.activation_checkpointing={ckpt}"))
        assert learner.module.value.trunk.hf.is_gradient_checkpointing is ckpt
        out.append((learner.step(trajs), _flat(learner.module.value.parameters())))
    (m0, w0), (m1, w1) = out
    for k in ("loss", "learner/value_loss", "grad_norm"):
        assert abs(m0[k] - m1[k]) <= TOL * max(1.0, abs(m0[k])), (k, m0[k], m1[k])
    assert (w0 - w1).abs().max().item() <= TOL


def _critic_optimizer_state(learner) -> list[dict[str, torch.Tensor]]:
    ids = {id(p) for p in learner.module.value.parameters()}
    return [learner.optimizer.state[p] for p in learner.params if id(p) in ids]


def test_resume_restores_the_critic_and_its_optimizer_state(llama_dir, tmp_path):
    from rl.learner import Learner

    cfg = _cfg(tmp_path, llama_dir, "learner.ppo_epochs=2")
    trajs = _rollouts(llama_dir)
    a = Learner(cfg)
    a.step(trajs)
    ckpt = a.save(tmp_path / "ckpt")
    b = Learner(cfg)
    assert not torch.equal(_flat(a.module.value.parameters()), _flat(b.module.value.parameters()))
    b.load(ckpt)
    sa, sb = a.module.value.state_dict(), b.module.value.state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = _critic_optimizer_state(a), _critic_optimizer_state(b)
    assert len(oa) == len(ob) == sum(1 for p in a.module.value.parameters() if p.requires_grad)
    for x, y in zip(oa, ob):
        assert set(x) == set(y) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(x[k], y[k]) for k in x)
    ma, mb = a.step(trajs), b.step(trajs)
    timing = ("learner/step_s", "learner/tokens_per_s")
    assert ({k: v for k, v in ma.items() if k not in timing}
            == {k: v for k, v in mb.items() if k not in timing})
    assert torch.equal(_flat(a.module.value.parameters()), _flat(b.module.value.parameters()))


def _fsdp_rank(rank: int, world: int, init: str, cfg, traj_file: str, ckpt: str, out: str) -> None:
    """One rank of the sharded learner: a policy step on its share, the critic gathered whole, a checkpoint
    written and loaded into a fresh sharded learner (collectives: every rank runs all of it)."""
    import torch.distributed as dist

    from rl.learner import Learner
    from rl.learner.fsdp import full_state_dict
    from tests.dist_backend import init_rank, train_share

    init_rank(rank, world, init)
    try:
        learner = Learner(cfg)
        m = train_share(learner, [torch.load(traj_file, weights_only=False)], world, rank)[0]
        critic = full_state_dict(learner.module.value)
        learner.save(ckpt)
        resumed = Learner(cfg)
        resumed.load(ckpt)
        again = full_state_dict(resumed.module.value)
        if rank == 0:
            torch.save({"metrics": m, "critic": critic, "resumed": again}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_ranks_train_the_critic_as_one_rank(llama_dir, tmp_path):
    """learner.sharding=fsdp, 2 spawned gloo ranks: the critic's decoder layers are FSDP units; after one
    step its weights equal an unsharded learner's (relative to how far they moved, <= 5e-4: the HF tolerance
    of tests/test_learner_fsdp.py, reduce order), the loss and value loss within 1e-5 relative, and a
    sharded checkpoint restores the critic exactly."""
    import torch.multiprocessing as mp

    from rl.learner import Learner
    from tests.dist_backend import require_ranks

    require_ranks(2)
    cfg = _cfg(tmp_path, llama_dir, "learner.num_ranks=2", "learner.sharding=fsdp", "learner.ppo_epochs=2")
    trajs = _rollouts(llama_dir)
    torch.save(trajs, tmp_path / "trajs.pt")
    out = tmp_path / "rank0.pt"
    mp.start_processes(_fsdp_rank, nprocs=2, start_method="spawn", args=(
        2, str(tmp_path / "rendezvous"), cfg, str(tmp_path / "trajs.pt"), str(tmp_path / "ckpt"), str(out)))
    got = torch.load(out, weights_only=False)
    single = Learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"num_ranks": 1, "sharding": "none"})}))
    before = {k: v.clone() for k, v in single.module.value.state_dict().items()}
    m1 = single.step(trajs)
    after = single.module.value.state_dict()
    keys = sorted(after)
    assert set(got["critic"]) == set(keys)
    flat = {name: torch.cat([sd[k].reshape(-1).double() for k in keys])
            for name, sd in (("before", before), ("single", after), ("fsdp", got["critic"]),
                             ("resumed", got["resumed"]))}
    moved = float((flat["single"] - flat["before"]).norm())
    assert moved > 0
    rel = float((flat["fsdp"] - flat["single"]).norm()) / moved
    print(f"fsdp vs one rank: critic weights rel {rel:.2e}, value loss rel "
          f"{abs(got['metrics']['learner/value_loss'] / m1['learner/value_loss'] - 1):.2e}")
    assert rel <= 5e-4
    assert torch.equal(flat["resumed"], flat["fsdp"])
    for k in ("loss", "learner/value_loss"):
        assert got["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-9), k


# ---- configs ----------------------------------------------------------------------------------------------


def test_smollm2_arith_qa_with_a_critic_loads_and_builds(llama_dir):
    from rl.learner import Learner

    cfg = load_config("configs/smollm2_arith_qa.yaml", [f"model.hf_path={llama_dir}", *GAE_CRITIC])
    assert (cfg.learner.advantage, cfg.learner.value_model) == ("gae", "critic")
    learner = Learner(cfg)
    assert isinstance(learner.module.value, HFCritic)


def test_the_real_smollm2_config_with_a_critic_passes_validation():
    from model.embedded import checkpoint_dir

    try:
        converted = (checkpoint_dir("smollm2-135m-instruct") / "config.json").is_file()
    except Exception as e:  # noqa: BLE001 - the GGUF file is missing: nothing to validate against
        pytest.skip(f"the embedded SmolLM2 GGUF is not available here ({e})")
    if not converted:
        pytest.skip("the embedded SmolLM2 checkpoint is not converted on this machine (`make setup`); "
                    "converting it takes tens of seconds")
    cfg = load_config("configs/smollm2_arith_qa.yaml", list(GAE_CRITIC))
    lc = cfg.learner
    assert (lc.advantage, lc.value_model, lc.critic_preset) == ("gae", "critic", None)


# ---- refused ----------------------------------------------------------------------------------------------


def test_critic_preset_with_an_hf_policy_is_refused(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="remove learner.critic_preset"):
        _cfg(tmp_path, llama_dir, "learner.critic_preset=tiny")
    policy = HFPolicy.from_pretrained(llama_dir)
    with pytest.raises(ValueError, match="remove learner.critic_preset"):
        build_value_model("critic", policy, "tiny", 0)


def test_a_critic_of_the_other_kind_of_model_is_refused(llama_dir):
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM, OdysseyModel

    hf = HFPolicy.from_pretrained(llama_dir)
    odyssey = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match="needs an HFCritic"):
        TrainModule(hf, Critic(OdysseyModel(OdysseyConfig.from_preset("tiny"))))
    with pytest.raises(ValueError, match="an Odyssey policy a Critic of an Odyssey trunk"):
        TrainModule(odyssey, build_value_model("critic", hf, None, 0))
    with pytest.raises(TypeError, match="must be an HFPolicy"):
        HFCritic(odyssey.model)
    with pytest.raises(ValueError, match="does not split a separate critic"):
        TrainModule(hf, build_value_model("critic", hf, None, 0), context_parallel_group=object())


def test_images_are_refused_by_the_hf_critic(llama_dir):
    from model.vision import ImagePatches

    critic = build_value_model("critic", HFPolicy.from_pretrained(llama_dir), None, 0)
    images = ImagePatches(torch.zeros(1, 3 * 2 * 2), torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]))
    ids, cu = torch.zeros(5, dtype=torch.long), torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="reads text only"):
        critic(ids, cu, torch.arange(5), images)
