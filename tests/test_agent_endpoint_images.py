"""Images through the policy endpoint (rl/rollout/agent_recorder.py): an OpenAI-client agent sends image_url
parts (base64 data URLs) to a vision policy; the recorded episode holds each image's token block and PNG, and
the trainer's forward on the stored trajectory gives the rollout's log-probs and routes. Bad images are clear
400s that leave the server serving and the episode unmarked."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.image import prepare_image
from model.image_tokens import IMAGE_PAD_ID, IMAGE_TOKEN_IDS
from model.modeling import OdysseyForCausalLM
from model.tokenizer import load_tokenizer
from rl.learner.batch import to_sample
from rl.learner.forward import TrainModule
from rl.learner.packing import collate
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig
from rl.rollout.engine import TorchEngine
from rl.trajectory import TrajectoryStore, check_image_tokens
from tests.test_agent_endpoint import _episode, _Served, arith_task
from tests.test_vision_agent_loop import png

P, MAX_PIXELS = 8, 64 * 64
CFG = EpisodeConfig(max_new_tokens=6, max_episode_tokens=4096, stop_on_tool_call=False)


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url("image/png;base64", base64.b64encode(data))}}


def data_url(head: str, body: bytes | str) -> str:
    return f"data:{head}," + (body.decode() if isinstance(body, bytes) else body)


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer(), patch_size=P, max_pixels=MAX_PIXELS)


def looking_agent(client, task) -> str:
    """A screenshot-reading agent written against the openai client: an image in the question, a tool result
    followed by a user message with two images (one repeated), then a rewritten history (a new segment) that
    keeps only the last image."""
    messages = [
        {"role": "system", "content": "You read screens."},
        {"role": "user", "content": [{"type": "text", "text": task["prompt"]}, image_part(png(1, 30, 20))]},
    ]
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    shot = png(2, 16, 40)
    messages.append({"role": "user", "content": [image_part(shot), {"type": "text", "text": "and now?"},
                                                 image_part(png(1, 30, 20))]})
    reply = client.chat.completions.create(model="policy", messages=messages)
    summary = [{"role": "user", "content": [{"type": "text", "text": "The last screen:"}, image_part(shot)]}]
    reply = client.chat.completions.create(model="policy", messages=summary)
    return reply.choices[0].message.content or ""


def test_openai_client_agent_sends_images_and_the_episode_is_faithful(model, codec, tmp_path):
    traj = asyncio.run(_episode(TorchEngine(model, prefill_chunk_size=24), codec, looking_agent, cfg=CFG))
    assert traj.infra_error is None and "agent_error" not in traj.metadata, traj.metadata
    assert traj.metadata["requests"] == 3 and traj.metadata["n_segments"] == 2
    assert len(traj.image_spans) == 4 and len(traj.images) == 2  # a repeated image is stored once
    check_image_tokens(traj)
    # every image token sits in a span: nothing else in the context is an image pad
    assert int((traj.tokens == IMAGE_PAD_ID).sum()) == sum(
        sp.grid_h * sp.grid_w for sp in traj.image_spans)
    # token in: the first request's ids are the template's rendering of its messages with the images in place
    shown = prepare_image(png(1, 30, 20), P, MAX_PIXELS)
    first = [{"role": "system", "content": "You read screens."},
             {"role": "user", "content": [{"type": "text", "text": arith_task(3)["prompt"]},
                                          {"type": "image", "image": shown}]}]
    enc = codec.encode_prompt(first, None)
    assert traj.tokens[: len(enc.ids)].tolist() == enc.ids
    assert traj.image_spans[0].start == enc.images[0][0]
    # the second segment's image sits where its own rendering puts it, offset by the segment start
    start = traj.metadata["segment_starts"][0]
    assert traj.image_spans[-1].start > start
    # the learner on the stored trajectory: the rollout's log-probs and routes, image tokens included
    TrajectoryStore(tmp_path).append(traj)
    (back,) = TrajectoryStore(tmp_path).read_all()
    assert back.images == traj.images and back.image_spans == traj.image_spans
    sample = to_sample(back, 0, patch_size=P)
    mb = collate([sample], with_replay=True, patch_size=P)
    with torch.no_grad():
        out = TrainModule(model)(mb, return_routed=True)
    assert (out.logp - torch.from_numpy(sample.rollout_logp)).abs().max().item() < 1e-4
    assert torch.equal(out.routed, mb.replay)
    # the recorded conversation names images by content address, not bytes
    parts = [p for m in traj.metadata["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert {p["sha256"] for p in parts if p["type"] == "image"} == set(traj.images)


def test_bad_images_are_clear_400s_and_the_server_serves_on(model, codec):
    s = _Served(TorchEngine(model), codec, CFG)
    text_only = _Served(TorchEngine(model), ChatCodec(load_tokenizer()), CFG)
    try:
        def ask(*content, role="user"):
            return {"model": "policy", "messages": [{"role": role, "content": list(content)}]}

        def url(u):
            return ask({"type": "image_url", "image_url": {"url": u}})

        good = png(3, 20, 20)
        b64 = base64.b64encode(b"not an image at all").decode()
        cases = [
            (url("https://example.com/cat.png"), "invalid_image_url", "data URL"),
            (url("data:image/png;base64,%%%"), "invalid_image_url", "base64"),
            (url(data_url("image/png", b64)), "invalid_image_url", "base64"),
            (url(data_url("image/png;base64", b64)), "invalid_image", "Pillow"),
            (ask({"type": "image_url", "image_url": 7}), "invalid_request", "data:image/png"),
            ({"model": "policy", "messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": [image_part(good)]},
                                              {"role": "user", "content": "?"}]},
             "invalid_request", "assistant"),
            ({"model": "policy", "prompt": [1, IMAGE_TOKEN_IDS[0], 5]}, "invalid_request", "image_url"),
        ]  # fmt: skip
        for body, code, says in cases:
            path = "/completions" if "prompt" in body else "/chat/completions"
            r = s.post(path, body)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
            assert says in r.json()["error"]["message"], r.text
        r = text_only.post("/chat/completions", ask({"type": "text", "text": "look"}, image_part(good)))
        assert r.status_code == 400 and r.json()["error"]["code"] == "images_not_supported", r.text
        assert "text only" in r.json()["error"]["message"]
        # hostile text that spells an image block is text: no image tokens without an image
        spelled = "<|image_start|><|image_pad|><|image_end|>"
        r = s.post("/chat/completions", ask({"type": "text", "text": spelled}, image_part(good)))
        assert r.status_code == 200, r.text
        traj = s.rec.episode_trajectory(1.0, {})
        assert len(traj.image_spans) == 1
        check_image_tokens(traj)
        (span,) = traj.image_spans
        assert int(np.isin(traj.tokens, IMAGE_TOKEN_IDS).sum()) == span.end - span.start
        assert s.rec.infra_error is None and s.rec.truncated is None
    finally:
        s.close()
        text_only.close()


def test_an_agents_image_bytes_are_decoded_only_in_the_killable_child(model, codec, monkeypatch):
    """The endpoint decodes an agent's image bytes as tool images are (envs/tool_result.py `check_image`):
    in a child process, never in the worker's own; the episode then reads the child's re-encoded PNG."""
    import envs.tool_result as tool_result

    seen: list[tuple[str, bytes]] = []
    real = tool_result.call_in_child

    async def spy(fn, *args, **kwargs):
        seen.append((fn.__name__, args[0]))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(tool_result, "call_in_child", spy)
    s = _Served(TorchEngine(model), codec, CFG)
    try:
        shot = png(4, 24, 18)
        body = {"model": "policy", "messages": [{"role": "user", "content": [image_part(shot)]}]}
        r = s.post("/chat/completions", body)
        assert r.status_code == 200, r.text
        assert seen == [("sanitize_image", shot)]
        traj = s.rec.episode_trajectory(1.0, {})
        assert len(traj.images) == 1 and len(traj.image_spans) == 1
        check_image_tokens(traj)
    finally:
        s.close()
