"""TorchEngine with images (rl/rollout/engine.py): rollout log-probs and routes equal the trainer's forward on
the stored tokens and images (fp32, <= 1e-4, routes identical, image tokens included) through chunked
prefill that cuts images, continuous batching, sessions with image observations and weight updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.image import prepare_image
from model.modeling import OdysseyForCausalLM
from model.tokenizer import encode_chat_images, encode_continuation_images, load_tokenizer
from model.vision import ImagePatches
from rl.rollout.engine import GenerationRequest, TorchEngine
from rl.rollout.sampling import SamplingParams

PARITY_TOL = 1e-4  # fp32 rollout vs trainer log-prob (as tests/test_engine.py)
P, MAX_PIXELS = 8, 64 * 64


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def other_model() -> OdysseyForCausalLM:
    torch.manual_seed(1)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def image(seed: int, h: int, w: int):
    rng = np.random.default_rng(seed)
    return prepare_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), P, MAX_PIXELS)


def user_turn(seed: int, n_images: int):
    """A prompt with `n_images` images between text parts: (ids, [(offset, PreparedImage)])."""
    parts = [{"type": "text", "text": f"task {seed}:"}]
    for j in range(n_images):
        parts += [
            {"type": "image", "image": image(seed * 10 + j, 16 + 8 * j, 24)},
            {"type": "text", "text": "?"},
        ]
    enc = encode_chat_images(
        load_tokenizer(), [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    return enc.ids, enc.images


@torch.no_grad()
def trainer(model, ids: list[int], images: list) -> tuple[torch.Tensor, np.ndarray]:
    """(log p(ids[t+1] | ids[:t+1]) [T-1], routed experts [T, n_moe, k]) from one full forward."""
    ip = ImagePatches.from_images([img.pixels for _, img in images], [o for o, _ in images], P)
    t = torch.tensor(ids)
    out = model(t, images=ip, return_routed_experts=True)
    lp = torch.log_softmax(out.logits.float(), -1)[:-1].gather(-1, t[1:, None]).squeeze(-1)
    return lp, out.routed_experts.numpy()


def test_rollout_equals_trainer_with_images_through_chunked_prefill_and_batching(model):
    """Four requests (0-2 images each) decoded together, prefill chunks of 16 tokens (image blocks are cut):
    every sampled token's log-prob equals the trainer's on the stored sequence, and every token's recorded
    routing (prompt, image tokens and generated) equals the trainer's."""
    turns = [user_turn(s, n) for s, n in [(1, 1), (2, 2), (3, 0), (4, 1)]]
    reqs = [
        GenerationRequest(ids, SamplingParams(max_new_tokens=8, seed=i), images=imgs)
        for i, (ids, imgs) in enumerate(turns)
    ]
    cut = [o // 16 != (o + img.n_tokens - 1) // 16 for ids, imgs in turns for o, img in imgs]
    assert any(cut)  # some image block straddles a prefill chunk boundary (a single request's chunks)
    results = TorchEngine(model, prefill_chunk_size=16, max_batch_size=3).generate(reqs)
    for (ids, imgs), res in zip(turns, results):
        full = ids + res.token_ids
        lp, routed = trainer(model, full, imgs)
        err = (lp[len(ids) - 1 :] - torch.tensor(res.logprobs)).abs().max().item()
        assert err < PARITY_TOL, err
        rec = np.concatenate([res.prompt_routed_experts, res.routed_experts]).astype(np.int64)
        assert np.array_equal(rec, routed)
        assert res.session.images == imgs  # the session keeps its images with its tokens


def test_image_pixels_matter(model):
    ids, imgs = user_turn(5, 1)
    other = [(imgs[0][0], image(999, 16, 24))]
    p = SamplingParams(max_new_tokens=4, seed=0)
    a = TorchEngine(model).generate([GenerationRequest(ids, p, images=imgs)])[0]
    b = TorchEngine(model).generate([GenerationRequest(ids, p, images=other)])[0]
    assert not np.allclose(a.logprobs, b.logprobs, atol=1e-3)


def test_session_with_an_image_observation_equals_the_full_history(model):
    """Turn 2 appends a tool observation holding an image to the session: same tokens, log-probs (<= 1e-4)
    and routing as one request over the whole history with all its images; and the trainer agrees."""
    tok = load_tokenizer()
    ids, imgs = user_turn(6, 1)
    eng = TorchEngine(model, prefill_chunk_size=32)
    t1 = eng.generate([GenerationRequest(ids, SamplingParams(max_new_tokens=5, seed=1), images=imgs)])[0]
    obs = encode_continuation_images(
        tok,
        [
            {
                "role": "tool",
                "content": [{"type": "text", "text": "zoom:"}, {"type": "image", "image": image(61, 40, 16)}],
            }
        ],
    )
    p2 = SamplingParams(max_new_tokens=6, seed=2)
    t2 = eng.generate([GenerationRequest(obs.ids, p2, session=t1.session, images=obs.images)])[0]
    history = ids + t1.token_ids + obs.ids
    off = len(ids) + len(t1.token_ids)
    all_imgs = imgs + [(off + o, img) for o, img in obs.images]
    ref = TorchEngine(model).generate([GenerationRequest(history, p2, images=all_imgs)])[0]
    assert t2.token_ids == ref.token_ids
    assert np.allclose(t2.logprobs, ref.logprobs, atol=PARITY_TOL)
    assert np.array_equal(t2.prompt_routed_experts, ref.prompt_routed_experts[-len(obs.ids) :])
    lp, routed = trainer(model, history + t2.token_ids, all_imgs)
    assert (lp[len(history) - 1 :] - torch.tensor(t2.logprobs)).abs().max().item() < PARITY_TOL
    assert np.array_equal(t2.routed_experts.astype(np.int64), routed[len(history) :])
    assert t2.session.images == all_imgs


def test_session_with_images_after_a_weight_update_is_rebuilt_with_its_images(model, other_model):
    eng = TorchEngine(OdysseyForCausalLM(model.config).eval())
    eng.update_weights(model.state_dict(), version=0)
    ids, imgs = user_turn(7, 2)
    t1 = eng.generate([GenerationRequest(ids, SamplingParams(max_new_tokens=4, seed=1), images=imgs)])[0]
    eng.update_weights(other_model.state_dict(), version=1)
    obs = [100, 200, 300]
    p2 = SamplingParams(max_new_tokens=5, seed=2)
    t2 = eng.generate([GenerationRequest(obs, p2, session=t1.session)])[0]
    history = ids + t1.token_ids + obs
    ref = TorchEngine(other_model).generate([GenerationRequest(history, p2, images=imgs)])[0]
    assert t2.token_ids == ref.token_ids and np.allclose(t2.logprobs, ref.logprobs, atol=PARITY_TOL)
    assert t2.session.images == imgs and t2.token_versions == [1] * 5


def test_bad_image_requests_fail_clearly(model):
    ids, imgs = user_turn(8, 1)
    with pytest.raises(ValueError, match="not the image block"):
        TorchEngine(model).generate([GenerationRequest(ids, images=[(imgs[0][0] + 1, imgs[0][1])])])
    with pytest.raises(ValueError, match="PreparedImage"):
        TorchEngine(model).generate([GenerationRequest(ids, images=[(imgs[0][0], b"png")])])
    with pytest.raises(ValueError, match="patch size 8"):
        big = prepare_image(np.zeros((32, 32, 3), np.uint8), 16, 32 * 32)  # a 2x2 grid of 16-pixel patches
        tokens = encode_chat_images(
            load_tokenizer(), [{"role": "user", "content": [{"type": "image", "image": big}]}]
        )
        TorchEngine(model).generate([GenerationRequest(tokens.ids, images=tokens.images)])
    text_only = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", vision_patch_size=0)).eval()
    with pytest.raises(ValueError, match="text-only"):
        TorchEngine(text_only).generate([GenerationRequest(ids, images=imgs)])
