"""Images in the trajectory, the store and the learner (envs/trajectory.py, rl/trajectory.py,
rl/learner/batch.py, packing.py, forward.py): content-addressed PNGs with their token spans, checksummed and
validated on read-back, decoded and packed per micro-batch, and the learner's packed forward with images
(and routing replay over image tokens) equal to each trajectory's own forward."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from envs.trajectory import ImageSpan, Trajectory, TurnSpan
from model.config import OdysseyConfig
from model.image import prepare_image
from model.modeling import OdysseyForCausalLM
from model.tokenizer import encode_chat_images, encode_continuation_images, load_tokenizer
from model.vision import ImagePatches
from rl.learner.batch import ModelFacts, check_trajectory, to_sample
from rl.learner.forward import TrainModule
from rl.learner.packing import collate
from rl.trajectory import TrajectoryStore, batch_crc32, check_image_tokens, trajectories_to_batch

P, MAX_PIXELS = 8, 64 * 64


def image(seed: int, h: int = 24, w: int = 16):
    rng = np.random.default_rng(seed)
    return prepare_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), P, MAX_PIXELS)


def vision_traj(seed: int, model: OdysseyForCausalLM | None = None) -> Trajectory:
    """prompt (text + image) -> assistant turn -> tool observation (an image and the prompt's image again) ->
    assistant turn. Assistant tokens are random text ids; with `model`, rollout log-probs and routed experts
    are that model's own (a faithful rollout), else random."""
    tok = load_tokenizer()
    rng = np.random.default_rng(seed)
    a, b = image(seed), image(seed + 100, 8, 40)
    prompt = encode_chat_images(
        tok,
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": a}]}],
        add_generation_prompt=True,
    )
    tokens, turns, placed = list(prompt.ids), [TurnSpan("prompt", 0, len(prompt.ids))], list(prompt.images)
    for k in range(2):
        gen = rng.integers(100, 3000, 5).tolist() + [tok.convert_tokens_to_ids("<|im_end|>")]
        turns.append(TurnSpan("assistant", len(tokens), len(tokens) + len(gen)))
        tokens += gen
        if k == 0:
            obs = encode_continuation_images(
                tok,
                [
                    {
                        "role": "tool",
                        "content": [
                            {"type": "image", "image": b},
                            {"type": "text", "text": "again"},
                            {"type": "image", "image": a},
                        ],
                    }
                ],
            )
            placed += [(len(tokens) + s, img) for s, img in obs.images]
            turns.append(TurnSpan("observation", len(tokens), len(tokens) + len(obs.ids)))
            tokens += obs.ids
    T = len(tokens)
    mask = np.zeros(T, np.uint8)
    for t in turns:
        if t.role == "assistant":
            mask[t.start : t.end] = 1
    spans = [ImageSpan(img.sha256, s, s + img.n_tokens, *img.grid) for s, img in placed]
    images = {img.sha256: img.png for _, img in placed}
    logp = np.where(mask == 1, -rng.random(T), np.nan).astype(np.float32)
    routed = None
    if model is not None:
        ids = torch.tensor(tokens)
        ip = ImagePatches.from_images([img.pixels for _, img in placed], [s for s, _ in placed], P)
        with torch.no_grad():
            out = model(ids, images=ip, return_routed_experts=True)
            lp = torch.log_softmax(out.logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        logp = np.where(mask == 1, np.concatenate([[np.nan], lp.numpy()]), np.nan).astype(np.float32)
        routed = out.routed_experts.numpy().astype(np.uint16)
    return Trajectory(
        tokens=np.array(tokens, np.int32),
        loss_mask=mask,
        rollout_logprobs=logp,
        routed_experts=routed,
        turns=turns,
        images=images,
        image_spans=spans,
        metadata={"task_id": f"v{seed}", "policy_version": 0},
    )


# ---- the record ------------------------------------------------------------------------------------------


def test_record_keeps_images_content_addressed_and_deduplicated():
    t = vision_traj(0)
    assert len(t.image_spans) == 3 and len(t.images) == 2  # the prompt's image is stored once
    assert all(hashlib.sha256(v).hexdigest() == k for k, v in t.images.items())
    check_image_tokens(t)
    assert all(t.loss_mask[s.start : s.end].sum() == 0 for s in t.image_spans)  # never trained on


def test_record_rejects_bad_images():
    t = vision_traj(1)
    base = dict(tokens=t.tokens, loss_mask=t.loss_mask, rollout_logprobs=t.rollout_logprobs, turns=t.turns)
    sp = t.image_spans[0]
    key = next(iter(t.images))
    with pytest.raises(ValueError, match="not the sha256 of its bytes"):
        Trajectory(**base, images={"0" * 64: t.images[key]}, image_spans=[])
    with pytest.raises(ValueError, match="no span uses"):
        Trajectory(**base, images=t.images, image_spans=t.image_spans[:1])
    with pytest.raises(ValueError, match="not in Trajectory.images"):
        Trajectory(**base, images={}, image_spans=[sp])
    asst = t.turns[1]
    moved = ImageSpan(sp.sha256, asst.start, asst.end, sp.grid_h, sp.grid_w)
    with pytest.raises(ValueError, match="not inside one prompt or observation turn"):
        Trajectory(**base, images={sp.sha256: t.images[sp.sha256]}, image_spans=[moved])
    with pytest.raises(TypeError, match="must be bytes"):
        Trajectory(**base, images={sp.sha256: "text"}, image_spans=[sp])


# ---- the store -------------------------------------------------------------------------------------------


def test_store_round_trip_with_images(tmp_path):
    trajs = [vision_traj(2), vision_traj(3)]
    store = TrajectoryStore(tmp_path)
    store.append(trajs)
    back = store.read_all()
    for a, b in zip(trajs, back):
        assert a.images == b.images and a.image_spans == b.image_spans
        assert np.array_equal(a.tokens, b.tokens)
    assert batch_crc32(trajectories_to_batch(trajs)) == batch_crc32(trajectories_to_batch(back))


def test_store_skips_a_file_whose_image_bytes_changed(tmp_path):
    t = vision_traj(4)
    store = TrajectoryStore(tmp_path)
    path = store.append(t)
    data = bytearray(path.read_bytes())
    png = next(iter(t.images.values()))
    at = data.find(png[200:232])
    assert at > 0
    data[at + 5] ^= 0xFF  # one flipped bit pattern inside the PNG: the Arrow file is still well-formed
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=f"skipping corrupt file {path.name}.*checksum"):
        assert TrajectoryStore(tmp_path).read_all() == []


def test_store_skips_a_file_whose_image_tokens_do_not_match_the_span(tmp_path):
    t = vision_traj(5)
    sp = t.image_spans[0]
    tokens = t.tokens.copy()
    tokens[sp.start + 1] = 500  # a pad replaced by text: the record's structure is fine, the layout is not
    bad = Trajectory(
        tokens=tokens,
        loss_mask=t.loss_mask,
        rollout_logprobs=t.rollout_logprobs,
        turns=t.turns,
        images=t.images,
        image_spans=t.image_spans,
    )
    with pytest.raises(ValueError, match="not the image block"):
        check_image_tokens(bad)
    path = TrajectoryStore(tmp_path).append(bad)
    with pytest.warns(RuntimeWarning, match=f"skipping.*{path.name}"):
        assert TrajectoryStore(tmp_path).read_all() == []


# ---- the learner -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def facts(model, patch_size: int) -> ModelFacts:
    c = model.config
    return ModelFacts(
        c.vocab_size,
        len(model.moe_layer_indices),
        c.n_routed_experts,
        c.num_experts_per_tok,
        None,
        vision_patch_size=patch_size,
    )


def test_text_only_learner_refuses_images(model):
    t = vision_traj(6)
    with pytest.raises(ValueError, match="trajectory 0.*text-only"):
        check_trajectory(t, 0, facts(model, 0), need_routing=False)


def test_learner_forward_with_images_equals_rollout_and_replays_image_routes(model):
    """Three faithful image trajectories packed into one micro-batch: the learner's log-probs equal the
    rollout's (the model's own forward on each, <= 1e-4 fp32), and the routes its free forward picks equal
    the recorded ones on every input token, image tokens included; replaying them changes nothing."""
    trajs = [vision_traj(10 + i, model) for i in range(3)]
    f = facts(model, P)
    for i, t in enumerate(trajs):
        check_trajectory(t, i, f, need_routing=True)
    samples = [to_sample(t, i, patch_size=P) for i, t in enumerate(trajs)]
    mb = collate(samples, with_replay=True, patch_size=P)
    assert mb.images.n == sum(s.grid_h * s.grid_w for t in trajs for s in t.image_spans)
    assert torch.all(mb.input_ids[mb.images.token_index] == 13)  # every patch on an <|image_pad|>
    tm = TrainModule(model)
    with torch.no_grad():
        free = tm(mb, replay=False, return_routed=True)
        replayed = tm(mb, replay=True, return_routed=True)
    rollout = torch.from_numpy(np.concatenate([s.rollout_logp for s in samples]))
    assert (free.logp - rollout).abs().max() < 1e-4
    assert torch.equal(free.routed, mb.replay)  # image tokens' routes included
    assert torch.equal(replayed.routed, mb.replay)
    assert (replayed.logp - free.logp).abs().max() < 1e-6


def test_learner_images_get_gradients(model):
    t = vision_traj(20, model)
    mb = collate([to_sample(t, 0, patch_size=P)], patch_size=P)
    model.zero_grad()
    TrainModule(model)(mb).logp.sum().backward()
    assert model.model.vision.weight.grad.abs().sum() > 0  # the assistant turns after images train W_p
    model.zero_grad()


def test_collate_without_patch_size_fails_clearly(model):
    s = to_sample(vision_traj(21), 0, patch_size=P)
    with pytest.raises(ValueError, match="patch_size"):
        collate([s])


def test_sequence_chunked_learner_forward_with_images_equals_one_pass(model):
    """learner.sequence_chunk_tokens windows (40 tokens: image blocks are cut) carry each window's patches:
    log-probs equal the whole-micro-batch forward (atol 1e-5 fp32, as tests/test_sequence_chunks.py) and
    gradients of the patch embedding agree (relative L2 < 1e-4)."""
    trajs = [vision_traj(30 + i, model) for i in range(2)]
    mb = collate([to_sample(t, i, patch_size=P) for i, t in enumerate(trajs)], with_replay=True, patch_size=P)
    whole, chunked = TrainModule(model), TrainModule(model, sequence_chunk_tokens=40)
    assert chunked.chunks(mb) > 1
    offs = np.cumsum([0] + [t.n_tokens - 1 for t in trajs])  # packed offset of each sample's inputs
    assert any(
        (o + s.start) // 40 != (o + s.end - 2) // 40 for o, t in zip(offs, trajs) for s in t.image_spans
    )
    grads = []
    for tm in (whole, chunked):
        model.zero_grad()
        out = tm(mb, replay=True)
        out.logp.sum().backward()
        grads.append((out.logp.detach(), model.model.vision.weight.grad.clone()))
    model.zero_grad()
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-5, rtol=0)
    rel = (grads[1][1] - grads[0][1]).norm() / grads[0][1].norm()
    assert rel < 1e-4, rel


