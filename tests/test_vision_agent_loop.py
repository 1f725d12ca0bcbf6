"""Images through a whole episode (rl/rollout/agent_loop.py with TorchEngine): a prompt image and tool
observations with images become a token-faithful trajectory whose images are content-addressed, which the
store round-trips, and on which the learner's forward reproduces the rollout's log-probs (<= 1e-4 fp32) and
routes (image tokens included)."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.image import prepare_image
from model.modeling import OdysseyForCausalLM
from model.tokenizer import load_tokenizer
from rl.learner.batch import to_sample
from rl.learner.forward import TrainModule
from rl.learner.packing import collate
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
from rl.rollout.engine import TorchEngine
from rl.trajectory import TrajectoryStore, check_image_tokens

P, MAX_PIXELS = 8, 64 * 64


def png(seed: int, h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def tool_obs(i: int) -> list[dict]:
    """The i-th tool observation: a text part and an image (PNG bytes, the same each time)."""
    return [
        {
            "role": "tool",
            "content": [{"type": "text", "text": f"view {i}:"}, {"type": "image", "image": png(7, 30, 12)}],
        }
    ]


class ImageEnv:
    """Minimal env speaking the loop's interface: an image in the prompt (a raw array), an image in each tool
    observation (PNG bytes; the second repeats the first so one image is stored once), done after 3 turns."""

    env_id = "image-test"

    def __init__(self) -> None:
        self.turn = 0

    async def areset(self, seed: int, options=None):
        arr = np.random.default_rng(seed).integers(0, 256, (20, 28, 3), dtype=np.uint8)
        text = {"type": "text", "text": "What colour dominates?"}
        return [{"role": "user", "content": [text, {"type": "image", "image": arr}]}], {"task_id": "img"}

    def tool_schemas(self):
        return []

    async def astep(self, text: str):
        self.turn += 1
        if self.turn == 3:
            return [], 1.0, True, False, {"success": 1.0}
        obs = tool_obs(self.turn)
        return obs, 0.0, False, False, {}

    async def aclose(self):
        pass


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def episode(model, codec, seed: int = 3):
    eng = TorchEngine(model, prefill_chunk_size=24)
    cfg = EpisodeConfig(max_new_tokens=6, stop_on_tool_call=False)
    return asyncio.run(run_episode(eng, ImageEnv(), codec, cfg, seed=seed))


def test_episode_with_images_is_faithful_and_trains_like_it_rolled_out(model, tmp_path):
    tok = load_tokenizer()
    codec = ChatCodec(tok, patch_size=P, max_pixels=MAX_PIXELS)
    traj = episode(model, codec)
    assert traj.infra_error is None and traj.outcome == 1.0 and traj.n_assistant_turns == 3
    assert len(traj.image_spans) == 3 and len(traj.images) == 2  # the repeated observation image: once
    check_image_tokens(traj)
    # token faithfulness: the whole conversation rendered at once gives the same ids and image positions
    msgs = [dict(m) for m in traj.metadata["messages"]]
    json.dumps(msgs)  # the recorded conversation is JSON (images by sha256)
    by_sha = {sp.sha256: (sp.grid_h, sp.grid_w) for sp in traj.image_spans}
    assert all(
        p["sha256"] in by_sha
        for m in msgs
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    )
    # the learner on the stored trajectory: rollout log-probs and routes, image tokens included
    TrajectoryStore(tmp_path).append(traj)
    (back,) = TrajectoryStore(tmp_path).read_all()
    assert back.images == traj.images and back.image_spans == traj.image_spans
    mb = collate([to_sample(back, 0, patch_size=P)], with_replay=True, patch_size=P)
    with torch.no_grad():
        out = TrainModule(model)(mb, return_routed=True)
    rollout = torch.from_numpy(to_sample(back, 0, patch_size=P).rollout_logp)
    assert (out.logp - rollout).abs().max().item() < 1e-4
    assert torch.equal(out.routed, mb.replay)


def test_prompt_and_observation_spans_are_their_encodings_with_images_in_place(model):
    """The prompt span is encode_chat_images(prompt) and each observation span is
    encode_continuation_images(observation) (after the forced end-of-turn when the model did not emit it),
    with every image span at the offset the encoder gave it."""
    tok = load_tokenizer()
    codec = ChatCodec(tok, patch_size=P, max_pixels=MAX_PIXELS)
    traj = episode(model, codec, seed=4)
    prompt, _ = asyncio.run(ImageEnv().areset(seed=4))
    want = [codec.encode_prompt(codec.prepare(prompt), [])]
    want += [codec.encode_observation(tool_obs(i)) for i in (1, 2)]
    spans = [t for t in traj.turns if t.role != "assistant"]
    assert [t.role for t in spans] == ["prompt", "observation", "observation"]
    starts = []
    for t, enc in zip(spans, want):
        assert traj.tokens[t.start : t.end].tolist() == enc.ids
        starts += [t.start + o for o, _ in enc.images]
    assert starts == [sp.start for sp in traj.image_spans]


def test_images_for_a_text_only_policy_end_the_episode_as_an_env_error(model):
    traj = episode(model, ChatCodec(load_tokenizer()))
    assert traj.metadata["infra_source"] == "env" and "policy is text-only" in traj.infra_error
    assert traj.images == {}


def test_prepare_keeps_text_messages_and_prepares_images_once():
    codec = ChatCodec(load_tokenizer(), patch_size=P, max_pixels=MAX_PIXELS)
    text = [{"role": "user", "content": "hi"}]
    assert codec.prepare(text) == text
    img = prepare_image(png(1, 16, 16), P, MAX_PIXELS)
    out = codec.prepare([{"role": "tool", "content": [{"type": "image", "image": img}]}])
    assert out[0]["content"][0]["image"] is img


def test_worker_codec_gets_the_policy_vision_settings(model):
    """The rollout worker prepares env images with its policy's vision settings
    (rl.rollout.worker.policy_vision): TorchEngine's model config, (0, 0) for a text-only policy. VllmEngine's
    (its checkpoint's config.json) is checked in tests/test_vllm_engine.py."""
    from rl.rollout.worker import policy_vision

    assert policy_vision(TorchEngine(model)) == (P, MAX_PIXELS)
    text_only = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", vision_patch_size=0))
    assert policy_vision(TorchEngine(text_only))[0] == 0