def test_critic_reads_images_with_the_policys_patch_size(model):
    """A separate critic (a copy of the policy's trunk) sees the micro-batch's images: its values equal its
    trunk's forward with the same patches (exact); a critic with another patch size is refused by name."""
    import copy

    from model.modeling import OdysseyModel
    from rl.learner.value import Critic

    t = vision_traj(40, model)
    mb = collate([to_sample(t, 0, patch_size=P)], patch_size=P)
    critic = Critic(copy.deepcopy(model.model)).eval()
    with torch.no_grad():
        critic.head.proj.weight.normal_()  # the value head starts at zero: give it a direction to read
    with torch.no_grad():
        out = TrainModule(model, critic)(mb, values=True)
        h, _, _, _ = critic.trunk(mb.input_ids, mb.cu_seqlens, None, None, False, mb.images)
        blind, _, _, _ = critic.trunk(mb.input_ids, mb.cu_seqlens, None, None, False)
    torch.testing.assert_close(out.values, critic.head(h[mb.scored_pos]), atol=0, rtol=0)
    assert not torch.allclose(out.values, critic.head(blind[mb.scored_pos]))  # the images reached it
    other = Critic(OdysseyModel(OdysseyConfig.from_preset("tiny", vision_patch_size=16)))
    with pytest.raises(ValueError, match="critic's patch size \\(16\\) is not the policy's \\(8\\)"):
        TrainModule(model, other)(mb, values=True)
